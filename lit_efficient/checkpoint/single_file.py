"""The single-file format: one ordinary Lightning ``.ckpt``, the dict one device would have saved (`merge`),
gathered on global rank 0 one rank at a time and written atomically; loaded memory-mapped.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def write_atomically(checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Write the file under a temporary name and rename it into place: complete or absent, also across a power
    loss (the bytes are on disk before the rename, and the rename before this returns)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    remove_path(tmp)  # a folder there (a crashed save of the sharded format) would refuse the file
    save_durably(checkpoint, tmp)
    replace_path(tmp, path)


def replace_path(tmp: Path, path: Path) -> None:
    """Rename the complete ``tmp`` (a file or a folder) to ``path``, replacing what is there: a file, a folder (a
    run that saved the other format under the same name) or a link. A rename replaces a file or a link by a file
    atomically; nothing can be renamed over a non-empty folder, nor a folder over a file, so there the old entry
    moves aside first, and a crash between the two renames leaves both whole, under ``PATH.old`` and ``tmp``."""
    there = path.is_symlink() or path.exists()
    old = None
    if there and (tmp.is_dir() or (path.is_dir() and not path.is_symlink())):
        old = path.with_name(path.name + ".old")
        remove_path(old)
        os.replace(path, old)
    os.replace(tmp, path)
    sync_folder(path.parent)
    if old is not None:
        remove_path(old)


def remove_path(path: Path) -> None:
    """Remove a file, a folder or a link (the link only: never what it points at); nothing if absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def save_durably(obj: Any, path: Path) -> None:
    """``torch.save`` (or, for ``bytes``, the bytes of an earlier one) whose bytes are on disk when it returns
    (fsync): a rename after it never publishes a file whose content a power loss could still take."""
    with open(path, "wb") as f:
        if isinstance(obj, bytes):
            f.write(obj)
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def sync_folder(folder: Path) -> None:
    """fsync a folder, so that the entries renamed into it survive a power loss (POSIX; where a folder cannot be
    opened or synced, as on Windows, nothing: the rename itself is still atomic)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_file(path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
    """Load one checkpoint file on the CPU, memory-mapped: a tensor's bytes are read from the file when it
    is used, so a rank that takes its stage's share of a whole-model file materializes that share only
    (the pages stay the page cache's, copied privately where written). ``weights_only`` True or False, as
    the caller asked (``trainer.fit(..., weights_only=...)``), is obeyed as is. None (the default):
    ``weights_only=True`` (no arbitrary code on unpickling) when the content allows; a checkpoint holding
    other Python objects (custom hyper-parameter types, say) falls back to a full load, with a warning:
    only load such checkpoints from sources you trust."""
    if weights_only is not None:
        return _load(path, weights_only)
    return safely_or_in_full(lambda safe: _load(path, safe), str(path))


def safely_or_in_full(load: Callable[[bool], Any], source: str) -> Any:
    """``load(True)`` (torch's ``weights_only=True``), or where that refuses the content's Python objects,
    ``load(False)`` with a warning naming their types and the three ways to choose instead."""
    try:
        return load(True)
    except pickle.UnpicklingError as err:
        refused = sorted(set(re.findall(r"Unsupported global: GLOBAL ([\w.]+)", str(err))))
        types = ", ".join(refused) or re.sub(r"\x1b\[[0-9;]*m", "", str(err).splitlines()[0])[:200]
        warnings.warn(
            f"{source} holds Python objects that weights_only=True refuses ({types}); loading it in full, as a "
            "checkpoint you trust. Pass weights_only=True (trainer.fit(..., weights_only=True), also to validate, "
            "test and predict; Lightning 2.6 and later) to refuse such files instead, or weights_only=False to load "
            "them without this warning; torch.serialization.add_safe_globals allows named types in a safe load.",
            stacklevel=3,
        )
        return load(False)


def _load(path: str | os.PathLike, weights_only: bool) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except RuntimeError as err:  # a file in torch's legacy (non-zip) serialization cannot be mapped
        if "mmap" not in str(err):
            raise
        return torch.load(path, map_location="cpu", weights_only=weights_only)


def gather_to_rank_zero(obj: Any, world_size: int, group: dist.ProcessGroup | None) -> list[Any] | None:
    """Every rank's ``obj`` on global rank 0, in rank order (None elsewhere): the single file's gather.

    Streamed: rank 0 takes the ranks one at a time, each first sending its object's structure with every
    tensor replaced by its shape and dtype (`_Slot`, pickled: a few KiB), then the tensors' bytes one by one,
    received straight into tensors allocated for them. So rank 0 holds the received tensors once, which is
    the file less its own share, and a sending rank holds nothing more than its share (its host tensors are
    sent from where they lie). ``gather_object`` instead pickled every share on its rank (2x the share) and
    had rank 0 receive every pickle at once and unpickle them beside it: 3.3x the whole file at S=2
    (BENCHMARKS.md, "Checkpoints: host memory"). Collective over ``group`` (gloo); rank 0 gets host tensors,
    a device tensor is copied to the host as it is sent.
    """
    rank = dist.get_rank()
    if rank != 0:
        structure, tensors = _take_tensors(obj)
        dist.send_object_list([structure], dst=0, group=group)
        for tensor in tensors:
            if tensor.numel():
                dist.send(_as_bytes(tensor.cpu().contiguous()), dst=0, group=group)  # a device tensor: one at a time
        return None
    gathered = [obj]
    for src in range(1, world_size):
        box: list[Any] = [None]
        dist.recv_object_list(box, src=src, group=group)
        gathered.append(_fill(box[0], src, group))
    return gathered


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in a share sent to rank 0: its position in the send order, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: Any


def _take_tensors(obj: Any) -> tuple[Any, list[Any]]:
    """``obj`` with each strided tensor replaced by a `_Slot`, and the tensors. Tensors that are the same memory
    (a tied weight's two state-dict entries: two tensor objects, one storage) get one slot, so rank 0 gets one
    tensor for them, as unpickling would have given it."""
    tensors: list[Any] = []
    seen: dict[tuple, _Slot] = {}

    def take(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.layout == torch.strided:
            key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x.device)
            if key not in seen:
                seen[key] = _Slot(len(tensors), tuple(x.shape), x.dtype)
                tensors.append(x.detach())
            return seen[key]
        return _map(x, take)

    return take(obj), tensors


def _fill(structure: Any, src: int, group: dist.ProcessGroup | None) -> Any:
    """The structure `_take_tensors` made on rank ``src``, its tensors received one at a time, in slot order."""
    received: dict[int, torch.Tensor] = {}

    def put(x: Any) -> Any:
        if isinstance(x, _Slot):
            if x.index not in received:  # slots arrive in send order: a walk in the same order as `take`'s
                tensor = torch.empty(x.shape, dtype=x.dtype)
                if tensor.numel():
                    dist.recv(_as_bytes(tensor), src=src, group=group)
                received[x.index] = tensor
            return received[x.index]
        return _map(x, put)

    return put(structure)


def _map(x: Any, fn: Any) -> Any:
    """``x`` with ``fn`` applied to each value of a dict, list or tuple (their types kept), else ``x`` itself:
    what is left (a named tuple, another container) travels pickled, tensors included."""
    if isinstance(x, dict):
        items = {k: fn(v) for k, v in x.items()}
        if type(x) is dict:
            return items
        try:
            return type(x)(items)  # OrderedDict (a state_dict), Lightning's AttributeDict
        except TypeError:
            return items
    if type(x) in (list, tuple):
        return type(x)(fn(v) for v in x)
    return x


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (a view: no copy), for any dtype."""
    return tensor.reshape(-1).view(torch.uint8)
