"""Lightning's model summary of a split module: the unsplit model's table, not the share of rank 0's stage.

Lightning's `ModelSummary` callback counts ``pl_module.parameters()`` at ``on_fit_start``, after the strategy has
split the module: on processes rank 0 showed its stage's share as "Total params" (90.7K of a 164.9K model), and
its rows the layers it holds, a layer of another stage as an empty ``LayerOnOtherStage`` (the rows did not add up
to the total). `PACIStrategy` gives the stock summary callbacks (plain and Rich) this subclass in ``setup``, as it
does the progress bars: the summary walks the module with each placeholder's structure in its place, so its rows
(at any ``max_depth``), their types, parameters and modes are the unsplit module's, and a parameter tied across
two stages is one parameter wherever the unsplit module holds it once (the pipeline keeps a copy on each stage).
With an ``example_input_array`` the in and out sizes are one device's in one process, "?" on processes (a rank
cannot run the whole forward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import cache
from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from torch import nn

from lit_efficient.runtime.split import LayerOnOtherStage, Tie


def _unsplit_named_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``module.named_modules()`` with every placeholder's structure in its place, each module once."""
    seen: set[int] = set()

    def walk(m: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
        m = m.structure if isinstance(m, LayerOnOtherStage) else m
        if id(m) in seen:
            return
        seen.add(id(m))
        yield path, m
        for name, child in m.named_children():
            yield from walk(child, f"{path}.{name}" if path else name)

    yield from walk(module, "")


def _parameters(module: nn.Module, path: str, ties: Sequence[Tie]) -> dict[int, nn.Parameter]:
    """The parameters of the unsplit module's ``module`` (at ``path`` in the root), each once: a tied parameter's
    second copy is left out where its first copy is in ``module`` too, as the unsplit module holds one."""
    named = {}
    for where, m in _unsplit_named_modules(module):
        for name, p in m.named_parameters(recurse=False):
            named[f"{where}.{name}" if where else name] = p
    inside = [(tie.name, tie.alias) for tie in ties]
    if path:  # the ties' names are the root's: as this row names them
        start = path + "."
        inside = [(a[len(start) :], b[len(start) :]) for a, b in inside if a.startswith(start) and b.startswith(start)]
    second = {alias for first, alias in inside if first in named}
    unique: dict[int, nn.Parameter] = {}
    for name, p in named.items():
        if name not in second:
            unique.setdefault(id(p), p)
    return unique


@cache
def _whole_model_table(kind: type[Summary]) -> type[Summary]:
    """``kind`` (Lightning's summary) reading the module as the unsplit module has it."""

    class WholeModelSummary(kind):
        def __init__(self, model: Any, max_depth: int, ties: Sequence[Tie]) -> None:
            self._ties = tuple(ties)
            super().__init__(model, max_depth=max_depth)

        def _forward_example_input(self) -> None:
            # On a rank the other stages' layers are placeholders: the example's forward (for the in and out
            # sizes) raised that a layer lives on another stage. There the sizes stay "?"; one process has them.
            if not any(isinstance(m, LayerOnOtherStage) for m in self._model.modules()):
                super()._forward_example_input()

        @property
        def named_modules(self) -> list[tuple[str, nn.Module]]:
            if self._max_depth == 0:
                return []
            mods = list(_unsplit_named_modules(self._model))[1:]  # the root module is not a row
            return [(n, m) for n, m in mods if self._max_depth < 0 or n.count(".") < self._max_depth]

        @property
        def param_nums(self) -> list[int]:
            return [_count(layer._module, self._ties, path) for path, layer in self._layer_summary.items()]

        @property
        def total_training_modes(self) -> dict[str, int]:
            modes = [m.training for _, m in _unsplit_named_modules(self._model)][1:]
            return {"train": modes.count(True), "eval": modes.count(False)}

        @property
        def total_parameters(self) -> int:
            return _count(self._model, self._ties, "")

        @property
        def trainable_parameters(self) -> int:
            return _count(self._model, self._ties, "", trainable=True)

    WholeModelSummary.__name__ = WholeModelSummary.__qualname__ = kind.__name__
    return WholeModelSummary


def _count(module: nn.Module, ties: Sequence[Tie], path: str, trainable: bool = False) -> int:
    return sum(p.numel() for p in _parameters(module, path, ties).values() if p.requires_grad or not trainable)


@cache
def _whole_model_summary(kind: type[ModelSummary]) -> type[ModelSummary]:
    def _summary(self: ModelSummary, trainer: Any, pl_module: Any) -> Any:
        return _whole_model_table(Summary)(pl_module, self._max_depth, self._pipeline_ties())

    return type(kind.__name__, (kind,), {"_summary": _summary, "__module__": kind.__module__})


def summarize_the_unsplit_model(trainer: Any, ties: Callable[[], Sequence[Tie]]) -> None:
    """Give the trainer's summary callbacks the unsplit model's table; ``ties()``: the split's tied parameters."""
    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummary):
            if not getattr(callback, "_pipeline_ties", None):
                callback.__class__ = _whole_model_summary(type(callback))
            callback._pipeline_ties = ties
