"""Discrete-event simulator of pipeline schedules: makespan, utilization, bubble and drift from costs.

This file owns the cost model that benchmarks and `PipelineMonitor` compare measurements against,
and the closed forms of DESIGN.md section 3 (`flush_utilization`, `paci_drift_bound`). It is pure:
the input is the per-stage action streams of `schedules.py` (or hand-written strings), the output
a `SimulationResult`.

Model: every stage runs its own stream strictly in order, one action at a time. An action starts
when its stage is free and its dependencies have finished (plus ``comm`` when the dependency crossed
a link between stages):

- ``F(j)`` on stage s > 0 needs ``F(j)`` on stage s-1;
- ``B(j)`` needs ``F(j)`` on its own stage and, unless it is the last stage, ``B(j)`` on stage s+1;
- ``STEP`` needs nothing but its place in the stream and takes ``step`` time.

Since the only shared resource is the stage itself, start = max(stage free, dependencies done) is
exact, and the order in which stages are visited does not change the result. A plan in which no
stage can progress before all have finished is a deadlock and raises `DeadlockError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from lit_efficient.pipeline.actions import Action, parse_actions
from lit_efficient.pipeline.schedules import ScheduleName, stage_actions

_Key = tuple[int, str, int]  # (stage, kind, micro-batch) of a finished F/B


class DeadlockError(RuntimeError):
    """A plan in which some stage waits forever for an action that never runs."""


class Slot(NamedTuple):
    """One executed action: ``stage`` ran ``action`` during ``[start, end)``."""

    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    """What one simulated run of a plan did.

    Args:
        makespan: Time from the first action's start (0) to the last action's end.
        busy: Per stage, total time spent running actions (forward, backward and steps).
        timeline: Every executed action in execution order per stage, stage by stage; for pictures.
        drift: Per stage, micro-batch -> number of ``STEP``s that stage ran between the forward and
            the backward of that micro-batch (its weight-version drift).
        steady_window: ``(start, end)`` of the steady state, or None when the run has none: from the
            start of stage 0's first backward (every stage has finished warming up by then when
            stages are balanced) to the end of stage 0's last forward (after which stage 0, and
            then each later stage, only drains). Stage 0 is the last to reach steady state and the
            first to leave it, so this window lies inside every stage's steady state.
    """

    makespan: float
    busy: tuple[float, ...]
    timeline: tuple[Slot, ...]
    drift: tuple[dict[int, int], ...]
    steady_window: tuple[float, float] | None

    @property
    def num_stages(self) -> int:
        """Pipeline depth S."""
        return len(self.busy)

    @property
    def utilization(self) -> tuple[float, ...]:
        """Per stage, busy time over makespan (warm-up and drain included)."""
        return tuple(b / self.makespan if self.makespan > 0 else 0.0 for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle fraction of the whole run: 1 - mean utilization."""
        return 1.0 - sum(self.utilization) / self.num_stages

    @property
    def max_drift(self) -> tuple[int, ...]:
        """Per stage, the largest drift of any micro-batch (0 when the stage ran none)."""
        return tuple(max(d.values(), default=0) for d in self.drift)

    @property
    def mean_drift(self) -> float:
        """Drift averaged over every (stage, micro-batch) pair that ran a backward."""
        values = [v for d in self.drift for v in d.values()]
        return sum(values) / len(values) if values else 0.0

    @property
    def steady_utilization(self) -> tuple[float, ...]:
        """Per stage, the busy fraction of `steady_window`; NaN when there is no steady state.

        Only the part of each action inside the window counts, so warm-up and drain are excluded.
        """
        if self.steady_window is None:
            return tuple(math.nan for _ in self.busy)
        low, high = self.steady_window
        inside = [0.0] * self.num_stages
        for slot in self.timeline:
            inside[slot.stage] += max(0.0, min(slot.end, high) - max(slot.start, low))
        return tuple(t / (high - low) for t in inside)


