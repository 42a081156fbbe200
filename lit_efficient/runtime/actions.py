"""The unit of a pipeline schedule: one thing one stage does, with a short string form.

`1F3` is stage 1 running the forward of micro-batch 3, `0B2` stage 0 running the backward of
micro-batch 2, `2STEP0` stage 2 stepping its optimizer for window 0 (micro-batches [0, N)).
Schedules are lists (or lazy streams) of these; tests write them as strings. The zero-bubble schedules
this package is compared with split a backward in two, `3I2` (the input gradient) and `3W2` (the
weight gradient): the same vocabulary describes them (`lit_efficient.tools.schedule_plans`), though
the runtime runs only F, B and STEP.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

ActionKind = Literal["F", "B", "I", "W", "STEP"]
_PATTERN = re.compile(r"^(\d+)(F|B|I|W|STEP)(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One action of one stage.

    Args:
        stage: The pipeline stage that runs it (0 is the first).
        kind: ``"F"`` forward, ``"B"`` backward, ``"STEP"`` local optimizer step; in the compared
            schedules' plans also ``"I"`` (input-gradient half of a backward) and ``"W"`` (weight-gradient
            half, after ``I``).
        index: The micro-batch for ``F``/``B``; the window (optimizer step) number for ``STEP``.
    """

    stage: int
    kind: ActionKind
    index: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.index}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str(action)``: ``Action.parse("1B4") == Action(1, "B", 4)``."""
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><F|B|I|W|STEP><index>, for example '1F3', '3I2' "
                "or '0STEP2'"
            )
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))  # type: ignore[arg-type]


def format_actions(actions: Iterable[Action]) -> str:
    """Space-separated string form of a stream, as used by the tests."""
    return " ".join(str(a) for a in actions)


def parse_actions(text: str) -> list[Action]:
    """Inverse of `format_actions`."""
    return [Action.parse(token) for token in text.split()]
