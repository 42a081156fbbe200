"""Training loaders that Lightning resumes in the middle of an epoch, exactly.

Lightning saves a training loader's ``state_dict()`` in every checkpoint and hands it back through
``load_state_dict()`` before a resumed fit iterates again, when the loader has both ("stateful data
loading"); a loader without them restarts its epoch from the first batch, so a run resumed mid-epoch
reads batches the uninterrupted run never read there (Lightning warns "your dataloader is not
resumable"). Two pieces make the data modules' training order a function of (seed, epoch, batch):

- `EpochShuffle`: the permutation of epoch ``e`` is drawn from a generator seeded with ``seed + e``
  (Lightning calls ``set_epoch`` at every epoch's start, also on the epoch a run resumes in). A
  ``RandomSampler`` with one seeded generator draws epoch ``e``'s order after ``e`` earlier draws,
  which a resumed process never made.
- `ResumableLoader`: a DataLoader whose state is (epoch, batches yielded in it). Resumed in the same
  epoch it skips that many batches of the epoch's index order without loading them; resumed in a later
  epoch (the checkpoint was taken at an epoch's end) it skips nothing, and reads the epoch after the saved one
  even where Lightning counts one more: resuming training bounded by ``max_steps`` from a checkpoint written after
  an epoch's validation (ModelCheckpoint's default moment), Lightning 2.6 restarts the finished epoch, reads none
  of its batches, counts it again, and sets every later epoch one higher than the uninterrupted run did (each
  epoch read the next one's order; 5e-4 in the weights after 4 steps). Not covered, as no loader can: from a
  checkpoint written at the training epoch's end without a validation there, Lightning reads one batch of the
  restarted epoch before it counts ahead; and ``reload_dataloaders_every_n_epochs`` gives the resumed run a new
  loader after the state was loaded into the old one.
  Under several replicas Lightning wraps the sampler in its distributed wrapper, which forwards ``set_epoch``: the
  same state holds. The state also records the replicas reading the epoch: their batches interleave one order, so
  a count of batches means another position on another number of replicas; resumed there mid-epoch the epoch
  restarts, with a warning.
"""

from __future__ import annotations

import inspect
import numbers
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler


class EpochShuffle(Sampler[int]):
    """A random permutation of ``range(size)`` per epoch, a function of ``seed`` and the epoch alone.

    Epoch 0's order is what ``RandomSampler(generator=torch.Generator().manual_seed(seed))`` draws first.

    Args:
        size: The dataset's length.
        seed: The seed of epoch 0; epoch ``e`` uses ``seed + e``.
    """

    def __init__(self, size: int, seed: int) -> None:
        # Any integer type, as TextDataModule takes its seed (a numpy one there failed here at the first epoch).
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
            raise ValueError(
                f"EpochShuffle(size={size!r}) must be an integer >= 0: the dataset's length (len(dataset))."
            )
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"EpochShuffle(seed={seed!r}) must be an integer (epoch e draws with seed + e).")
        self.size = int(size)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())

    def __len__(self) -> int:
        return self.size


class _SkipFirst:
    """An index sampler's order without its first ``loader._skipping`` entries, which `ResumableLoader` sets for the
    duration of starting an iteration (DataLoader's iterators start their order once or twice while being built, and
    a persistent-workers iterator keeps this object and starts it again every epoch). Its length stays the whole
    epoch's: Lightning reads a loader's length after loading its state and counts the resumed epoch's batches from
    the checkpoint."""

    def __init__(self, order: Any, loader: ResumableLoader) -> None:
        self.order, self.loader = order, loader

    def __iter__(self) -> Iterator[Any]:
        order = iter(self.order)
        for _ in range(self.loader._skipping):
            next(order, None)
        return order

    def __len__(self) -> int:
        return len(self.order)


