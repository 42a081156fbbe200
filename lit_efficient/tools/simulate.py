"""Discrete-event simulator of pipeline schedules: makespan, utilization, bubble, drift and memory from costs.

This file owns the cost model that benchmarks and `PipelineMonitor` compare measurements against,
and the closed forms of docs/DESIGN.md section 3 (`flush_utilization`, `paci_drift_bound`). It is pure:
the input is per-stage action streams of `schedules.py` (or hand-written strings), or a rank-level
`schedule_plans.Plan` (several model stages per rank, split backward), the output a `SimulationResult`.

Model: every rank (a stage, in a stream of `schedules.py`) runs its own list strictly in order, one
task at a time. A task starts when its rank is free and its dependencies have finished (plus
``comm`` when the dependency crossed a link between ranks):

- ``F(j)`` on model stage s > 0 needs ``F(j)`` on stage s-1;
- ``B(j)`` (full backward) or ``I(j)`` (its input-gradient half) needs ``F(j)`` on its own stage
  and, unless it is the last stage, the input gradient of stage s+1 (its ``B(j)`` or ``I(j)``);
- ``W(j)`` (weight-gradient half) needs ``I(j)`` on its own stage;
- ``STEP`` needs nothing but its place in the list and takes ``step`` time.

Since the only shared resource is the rank itself, start = max(rank free, dependencies done) is
exact, and the order in which ranks are visited does not change the result. A plan in which no
rank can progress before all have finished is a deadlock and raises `DeadlockError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from lit_efficient.runtime.actions import Action, parse_actions
from lit_efficient.runtime.schedules import ScheduleName, stage_actions
from lit_efficient.tools.schedule_plans import Plan

# (model stage, what finished, micro-batch): "F" its forward, "G" its input gradient (B or I), "W".
_Key = tuple[int, str, int]


class _TaskLike(Protocol):
    """What the simulator reads of an `actions.Action`."""

    stage: int
    kind: str
    index: int


class DeadlockError(RuntimeError):
    """A plan in which some stage waits forever for an action that never runs."""


class Slot(NamedTuple):
    """One executed task: ``stage`` (the rank, for a `Plan`) ran ``action`` during ``[start, end)``."""

    stage: int
    action: Any  # an `actions.Action` (of a stage's stream, or of a rank's plan)
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    """What one simulated run of a plan did.

    "Stage" below is the unit that runs one list: a stage for `simulate_streams`, a rank for
    `simulate_plan`.

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
        peak_activations: Per stage, the most micro-batch activations held at once (from a forward
            to its B or W), in units of one micro-batch through everything the stage holds.
    """

    makespan: float
    busy: tuple[float, ...]
    timeline: tuple[Slot, ...]
    drift: tuple[dict[int, int], ...]
    steady_window: tuple[float, float] | None
    peak_activations: tuple[float, ...] = ()

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
        """Idle fraction of the whole run: 1 - mean utilization (0 for a run of no micro-batch: nothing ran, nothing
        waited)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.utilization) / self.num_stages

    @property
    def bubble_rate(self) -> float:
        """The zero-bubble paper's bubble rate: idle time over busy time, (makespan - busy) / busy, mean stage.

        1F1B-flush with balanced stages: (p-1)/N; the same idle expressed as a fraction of the
        makespan is `bubble_fraction` ((p-1)/(N+p-1)).
        """
        busy = sum(self.busy) / self.num_stages
        return (self.makespan - busy) / busy if busy > 0 else 0.0

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
    _check_depth(num_stages, accumulate)  # before the streams: "streams is empty" named the wrong layer
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
    return _run(plans, tuple(range(num_stages)), durations, comm, [1.0] * num_stages, "stage")


def simulate_plan(
    plan: Plan,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 2.0,
    input_grad: float | Sequence[float] | None = None,
    weight_grad: float | Sequence[float] | None = None,
    comm: float = 0.0,
    step: float = 0.0,
    activation: Sequence[float] | None = None,
) -> SimulationResult:
    """Simulate a rank-level `schedule_plans.Plan`; the result's "stages" are its ranks.

    Args:
        plan: Per rank, its tasks in order (`schedule_plans.build_plan`).
        forward: F time of one micro-batch, for every model stage or per model stage.
        backward: Full-backward (``B``) time, likewise.
        input_grad: ``I`` time; default half of ``backward``.
        weight_grad: ``W`` time; default half of ``backward``.
        comm: Latency added to every dependency that crosses from one rank to another.
        step: Time of one ``STEP`` (one model stage's optimizer step).
        activation: Per model stage, the size of one micro-batch's activations; default 1 / (model
            stages on its rank), so a rank's whole share of the model holds 1 per micro-batch.
    """
    n = plan.num_stages
    full = _per_stage("backward", backward, n)
    half = tuple(b / 2 for b in full)
    durations = {
        "F": _per_stage("forward", forward, n),
        "B": full,
        "I": half if input_grad is None else _per_stage("input_grad", input_grad, n),
        "W": half if weight_grad is None else _per_stage("weight_grad", weight_grad, n),
        "STEP": _per_stage("step", step, n),
    }
    on_rank = [plan.rank_of.count(plan.rank_of[s]) for s in range(n)]
    sizes = [1.0 / c for c in on_rank] if activation is None else list(_per_stage("activation", activation, n))
    return _run([list(t) for t in plan.tasks], plan.rank_of, durations, comm, sizes, "rank")


