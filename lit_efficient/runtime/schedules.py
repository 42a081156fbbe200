"""Schedule generators: (schedule, stage, S, N, micro-batch range) -> that stage's action stream.

Both schedules run micro-batches in 1F1B order: stage s runs up to S-s forwards ahead of its
backwards (warm-up), then alternates one backward and one forward, then runs the remaining
backwards (cool-down). A ``STEP`` follows the backward that closes a window of N micro-batches
(and, when asked, the last micro-batch of a partial window at the end of an epoch).

- ``1f1b_flush`` restarts that order in every window: the cool-down of window k completes before
  the first forward of window k+1, so every stage steps with the pipeline empty (the bubble).
- ``paci`` never restarts it: forwards of window k+1 fill the slots flush leaves idle, each stage
  steps on its own after its N-th backward, and a micro-batch's forward and backward on stage s
  are separated by at most ceil((S-1-s)/N) local steps (its weight-version drift).

A stream is a pure function of its arguments; ``stop=None`` makes it unbounded (lazy). The
runtime relies on one property, checked in the tests: the stream for ``stop=None`` and the one
for ``stop=M`` agree on every action before ``F(M)``, so a pipeline fed an unknown number of
micro-batches can be drained at any point by switching to the finite stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Literal

from lit_efficient.runtime.actions import Action

ScheduleName = Literal["paci", "1f1b_flush"]
SCHEDULES: tuple[ScheduleName, ...] = ("paci", "1f1b_flush")


def stage_actions(
    schedule: ScheduleName,
    stage: int,
    num_stages: int,
    accumulate: int,
    start: int = 0,
    stop: int | None = None,
    step_at_stop: bool = False,
) -> Iterator[Action]:
    """The action stream of one stage over micro-batches ``[start, stop)``.

    Args:
        schedule: ``"paci"`` or ``"1f1b_flush"``.
        stage: This stage, ``0 <= stage < num_stages``.
        num_stages: Pipeline depth S.
        accumulate: Micro-batches per optimizer step N; windows are ``[kN, (k+1)N)`` in micro-batch
            indices, so a range may start in the middle of a window (after a drain).
        start: First micro-batch of the range.
        stop: One past the last micro-batch, or None for an unbounded stream.
        step_at_stop: Also step after the backward of ``stop - 1`` when it does not close a window
            (the partial window at the end of an epoch).
    """
    _check(schedule, stage, num_stages, accumulate, start, stop)
    if schedule == "paci":
        chunks: Iterator[tuple[int, int | None]] = iter([(start, stop)])
    else:
        chunks = _windows(start, stop, accumulate)
    for first, end in chunks:
        yield from _one_f_one_b(stage, num_stages, accumulate, first, end, stop, step_at_stop)


def _check(schedule: str, stage: int, num_stages: int, accumulate: int, start: int, stop: int | None) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} is outside [0, {num_stages})")
    if accumulate < 1:
        raise ValueError(f"accumulate={accumulate} must be >= 1 (micro-batches per optimizer step)")
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"micro-batch range [{start}, {stop}) is empty-negative: need 0 <= start <= stop")


def _windows(start: int, stop: int | None, accumulate: int) -> Iterator[tuple[int, int | None]]:
    """The pieces of ``[start, stop)`` that fall into one window each."""
    first = start
    while stop is None or first < stop:
        end = (first // accumulate + 1) * accumulate
        yield first, end if stop is None else min(end, stop)
        first = end


def _one_f_one_b(
    stage: int,
    num_stages: int,
    accumulate: int,
    first: int,
    end: int | None,
    stop: int | None,
    step_at_stop: bool,
) -> Iterator[Action]:
    in_flight = num_stages - stage
    warmup_end = first + in_flight if end is None else min(end, first + in_flight)
    for j in range(first, warmup_end):
        yield Action(stage, "F", j)
    backwards = itertools.count(first) if end is None else range(first, end)
    for j in backwards:
        yield Action(stage, "B", j)
        if (j + 1) % accumulate == 0 or (step_at_stop and j + 1 == stop):
            yield Action(stage, "STEP", j // accumulate)
        if end is None or j + in_flight < end:
            yield Action(stage, "F", j + in_flight)
