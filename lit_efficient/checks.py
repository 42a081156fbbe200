"""The one test of a count argument, shared by every layer that checks one (each caller keeps its own message:
the value, what is allowed, the fix)."""

from __future__ import annotations

from typing import Any


def is_count(value: Any, minimum: int = 1) -> bool:
    """Whether ``value`` is a Python ``int`` >= ``minimum``: never a bool (``True`` would pass as 1 and hide a config
    typo), a float (``2.0`` fails later, far from the argument) or a numpy integer (it reaches hyper-parameters and
    checkpoints, which ``torch.load(weights_only=True)`` then refuses, and code that needs an ``int``)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
