"""The one test of a count argument, shared by every layer that checks one (each caller keeps its own message:
the value, what is allowed, the fix)."""

from __future__ import annotations

from numbers import Integral
from typing import Any


def is_count(value: Any, minimum: int = 1) -> bool:
    """Whether ``value`` is a whole number >= ``minimum``: any integer type (numpy's too), never a bool (``True``
    would pass as 1 and hide a config typo) and never a float (``2.0`` fails later, far from the argument)."""
    return isinstance(value, Integral) and not isinstance(value, bool) and value >= minimum
