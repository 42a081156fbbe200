"""``PACIStrategy(checkpoint_format="sharded", async_checkpoint=True)``: the share is copied, written in the
background while training continues, and the folder appears, whole, once every rank's write is done.

Same reference as tests/checkpoint/test_sharded_checkpoints.py: one uninterrupted device, checkpoints at step 3 (an
epoch's end), 1F1B-flush, one thread per process, 1e-6.
"""

from __future__ import annotations

import threading
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter

from lit_efficient import PACIStrategy
from lit_efficient.checkpoint import sharded_write as sharded
from tests.support.gpt_runs import gpt_model as _model
from tests.support.gpt_runs import gpt_trainer as _trainer
from tests.support.gpt_runs import max_diff as _max_diff
from tests.support.gpt_runs import ordered_data as _ordered

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("one_thread")]  # tests/conftest.py


def _async(stages: int = 2) -> PACIStrategy:
    return PACIStrategy(
        pipeline_stages=stages, schedule="1f1b_flush", start_method="forkserver", checkpoint_format="sharded",
        async_checkpoint=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def full():
    model = _model()
    _trainer("auto", 1, 6).fit(model, datamodule=_ordered())
    return model


@pytest.mark.parametrize("devices", [2, 1], ids=["2 processes", "one process"])
def test_background_saves_resume_exactly(tmp_path, full, devices):
    """A save every step (each waits for the one before), then a resume from step 3's on 2 processes."""
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, filename="{step}", save_top_k=-1)
    _trainer(_async(), devices, 3, callbacks=[ckpt], enable_checkpointing=True).fit(_model(), datamodule=_ordered())
    for step in (1, 2, 3):  # every one published, whole, before fit returned
        path = tmp_path / f"step={step}.ckpt"
        assert sharded.is_sharded(path) and (path / "meta.pt").is_file(), step
        assert not path.with_name(path.name + ".partial").exists(), step
    resumed = _model()
    _trainer(_async(), 2, 6).fit(resumed, datamodule=_ordered(), ckpt_path=str(tmp_path / "step=3.ckpt"))
    assert _max_diff(resumed, full) <= 1e-6


class _Observe(L.Callback):
    """What the checkpoint folder looks like right after ``trainer.save_checkpoint`` returns, and how long it took."""

    def __init__(self, path) -> None:
        self.path, self.seconds, self.published = path, None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 3:
            start = time.perf_counter()
            trainer.save_checkpoint(self.path)
            self.seconds = time.perf_counter() - start
            self.published = self.path.exists()


def test_training_continues_while_the_share_is_written(tmp_path, monkeypatch):
    """The write is made slow (1.5 s); save_checkpoint returns before it ends, the folder appears only once it
    is written, and fit waits for it before returning."""
    real_write = FileSystemWriter.write_data
    writer_threads = []

    def slow_write(self, plan, planner):
        writer_threads.append(threading.current_thread() is not threading.main_thread())
        time.sleep(1.5)  # far beyond the step's own time, also beside another test's load
        return real_write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write)
    observe = _Observe(tmp_path / "mid.ckpt")
    model = _model()
    _trainer(_async(), 1, 3, callbacks=[observe]).fit(model, datamodule=_ordered())
    assert writer_threads == [True]  # written off the training thread
    assert observe.seconds < 1.5 and not observe.published
    assert sharded.is_sharded(tmp_path / "mid.ckpt")  # published by the end of fit
    assert torch.load(tmp_path / "mid.ckpt" / "meta.pt", weights_only=True)["global_step"] == 1


def test_a_failed_background_write_is_raised_and_publishes_nothing(tmp_path, monkeypatch):
    def failing_write(self, plan, planner):
        raise OSError("disk gone")

    monkeypatch.setattr(FileSystemWriter, "write_data", failing_write)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, filename="{step}")
    with pytest.raises(RuntimeError, match="asynchronous checkpoint save failed"):
        _trainer(_async(), 1, 3, callbacks=[ckpt], enable_checkpointing=True).fit(_model(), datamodule=_ordered())
    assert not (tmp_path / "step=3.ckpt").exists()


