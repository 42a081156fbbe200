"""The one test of a count argument, of a flag, the one guess at a misspelt choice and the one short list of names,
shared by every layer that checks one (each caller keeps its own message: the value, what is allowed, the fix)."""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Sequence
from typing import Any


def is_count(value: Any, minimum: int = 1) -> bool:
    """Whether ``value`` is a Python ``int`` >= ``minimum``: never a bool (``True`` would pass as 1 and hide a config
    typo), a float (``2.0`` fails later, far from the argument) or a numpy integer (it reaches hyper-parameters and
    checkpoints, which ``torch.load(weights_only=True)`` then refuses, and code that needs an ``int``)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_real(value: Any) -> bool:
    """Whether ``value`` is a finite real number: never a bool, a string (``"0.1"`` compared with a number raised a
    TypeError far from the argument), NaN (which passes no range check's message) or an infinity."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_flags(owner: str, **flags: Any) -> None:
    """Refuse a flag that is not ``True`` or ``False``: a string is truthy, so ``"false"`` (a YAML or shell value
    quoted) would switch it on, silently."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(
                f"{owner}({name}={value!r}) must be True or False (a string such as 'false' would read as True)."
            )


def closest_choice(given: Any, choices: Sequence[str]) -> str | None:
    """The choice ``given`` most likely meant: the only one that contains it, case and dashes aside (``flush`` for
    ``1f1b_flush``), else the closest spelling; None when nothing is close."""
    if not isinstance(given, str):
        return None
    within = [c for c in choices if given.lower().replace("-", "_") in c.lower()]
    if len(within) == 1:
        return within[0]
    close = difflib.get_close_matches(given, list(choices), n=1)
    return close[0] if close else None


def named_few(names: list[Any], shown: int = 5) -> str:
    """The first ``shown`` of ``names`` and how many more, for a message."""
    more = f" and {len(names) - shown:,} more" if len(names) > shown else ""
    return ", ".join(str(n) for n in names[:shown]) + more
