"""Lightning's model summary of a split module: the whole model's table, not the share of rank 0's stage.

Lightning's `ModelSummary` callback counts ``pl_module.parameters()`` at ``on_fit_start``, after the strategy has
split the module: on processes rank 0 showed its stage's share as "Total params" (90.7K of a 164.9K model), and
its rows the layers it holds, a layer of another stage as an empty ``LayerOnOtherStage`` (the rows did not add up
to the total). `PACIStrategy` gives the stock summary callbacks (plain and Rich) this subclass in ``setup``, as it
does the progress bars: every row counts and names its layers as the unsplit module has them (a placeholder by the
structure it keeps), the totals count the whole model, a tied parameter once. One process holds every layer and
prints what plain Lightning prints.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from lightning.pytorch.callbacks import ModelSummary

from lit_efficient.runtime.split import LayerOnOtherStage, whole_model_parameters


@cache
def _whole_model_table(kind: type) -> type:
    """``kind`` (the summary class Lightning built) with its rows and totals read as the unsplit module has them."""

    class WholeModelSummary(kind):
        _whole_totals: tuple[int, int]

        @property
        def layer_types(self) -> list[str]:
            return [type(_as_unsplit(layer._module)).__name__ for layer in self._layer_summary.values()]

        @property
        def param_nums(self) -> list[int]:
            # Each row on its own, as Lightning counts it: a parameter tied across two rows is in both.
            return [whole_model_parameters(layer._module)[0] for layer in self._layer_summary.values()]

        @property
        def total_training_modes(self) -> dict[str, int]:
            modes = [m.training for m in _unsplit_modules(self._model)][1:]  # the root module is not counted
            return {"train": modes.count(True), "eval": modes.count(False)}

        @property
        def total_parameters(self) -> int:
            return self._whole_totals[0]

        @property
        def trainable_parameters(self) -> int:
            return self._whole_totals[1]

    WholeModelSummary.__name__ = WholeModelSummary.__qualname__ = kind.__name__
    return WholeModelSummary


def _as_unsplit(module: Any) -> Any:
    return module.structure if isinstance(module, LayerOnOtherStage) else module


def _unsplit_modules(module: Any) -> list[Any]:
    """``module.modules()`` with every placeholder's structure in its place."""
    found = []
    for m in module.modules():
        found.extend(m.structure.modules() if isinstance(m, LayerOnOtherStage) else [m])
    return found


@cache
def _whole_model_summary(kind: type[ModelSummary]) -> type[ModelSummary]:
    def _summary(self: ModelSummary, trainer: Any, pl_module: Any) -> Any:
        summary = kind._summary(self, trainer, pl_module)
        summary.__class__ = _whole_model_table(type(summary))
        summary._whole_totals = self._whole_model_parameters()
        return summary

    return type(kind.__name__, (kind,), {"_summary": _summary, "__module__": kind.__module__})


def count_the_whole_model(trainer: Any, counts: Callable[[], tuple[int, int]]) -> None:
    """Give the trainer's summary callbacks the whole model's table, ``counts()`` as its totals."""
    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummary):
            if not getattr(callback, "_whole_model_parameters", None):
                callback.__class__ = _whole_model_summary(type(callback))
            callback._whole_model_parameters = counts
