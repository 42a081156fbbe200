"""What a pipeline's training writes to the loggers: one row per optimizer step, as one device writes.

Lightning's logger connector writes the step metrics after every training batch under manual
optimization, but under automatic optimization only after the batch that ends an accumulation window
(``_LoggerConnector.update_train_step_metrics``). `PACIStrategy` runs the module under manual
optimization (the stages step their own optimizers) with windows of N batches, so without this module
every metric logged on step (its own ``train_loss``, whatever ``pipeline_loss`` logs) is written N times
per optimizer step, all at the same step, where one device with ``accumulate_grad_batches=N`` writes
once: N times the W&B history, every chart's x axis repeated. The connector's rule here is
automatic optimization's, so the rows, their steps and their values are one device's; epoch
aggregates are untouched (they accumulate at every ``log`` call whether a row is written or not).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
from typing_extensions import override


class _OneRowPerOptimizerStep(_LoggerConnector):
    """Lightning's connector with automatic optimization's rule for step metrics under accumulation."""

    @override
    def update_train_step_metrics(self) -> None:
        if self.trainer.fit_loop._should_accumulate():
            return  # inside a window: one device writes nothing here either
        super().update_train_step_metrics()


def log_once_per_optimizer_step(trainer: Any) -> None:
    """Make ``trainer`` write step metrics once per optimizer step (idempotent; costs one type check).

    The trainer's own connector object is kept (its state, the loggers it holds); its class becomes a
    subclass overriding that one method, as `lit_efficient.strategy.progress` does for the stock progress bars.
    A connector that is not Lightning's own (a user's subclass) is left alone.
    """
    connector = trainer._logger_connector
    if type(connector) is _LoggerConnector:
        connector.__class__ = _OneRowPerOptimizerStep
