"""Lightning's profilers see the pipeline's own actions: a row per stage and action, not one opaque
training_step."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer

from lit_efficient import PACIStrategy
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT


def test_simple_profiler_has_a_row_per_stage_and_action():
    torch.manual_seed(0)
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=2), max_steps=2, accumulate_grad_batches=2,
        profiler="simple", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    data = TextDataModule(block_size=32, batch_size=4, max_bytes=60_000)
    trainer.fit(GPT(n_layer=2, n_head=2, n_embd=32, block_size=32), datamodule=data)
    durations = trainer.profiler.recorded_durations
    for stage in (0, 1):
        assert len(durations[f"[pipeline] stage {stage} forward"]) == 4  # 2 steps x N=2 micro-batches
        assert len(durations[f"[pipeline] stage {stage} backward"]) == 4
        assert len(durations[f"[pipeline] stage {stage} optimizer step"]) == 2
    assert len(durations["[pipeline] stage 1 receive activations"]) == 4
    assert len(durations["[pipeline] stage 0 receive gradients"]) == 4
    assert "[pipeline] stage 0 forward" in trainer.profiler.summary()
