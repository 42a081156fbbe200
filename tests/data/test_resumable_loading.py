"""A run resumed in the middle of an epoch reads what the uninterrupted run reads, with the shipped data module.

TextDataModule's training loader restarted its epoch from the first batch on resume, drawing the epoch's order
from a fresh generator: resumed runs drifted from uninterrupted ones (2e-4 in the weights after 6 more steps) with
plain one-device Lightning and with the pipeline alike (issue 33, item 2).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningDataModule, LightningModule, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lit_efficient import PACIStrategy
from lit_efficient.data import EpochShuffle, ResumableLoader, TextDataModule
from lit_efficient.models import HFCausalLM
from tests.support.gpt_runs import BLOCK, gpt_model, gpt_trainer, max_diff, text_data

# 2 steps of 4 micro-batches per epoch, validated at its end as a user's fit is (validation inside fit, drained)
EPOCH = dict(limit_train_batches=8, max_epochs=-1, limit_val_batches=2)


def _batches(loader, count=None):
    out = []
    for x, _ in loader:
        out.append(x)
        if count is not None and len(out) == count:
            break
    return out


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)) * 8)
    module = TextDataModule(str(path), block_size=7, batch_size=4, seed=3)
    module.setup("fit")
    return module


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loaded_state_continues_the_epoch_and_the_next_starts_whole(data, num_workers):
    data.num_workers = num_workers
    whole = data.train_dataloader()
    whole.sampler.set_epoch(2)
    uninterrupted = _batches(whole)
    saved = data.train_dataloader()
    saved.sampler.set_epoch(2)
    _batches(saved, 5)
    state = saved.state_dict()
    assert state == {"epoch": 2, "batches": 5, "replicas": 1, "counted": 2}
    resumed = data.train_dataloader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(2)
    assert len(resumed) == len(whole)  # Lightning counts the epoch's batches from its length
    rest = _batches(resumed)
    assert len(rest) == len(uninterrupted) - 5
    assert all(torch.equal(a, b) for a, b in zip(rest, uninterrupted[5:], strict=True))
    resumed.sampler.set_epoch(3)  # the next epoch is whole, in its own order
    following = _batches(resumed)
    assert len(following) == len(whole)
    assert not torch.equal(following[0], uninterrupted[0])
    for loader in (whole, saved, resumed):  # persistent workers would outlive the test, slowing the next ones
        if loader._iterator is not None:
            loader._iterator._shutdown_workers()


def test_a_state_from_an_earlier_epoch_skips_nothing(data):
    """A checkpoint at an epoch's end: Lightning resumes in the next epoch, which starts at its first batch."""
    loader = data.train_dataloader()
    loader.load_state_dict({"epoch": 0, "batches": len(loader)})
    loader.sampler.set_epoch(1)
    fresh = data.train_dataloader()
    fresh.sampler.set_epoch(1)
    assert all(torch.equal(a, b) for a, b in zip(_batches(loader), _batches(fresh), strict=True))


def test_epochs_counted_ahead_after_a_resume_read_the_uninterrupted_order_through_a_second_resume(data):
    """Lightning's count one ahead (`test_a_run_bounded_by_max_steps_resumes_from_an_epochs_end_exactly`): the epoch
    after the saved one is read whatever Lightning counts, and the lead is kept, through a mid-epoch save too."""

    def epoch_order(epoch):
        loader = data.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return _batches(loader)

    resumed = data.train_dataloader()
    resumed.load_state_dict({"epoch": 0, "batches": len(resumed), "replicas": 1, "counted": 0})
    resumed.sampler.set_epoch(2)  # epoch 1 restarted, none of it read, counted again
    first = _batches(resumed, 3)
    assert all(torch.equal(a, b) for a, b in zip(first, epoch_order(1)[:3], strict=True))
    state = resumed.state_dict()
    assert state == {"epoch": 1, "batches": 3, "replicas": 1, "counted": 2}
    again = data.train_dataloader()  # resumed mid-epoch: Lightning counts that epoch as it saved it
    again.load_state_dict(state)
    again.sampler.set_epoch(2)
    rest = _batches(again)
    assert all(torch.equal(a, b) for a, b in zip(rest, epoch_order(1)[3:], strict=True))
    again.sampler.set_epoch(3)
    assert all(torch.equal(a, b) for a, b in zip(_batches(again), epoch_order(2), strict=True))