def _run(
    plans: list[list[_TaskLike]],
    rank_of: Sequence[int],
    durations: dict[str, tuple[float, ...]],
    comm: float,
    sizes: Sequence[float],
    unit: str,
) -> SimulationResult:
    """The event loop: each rank runs ``plans[rank]`` in order, a task as soon as its rank and inputs are free."""
    _check_cost("comm", comm)
    num_ranks = len(plans)
    done: dict[_Key, float] = {}
    slots: list[list[Slot]] = [[] for _ in plans]
    free = [0.0] * num_ranks
    remaining = sum(len(p) for p in plans)
    sweep = 0
    while remaining:
        # Alternate the visiting order: forwards flow down and backwards flow up, so each sweep
        # direction advances one of them across all ranks in one pass (fewer passes, same result).
        order = range(num_ranks) if sweep % 2 == 0 else range(num_ranks - 1, -1, -1)
        sweep += 1
        progressed = 0
        for r in order:
            plan = plans[r]
            while len(slots[r]) < len(plan):
                task = plan[len(slots[r])]
                ready = _ready_at(task, rank_of, done, comm)
                if ready is None:
                    break
                start = max(free[r], ready)
                free[r] = start + durations[task.kind][task.stage]
                slots[r].append(Slot(r, task, start, free[r]))
                for key in _produces(task):
                    done[key] = free[r]
                progressed += 1
        if not progressed:
            raise _deadlock(plans, slots, done, rank_of, unit)
        remaining -= progressed

    timeline = tuple(slot for rank_slots in slots for slot in rank_slots)
    return SimulationResult(
        makespan=max((slot.end for slot in timeline), default=0.0),
        busy=tuple(sum(slot.end - slot.start for slot in rank_slots) for rank_slots in slots),
        timeline=timeline,
        drift=tuple(_drift(plan) for plan in plans),
        steady_window=_steady_window(slots[0]),
        peak_activations=tuple(_peak(plan, sizes) for plan in plans),
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


def _dependencies(task: _TaskLike, rank_of: Sequence[int]) -> list[tuple[_Key, bool]]:
    """What ``task`` waits for, each with whether it crosses a link between ranks (and so pays ``comm``)."""
    s, j = task.stage, task.index
    if task.kind == "F":
        return [((s - 1, "F", j), rank_of[s - 1] != rank_of[s])] if s > 0 else []
    if task.kind in ("B", "I"):
        own = [((s, "F", j), False)]
        return own + [((s + 1, "G", j), rank_of[s + 1] != rank_of[s])] if s < len(rank_of) - 1 else own
    if task.kind == "W":
        return [((s, "G", j), False)]
    return []


def _produces(task: _TaskLike) -> tuple[_Key, ...]:
    """What a finished ``task`` makes available: B is I and W in one."""
    s, j = task.stage, task.index
    return {"F": ((s, "F", j),), "B": ((s, "G", j), (s, "W", j)), "I": ((s, "G", j),), "W": ((s, "W", j),)}.get(
        task.kind, ()
    )


def _ready_at(task: _TaskLike, rank_of: Sequence[int], done: dict[_Key, float], comm: float) -> float | None:
    """When the dependencies of ``task`` are met, or None if one has not run yet."""
    ready = 0.0
    for key, crosses in _dependencies(task, rank_of):
        if key not in done:
            return None
        ready = max(ready, done[key] + (comm if crosses else 0.0))
    return ready


def _deadlock(
    plans: list[list[_TaskLike]], slots: list[list[Slot]], done: dict[_Key, float], rank_of: Sequence[int], unit: str
) -> DeadlockError:
    split = {(t.stage, t.index) for plan in plans for t in plan if t.kind == "I"}
    waits = []
    for r, plan in enumerate(plans):
        if len(slots[r]) < len(plan):
            task = plan[len(slots[r])]
            missing = [k for k, _ in _dependencies(task, rank_of) if k not in done]
            # "G" (an input gradient) is named as the task that makes it: I in a split plan, else B.
            names = " and ".join(
                f"{s}{'I' if kind == 'G' and (s, j) in split else 'B' if kind == 'G' else kind}{j}"
                for s, kind, j in missing
            )
            waits.append(f"{unit} {r} waits at {task} for {names}")
    return DeadlockError(
        f"deadlock: no {unit} can progress; "
        + "; ".join(waits)
        + f". Each {unit} must order its tasks so that what it waits for is reachable in the others' lists."
    )


def _drift(plan: Sequence[_TaskLike]) -> dict[int, int]:
    """Steps between each micro-batch's F and its B (or I); list order is execution order on a rank.

    A rank holding several model stages reports, per micro-batch, the largest drift over them.
    """
    steps = 0
    steps_at_forward: dict[tuple[int, int], int] = {}
    drift: dict[int, int] = {}
    for task in plan:
        key = (task.stage, task.index)
        if task.kind == "STEP":
            steps += 1
        elif task.kind == "F":
            steps_at_forward[key] = steps
        elif task.kind in ("B", "I") and key in steps_at_forward:
            drift[task.index] = max(drift.get(task.index, 0), steps - steps_at_forward[key])
    return drift


def _peak(plan: Sequence[_TaskLike], sizes: Sequence[float]) -> float:
    """Most activation held at once: a forward's from its F to its B, or to its W when split.

    W needs the inputs of the stage's matmuls, most of what forward saved, so a split backward
    keeps the activation until W. Allocation and release both happen on the rank that holds the
    stage, so list order is time order and the peak needs no timing.
    """
    held = peak = 0.0
    for task in plan:
        if task.kind == "F":
            held += sizes[task.stage]
            peak = max(peak, held)
        elif task.kind in ("B", "W"):
            held -= sizes[task.stage]
    return peak


def _steady_window(first_stage: list[Slot]) -> tuple[float, float] | None:
    backwards = [slot.start for slot in first_stage if slot.action.kind in ("B", "I")]
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
