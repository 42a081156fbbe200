"""One walk over the tensors of a nested structure (a batch, a checkpoint's state), shared by every layer."""

from __future__ import annotations

from collections.abc import Callable
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
