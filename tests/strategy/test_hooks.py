"""Which Lightning hooks PACIStrategy never calls, and the one warning that says so (pure, no processes)."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import LearningRateMonitor

from lit_efficient import GradientAccumulation
from lit_efficient.models import GPT
from lit_efficient.strategy.module_hooks import training_step_logs, uncalled_hooks, warn_uncalled_hooks


class _GradNormLogger(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        pass


class _Custom(GPT):
    def training_step(self, batch, batch_idx):
        loss, _ = self.pipeline_loss(self(batch[0]), batch)
        self.log("train_loss", loss)
        self.log("train_acc", loss * 0)
        self.log_dict({"a": loss})
        return loss

    def on_after_backward(self) -> None:
        pass


def test_gpt_and_the_package_callbacks_lose_nothing():
    callbacks = [GradientAccumulation(steps=2), LearningRateMonitor()]
    assert uncalled_hooks(GPT(n_layer=1), callbacks) == []
    assert training_step_logs(GPT(n_layer=1)) == []  # it logs train_loss, which the strategy logs itself


def test_overrides_that_never_run_are_named():
    module = _Custom(n_layer=1)
    assert uncalled_hooks(module, [_GradNormLogger()]) == [
        "_Custom.on_after_backward",
        "_GradNormLogger.on_before_optimizer_step",
    ]
    assert training_step_logs(module) == ["train_acc", "log_dict(...)"]
    with pytest.warns(UserWarning, match=r"on_after_backward.*train_acc, log_dict\(\.\.\.\).*pipeline_loss"):
        warn_uncalled_hooks(module, [_GradNormLogger()])
