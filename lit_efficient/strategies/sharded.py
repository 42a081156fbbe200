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

A rank reads only what its stage needs (its keys, its parameters' optimizer state and accumulated
gradients, its own per-rank record when the layout is the same; the small non-tensor entries all) and
gets the dict a single file would give it (`file_view`), so both formats resume through the strategy's
one loading path, on any layout. Writing is atomic: into ``PATH.partial``, renamed into place once
every rank's share and meta.pt are complete, so ``ckpt_path="last"`` never picks a partial folder.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import warnings
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lit_efficient.strategies.checkpoint import assemble, load_file, to_automatic_loops

FORMAT = 3  # `pipeline["format"]` of a sharded checkpoint (2: the single file, 1: an earlier directory)
META = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME: the name Lightning's tools look for
INDEX = ".metadata"  # DCP's index file
_GLOBAL = ("format", "layout", "param_names", "hyper")  # pipeline entries every rank reads


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder in this format (or any DCP folder Lightning wrote)."""
    path = Path(path)
    return path.is_dir() and (path / INDEX).is_file()


def partial_path(path: Path) -> Path:
    """Where a checkpoint is written before it is published: not a name `ckpt_path="last"` matches."""
    return path.with_name(path.name + ".partial")


# -- writing ------------------------------------------------------------------------------------------


def rank_tree(share: dict[str, Any]) -> dict[str, Any]:
    """What one share (`checkpoint.rank_share`) writes into the folder: its tensors under the unsplit names."""
    key = f"stage{share['stage']}-replica{share['replica']}"
    record = {k: share[k] for k in ("accumulation", "rng", "averager") if k in share}
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
        layout: The pipeline layout (`PipelineCheckpointing.layout`).
        group: The process group DCP plans over (gloo: small objects, no device copies); None: the default.
        distributed: False in one process (no process group): this process writes everything.
    """
    path = Path(path)
    tmp = partial_path(path)
    coordinator = not distributed or dist.get_rank() == 0
    if coordinator:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
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
    with _quiet_dcp():
        dcp.save(tree, storage_writer=FileSystemWriter(tmp), process_group=group, no_dist=not distributed)
    if coordinator:  # dcp.save returns once every rank's data and the index are written
        torch.save(meta, tmp / META)
        publish(tmp, path)
    if distributed:
        dist.barrier(group=group)  # nobody reads or removes it before it is complete


def save_weights(path: str | os.PathLike, checkpoint: dict[str, Any]) -> None:
    """One process writes a weights-only folder: ``model`` and meta.pt (no optimizer, no pipeline section)."""
    path = Path(path)
    tmp = partial_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states", "lr_schedulers")}
    with _quiet_dcp():
        dcp.save({"model": checkpoint["state_dict"]}, storage_writer=FileSystemWriter(tmp), no_dist=True)
    torch.save(meta, tmp / META)
    publish(tmp, path)


def publish(tmp: Path, path: Path) -> None:
    """Move the complete ``tmp`` to ``path``, replacing what is there (a file or a folder).

    A folder cannot be renamed over a non-empty one, so the old checkpoint moves aside first. A crash
    between the two renames leaves both whole, under ``PATH.old`` and ``PATH.partial``."""
    old = None
    if path.is_symlink() or path.exists():
        old = path.with_name(path.name + ".old")
        _remove(old)
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        _remove(old)


@contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP's warnings that do not apply: one process saving alone is meant (devices=1), and the folder is a
    fresh one, so nothing is overwritten."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        warnings.filterwarnings("ignore", message=".*overwrit.*")
        yield


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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


# -- reading ------------------------------------------------------------------------------------------