def test_an_epochs_order_depends_on_seed_and_epoch_only():
    shuffle = EpochShuffle(50, seed=7)
    shuffle.set_epoch(4)
    fourth = list(shuffle)
    again = EpochShuffle(50, seed=7)  # no epochs drawn before
    again.set_epoch(4)
    assert list(again) == fourth and sorted(fourth) == list(range(50))
    shuffle.set_epoch(0)
    first = torch.randperm(50, generator=torch.Generator().manual_seed(7)).tolist()
    assert list(shuffle) == first  # epoch 0: what RandomSampler with a generator seeded alike draws first


def test_shuffle_true_shuffles_by_seed_and_epoch_in_ddps_order(monkeypatch):
    """``ResumableLoader(shuffle=True)`` kept torch's RandomSampler, which draws each epoch's order from the process's
    stream: no epoch to place a mid-epoch state (the epoch restarted, with a warning) and, from an epoch's end, the
    next order drawn before a resume put the stream back (silent; 0 of 16 batches the uninterrupted run's, a user
    audit). Now the order Lightning's distributed sampler gives the same loader: seed_everything's seed, or the
    generator's."""
    dataset = TensorDataset(torch.arange(20))
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    loader = ResumableLoader(dataset, batch_size=4, shuffle=True)
    for epoch in (0, 3):
        ddp = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=7)
        ddp.set_epoch(epoch)
        loader.sampler.set_epoch(epoch)
        assert list(loader.sampler) == list(ddp)
    seeded = ResumableLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    assert list(seeded.sampler) == torch.randperm(20, generator=torch.Generator().manual_seed(3)).tolist()
    loader.load_state_dict({"epoch": 3, "batches": 2, "replicas": 1, "counted": 3})
    assert [b[0].tolist() for b in loader] == [list(ddp)[i : i + 4] for i in (8, 12, 16)]  # epoch 3 continues
    # Under replicas Lightning puts its own DistributedSampler, of the same seed, in its place: DDP's order there too
    # (an EpochShuffle would be wrapped, its permutation applied twice; the review).
    from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
    from lightning.pytorch.utilities.data import _is_dataloader_shuffled

    replica = _get_distributed_sampler(loader, _is_dataloader_shuffled(loader), 0, num_replicas=2, rank=1)
    ddp = torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=7)
    assert type(replica) is torch.utils.data.DistributedSampler and list(replica) == list(ddp)


def test_a_mid_epoch_state_of_another_replica_count_restarts_the_epoch_with_a_warning(data):
    """Replicas read one epoch's order interleaved (each every R-th index, as Lightning's distributed wrapper deals
    them): k batches on one replica are not k batches on each of two. Skipping them anyway dropped half the samples
    the one-replica run never trained on; the epoch restarts instead, and says why. A state from before the
    replicas were recorded (one replica) and the same count both continue as before."""
    replica0 = torch.utils.data.DistributedSampler(data.train_set, num_replicas=2, rank=0, shuffle=False)
    two = ResumableLoader(data.train_set, batch_size=4, sampler=replica0)
    whole = _batches(two)
    two.load_state_dict({"epoch": 0, "batches": 3, "replicas": 1})
    with pytest.warns(
        UserWarning, match="1 data-parallel replica.*has 2.*starts the epoch again.*ends it 3 batches early"
    ):
        again = _batches(two)
    assert len(again) == len(whole) and all(torch.equal(a, b) for a, b in zip(again, whole, strict=True))
    two.load_state_dict({"epoch": 0, "batches": 3, "replicas": 2})  # the same count: continues exactly
    assert all(torch.equal(a, b) for a, b in zip(_batches(two), whole[3:], strict=True))
    one = data.train_dataloader()
    one.sampler.set_epoch(0)
    first = _batches(one)
    one.load_state_dict({"epoch": 0, "batches": 3})  # a checkpoint from before the count: one replica
    one.sampler.set_epoch(0)
    assert all(torch.equal(a, b) for a, b in zip(_batches(one), first[3:], strict=True))


def test_a_foreign_state_is_refused_with_the_fix(data):
    with pytest.raises(ValueError, match="Resume with the data module that wrote the checkpoint"):
        data.train_dataloader().load_state_dict({"seen": 3})
    assert isinstance(data.train_dataloader(), ResumableLoader)


def _checkpoints(root: Path, folder: str) -> list[ModelCheckpoint]:
    return [ModelCheckpoint(dirpath=root / folder, save_last=True, every_n_train_steps=3, save_top_k=0)]


def _after_each_validation(root: Path, folder: str) -> list[ModelCheckpoint]:
    """ModelCheckpoint's default moment: after each epoch's validation (last.ckpt at an epoch's end)."""
    return [ModelCheckpoint(dirpath=root / folder, save_last=True, save_top_k=0)]


