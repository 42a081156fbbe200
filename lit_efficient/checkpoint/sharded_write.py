"""The sharded checkpoint format: a folder in which every rank writes its own share, in parallel.

`PACIStrategy(checkpoint_format="sharded")` writes a ``torch.distributed.checkpoint`` (DCP) folder laid
out as Lightning's FSDP strategy lays out its sharded checkpoints, so Lightning's own tool consolidates
it (``python -m lightning.pytorch.utilities.consolidate_checkpoint PATH`` writes ``PATH.consolidated``,
the file one device's ``Module.load_from_checkpoint`` and ``Trainer(ckpt_path=...)`` read)::

    PATH/                  the name ModelCheckpoint gives (``step=3.ckpt``), a folder
      __0_0.distcp ...     each rank's tensors, written by that rank
      .metadata            DCP's index: every key, its shape and dtype, the file that holds it
      meta.pt              Lightning's dict without weights and optimizer (loops, callbacks, schedulers,
                           hyper-parameters), written by global rank 0

The keys are the unsplit model's, as one device would name them:

- ``model``: the module's ``state_dict``, each stage's keys from its rank (replica 0);
- ``optimizer_0``: one device's optimizer keyed by parameter name (as FSDP's is): ``state`` by name, each
  stage's from its rank, and ``param_groups`` the unsplit groups whose ``params`` are names in one
  device's order (a tied weight once, under its first name). ``Optimizer.load_state_dict`` matches
  groups by position, so the consolidated file resumes on one device as it is;
- ``pipeline``: the format, the layout, the names per group, each name's group and hyper-parameters
  (``hyper``), the optimizer state of tied weights' second copies (``tied_state``), and per rank
  (``ranks.stage{s}-replica{r}``) the accumulated gradients of an unfinished window by name, the
  stage's version and random streams, the LocalSGD/DiLoCo state; a diverged replica's weights and
  optimizer state under ``replicas``.

Reading is `sharded_read.py`'s: a rank reads only what its stage needs and gets the dict a single file
would give it, so both formats resume through the strategy's one loading path, on any layout. Writing
(this module) is atomic: into ``PATH.partial``, renamed into place once
every rank's share and meta.pt are complete, so ``ckpt_path="last"`` never picks a partial folder.
"""

from __future__ import annotations

import io
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from lit_efficient.checkpoint.merge import RANK_RECORD, assemble, rank_key, to_automatic_loops
from lit_efficient.checkpoint.single_file import remove_path, replace_path, save_durably, sync_folder

