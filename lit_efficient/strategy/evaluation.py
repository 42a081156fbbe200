"""Evaluation under PACIStrategy: validation/test/predict batches streamed through the stages.

Evaluation runs forward only, one batch after another through every stage, from a drained pipeline; the
last stage calls the module's own ``validation_step``/``test_step``/``predict_step`` with ``self(...)``
answered by the pipeline's output (`forward_answers`). The hooks are `PACIStrategy`'s.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lit_efficient.nested import tensors_in

Shape = tuple[int, ...]


@contextmanager
def forward_answers(module: LightningModule, output: Any, hook: str, input_shapes: list[Shape]) -> Iterator[None]:
    """While ``hook`` runs on the last stage, ``module(...)`` returns the pipeline's output. The pipeline ran one
    forward, of ``pipeline_input(batch)`` (its tensors' shapes: ``input_shapes``, taken before the hook could change
    the batch): a call with other arguments would get that same output, silently, so it raises. The first call's
    tensors are checked by shape (a prompt cut short to sample from got the whole input's output), not by value: its
    random numbers (a random masking) are drawn on stage 0's rank, not here. A later call must repeat the first's
    values (a test-time augmentation, ``self(x)`` then ``self(x.flip(1))``, got the unaugmented output)."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():  # the user's torch.enable_grad(): the output carries none, said here, not later
            raise RuntimeError(
                f"{type(module).__name__}.{hook} called self(...) with gradients enabled. Under PACIStrategy the last "
                "stage answers it with the pipeline's output, which the stages computed forward only, without a "
                "graph, so no gradient reaches the weights or the input from it (autograd would say 'element 0 of "
                "tensors does not require grad'). Compute gradients in an evaluation (a saliency map, a gradient "
                'norm) after fit on global rank 0 or on one device from a checkpoint (docs/python-api.md, "The '
                'whole model").'
            )
        if not calls:
            _check_shapes(module, hook, (args, kwargs), input_shapes)
        elif not _same(calls[0], (args, kwargs)):
            raise RuntimeError(
                f"{type(module).__name__}.{hook} called self(...) a second time with other arguments than the first. "
                "Under PACIStrategy the last stage answers the module's forward with the pipeline's output for "
                "self.pipeline_input(batch), whatever it is called with, so a forward of another input (a test-time "
                "augmentation, a perturbed copy, a generation loop's next token) would get the same output. Call "
                "self(...) with self.pipeline_input(batch) only, and evaluate a variation as data of its own (a "
                "transform in another dataloader, or in pipeline_input); generate after fit (docs/python-api.md, "
                '"The whole model").'
            )
        calls.append((args, kwargs))
        return output

    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.forward
    # A step that never calls self(...) leaves the pipeline's output unread, as Lightning lets a step skip a batch or
    # a loader (``if dataloader_idx == 1: return None``); it raised here. A step that runs the layers itself (a
    # generation loop) fails on processes with LayerNotHereError, naming the layer.


def _check_shapes(module: LightningModule, hook: str, given: Any, expected: list[Shape]) -> None:
    """Refuses a first call with a tensor of a shape that ``pipeline_input(batch)`` has not (once per tensor it has):
    another input, or one the pipeline never saw. Order and names are not compared (keyword arguments, a dict in
    another order); fewer tensors are taken (a Hugging Face module's forward accepts the bare ``input_ids`` of an
    ``(input_ids, attention_mask)`` input)."""
    args, kwargs = given
    theirs = shapes_of((args, {k: v for k, v in kwargs.items() if v is not None}))
    unmatched = Counter(theirs) - Counter(expected)
    if not expected or not unmatched:
        return
    raise RuntimeError(
        f"{type(module).__name__}.{hook} called self(...) with tensors of shapes {_listed(theirs)}, but the pipeline "
        f"ran self.pipeline_input(batch), of shapes {_listed(expected)}. Under PACIStrategy the last stage answers "
        "the module's forward with the pipeline's output for self.pipeline_input(batch), whatever it is called with, "
        "so a forward of another input (a prompt cut short to sample from, a crop) would get the output for the "
        "whole input. Call self(self.pipeline_input(batch)); sample or generate after fit on global rank 0, or on "
        'one device from a checkpoint (docs/python-api.md, "The whole model").'
    )


def shapes_of(obj: Any) -> list[Shape]:
    """The shapes of the tensors in ``obj`` (`nested.tensors_in`)."""
    return [tuple(t.shape) for t in tensors_in(obj)]


def _listed(shapes: list[Shape]) -> str:
    return ", ".join(str(s) for s in shapes) or "none"


def _same(a: Any, b: Any) -> bool:
    """The same values: tensors and arrays element by element (NaN equal to NaN, any dtype and device), mappings,
    sequences and dataclasses field by field, a keyword argument given as None the same as one not given, anything
    else by ``==``."""
    if a is b:
        return True
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.shape != b.shape:
            return False
        b = b.to(a.device)
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and bool(
            np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc")
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        a, b = ({k: v for k, v in m.items() if v is not None} for m in (a, b))
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (Tensor, np.ndarray, Mapping, list, tuple)) or isinstance(
        b, (Tensor, np.ndarray, Mapping, list, tuple)
    ):
        return False  # one a container or an array, the other not
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a usable equality: not known to be the same
        return False
