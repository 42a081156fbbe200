"""A PACI checkpoint in the middle of a window resumes every staleness correction as the uninterrupted run.

A correction that keeps counts of its own (``delay_compensation`` counts the window's stale forwards, for the share
its step corrects) lost them at a resume mid-window: the resumed step corrected a smaller share (6e-2 in the weights).
The stage's accumulation state carries them now; the other corrections read only the optimizer's state.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lit_efficient import PACIStrategy
from lit_efficient.data import ResumableLoader
from lit_efficient.runtime.staleness import CORRECTIONS
from tests.support.gpt_runs import BLOCK, gpt_model, gpt_trainer, max_diff

# The compiled form compiles each stage's prediction (minutes on CPU); it shares the in-place form's state: none.
_EAGER = [c for c in CORRECTIONS if not c.endswith("_compiled")]


class _SaveAt(Callback):
    def __init__(self, path, batch_idx: int) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.batch_idx and trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def _fit(tmp_path, correction: str, fmt: str, ckpt_path=None, save=False):
    """S=3 and N=4 from the first step (no synchronous start): stage 0's forwards of micro-batches 4 and 5 run
    before window 1's step, stale; the checkpoint after micro-batch 5 is in the middle of window 2."""
    x = torch.randint(1, 60, (24, BLOCK + 1), generator=torch.Generator().manual_seed(0))
    rows = [(r[:-1], r[1:]) for r in x]
    model = gpt_model()
    strategy = PACIStrategy(
        pipeline_stages=3, schedule="paci", sync_start_steps=0, staleness_correction=correction, checkpoint_format=fmt
    )
    callbacks = [_SaveAt(tmp_path / f"mid-{fmt}.ckpt", 5)] if save else []
    trainer = gpt_trainer(strategy, 1, 5, tmp_path, callbacks=callbacks)
    trainer.fit(model, ResumableLoader(rows, batch_size=2), ckpt_path=ckpt_path)
    return model


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("correction", _EAGER)
def test_a_mid_window_checkpoint_resumes_each_correction_exactly(tmp_path, correction):
    whole = _fit(tmp_path, correction, "file", save=True)
    assert max_diff(_fit(tmp_path, correction, "file", ckpt_path=tmp_path / "mid-file.ckpt"), whole) == 0.0


@pytest.mark.usefixtures("one_thread")
def test_delay_compensations_counts_resume_from_a_folder_too(tmp_path):
    whole = _fit(tmp_path, "delay_compensation", "sharded", save=True)
    resumed = _fit(tmp_path, "delay_compensation", "sharded", ckpt_path=tmp_path / "mid-sharded.ckpt")
    assert max_diff(resumed, whole) == 0.0
