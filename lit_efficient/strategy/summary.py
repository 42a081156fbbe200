"""Lightning's model summary of a split module: the whole model's totals, not the share of rank 0's stage.

Lightning's `ModelSummary` callback counts ``pl_module.parameters()`` at ``on_fit_start``, after the strategy has
split the module: on processes rank 0 showed its stage's share as "Total params" (90.7K of a 164.9K model).
`PACIStrategy` gives the stock summary callbacks (plain and Rich) this subclass in ``setup``, as it does the
progress bars; the table's rows stay the module's children as this rank holds them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from lightning.pytorch.callbacks import ModelSummary


class _WholeTotals:
    """A Lightning summary whose totals and size are the whole model's; everything else is the summary's own."""

    def __init__(self, summary: Any, total: int, trainable: int) -> None:
        self._summary, self.total_parameters, self.trainable_parameters = summary, total, trainable

    def __getattr__(self, name: str) -> Any:
        return getattr(self._summary, name)

    @property
    def model_size(self) -> float:
        return self.total_parameters * self._summary._precision_megabytes


@cache
def _whole_model_summary(kind: type[ModelSummary]) -> type[ModelSummary]:
    def _summary(self: ModelSummary, trainer: Any, pl_module: Any) -> Any:
        summary = kind._summary(self, trainer, pl_module)
        return _WholeTotals(summary, *self._whole_model_parameters())

    return type(kind.__name__, (kind,), {"_summary": _summary, "__module__": kind.__module__})


def count_the_whole_model(trainer: Any, counts: Callable[[], tuple[int, int]]) -> None:
    """Give the trainer's summary callbacks the whole model's totals, ``counts()`` when they summarize."""
    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummary):
            if not getattr(callback, "_whole_model_parameters", None):
                callback.__class__ = _whole_model_summary(type(callback))
            callback._whole_model_parameters = counts
