"""Whether the module's own ``forward`` computes what the pipeline computes: ``pipeline_layers()`` one after another.

The pipeline never calls ``forward``: each stage runs its layers, layer k on layer k-1's output, and the last layer's
output goes to ``pipeline_loss``. A ``forward`` that does anything between the layers (a residual across them, an
activation, a reshape, a scaling of the input) is a model the pipeline does not train: it trained
``head(block2(block1(x)))`` for a ``forward`` of ``head(h + block2(h))``, silently (0.72 in the weights after three
epochs, against the user's model under plain Lightning), and evaluated it so. `forward_outside_layers` traces
``forward`` once on fake tensors (no compute, any model size: `tools.fake_memory.fake_module`) and follows the
tensors: every layer called once, in order, each on what the previous one returned.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lit_efficient.tools.fake_memory import fake_batch, fake_module


def _tensors(value: Any) -> list[Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]


def _among(tensors: list[Tensor], pool: list[Tensor]) -> bool:
    return all(any(t is p for p in pool) for t in tensors)


def forward_outside_layers(module: nn.Module, layers: list[nn.Module], batch: Any) -> str | None:
    """What ``module``'s forward computes outside its ``layers``, for one ``batch``, said in a sentence; None where
    it chains them exactly, or where it cannot be told (forward calls none of them, as a Hugging Face model's calls
    its own blocks and not the package's adapters, or cannot run on fake tensors)."""
    calls: list[tuple[int, list[Tensor], list[Tensor]]] = []  # (layer, its tensor inputs, its tensor outputs)
    pending: dict[int, list[Tensor]] = {}

    def before(index: int) -> Any:
        def hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
            pending[index] = _tensors((args, kwargs))

        return hook

    def after(index: int) -> Any:
        def hook(_: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            calls.append((index, pending.pop(index, []), _tensors(output)))

        return hook

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(before(index), with_kwargs=True))
        handles.append(layer.register_forward_hook(after(index), with_kwargs=True))
    # A forward that logs would hand Lightning fake tensors: its logging is off for the trace. The random streams are
    # as before it (a fake dropout draws nothing, but nothing here may move a user's stream).
    own = {name: module.__dict__[name] for name in ("log", "log_dict") if name in module.__dict__}  # the strategy's
    module.__dict__["log"] = module.__dict__["log_dict"] = lambda *args, **kwargs: None
    try:
        with torch.random.fork_rng(devices=[]), fake_module(module) as mode, torch.no_grad():
            inputs = module.pipeline_input(fake_batch(batch, mode))  # type: ignore[operator]
            output = module(*(inputs if isinstance(inputs, tuple) else (inputs,)))
    except Exception:  # noqa: BLE001 - data-dependent code, another signature: nothing can be told, nothing is said
        return None
    finally:
        for handle in handles:
            handle.remove()
        del module.__dict__["log"], module.__dict__["log_dict"]
        module.__dict__.update(own)
    if not calls:
        return None
    order = [index for index, _, _ in calls]
    if order != list(range(len(layers))):
        return f"forward calls the pipeline layers in the order {order}, not once each in order 0..{len(layers) - 1}"
    given = _tensors(inputs)
    for index, consumed, _ in calls:
        pool = given if index == 0 else calls[index - 1][2]
        if not _among(consumed, pool):
            what = "what pipeline_input returned" if index == 0 else f"layer {index - 1}'s output"
            return f"layer {index} ({type(layers[index]).__name__}) is given something other than {what}"
    if not _among(_tensors(output), calls[-1][2]):
        return f"forward returns something other than layer {len(layers) - 1}'s output"
    return None
