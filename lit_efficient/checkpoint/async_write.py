"""Sharded checkpoints written in the background while training continues (``async_checkpoint=True``).

A save still starts at the point Lightning saves (the pipeline drained, `sharded_write.prepare`'s small
collective: the skeletons to global rank 0), then ``torch.distributed.checkpoint.async_save`` copies the
rank's share into host memory and returns; a thread writes the copy and runs DCP's closing collective, on
a gloo group of its own (the training's collectives keep theirs). When it is done, global rank 0 writes
meta.pt and renames the folder into place (`sharded_write.Prepared.finish`), from that thread: the checkpoint
appears as soon as every rank's data is on disk, and until then ``ckpt_path="last"`` finds the previous
one, whole. One save at a time: the next save, a synchronous one, and the end of training wait for the
one in flight (and raise what it raised). A checkpoint ModelCheckpoint rotates out while a save is in flight is
removed once that save is published (`when_published`), never before: until then it is the newest whole one.

What it costs: one more copy of the rank's share in host memory while it is written, and the writing
thread's CPU time beside training's. A save in flight when the fit fails still completes and is published (its
state was copied before the failure: a whole checkpoint that ``ckpt_path="last"`` resumes); a write that fails
itself is never published (its ``NAME.partial`` is cleared by the next save to that name). The process waits for
the thread at exit.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from lit_efficient.checkpoint.sharded_write import Prepared, prepare, quiet_dcp


class AsyncCheckpointer:
    """This process's asynchronous sharded saves, one in flight at most.

    Args:
        distributed: False in one process (no process group): DCP saves without collectives.
        timeout: Of the writing thread's gloo group (its collectives wait for the slowest rank's write).
    """

    def __init__(self, distributed: bool, timeout: Any = None) -> None:
        self.distributed = distributed
        self.timeout = timeout
        self.group: Any = None
        self._done: threading.Event | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # the save's publication against `when_published`'s queueing
        self._after: list[Callable[[], None]] = []  # what runs once the save in flight is published

    def save(
        self, path: Path, shares: list[dict[str, Any]], base: dict[str, Any], layout: dict[str, Any], sync_group: Any
    ) -> None:
        """Start writing the shares into ``path`` (arguments as `sharded_write.save`'s; ``sync_group`` for the
        preparation's collective). Returns once the share is copied; collective like a synchronous save."""
        self.wait()
        if self.distributed and self.group is None:  # collective: every rank saves at the same point
            self.group = dist.new_group(backend="gloo", timeout=self.timeout)
        prepared = prepare(path, shares, base, layout, sync_group, self.distributed)
        with quiet_dcp():
            future = dcp.async_save(
                prepared.tree, storage_writer=FileSystemWriter(prepared.tmp), process_group=self.group,
                no_dist=not self.distributed,
            )  # fmt: skip
        done = self._done = threading.Event()
        future.add_done_callback(lambda written: self._publish(written, prepared, done))  # type: ignore[arg-type]

    def when_published(self, action: Callable[[], None]) -> None:
        """Run ``action`` (a removal of an older checkpoint) once the save in flight is published, or now if none
        is in flight. Dropped if that save fails: the older checkpoint is then the newest whole one, and stays.
        ModelCheckpoint removes the checkpoint it rotates out right after starting the next save; removed then,
        no whole checkpoint of the run would be on disk while the new one is written."""
        with self._lock:
            if self._done is not None and not self._done.is_set():
                self._after.append(action)
                return
            failed = self._error is not None  # the last save failed (raised at the next `wait`): keep what is there
        if failed:
            warnings.warn(
                "a checkpoint rotated out while the background save before it failed is kept: it is the newest "
                "whole one (remove it by hand once a later save succeeds)",
                stacklevel=2,
            )
            return
        action()

    def wait(self) -> None:
        """Until the save in flight, if any, is written and published; raises what it raised."""
        if self._done is not None:
            self._done.wait()
            self._done = None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"the asynchronous checkpoint save failed: {error}") from error

    def close(self) -> None:
        """Wait for the save in flight and release the writing thread's group (end of training)."""
        try:
            self.wait()
        finally:
            if self.group is not None and dist.is_initialized():
                dist.destroy_process_group(self.group)
            self.group = None

    def _publish(self, written: Future, prepared: Prepared, done: threading.Event) -> None:
        # In DCP's thread: its future is done once every rank's data and the index are written.
        published = False
        try:
            written.result()
            prepared.finish()
            published = True
        except BaseException as err:  # noqa: BLE001 - raised in the main thread by `wait`
            self._error = err
        # Every action queued before the event is set runs before it is set (`wait` returns after them): taken
        # under the lock, run outside it (the main thread may queue another meanwhile), until none is left.
        while True:
            with self._lock:
                after, self._after = (self._after if published else []), []
                if not after:
                    done.set()
                    return
            for action in after:
                try:
                    action()
                except Exception as err:  # noqa: BLE001 - a removal that failed loses nothing; say it
                    warnings.warn(f"removing a rotated-out checkpoint failed: {err}", stacklevel=1)