def simulate(
    schedule: ScheduleName,
    num_stages: int,
    accumulate: int,
    num_microbatches: int,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 2.0,
    comm: float = 0.0,
    step: float = 0.0,
    step_at_stop: bool = True,
) -> SimulationResult:
    """Simulate ``schedule`` on micro-batches ``[0, num_microbatches)``.

    Args:
        schedule: ``"paci"`` or ``"1f1b_flush"``.
        num_stages: Pipeline depth S.
        accumulate: Micro-batches per optimizer step N.
        num_microbatches: How many micro-batches run before the pipeline drains.
        forward: Forward time of one micro-batch, for every stage or per stage (length S).
        backward: Backward time of one micro-batch, for every stage or per stage (length S).
        comm: Latency added to every dependency that crosses a link between two stages.
        step: Time of one optimizer step.
        step_at_stop: Step after a partial last window too (what the runtime does at epoch end).
    """
    if num_microbatches < 0:
        raise ValueError(f"num_microbatches={num_microbatches} must be >= 0")
    streams = [
        list(stage_actions(schedule, s, num_stages, accumulate, 0, num_microbatches, step_at_stop))
        for s in range(num_stages)
    ]
    return simulate_streams(streams, forward, backward, comm, step)


def simulate_streams(
    streams: Sequence[Sequence[Action] | str],
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 2.0,
    comm: float = 0.0,
    step: float = 0.0,
) -> SimulationResult:
    """Simulate explicit per-stage streams, e.g. ``["0F0 0B0", "1F0 1B0"]`` (see `simulate`).

    Raises:
        DeadlockError: when every unfinished stage waits for an action that cannot run.
        ValueError: when an action sits in another stage's stream or a cost is negative.
    """
    plans = [parse_actions(s) if isinstance(s, str) else list(s) for s in streams]
    num_stages = len(plans)
    if num_stages < 1:
        raise ValueError("streams is empty: pass one stream per stage (at least one)")
    for s, plan in enumerate(plans):
        for action in plan:
            if action.stage != s:
                raise ValueError(f"action {action} is in the stream of stage {s}: each stream holds its own stage's")
    durations = {
        "F": _per_stage("forward", forward, num_stages),
        "B": _per_stage("backward", backward, num_stages),
        "STEP": _per_stage("step", step, num_stages),
    }
    _check_cost("comm", comm)

    done: dict[_Key, float] = {}
    slots: list[list[Slot]] = [[] for _ in plans]
    free = [0.0] * num_stages
    remaining = sum(len(p) for p in plans)
    sweep = 0
    while remaining:
        # Alternate the visiting order: forwards flow down and backwards flow up, so each sweep
        # direction advances one of them across all stages in one pass (fewer passes, same result).
        order = range(num_stages) if sweep % 2 == 0 else range(num_stages - 1, -1, -1)
        sweep += 1
        progressed = 0
        for s in order:
            plan = plans[s]
            while len(slots[s]) < len(plan):
                action = plan[len(slots[s])]
                ready = _ready_at(action, num_stages, done, comm)
                if ready is None:
                    break
                start = max(free[s], ready)
                free[s] = start + durations[action.kind][s]
                slots[s].append(Slot(s, action, start, free[s]))
                if action.kind != "STEP":
                    done[(s, action.kind, action.index)] = free[s]
                progressed += 1
        if not progressed:
            raise _deadlock(plans, slots, done)
        remaining -= progressed

    timeline = tuple(slot for stage_slots in slots for slot in stage_slots)
    return SimulationResult(
        makespan=max((slot.end for slot in timeline), default=0.0),
        busy=tuple(sum(slot.end - slot.start for slot in stage_slots) for stage_slots in slots),
        timeline=timeline,
        drift=tuple(_drift(plan) for plan in plans),
        steady_window=_steady_window(slots[0]),
    )


