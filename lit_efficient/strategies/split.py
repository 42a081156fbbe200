"""Splitting a module into pipeline stages in place, and putting it back together.

A rank keeps its own stage's layers. Every other layer is swapped, at its place in the module
tree, for a `LayerOnOtherStage` placeholder without parameters, so ``module.parameters()``,
``configure_optimizers`` and ``state_dict`` see exactly this stage, under the unsplit module's
key names. The placeholder remembers the layer's structure on the meta device (no memory), which
is what lets `unsplit` rebuild the whole model on one rank from the stages' state dicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


class LayerOnOtherStage(nn.Module):
    """Stands in for a pipeline layer that lives on another stage.

    Args:
        index: The layer's position in ``pipeline_layers()``.
        stage: The stage that holds it.
        structure: The layer on the meta device (kept out of the module tree).
    """

    def __init__(self, index: int, stage: int, structure: nn.Module) -> None:
        super().__init__()
        self.index = index
        self.stage = stage
        self.__dict__["structure"] = structure  # not a submodule: no keys, no parameters

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"pipeline layer {self.index} lives on stage {self.stage}, not on this rank. Under PACIStrategy a "
            "module's forward is answered by the pipeline: evaluation steps must call self(self.pipeline_input(batch)) "
            "once instead of running the layers themselves."
        )

    def extra_repr(self) -> str:
        return f"layer={self.index}, stage={self.stage}"


@dataclass
class Split:
    """Where each layer went: ``sizes[s]`` layers on stage s, and the slots of the moved-out layers."""

    sizes: list[int]
    stage: int
    slots: list[tuple[nn.Module, str]]  # (parent, attribute name) of every layer, in order

    @property
    def bounds(self) -> tuple[int, int]:
        """``[first, last)`` layer indices of this rank's stage."""
        first = sum(self.sizes[: self.stage])
        return first, first + self.sizes[self.stage]

    def stage_of_layer(self, index: int) -> int:
        """The stage that holds layer ``index``."""
        total = 0
        for stage, size in enumerate(self.sizes):
            total += size
            if index < total:
                return stage
        raise IndexError(index)


def layer_parameter_counts(module: nn.Module, layers: Sequence[nn.Module]) -> list[int]:
    """Parameters per layer, after checking that every parameter belongs to exactly one layer."""
    owner: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            if id(p) in owner and owner[id(p)] != i:
                raise ValueError(
                    f"a parameter is shared by pipeline layers {owner[id(p)]} and {i} (tied weights?). "
                    "Layers on different stages cannot share parameters: untie them (e.g. GPT(tie_weights=False))."
                )
            owner[id(p)] = i
    outside = [name for name, p in module.named_parameters() if id(p) not in owner]
    if outside:
        raise ValueError(
            f"parameters {outside[:5]}{' ...' if len(outside) > 5 else ''} belong to no layer of pipeline_layers(): "
            "every parameter must live in exactly one pipeline layer so that some stage trains it"
        )
    return [sum(p.numel() for p in layer.parameters()) for layer in layers]


def split_module(module: nn.Module, layers: Sequence[nn.Module], sizes: Sequence[int], stage: int) -> Split:
    """Replace every layer outside ``stage`` with a placeholder, in place; returns the record."""
    slots = _slots(module, layers)
    split = Split(list(sizes), stage, slots)
    first, last = split.bounds
    for i, ((parent, name), layer) in enumerate(zip(slots, layers, strict=True)):
        if first <= i < last:
            if isinstance(layer, LayerOnOtherStage):
                raise ValueError(
                    f"layer {i} is needed on stage {stage} but this rank holds no weights for it (the module was "
                    "split by an earlier run with another layout). Load a consolidated checkpoint into a fresh module."
                )
            continue
        if not isinstance(layer, LayerOnOtherStage):
            layer = LayerOnOtherStage(i, split.stage_of_layer(i), layer.to("meta"))
        layer.stage = split.stage_of_layer(i)
        _set(parent, name, layer)
    return split


def unsplit(split: Split, state_dicts: dict[int, dict[str, torch.Tensor]], device: torch.device) -> None:
    """Put every layer back, rebuilding moved-out ones from ``state_dicts[layer index]`` on ``device``."""
    for i, (parent, name) in enumerate(split.slots):
        current = _get(parent, name)
        if not isinstance(current, LayerOnOtherStage):
            continue
        layer = current.structure.to_empty(device=device)
        if i in state_dicts:
            layer.load_state_dict(state_dicts[i])
        _set(parent, name, layer)


def local_layer_state_dicts(split: Split) -> dict[int, dict[str, torch.Tensor]]:
    """This rank's layers' state dicts on CPU, keyed by layer index (for `unsplit` on another rank)."""
    first, last = split.bounds
    return {i: {k: v.detach().cpu() for k, v in _get(*split.slots[i]).state_dict().items()} for i in range(first, last)}


def _slots(module: nn.Module, layers: Sequence[nn.Module]) -> list[tuple[nn.Module, str]]:
    where: dict[int, tuple[nn.Module, str]] = {}
    for parent in module.modules():
        for name, child in parent._modules.items():
            if child is not None:
                where.setdefault(id(child), (parent, name))
    slots = []
    for i, layer in enumerate(layers):
        if id(layer) not in where:
            raise ValueError(
                f"pipeline_layers()[{i}] ({type(layer).__name__}) is not a submodule of the module: register every "
                "pipeline layer as an attribute or in an nn.ModuleList so the stage can find and keep it"
            )
        slots.append(where[id(layer)])
    return slots


def _get(parent: nn.Module, name: str) -> nn.Module:
    return parent._modules[name]  # type: ignore[return-value]


def _set(parent: nn.Module, name: str, layer: nn.Module) -> None:
    parent._modules[name] = layer