FORMAT = 3  # `pipeline["format"]` of a sharded checkpoint (2: the single file, 1: an earlier directory)
META = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME: the name Lightning's tools look for
INDEX = ".metadata"  # DCP's index file


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder in this format (or any DCP folder Lightning wrote)."""
    path = Path(path)
    return path.is_dir() and (path / INDEX).is_file()


def not_a_checkpoint_folder(path: str | os.PathLike) -> str:
    """Why the folder ``path`` is no checkpoint this version reads, for an error message: the first directory
    format's (2026-12-01: ``pipeline.json`` and one ``stage{s}-replica{r}.pt`` per rank; `FORMAT` 1), which no
    later version reads, is named with the way forward."""
    path = Path(path)
    if (path / "pipeline.json").is_file() and any(path.glob("stage*-replica*.pt")):
        return (
            f"{str(path)!r} is a checkpoint folder of lit_efficient's first directory format (pipeline.json and a "
            "stage*-replica*.pt per rank, written until 2026-12-01), which this version no longer reads. Resume it "
            "once with a version of that time (commit 9e7fed1 reads it) and save with checkpoint_format='file', or "
            "consolidate its weights there (torch.load each stage file's 'state_dict')"
        )
    return f"{str(path)!r} is a folder without {INDEX}: not a sharded checkpoint"


def partial_path(path: Path) -> Path:
    """Where a checkpoint is written before it is published: not a name `ckpt_path="last"` matches."""
    return path.with_name(path.name + ".partial")


# -- writing ------------------------------------------------------------------------------------------


def rank_tree(share: dict[str, Any]) -> dict[str, Any]:
    """What one share (`merge.rank_share`) writes into the folder: its tensors under the unsplit names."""
    key = rank_key(share["stage"], share["replica"])
    record = {k: share[k] for k in RANK_RECORD if k in share}
    pipeline: dict[str, Any] = {"ranks": {key: record}}
    tree: dict[str, Any] = {"pipeline": pipeline}
    by_name = _state_by_name(share)
    if "state_dict" not in share:
        return tree
    if share["replica"] > 0:  # a diverged replica (LocalSGD): its own weights, beside replica 0's
        pipeline["replicas"] = {key: {"state_dict": share["state_dict"], "optimizer": by_name}}
        return tree
    tree["model"] = share["state_dict"]
    copies = set(share.get("tied_copies", ()))
    tree["optimizer_0"] = {"state": {n: s for n, s in by_name.items() if n not in copies}}
    tied = {n: s for n, s in by_name.items() if n in copies}
    if tied:
        pipeline["tied_state"] = tied
    return tree


def skeleton(share: dict[str, Any]) -> dict[str, Any]:
    """The share without its tensors: what global rank 0 needs of every rank to write the global entries
    (groups, hyper-parameters, schedulers). Small: it is gathered."""
    out = {k: share[k] for k in ("stage", "replica", "tied_copies", "groups", "lr_schedulers") if k in share}
    if "state_dict" in share:
        out["state_dict"] = {}
    if "optimizer" in share:
        out["optimizer"] = {"state": {}, "param_groups": share["optimizer"]["param_groups"]}
    return out


def global_part(base: dict[str, Any], skeletons: list[dict[str, Any]], layout: dict[str, Any]) -> tuple[dict, dict]:
    """Global rank 0's entries: (the tree's global keys, meta.pt). ``base`` is Lightning's dict of rank 0."""
    meta = {k: v for k, v in base.items() if k not in ("state_dict", "optimizer_states")}
    merged = assemble(meta, skeletons, layout)  # the single file's merging, over the skeletons
    pipeline: dict[str, Any] = {"format": FORMAT, "layout": layout}
    tree: dict[str, Any] = {"pipeline": pipeline}
    if "optimizer_states" in merged:
        names = merged["pipeline"]["param_names"]
        groups = merged["optimizer_states"][0]["param_groups"]
        tree["optimizer_0"] = {"param_groups": [dict(g, params=names[m]) for m, g in enumerate(groups)]}
        pipeline["param_names"] = names
        # One entry (a list is one DCP item), not thousands: (name, merged group, hyper-parameters).
        pipeline["hyper"] = [(n, g, h) for n, (g, h, _) in merged["pipeline"]["optimizer_by_name"].items()]
        meta["lr_schedulers"] = merged["lr_schedulers"]
    else:
        meta.pop("lr_schedulers", None)
    return tree, to_automatic_loops(meta)


def save(
    path: str | os.PathLike,
    shares: list[dict[str, Any]],
    base: dict[str, Any],
    layout: dict[str, Any],
    group: Any = None,
    distributed: bool = True,
) -> None:
    """Write this process's shares into the folder ``path``; collective over ``group`` when ``distributed``.

    Args:
        path: The checkpoint's path (a folder; a file or folder already there is replaced once this one is
            complete).
        shares: This process's shares (one per stage it holds: one on a rank, all of them in one process).
        base: Lightning's checkpoint dict as global rank 0 built it (read on global rank 0 only).
        layout: The pipeline layout (`PACIStrategy.layout`).
        group: The process group DCP plans over (gloo: small objects, no device copies); None: the default.
        distributed: False in one process (no process group): this process writes everything.
    """
    prepared = prepare(Path(path), shares, base, layout, group, distributed)
    with quiet_dcp():
        dcp.save(
            prepared.tree, storage_writer=FileSystemWriter(prepared.tmp), process_group=group, no_dist=not distributed
        )
    prepared.finish()  # dcp.save returns once every rank's data and the index are written
    if distributed:
        dist.barrier(group=group)  # nobody reads or removes it before it is complete


@dataclass
class Prepared:
    """A save between its collective preparation and its write: what this process writes where, and what
    the coordinator (global rank 0) adds once every rank's data is written (`finish`)."""

    path: Path
    tmp: Path
    tree: dict[str, Any]
    meta: bytes  # Lightning's part, pickled at the save point: a background write must not read live objects later
    coordinator: bool

    def finish(self) -> None:
        """On the coordinator: meta.pt, then the folder renamed into place, once every rank's files are seen in it.
        Elsewhere nothing."""
        if self.coordinator:
            check_every_share_is_here(self.tmp, self.path, SHARE_PATIENCE_S)
            save_durably(self.meta, self.tmp / META)  # DCP's writer fsyncs the shares' files itself
            publish(self.tmp, self.path)