def _resume_against_uninterrupted(
    root: Path, strategy, devices: int, data=text_data, tied: bool = False, make_model=None,
    checkpoints=_checkpoints, stop: int = 3, steps: int = 6,
) -> float:  # fmt: skip
    """Fit to step ``stop`` (3: mid epoch 1), resume to ``steps`` (6: past epoch 2's start); against ``steps``
    uninterrupted steps that save at the same steps (a checkpoint drains a PACI pipeline, which is part of its
    trajectory)."""

    def fit(max_steps, folder, ckpt_path=None):
        model = make_model() if make_model else gpt_model(tie_weights=tied)
        trainer = gpt_trainer(strategy(), devices, max_steps, root, callbacks=checkpoints(root, folder),
                              enable_checkpointing=True, **EPOCH)  # fmt: skip
        trainer.fit(model, datamodule=data(), ckpt_path=ckpt_path)
        return model

    fit(stop, "first")
    last = next(p for p in (root / "first").iterdir() if p.name.startswith("last"))
    resumed = fit(steps, "resumed", str(last))
    return max_diff(resumed, fit(steps, "whole"))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "strategy",
    ["auto", "pipeline", pytest.param("two-replicas", marks=pytest.mark.multiproc)],
)
def test_a_run_bounded_by_max_steps_resumes_from_an_epochs_end_exactly(tmp_path, strategy):
    """last.ckpt after epoch 1's validation (step 4), resumed to step 8 (epochs 2 and 3), plain one-device Lightning,
    the pipeline in one process and two replicas on processes (Lightning's distributed sampler around the shuffle,
    which it forwards the epoch to) alike. Resuming ``max_steps`` training from an epoch's end, Lightning 2.6 counts
    the finished epoch twice and sets every later epoch one higher: each resumed epoch read the next one's order
    (5e-4 in the weights, module docstring of `lit_efficient.data.loading`)."""
    make, devices = {
        "auto": (lambda: "auto", 1),
        "pipeline": (lambda: PACIStrategy(pipeline_stages=2), 1),
        "two-replicas": (lambda: PACIStrategy(pipeline_stages=1, start_method="forkserver"), 2),
    }[strategy]
    diff = _resume_against_uninterrupted(tmp_path, make, devices, checkpoints=_after_each_validation, stop=4, steps=8)
    assert diff == 0.0


@pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one device at the pipeline runs' thread count
def test_plain_lightning_resumes_mid_epoch_exactly(tmp_path):
    assert _resume_against_uninterrupted(tmp_path, lambda: "auto", 1) == 0.0


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("devices", "checkpoint_format", "tied"),
    [(1, "file", True), (2, "file", False), (4, "sharded", True)],
    ids=["one-process-file-tied", "one-replica-file", "two-replicas-sharded-tied"],
)
def test_the_pipeline_resumes_mid_epoch_exactly(tmp_path, devices, checkpoint_format, tied):
    """PACI (the default schedule and options) on 2 stages: both in one process (devices=1), one replica on two
    processes (the user's sampler kept) and two replicas (Lightning's distributed sampler around it), in both
    checkpoint formats (both carry the loops' state alike: tests/checkpoint/test_sharded_checkpoints.py); with a
    tied embedding (`GPT(tie_weights=True)`: its delay line is in the checkpoint, tests/checkpoint/test_tied_resume.py)
    in one process and on two replicas."""

    def strategy():
        return PACIStrategy(pipeline_stages=2, checkpoint_format=checkpoint_format, start_method="forkserver")

    assert _resume_against_uninterrupted(tmp_path, strategy, devices, tied=tied) == 0.0


