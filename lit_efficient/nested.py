"""One walk over the tensors of a nested structure (a batch, a checkpoint's state), shared by every layer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import Tensor


def map_tensors(obj: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in its dicts (given back as plain dicts), lists, tuples and
    named tuples (their types kept: a named-tuple batch is rebuilt field by field, as Lightning moves it);
    anything else as it is."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def tensors_in(obj: Any) -> Iterator[Tensor]:
    """The tensors in ``obj``'s mappings (a Hugging Face ``BatchEncoding`` too), lists, tuples and dataclasses, in
    order, visited in place: nothing rebuilt (`map_tensors` rebuilds, which a tuple subclass of the user's may
    refuse)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, field.name))