SHARE_PATIENCE_S = 10.0  # how long global rank 0 waits to see another node's share in the folder before it refuses


def check_every_share_is_here(tmp: Path, path: Path, patience: float = SHARE_PATIENCE_S) -> None:
    """Raise, publishing nothing, when a file DCP's index names is not in the folder as this process sees it: the
    ranks wrote to a folder that is not one (node-local disks, each node writing its own ``PATH.partial``). Published,
    such a folder looked complete until a resume or a consolidation failed on the missing share. Each file is looked
    up by name, for up to ``patience`` seconds: a network file system may show another node's new file late."""
    index = FileSystemReader(tmp).read_metadata()
    missing = sorted({info.relative_path for info in index.storage_data.values()})
    deadline = time.monotonic() + patience
    while True:
        missing = [name for name in missing if not (tmp / name).exists()]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if missing:
        raise RuntimeError(
            f"the sharded checkpoint {path} is not complete where global rank 0 sees it: {', '.join(missing)} "
            f"(written by other ranks, __<rank>_0.distcp) not in {tmp}. Every rank writes its own share into the "
            "folder, so it must be on a file system every rank sees (a shared dirpath); on node-local disks use "
            "checkpoint_format='file', which global rank 0 writes alone. Nothing was published: the previous "
            "checkpoint is where it was"
        )


def prepare(
    path: Path,
    shares: list[dict[str, Any]],
    base: dict[str, Any],
    layout: dict[str, Any],
    group: Any,
    distributed: bool,
) -> Prepared:
    """The collective part before the write (arguments as `save`'s): a clean ``PATH.partial``, the skeletons
    gathered on global rank 0 and the global entries merged into its tree."""
    tmp = partial_path(path)
    coordinator = not distributed or dist.get_rank() == 0
    if coordinator:
        remove_path(tmp)  # left by a save that crashed (a file: a crashed save of the single-file format)
    if distributed:
        dist.barrier(group=group)
    tree: dict[str, Any] = {}
    for share in shares:
        _merge(tree, rank_tree(share))
    skeletons: list[Any] | None = [skeleton(s) for s in shares]
    if distributed:
        gathered: list[Any] | None = [None] * dist.get_world_size(group) if coordinator else None
        dist.gather_object(skeletons, gathered, dst=0, group=group)
        skeletons = [s for part in gathered for s in part] if gathered is not None else None
    meta: dict[str, Any] = {}
    if coordinator:
        assert skeletons is not None
        global_tree, meta = global_part(base, skeletons, layout)
        _merge(tree, global_tree)
    pickled = io.BytesIO()
    if coordinator:  # the callbacks' state as it is now (ModelCheckpoint's best_k_models changes before the next save)
        torch.save(meta, pickled)
    return Prepared(path, tmp, tree, pickled.getvalue(), coordinator)


def save_weights(path: str | os.PathLike, checkpoint: dict[str, Any]) -> None:
    """One process writes a weights-only folder: ``model`` and meta.pt (no optimizer, no pipeline section)."""
    path = Path(path)
    tmp = partial_path(path)
    remove_path(tmp)
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states", "lr_schedulers")}
    with quiet_dcp():
        dcp.save({"model": checkpoint["state_dict"]}, storage_writer=FileSystemWriter(tmp), no_dist=True)
    save_durably(meta, tmp / META)
    publish(tmp, path)


def publish(tmp: Path, path: Path) -> None:
    """Move the complete ``tmp`` to ``path``, replacing what is there (a file, a folder or a link): its entries
    (DCP's renamed .metadata, meta.pt) on disk first, then `replace_path`."""
    sync_folder(tmp)
    replace_path(tmp, path)


@contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP's warnings that do not apply: one process saving alone is meant (devices=1), and the folder is a
    fresh one, so nothing is overwritten."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        warnings.filterwarnings("ignore", message=".*overwrit.*")
        yield


def _state_by_name(share: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The share's optimizer state (local indices) by parameter name; parameters without state left out."""
    if "optimizer" not in share:
        return {}
    local = share["optimizer"]
    out = {}
    for group, names in zip(local["param_groups"], share["groups"], strict=True):
        for index, name in zip(group["params"], names, strict=True):
            if local["state"].get(index):
                out[name] = local["state"][index]
    return out


def _merge(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