def flush_utilization(num_stages: int, accumulate: int) -> float:
    """Closed-form utilization of 1F1B-flush with balanced stages and free communication: N/(N+S-1)."""
    _check_depth(num_stages, accumulate)
    return accumulate / (accumulate + num_stages - 1)


def paci_drift_bound(num_stages: int, accumulate: int, stage: int) -> int:
    """Closed-form largest weight-version drift of PACI on ``stage``: ceil((S-1-stage)/N)."""
    _check_depth(num_stages, accumulate)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} is outside [0, {num_stages})")
    return -(-(num_stages - 1 - stage) // accumulate)  # integer ceil, no float rounding


def _dependencies(action: Action, num_stages: int) -> list[tuple[_Key, bool]]:
    """What ``action`` waits for, each with whether it crosses a link (and so pays ``comm``)."""
    s, j = action.stage, action.index
    if action.kind == "F":
        return [((s - 1, "F", j), True)] if s > 0 else []
    if action.kind == "B":
        own = [((s, "F", j), False)]
        return own + [((s + 1, "B", j), True)] if s < num_stages - 1 else own
    return []


def _ready_at(action: Action, num_stages: int, done: dict[_Key, float], comm: float) -> float | None:
    """When the dependencies of ``action`` are met, or None if one has not run yet."""
    ready = 0.0
    for key, crosses in _dependencies(action, num_stages):
        if key not in done:
            return None
        ready = max(ready, done[key] + (comm if crosses else 0.0))
    return ready


def _deadlock(plans: list[list[Action]], slots: list[list[Slot]], done: dict[_Key, float]) -> DeadlockError:
    waits = []
    for s, plan in enumerate(plans):
        if len(slots[s]) < len(plan):
            action = plan[len(slots[s])]
            missing = [k for k, _ in _dependencies(action, len(plans)) if k not in done]
            names = " and ".join(str(Action(*k)) for k in missing)  # type: ignore[arg-type]
            waits.append(f"stage {s} waits at {action} for {names}")
    return DeadlockError(
        "deadlock: no stage can progress; "
        + "; ".join(waits)
        + ". Each stage must order its actions so that what it waits for is reachable in the others' streams."
    )


def _drift(plan: Sequence[Action]) -> dict[int, int]:
    """Steps between each micro-batch's F and B; stream order is execution order on a stage."""
    steps = 0
    steps_at_forward: dict[int, int] = {}
    drift: dict[int, int] = {}
    for action in plan:
        if action.kind == "STEP":
            steps += 1
        elif action.kind == "F":
            steps_at_forward[action.index] = steps
        elif action.index in steps_at_forward:
            drift[action.index] = steps - steps_at_forward[action.index]
    return drift


def _steady_window(first_stage: list[Slot]) -> tuple[float, float] | None:
    backwards = [slot.start for slot in first_stage if slot.action.kind == "B"]
    forwards = [slot.end for slot in first_stage if slot.action.kind == "F"]
    if not backwards or not forwards or max(forwards) <= min(backwards):
        return None  # too few micro-batches: stage 0 finished all forwards before its first backward
    return min(backwards), max(forwards)


def _per_stage(name: str, value: float | Sequence[float], num_stages: int) -> tuple[float, ...]:
    if isinstance(value, int | float):
        values = (float(value),) * num_stages
    else:
        values = tuple(float(v) for v in value)
        if len(values) != num_stages:
            raise ValueError(
                f"{name} has {len(values)} costs for {num_stages} stages: give one number or one per stage"
            )
    for v in values:
        _check_cost(name, v)
    return values


def _check_cost(name: str, value: float) -> None:
    if not value >= 0 or math.isinf(value):  # `not >=` also rejects NaN
        raise ValueError(f"{name}={value} must be a finite time >= 0")


def _check_depth(num_stages: int, accumulate: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    if accumulate < 1:
        raise ValueError(f"accumulate={accumulate} must be >= 1 (micro-batches per optimizer step)")
