"""Reading a sharded checkpoint (`sharded_write`'s format): a process's part of the folder, as the single file's dict.

A rank reads only what its stage needs: its ``state_dict`` keys (straight into its parameters), its
parameters' optimizer state and accumulated gradients by name, its own per-rank record (random streams,
version, averager) when the layout is the same, and the small non-tensor entries all (the layout, the
groups, every rank's window counter). `file_view` turns that into the dict `merge.assemble` makes
for a single file, so the strategy's one load path (`strategy.stage_checkpoints`) loads both formats alike, and a file
Lightning's ``consolidate_checkpoint`` made of a folder too (`from_consolidated`).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lit_efficient.checkpoint.sharded_write import FORMAT, META
from lit_efficient.checkpoint.single_file import load_file, safely_or_in_full

_GLOBAL = ("format", "layout", "param_names", "hyper")  # pipeline entries every rank reads


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
        weights_only: As `single_file.load_file`: None tries ``weights_only=True`` first.
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
    # Where the folder has none of this process's keys, every weight is read (O(model) here, not O(share)): the
    # module's on_load_checkpoint may rename the saved keys to its own (a legacy layout kept by on_save_checkpoint),
    # and a strict load then names what the model lacks. By this process's keys only, a renamed folder gave it
    # nothing, and strict_loading=False trained on fresh weights. Some keys missing (a new head fine-tuned from a
    # checkpoint without it) read the share as before.
    every_weight = bool(keys) and not keys & {paths[flat][1] for flat in entries if paths[flat][0] == "model"}

    def wanted(flat: str, p: tuple) -> bool:
        top = p[0]
        if top == "model":
            return every_weight or p[1] in keys
        if top == "optimizer_0":
            return p[1] == "param_groups" or (p[1] == "state" and p[2] in names)
        if top != "pipeline":
            return False
        if p[1] == "tied_state":
            return p[2] in names
        if p[1] == "ranks":
            if len(p) > 4 and p[3:5] == ("accumulation", "grads"):
                return p[5] in names
            # Everyone's window counters and random-stream and averager markers (small: whether the layouts'
            # per-rank state is dropped, and said so, as for a file); the rest of a record, its own rank's.
            small_entry = not isinstance(entries[flat], TensorStorageMetadata) or p[3] == "rng"
            window = p[3:5] in (("accumulation", "window"), ("accumulation", "microbatches"))
            return p[2] in mine or window or (p[3] in ("rng", "averager") and small_entry)
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
    view = file_view(_tree({**small, **loaded}, paths), meta)
    if not every_weight:  # every key the folder holds, not only this process's: what a strict load compares
        view["pipeline"]["saved_keys"] = [paths[flat][1] for flat in entries if paths[flat][0] == "model"]
    return view


def file_view(tree: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The single file's dict (`merge.assemble`'s layout) from a sharded checkpoint's tree, whole
    (consolidated) or a rank's part, so the strategy's one load path loads both alike.

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
    hyper = {n: (g, h) for n, g, h in saved.get("hyper", [])}
    if optimizer is not None and "param_groups" in optimizer:
        state = {**optimizer.get("state", {}), **saved.get("tied_state", {})}
        out["optimizer_states"] = [{"state": optimizer.get("state", {}), "param_groups": optimizer["param_groups"]}]
        if hyper:
            pipeline["optimizer_by_name"] = {n: (g, h, state.get(n, {})) for n, (g, h) in hyper.items()}
    # A diverged replica's own weights, with its optimizer state where the folder has one (not under
    # save_weights_only: the weights still are this replica's, not replica 0's). A parameter of the replica
    # without optimizer state (never stepped there) has no entry in the folder (DCP keeps no empty dict): it gets
    # ``{}`` as in the file, not replica 0's state under it.
    replicas = {}
    for key, replica in saved.get("replicas", {}).items():
        weights, states = replica.get("state_dict", {}), replica.get("optimizer", {})
        by_name = {n: (*hyper[n], states.get(n, {})) for n in (*weights, *states) if n in hyper}
        replicas[key] = {"state_dict": weights, "optimizer_by_name": by_name}
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
        with warnings.catch_warnings():  # DCP warns that no_dist means one process: here each rank reads alone
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            try:
                dcp.load(request, storage_reader=reader, planner=_Planner(weights_only, str(reader.path)), no_dist=True)
            except CheckpointException as err:  # one reader, one failure: its own (weights_only's refusal, say)
                failures = [failure for failure, _ in err.failures.values() if isinstance(failure, Exception)]
                if len(failures) == 1:
                    raise failures[0] from None
                raise
    return request


class _Planner(DefaultLoadPlanner):
    """DCP's planner over flat keys, unpickling non-tensor entries as `single_file.load_file` does (DCP's
    own allows any object)."""

    def __init__(self, weights_only: bool | None, folder: str) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.weights_only, self.folder = weights_only, folder

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:  # one warning per folder, not per entry
        self.state_dict[read_item.dest_index.fqn] = _unpickle(
            value, self.weights_only, f"checkpoint folder {self.folder}"
        )


def _unpickle(value: io.BytesIO, weights_only: bool | None, source: str) -> Any:
    def load(safe: bool) -> Any:
        value.seek(0)
        return torch.load(value, map_location="cpu", weights_only=safe)

    return load(weights_only) if weights_only is not None else safely_or_in_full(load, source)


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