def _stock_gpt2() -> LightningModule:
    """A user's Hugging Face GPT-2 (random init from its config; its head tied to the embedding by default)."""
    transformers = pytest.importorskip("transformers")
    seed_everything(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=BLOCK,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = HFCausalLM(transformers.GPT2LMHeadModel(config), learning_rate=3e-3, warmup_steps=2, max_steps=20)
    assert model.model.get_output_embeddings().weight is model.model.get_input_embeddings().weight
    return model


@pytest.mark.usefixtures("one_thread")
def test_a_stock_hugging_face_model_with_a_tied_head_resumes_mid_epoch_exactly(tmp_path):
    """The tied weight's delay line by its Hugging Face names (`transformer.wte` / `lm_head`), PACI's defaults,
    both stages in one process: what a user's own model gets."""
    strategy = lambda: PACIStrategy(pipeline_stages=2)  # noqa: E731
    assert _resume_against_uninterrupted(tmp_path, strategy, 1, make_model=_stock_gpt2) == 0.0


class UsersTokens(LightningDataModule):
    """A user's own data module (their token tensors), with the package's loader and shuffle as documented."""

    def train_dataloader(self):
        tokens = torch.randint(0, 256, (64, BLOCK + 1), generator=torch.Generator().manual_seed(0))
        dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        return ResumableLoader(dataset, batch_size=4, sampler=EpochShuffle(len(dataset), seed=5))


class EpochAndIndex(EpochShuffle):
    """docs/checkpoints.md's recipe for augmentation that a resume replays: the sampler hands the Dataset the epoch
    with each index, and the Dataset draws from a generator seeded by both."""

    def __iter__(self):
        return ((self.epoch, index) for index in super().__iter__())


class RandomCrops(torch.utils.data.Dataset):
    """A user's augmentation: a random window of each sample, drawn from the sample's own generator."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, key):
        epoch, index = key
        start = int(torch.randint(0, 8, (), generator=torch.Generator().manual_seed(epoch * len(self) + index)))
        window = self.tokens[index, start : start + BLOCK + 1]
        return window[:-1], window[1:]


class UsersAugmentedTokens(LightningDataModule):
    def train_dataloader(self):
        tokens = torch.randint(0, 256, (64, BLOCK + 8), generator=torch.Generator().manual_seed(0))
        return ResumableLoader(RandomCrops(tokens), batch_size=4, sampler=EpochAndIndex(len(tokens), seed=5))


class UsersShuffledResumableTokens(UsersTokens):
    def train_dataloader(self):
        return ResumableLoader(super().train_dataloader().dataset, batch_size=4, shuffle=True)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "data",
    [UsersTokens, UsersShuffledResumableTokens, UsersAugmentedTokens],
    ids=["epoch-shuffle", "shuffle-true", "augmentation-by-epoch-and-index"],
)
def test_a_users_own_data_module_resumes_mid_epoch_exactly_with_the_resumable_loader(tmp_path, data):
    """With a plain DataLoader a resumed epoch starts again (Lightning: "not resumable"); the loader and shuffle the
    package's data modules use are public for a user's own (lit_efficient.data). The pipeline in one process: the
    same state on processes, as above. ``shuffle=True`` restarted its epoch (RandomSampler has no epoch), with a
    warning, and its batches were trained twice. Draws a Dataset makes from the process's stream are not replayed by
    a resume (the loader's workers start their streams again, as under plain Lightning; in the main process the
    stream comes back after Lightning fetched ahead): docs/checkpoints.md's recipe's are, through epoch 1's middle
    and epoch 2's start."""
    strategy = lambda: PACIStrategy(pipeline_stages=2)  # noqa: E731
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*starts the epoch again.*")
        assert _resume_against_uninterrupted(tmp_path, strategy, 1, data) == 0.0


class UsersShuffledTokens(UsersTokens):
    """A user's own data module with a plain shuffled DataLoader (not resumable: a resumed epoch starts again)."""

    def train_dataloader(self):
        return DataLoader(super().train_dataloader().dataset, batch_size=4, shuffle=True)


@pytest.mark.usefixtures("one_thread")
def test_a_plain_shuffled_loader_resumed_mid_epoch_starts_its_epoch_again_in_one_devices_order(tmp_path):
    """Lightning restarts a plain loader's epoch on a resume; its order is drawn from torch's global stream when the
    epoch starts. The strategy puts the process's stream back from the checkpoint (so that later epochs draw what
    the uninterrupted run drew), which it did at the restore, before that draw: the restarted epoch read another
    order than one device's (0.08 in the weights after 12 steps, found by a user audit). It is put back at the first
    training batch, after the loader's draw. Resumed at step 3 to the restarted epoch's end (step 4): one device's
    later epochs draw from its fresh stream, which Lightning does not restore."""

    def resumed(strategy, folder: str):
        def fit(max_steps, sub, ckpt_path=None):
            seed_everything(0)  # what a script does before building its model and data
            model = gpt_model()
            trainer = gpt_trainer(strategy(), 1, max_steps, tmp_path, callbacks=_checkpoints(tmp_path, sub),
                                  enable_checkpointing=True, **EPOCH)  # fmt: skip
            trainer.fit(model, datamodule=UsersShuffledTokens(), ckpt_path=ckpt_path)
            return model

        fit(3, f"{folder}-first")
        last = next(p for p in (tmp_path / f"{folder}-first").iterdir() if p.name.startswith("last"))
        return fit(4, f"{folder}-resumed", str(last))

    one_device = resumed(lambda: "auto", "one-device")
    assert max_diff(resumed(lambda: PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"), "piped"), one_device) == 0.0


@pytest.mark.usefixtures("one_thread")
def test_a_save_before_the_first_training_batch_keeps_the_restored_stream(tmp_path):
    """The stream is put back at the first training batch; a save before it (a fit resumed at its max_steps, which
    runs no batch, then save_checkpoint) wrote the process's current stream, not the one it restored (review)."""

    def fit(folder: str, ckpt_path=None):
        trainer = gpt_trainer(PACIStrategy(pipeline_stages=2), 1, 3, tmp_path, callbacks=_checkpoints(tmp_path, folder),
                              enable_checkpointing=True, **EPOCH)  # fmt: skip
        trainer.fit(gpt_model(), datamodule=text_data(), ckpt_path=ckpt_path)
        return trainer

    fit("first")
    last = next(p for p in (tmp_path / "first").iterdir() if p.name.startswith("last"))
    fit("again", str(last)).save_checkpoint(tmp_path / "again.ckpt")

    def streams(path):
        return [r["rng"]["cpu"] for r in torch.load(path, weights_only=False)["pipeline"]["ranks"].values()]

    assert all(torch.equal(a, b) for a, b in zip(streams(tmp_path / "again.ckpt"), streams(last), strict=True))


def test_without_a_sampler_epoch_nothing_is_skipped(data):
    """Under overfit_batches Lightning swaps in a sequential sampler, which has no epoch: a state saved at an
    epoch's end would otherwise skip the next epoch's batches (all of them, for a whole epoch saved)."""
    loader = data.train_dataloader()
    plain = ResumableLoader(loader.dataset, batch_size=4, drop_last=True)  # SequentialSampler: no set_epoch
    plain.load_state_dict({"epoch": None, "batches": len(plain)})
    assert len(_batches(plain)) == len(plain)


def test_a_loader_whose_sampler_has_no_epoch_says_that_a_mid_epoch_state_restarts_the_epoch():
    """A sampler of the user's own without an epoch cannot place a state taken mid-epoch: the loader restarted the
    epoch silently, where Lightning warns only for loaders without a state. A state taken at an epoch's end restarts
    nothing that matters, and says nothing."""
    from torch.utils.data import SequentialSampler

    data = list(range(8))
    loader = ResumableLoader(data, batch_size=2, sampler=SequentialSampler(data))
    loader.load_state_dict({"epoch": None, "batches": 2, "replicas": 1, "counted": None})
    said = r"taken 2 batches into an epoch, but this loader's sampler \(SequentialSampler\) has no epoch"
    with pytest.warns(UserWarning, match=said):
        assert [int(b[0]) for b in loader] == [0, 2, 4, 6]
    loader.load_state_dict({"epoch": None, "batches": 4, "replicas": 1, "counted": None})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(loader)) == 4


class _FromBatch(Callback):
    def __init__(self, path: Path, batch_idx: int) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.batch_idx and trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    ("stages", "devices"), [(2, 1), pytest.param(1, 2, marks=pytest.mark.multiproc)], ids=["pipeline", "two-replicas"]
)
def test_an_unshuffled_loader_passed_to_fit_resumes_mid_window_exactly(tmp_path, stages, devices):
    """``ResumableLoader(dataset, shuffle=False)`` handed to ``fit``: its sequential sampler had no epoch, so a
    checkpoint at batch 5 (mid-window, N=4) resumed reading batches 0-5 as its 6-11 (0.026 in the weights). It reads
    the dataset in order through a sampler with Lightning's epoch now: the pipeline resumes exactly (the default
    schedule; the uninterrupted run saves at the same batch, whose drain is part of a PACI run's trajectory). On two
    replicas Lightning's distributed sampler (unshuffled, as the loader's) takes the sampler's place and carries the
    epoch itself: each replica resumes its half exactly."""
    x = torch.randint(1, 60, (24 * devices, BLOCK + 1), generator=torch.Generator().manual_seed(0))
    rows = [(r[:-1], r[1:]) for r in x]

    def fit(ckpt_path=None, save=False):
        seed_everything(0)
        model = gpt_model()
        trainer = gpt_trainer(PACIStrategy(pipeline_stages=stages, start_method="forkserver"), devices, 3, tmp_path,
                              callbacks=[_FromBatch(tmp_path / "mid.ckpt", 5)] if save else [])  # fmt: skip
        trainer.fit(model, ResumableLoader(rows, batch_size=2), ckpt_path=ckpt_path)
        return model

    whole = fit(save=True)
    assert max_diff(fit(tmp_path / "mid.ckpt"), whole) == 0.0
