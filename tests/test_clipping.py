"""Gradient clipping under the pipeline: flush clips the global norm (exact, tested with tied weights in
test_tied.py); paci clips per stage and says so once, at setup."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from lightning.pytorch import Trainer

from lit_efficient import PACIStrategy
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT


def _fit(schedule: str, algorithm: str) -> tuple[list[str], GPT]:
    torch.manual_seed(0)
    model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=32)
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=2, schedule=schedule), max_steps=2,
        accumulate_grad_batches=2, gradient_clip_val=0.1, gradient_clip_algorithm=algorithm, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=TextDataModule(block_size=32, batch_size=4, max_bytes=60_000))
    return [str(w.message) for w in caught if "gradient_clip_val" in str(w.message)], model


def test_paci_norm_clipping_warns_once_that_it_clips_per_stage():
    messages, _ = _fit("paci", "norm")
    assert len(messages) == 1
    assert "clips each of the 2 stages' gradient norms to 0.1 separately" in messages[0]
    assert "sqrt(2) x 0.1 = 0.141" in messages[0] and "schedule='1f1b_flush'" in messages[0]


@pytest.mark.parametrize(("schedule", "algorithm"), [("paci", "value")])
def test_clipping_that_matches_one_device_says_nothing(schedule, algorithm):
    messages, _ = _fit(schedule, algorithm)
    assert messages == []


def _trained(strategy, tie: bool, **trainer_args) -> GPT:
    torch.manual_seed(0)
    model = GPT(n_layer=4, n_head=2, n_embd=32, block_size=32, tie_weights=tie)
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=3, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        **trainer_args,
    )  # fmt: skip
    trainer.fit(model, datamodule=TextDataModule(block_size=32, batch_size=4, max_bytes=60_000))
    return model


CLIP = dict(gradient_clip_val=0.05, gradient_clip_algorithm="norm")


@functools.cache
def _one_device(tie: bool) -> tuple[dict, dict]:
    """One device's weights after the run, clipped and unclipped (shared by the parametrized cases)."""
    return _trained("auto", tie, **CLIP).state_dict(), _trained("auto", tie).state_dict()


@pytest.mark.parametrize(("stages", "tie"), [(2, False), (4, False)])
def test_flush_clips_the_global_norm_in_one_process_as_one_device(stages, tie):
    """In one process the stages sum their squared norms among themselves (LocalStageSum) inside their steps:
    the run equals one device's clipping of the whole model's norm, and differs from the unclipped run (the
    clip acted)."""
    got = _trained(PACIStrategy(pipeline_stages=stages, schedule="1f1b_flush"), tie, **CLIP).state_dict()
    want, unclipped = _one_device(tie)
    diff = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in a)  # noqa: E731
    assert diff(got, want) < 1e-7  # measured: 0.0 at S=2 and S=4
    assert diff(want, unclipped) > 1e-6  # AdamW barely feels a rescaled gradient: 1.0e-5 here


def test_flush_norm_clipping_with_a_tied_weight_in_one_process_is_refused_naming_what_works():
    refused = r"tied between the first and the last stage cannot run in one process.*devices=2"
    with pytest.raises(ValueError, match=refused):
        _trained(PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"), True, **CLIP)