def test_async_needs_the_sharded_format():
    with pytest.raises(ValueError, match="checkpoint_format='sharded'"):
        PACIStrategy(async_checkpoint=True)


class _SeeFolderAt(L.Callback):
    """Which checkpoints exist, whole, when batch ``batch_idx`` starts."""

    def __init__(self, folder, batch_idx: int) -> None:
        self.folder, self.batch_idx, self.seen = folder, batch_idx, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.batch_idx:
            self.seen = sorted(p.name for p in self.folder.iterdir() if sharded.is_sharded(p))


def test_a_rotated_checkpoint_is_removed_only_once_its_successor_is_published(tmp_path, monkeypatch):
    """ModelCheckpoint(save_top_k=1) removes the checkpoint it rotates out right after starting the next save.
    Removed then, while the new one is still written (made slow: 0.5 s), no whole checkpoint of the run was on
    disk, and a crash then lost both. Now the removal waits for the new checkpoint's publication."""
    real_write = FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        time.sleep(1.5)  # far beyond the step's own time, also beside another test's load
        return real_write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write)
    folder = tmp_path / "checkpoints"
    ckpt = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, filename="{step}", save_top_k=1)
    see = _SeeFolderAt(folder, batch_idx=8)  # step 2's save in flight (its last micro-batch was batch 7)
    _trainer(_async(), 1, 3, callbacks=[see, ckpt], enable_checkpointing=True).fit(_model(), datamodule=_ordered())
    assert see.seen == ["step=1.ckpt"]  # the newest whole checkpoint, kept while step 2's is written
    assert sorted(p.name for p in folder.iterdir()) == ["step=3.ckpt"]  # each removed once its successor was


def test_a_last_link_to_a_background_save_is_refused_before_anything_trains():
    """save_last='link' makes last.ckpt a link to the checkpoint just started, which a background save publishes
    only later: a crash in between leaves a dangling link, and ckpt_path='last' then trains from scratch."""
    ckpt = ModelCheckpoint(save_last="link", every_n_train_steps=1)
    trainer = _trainer(_async(), 1, 1, callbacks=[ckpt], enable_checkpointing=True)
    with pytest.raises(ValueError, match=r"save_last='link'.*Use save_last=True"):
        trainer.fit(_model(), datamodule=_ordered())


def test_a_failed_background_save_keeps_the_checkpoint_it_would_have_rotated_out(tmp_path, monkeypatch):
    """The save of step 2 fails (its error is raised at the next save); the step-1 checkpoint ModelCheckpoint rotates
    out meanwhile is then the newest whole one, and stays, whether the failure came before or after the rotation."""
    real_write, calls = FileSystemWriter.write_data, []

    def second_write_fails(self, plan, planner):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", second_write_fails)
    folder = tmp_path / "checkpoints"
    ckpt = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, filename="{step}", save_top_k=1)
    with pytest.raises(RuntimeError, match="asynchronous checkpoint save failed(.|\n)*disk full"):
        _trainer(_async(), 1, 3, callbacks=[ckpt], enable_checkpointing=True).fit(_model(), datamodule=_ordered())
    assert sharded.is_sharded(folder / "step=1.ckpt")
    assert not (folder / "step=2.ckpt").exists()


def test_a_removal_asked_after_a_failed_save_is_not_done():
    """The ordering the fit above may not hit: the save has already failed (its error waits for the next `wait`)
    when ModelCheckpoint asks to remove the checkpoint before it. The removal is refused with a warning."""
    from lit_efficient.checkpoint.async_write import AsyncCheckpointer

    checkpointer, removed = AsyncCheckpointer(distributed=False), []
    checkpointer._done, checkpointer._error = threading.Event(), OSError("disk full")
    checkpointer._done.set()
    with pytest.warns(UserWarning, match="newest whole one"):
        checkpointer.when_published(lambda: removed.append(1))
    assert removed == []
    checkpointer._error = None  # the next save succeeded: a removal then runs at once
    checkpointer.when_published(lambda: removed.append(2))
    assert removed == [2]