class SequentialWithEpoch(SequentialSampler):
    """The dataset in order, every epoch, with the ``epoch`` Lightning sets (``set_epoch``): a `ResumableLoader`
    made with ``shuffle=False`` reads it to tell a mid-epoch state's epoch from the next one."""

    def __init__(self, data_source: Any) -> None:
        super().__init__(data_source)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class _SeededShuffle(RandomSampler):
    """`ResumableLoader`'s ``shuffle=True``: `EpochShuffle`'s order (seed + epoch), as a ``RandomSampler``, which
    Lightning replaces under several replicas with its ``DistributedSampler`` of the same seed (DDP's order: an
    `EpochShuffle` there is wrapped, and its order permuted twice)."""

    def __init__(self, data_source: Any, seed: int) -> None:
        super().__init__(data_source)
        self._order = EpochShuffle(len(data_source), seed)  # type: ignore[arg-type]

    @property
    def epoch(self) -> int:  # what ResumableLoader's state records
        return self._order.epoch

    def set_epoch(self, epoch: int) -> None:
        self._order.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)


class ResumableLoader(DataLoader):
    """A DataLoader Lightning resumes mid-epoch: ``state_dict()`` is the epoch (the sampler's, set by Lightning) and
    the batches yielded in it; after ``load_state_dict()`` the next iteration of that epoch starts after them.

    The skipped batches are skipped as indices, never loaded. Takes DataLoader's arguments; ``shuffle=False`` (the
    default) reads the dataset in order through `SequentialWithEpoch`; ``shuffle=True`` shuffles in `EpochShuffle`'s
    order, seeded as Lightning seeds a distributed sampler's shuffle (the ``generator``'s seed where one is given, else
    ``seed_everything``'s, else 0): DDP's order on one replica, and on several Lightning's own DistributedSampler, a
    function of the seed and the epoch either way (torch's ``RandomSampler`` drew each epoch's order from the
    process's stream, which no resume puts back before an epoch's draw). With a sampler that has no epoch (a user's
    own; Lightning swaps a plain sequential one in under ``overfit_batches``) the state cannot tell the saved epoch
    from the next one, so nothing is skipped: the epoch restarts, as a plain DataLoader's does, with a warning when
    the state was taken mid-epoch.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = inspect.signature(DataLoader.__init__).bind(self, *args, **kwargs).arguments
        given.pop("self")
        own_order = given.get("sampler") is not None or given.get("batch_sampler") is not None
        if not own_order and not isinstance(given["dataset"], IterableDataset):
            if given.pop("shuffle", None):
                generator = given.get("generator")
                seed = generator.initial_seed() if generator is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
                given["sampler"] = _SeededShuffle(given["dataset"], seed)
            else:  # in order, with an epoch
                given["sampler"] = SequentialWithEpoch(given["dataset"])
        super().__init__(**given)
        self._epoch: int | None = None  # the epoch whose order the last iteration read
        self._counted: int | None = None  # the epoch Lightning had set for it
        self._ahead = 0  # how far Lightning's count runs ahead of the epochs read, since a resume (module docstring)
        self._yielded = 0
        self._resume: dict[str, Any] | None = None
        self._skipping = 0

    @property
    def _index_sampler(self) -> Any:  # DataLoader's iterators read their batch order from here
        return _SkipFirst(super()._index_sampler, self)

    def _sampler_int(self, name: str) -> int | None:
        """An integer attribute of the sampler (or the batch sampler's): ``epoch``, Lightning's distributed wrapper's
        ``num_replicas``; None where neither has it."""
        for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            if isinstance(getattr(sampler, name, None), int):
                return getattr(sampler, name)
        return None

    def _replicas(self) -> int:
        """The replicas reading this epoch's order (1 without Lightning's distributed wrapper)."""
        return self._sampler_int("num_replicas") or 1

    def _sampler_epoch(self) -> int | None:
        return self._sampler_int("epoch")

    def _read_epoch(self, counted: int | None, resume: dict[str, Any] | None) -> tuple[int | None, bool]:
        """The epoch whose order this iteration reads, for Lightning's ``counted``, and whether it continues the
        saved one; keeps how far Lightning counts ahead (`_ahead`)."""
        if counted is None:
            return None, False
        if resume is None or resume["epoch"] is None:
            return counted - self._ahead, False
        saved_count = resume.get("counted", resume["epoch"])  # states before 12-06: no count of their own
        if counted == saved_count:  # the saved epoch continues
            epoch = resume["epoch"]
        elif counted > saved_count:  # a later one: the one after the saved epoch, however far Lightning counted
            epoch = resume["epoch"] + 1
        else:
            epoch = counted
        self._ahead = counted - epoch
        return epoch, counted == saved_count

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # A generator: the body runs at the first batch, after Lightning's set_epoch for the epoch.
        counted, resume, self._resume = self._sampler_epoch(), self._resume, None
        if counted is None and resume is not None and resume["batches"] and _rank_zero():
            _warn_epoch_restarts(self, resume["batches"])
        epoch, same_epoch = self._read_epoch(counted, resume)
        if epoch != counted:  # Lightning counts ahead: the sampler draws the order of the epoch read
            for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
                if callable(getattr(sampler, "set_epoch", None)):
                    sampler.set_epoch(epoch)
        skip = resume["batches"] if same_epoch and resume is not None else 0
        saved, replicas = (resume or {}).get("replicas", 1), self._replicas()
        if skip and saved != replicas and _rank_zero():  # every rank's loader finds it: said once
            warnings.warn(
                f"The checkpoint was taken {skip} batches into epoch {epoch} on {saved} data-parallel replica(s); "
                f"this run has {replicas}, which read that epoch's order interleaved otherwise, so no count of "
                "batches skipped here continues it exactly: the loader starts the epoch again from its first batch, "
                f"and Lightning, which counts {skip} of its batches as done, ends it {skip} batches early (samples "
                "of it are trained twice, others not in this epoch). To continue exactly, resume on the same number "
                "of replicas, or from a checkpoint taken at an epoch's end.",
                stacklevel=1,  # this file's: the caller is Lightning's loader, which did nothing wrong
            )
        if skip and saved != replicas:
            skip = 0
        self._skipping = skip
        try:
            batches = super().__iter__()
        finally:
            self._skipping = 0
        self._epoch, self._counted, self._yielded = epoch, counted, skip
        for batch in batches:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "batches": self._yielded, "replicas": self._replicas(), "counted": self._counted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        known = {"epoch", "batches", "replicas", "counted"}  # replicas: since 12-04; counted: since 12-06
        if not {"epoch", "batches"} <= set(state) <= known:
            raise ValueError(
                f"ResumableLoader.load_state_dict: the checkpoint's loader state has keys {sorted(state)}, not "
                "['batches', 'counted', 'epoch', 'replicas']: it was saved by another training loader. Resume with the "
                "data module that wrote the checkpoint."
            )
        self._resume = dict(state)


def _warn_epoch_restarts(loader: ResumableLoader, batches: int) -> None:
    """A state of ``batches`` into an epoch that a sampler without an epoch cannot place: said, not silent (Lightning
    warns only for loaders without a state, and a ``ResumableLoader(shuffle=False)`` has one)."""
    try:
        finished = batches >= len(loader)
    except TypeError:  # no length: an IterableDataset's
        finished = False
    if finished:  # taken at an epoch's end: the next epoch starts at its first batch anyway
        return
    warnings.warn(
        f"ResumableLoader: the checkpoint was taken {batches} batches into an epoch, but this loader's sampler "
        f"({type(loader.sampler).__name__}) has no epoch, so the state cannot tell that epoch from the next: the "
        f"loader starts the epoch again from its first batch, and Lightning, which counts {batches} of its batches as "
        "done, ends it that many batches early. For an exact resume give the loader a sampler with an epoch "
        "(ResumableLoader(dataset, shuffle=True), or sampler=EpochShuffle(len(dataset), seed)), or resume from a "
        "checkpoint taken at an epoch's end (exact where your sampler draws its order from nothing random: one drawn "
        "from the process's stream draws it before a resume puts the stream back).",
        stacklevel=1,  # this file's: the caller is Lightning's loader, which did nothing wrong
    )


def _rank_zero() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