def read(
    path: str | os.PathLike,
    keys: Collection[str],
    names: Collection[str],
    own: Collection[str],
    layout: dict[str, Any] | None,
    targets: dict[str, Tensor] | None = None,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """This process's part of the folder, as the dict a single file would give it (`file_view`).

    Args:
        path: The folder.
        keys: The ``state_dict`` keys this process holds.
        names: Its parameter names (the tied weights' second copies included).
        own: Its ranks' keys (``stage{s}-replica{r}``): their per-rank records (random streams, averager)
            are read when the layout equals ``layout``, and a diverged replica's weights.
        layout: This run's layout.
        targets: Tensors to read weights into in place, by key (the module's own): no second copy.
        weights_only: As `checkpoint.load_file`: None tries ``weights_only=True`` first.
    """
    path = Path(path)
    reader = FileSystemReader(path)
    metadata = reader.read_metadata()
    paths = metadata.planner_data
    entries = metadata.state_dict_metadata
    globals_ = {("pipeline", g) for g in _GLOBAL}
    small = _read(reader, {k: None for k in entries if paths[k][:2] in globals_}, weights_only)
    saved_layout = _tree(small, paths).get("pipeline", {}).get("layout")
    mine = set(own) if saved_layout == layout else set()
    keys, names = set(keys), set(names)

    def wanted(flat: str, p: tuple) -> bool:
        top = p[0]
        if top == "model":
            return p[1] in keys
        if top == "optimizer_0":
            return p[1] == "param_groups" or (p[1] == "state" and p[2] in names)
        if top != "pipeline":
            return False
        if p[1] == "tied_state":
            return p[2] in names
        if p[1] == "ranks":
            if len(p) > 4 and p[3:5] == ("accumulation", "grads"):
                return p[5] in names
            # Everyone's window counter and random-stream and averager markers (small: whether the layouts'
            # per-rank state is dropped, and said so, as for a file); the rest of a record, its own rank's.
            small_entry = not isinstance(entries[flat], TensorStorageMetadata) or p[3] == "rng"
            return p[2] in mine or p[3:5] == ("accumulation", "window") or (p[3] in ("rng", "averager") and small_entry)
        if p[1] == "replicas":
            return p[2] in own and (p[4] in keys if p[3] == "state_dict" else p[4] in names)
        return False

    targets = targets or {}
    request: dict[str, Any] = {}
    for flat, entry in entries.items():
        p = paths[flat]
        if flat in small or not wanted(flat, p):
            continue
        if isinstance(entry, TensorStorageMetadata):
            target = targets.get(p[1]) if p[0] == "model" else None
            if target is None or target.shape != entry.size or target.dtype != entry.properties.dtype:
                target = torch.empty(entry.size, dtype=entry.properties.dtype)
            request[flat] = target.detach()
        else:
            request[flat] = None
    loaded = _read(reader, request, weights_only)
    meta = load_file(path / META, weights_only) if (path / META).is_file() else {}
    return file_view(_tree({**small, **loaded}, paths), meta)


def file_view(tree: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The single file's dict (`checkpoint.assemble`'s layout) from a sharded checkpoint's tree, whole
    (consolidated) or a rank's part, so `PipelineCheckpointing` and `InProcessPipeline` load both alike.

    Args:
        tree: ``{"model", "optimizer_0", "pipeline"}`` as in the folder (or ``state_dict`` and
            ``optimizer_states`` as Lightning's consolidation renames them).
        meta: Lightning's part (meta.pt).
    """
    out = dict(meta)
    out["state_dict"] = tree.get("model", tree.get("state_dict", {}))
    optimizer = tree.get("optimizer_0")
    if optimizer is None and tree.get("optimizer_states"):
        optimizer = tree["optimizer_states"][0]
    saved = tree.get("pipeline", {})
    pipeline: dict[str, Any] = {k: saved[k] for k in ("format", "layout", "param_names") if k in saved}
    ranks = saved.get("ranks", {})
    for record in ranks.values():  # DCP keeps no empty dict: a window whose gradients are all None
        if record.get("accumulation", {}).get("window") is not None:
            record["accumulation"].setdefault("grads", {})
    pipeline["ranks"] = ranks
    if optimizer is not None and "param_groups" in optimizer:
        state = {**optimizer.get("state", {}), **saved.get("tied_state", {})}
        hyper = {n: (g, h) for n, g, h in saved.get("hyper", [])}
        out["optimizer_states"] = [{"state": optimizer.get("state", {}), "param_groups": optimizer["param_groups"]}]
        if hyper:
            pipeline["optimizer_by_name"] = {n: (g, h, state.get(n, {})) for n, (g, h) in hyper.items()}
        replicas = {}
        for key, replica in saved.get("replicas", {}).items():
            by_name = {n: (*hyper[n], s) for n, s in replica.get("optimizer", {}).items() if n in hyper}
            replicas[key] = {"state_dict": replica.get("state_dict", {}), "optimizer_by_name": by_name}
        pipeline["replicas"] = replicas
    out["pipeline"] = pipeline
    return out


def from_consolidated(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A file Lightning's ``consolidate_checkpoint`` made of a folder of this format, as `file_view` gives it
    (any other checkpoint as it is): PACIStrategy resumes it on any layout, like its own file."""
    if checkpoint.get("pipeline", {}).get("format") != FORMAT:
        return checkpoint
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states", "pipeline")}
    return file_view(checkpoint, meta)


def consolidated_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The whole model's ``state_dict`` from a folder (what `checkpoint.consolidate_checkpoint` returns)."""
    reader = FileSystemReader(Path(path))
    metadata = reader.read_metadata()
    request = {}
    for flat, entry in metadata.state_dict_metadata.items():
        if metadata.planner_data[flat][0] == "model" and isinstance(entry, TensorStorageMetadata):
            request[flat] = torch.empty(entry.size, dtype=entry.properties.dtype)
    loaded = _read(reader, request, True)
    return _tree(loaded, metadata.planner_data).get("model", {})


def _read(reader: FileSystemReader, request: dict[str, Any], weights_only: bool | None) -> dict[str, Any]:
    """Read the flat DCP keys of ``request`` (tensors into the given ones, other values replaced), without
    a collective: each rank reads its own part."""
    if request:
        dcp.load(request, storage_reader=reader, planner=_Planner(weights_only), no_dist=True)
    return request


class _Planner(DefaultLoadPlanner):
    """DCP's planner over flat keys, unpickling non-tensor entries as `checkpoint.load_file` does (DCP's
    own allows any object)."""

    def __init__(self, weights_only: bool | None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.weights_only = weights_only

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = _unpickle(value, self.weights_only)


def _unpickle(value: io.BytesIO, weights_only: bool | None) -> Any:
    if weights_only is not None:
        return torch.load(value, map_location="cpu", weights_only=weights_only)
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        value.seek(0)
        return torch.load(value, map_location="cpu", weights_only=False)


def _tree(flat: dict[str, Any], paths: dict[str, tuple]) -> dict[str, Any]:
    """Nested dicts and lists from DCP's flat keys and their original paths (``metadata.planner_data``)."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        _put(tree, paths[key], value)
    return tree


def _put(node: Any, path: Iterable[Any], value: Any) -> None:
    path = list(path)
    for key, child_key in zip(path[:-1], path[1:], strict=True):
        child = _get(node, key)
        if child is None:
            child = [] if isinstance(child_key, int) else {}
            _set(node, key, child)
        node = child
    _set(node, path[-1], value)


def _get(node: Any, key: Any) -> Any:
    if isinstance(node, list):
        return node[key] if key < len(node) else None
    return node.get(key)


def _set(node: Any, key: Any, value: Any) -> None:
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
        node[key] = value
    else:
        node[key] = value
