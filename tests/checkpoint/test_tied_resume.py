"""Under PACI a weight tied between the first and the last stage applies its embedding-side gradient d = ceil(S/N)
updates late (`lit_efficient.runtime.tied`). A checkpoint keeps the d gradients still pending at the save, and a
resume on the same layout sends them again: the resumed run continues the uninterrupted one bit for bit, in one
process and on processes (with replicas), from a file and from a sharded folder; `save_checkpoint` after fit keeps
the same line. A checkpoint without them (written before they were kept) or on another layout restarts the line,
and a layout change says so.

Checkpoints are taken at an epoch's end (`ordered_data`: 12 micro-batches an epoch), where a resumed run reads the
same batches as the uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_efficient import PACIStrategy
from lit_efficient.models import GPT
from tests.support.compare import assert_equal
from tests.support.gpt_runs import gpt_model, gpt_trainer, max_diff, ordered_data
from tests.support.multiproc import spawn, values

pytestmark = pytest.mark.usefixtures("one_thread")  # one process and S processes agree bit for bit


def _fit(stages, devices, steps, accumulate, ckpt_path=None, save_to=None, fmt="file", every=None) -> GPT:
    model = gpt_model(tie_weights=True)
    strategy = PACIStrategy(
        pipeline_stages=stages, sync_start_steps=0, checkpoint_format=fmt, start_method="forkserver"
    )  # no synchronous start: stale forwards from the first step
    every = every or steps
    saver = [ModelCheckpoint(dirpath=save_to, every_n_train_steps=every, filename="{step}", save_top_k=-1)]
    saver = saver if save_to else []
    trainer = gpt_trainer(
        strategy, devices, steps, accumulate_grad_batches=accumulate, callbacks=saver, enable_checkpointing=bool(saver)
    )
    trainer.fit(model, datamodule=ordered_data(), ckpt_path=ckpt_path)
    if save_to:
        trainer.save_checkpoint(save_to / "after-fit.ckpt")  # the common way to write the final model
    return model


@pytest.mark.parametrize(("stages", "accumulate", "delay"), [(3, 2, 2)], ids=["d=2"])  # d=1: with replicas below
def test_a_resume_continues_the_tied_weights_delay_line_bit_for_bit(tmp_path, stages, accumulate, delay):
    epoch = 12 // accumulate
    whole = _fit(stages, 1, epoch + 3, accumulate)
    _fit(stages, 1, epoch, accumulate, save_to=tmp_path)
    path = tmp_path / f"step={epoch}.ckpt"
    saved = torch.load(path, weights_only=False)
    line = saved["pipeline"]["ranks"]["stage0-replica0"]["tied"]["embed.wte.weight"]
    assert (line["updates"], line["delay"], len(line["pending"])) == (epoch, delay, delay)
    last = saved["pipeline"]["ranks"][f"stage{stages - 1}-replica0"]["tied"]["head.lm_head.weight"]
    assert (last["updates"], last["delay"]) == (epoch, delay) and "pending" not in last
    after_fit = torch.load(tmp_path / "after-fit.ckpt", weights_only=False)["pipeline"]["ranks"]
    assert_equal(after_fit, saved["pipeline"]["ranks"], "save_checkpoint after fit")  # the same line, pending included
    resumed = _fit(stages, 1, epoch + 3, accumulate, ckpt_path=path)
    assert max_diff(resumed, whole) == 0.0
    # Without the pending gradients (a checkpoint written before they were kept) the line restarts: not exact.
    for record in saved["pipeline"]["ranks"].values():
        record.pop("tied", None)
    torch.save(saved, tmp_path / "without.ckpt")
    restarted = _fit(stages, 1, epoch + 3, accumulate, ckpt_path=tmp_path / "without.ckpt")
    assert max_diff(restarted, whole) > 1e-3


@pytest.mark.multiproc
def test_two_replicas_resume_from_a_sharded_folder_bit_for_bit(tmp_path):
    """2 stages x 2 replicas (epochs of 6 micro-batches a replica, N=2): the delay line on each replica, and PACI's
    default correction, whose in-place prediction leaves each replica its own rounding residue (replicas drifted
    apart by 1e-7 and a resume continued the run that saved only to 4e-7): a save makes them agree first."""
    whole = _fit(2, 4, 6, 2, save_to=tmp_path, fmt="sharded", every=3)
    resumed = _fit(2, 4, 6, 2, ckpt_path=tmp_path / "step=3.ckpt", fmt="sharded")
    assert max_diff(resumed, whole) == 0.0


def test_another_layout_restarts_the_delay_line_and_says_so(tmp_path):
    _fit(2, 1, 3, 4, save_to=tmp_path)
    with pytest.warns(UserWarning, match=r"the per-rank state does not: .*restarts its delay line under PACI"):
        resumed = _fit(3, 1, 6, 4, ckpt_path=tmp_path / "step=3.ckpt")
    assert max_diff(resumed, gpt_model(tie_weights=True)) > 1e-3  # it trained on


def _evaluate(rank: int, world: int, path: str) -> dict[str, torch.Tensor] | None:
    model = gpt_model(tie_weights=True)
    trainer = gpt_trainer(PACIStrategy(pipeline_stages=2, sync_start_steps=0), world, 6)
    trainer.validate(model, datamodule=ordered_data(), ckpt_path=path, verbose=False)
    return {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else None


@pytest.mark.multiproc
def test_an_evaluation_of_a_mid_run_checkpoint_leaves_one_devices_weights_in_one_process_and_on_processes(tmp_path):
    """A checkpoint taken between PACI's delayed updates holds the tied weight's two copies with different values.
    The model an evaluation leaves is what one device's ``load_state_dict`` makes of it (the later key's value), in
    one process and on rank 0 of processes alike: there the embedding's copy was kept (7e-9 from one process)."""
    _fit(2, 1, 6, 2, save_to=tmp_path, every=3)
    path = str(tmp_path / "step=3.ckpt")
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert not torch.equal(saved["embed.wte.weight"], saved["head.lm_head.weight"])  # the copies differ mid-run
    one_device = gpt_model(tie_weights=True)
    one_device.load_state_dict(saved)
    assert_equal(_evaluate(0, 1, path), one_device.state_dict(), "one process")
    on_processes = values(spawn(_evaluate, 2, path, timeout=180, torchrun_env=True))[0]
    assert_equal(on_processes, one_device.state_dict(), "rank 0 of 2 processes")
