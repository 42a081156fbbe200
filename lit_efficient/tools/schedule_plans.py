"""Every schedule compared in BENCHMARKS.md as data: per rank, the ordered tasks it runs on its model chunks.

`schedules.py` generates what this package runs: one model stage per rank, a full backward. The
schedules it is compared with place several model stages ("chunks", virtual stages) on one rank
and split the backward in two: ``I`` (gradient w.r.t. the chunk's input, on the critical path) and
``W`` (gradient w.r.t. its weights, movable into bubbles). This module writes them as a `Plan`
that `simulate.simulate_plan` runs, with the orders of torch.distributed.pipelining's generators
(torch 2.13) re-derived here, not imported:

- ``gpipe`` (`ScheduleGPipe`), ``1f1b_flush`` (`Schedule1F1B`), ``paci`` (this package):
  one chunk per rank, taken from `schedules.py` (gpipe: every forward, then every backward);
- ``interleaved_1f1b`` (`ScheduleInterleaved1F1B`, Narayanan et al. 2021): ``virtual`` chunks per
  rank in a loop (chunk c on rank c mod p), depth first;
- ``zb1p`` (`ScheduleInterleavedZeroBubble`; Qi et al., ICLR 2024): the same loop with I/W split
  and each rank's W delayed to fill the cool-down; ``virtual=1`` is the paper's ZB-H1 / ZB-1p;
- ``zbv`` (`ScheduleZBVZeroBubble`, the paper's ZB-V) and ``dualpipev`` (`ScheduleDualPipeV`,
  DeepSeek-V3): two chunks per rank in a V (rank r holds chunks r and 2p-1-r).

Synchronous schedules repeat their one-window order for every window (micro-batches ``[kN,
(k+1)N)``) and each rank steps every chunk it holds at the end of it; PACI is one stream.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from lit_efficient.runtime.actions import Action, ActionKind
from lit_efficient.runtime.schedules import stage_actions

PlanName = Literal["gpipe", "1f1b_flush", "paci", "interleaved_1f1b", "zb1p", "zbv", "dualpipev"]
PLANS: tuple[PlanName, ...] = ("gpipe", "1f1b_flush", "paci", "interleaved_1f1b", "zb1p", "zbv", "dualpipev")


@dataclass(frozen=True)
class Plan:
    """Per rank, the tasks it runs in order, and which rank holds each model stage.

    Args:
        name: What generated it.
        rank_of: ``rank_of[stage]`` is the rank holding that model stage.
        tasks: ``tasks[rank]`` in execution order.
    """

    name: str
    rank_of: tuple[int, ...]
    tasks: tuple[tuple[Action, ...], ...]

    @property
    def num_ranks(self) -> int:
        """Ranks (devices) p."""
        return len(self.tasks)

    @property
    def num_stages(self) -> int:
        """Model stages (chunks) over all ranks."""
        return len(self.rank_of)

    def __str__(self) -> str:
        return "\n".join(" ".join(str(t) for t in rank) for rank in self.tasks)

    @classmethod
    def parse(cls, text: str, rank_of: Sequence[int] | None = None, name: str = "custom") -> Plan:
        """One line of tasks per rank; ``rank_of`` defaults to one stage per rank (stage r on rank r)."""
        tasks = tuple(tuple(Action.parse(t) for t in line.split()) for line in text.strip().splitlines())
        return cls(name, tuple(range(len(tasks)) if rank_of is None else rank_of), tasks)


def build_plan(name: PlanName, num_ranks: int, accumulate: int, windows: int = 1, virtual: int = 2) -> Plan:
    """The plan of ``name`` on ``num_ranks`` ranks for ``windows`` optimizer steps of N micro-batches.

    Args:
        name: One of `PLANS`.
        num_ranks: Pipeline ranks p.
        accumulate: Micro-batches per optimizer step N.
        windows: Optimizer steps; the plan covers micro-batches ``[0, windows * N)``.
        virtual: Chunks per rank for ``interleaved_1f1b`` and ``zb1p`` (``zbv``/``dualpipev`` use 2,
            the others 1).

    Raises:
        ValueError: for an unknown name, a size < 1, or an N the schedule refuses (as torch does).
    """
    if name not in PLANS:
        raise ValueError(f"unknown plan {name!r}: choose one of {', '.join(PLANS)}")
    for label, value in (("num_ranks", num_ranks), ("accumulate", accumulate), ("windows", windows)):
        if value < 1:
            raise ValueError(f"{label}={value} must be >= 1")
    if name in ("paci", "1f1b_flush"):
        stop = windows * accumulate
        streams = [stage_actions(name, r, num_ranks, accumulate, 0, stop) for r in range(num_ranks)]
        tasks = tuple(tuple(a for a in stream) for stream in streams)
        return Plan(name, tuple(range(num_ranks)), tasks)
    if name in ("zbv", "dualpipev"):
        chunks = 2
        rank_of = tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(2 * num_ranks))
    else:
        chunks = virtual if name in ("interleaved_1f1b", "zb1p") else 1
        if chunks < 1:
            raise ValueError(f"virtual={virtual} must be >= 1 (chunks per rank)")
        rank_of = tuple(s % num_ranks for s in range(chunks * num_ranks))
    one_window: Callable[[int], list[Action]] = {
        "gpipe": lambda r: _gpipe(r, accumulate),
        "interleaved_1f1b": lambda r: _looped(r, num_ranks, chunks, accumulate, zero_bubble=False),
        "zb1p": lambda r: _looped(r, num_ranks, chunks, accumulate, zero_bubble=True),
        "zbv": lambda r: _zbv(r, num_ranks, accumulate),
        "dualpipev": lambda r: _dualpipev(r, num_ranks, accumulate),
    }[name]
    tasks = []
    for r in range(num_ranks):
        order, mine = one_window(r), sorted(s for s, owner in enumerate(rank_of) if owner == r)
        stream = []
        for k in range(windows):
            stream += [Action(t.stage, t.kind, t.index + k * accumulate) for t in order]
            stream += [Action(s, "STEP", k) for s in mine]
        tasks.append(tuple(stream))
    return Plan(name, rank_of, tuple(tasks))


def check_plan(plan: Plan) -> None:
    """Raise ValueError unless every (stage, micro-batch) has one F and one B or one I then one W, on its rank."""
    seen: dict[tuple[int, int], list[str]] = defaultdict(list)
    for rank, tasks in enumerate(plan.tasks):
        for task in tasks:
            if plan.rank_of[task.stage] != rank:
                owner = plan.rank_of[task.stage]
                raise ValueError(f"task {task} is on rank {rank} but stage {task.stage} is on rank {owner}")
            if task.kind != "STEP":
                seen[(task.stage, task.index)].append(task.kind)
    indices = {j for _, j in seen}
    for stage in range(plan.num_stages):
        for j in indices:
            kinds = seen.get((stage, j), [])
            if kinds not in (["F", "B"], ["F", "I", "W"]):
                raise ValueError(f"stage {stage} micro-batch {j} runs {''.join(kinds) or 'nothing'}: need F B or F I W")


# -- one-window orders (torch's generators, re-derived) --------------------------------------------


class _Counter:
    """Next micro-batch per (stage, kind): a generator names tasks by what comes next, as torch's do."""

    def __init__(self) -> None:
        self.next: dict[tuple[int, str], int] = defaultdict(int)
        self.tasks: list[Action] = []

    def add(self, stage: int, kind: ActionKind) -> int:
        index = self.next[(stage, kind)]
        self.next[(stage, kind)] += 1
        self.tasks.append(Action(stage, kind, index))
        return index


def _gpipe(rank: int, accumulate: int) -> list[Action]:
    return [Action(rank, "F", j) for j in range(accumulate)] + [Action(rank, "B", j) for j in range(accumulate)]


def _looped(rank: int, p: int, v: int, n: int, zero_bubble: bool) -> list[Action]:
    """Interleaved 1F1B (``zero_bubble=False``) or interleaved ZB-1p on rank ``rank`` of a loop of v*p chunks.

    Forwards run chunk by chunk in rounds of ``per_round`` micro-batches (depth first); rank r warms up
    with (v-1)*per_round + f*(p-1-r) forwards (f=2 for 1F1B, whose backward is as long as two forwards;
    f=1 for ZB, whose I is as long as one), then alternates F and B (or I), then drains. ZB runs each
    rank's W r slots late, so the W of the first micro-batches fills the warm-up gap of later ranks.
    """
    rounds = max(1, n // p)
    if n % rounds:
        raise ValueError(f"accumulate={n} must be a multiple of {rounds} (micro-batch rounds of {p} ranks)")
    per_round = n // rounds
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), n * v)
    backward: ActionKind = "I" if zero_bubble else "B"
    out = _Counter()
    pending_w: list[int] = []  # stages of the I's whose W has not run, oldest first

    def forward_stage(op: int) -> int:
        return (op // per_round) % v * p + rank

    def backward_stage(op: int) -> int:
        return (v - 1 - (op - warmup) // per_round % v) * p + rank

    for op in range(n * v + warmup):
        if op < n * v:
            out.add(forward_stage(op), "F")
        if op >= warmup:
            stage = backward_stage(op)
            out.add(stage, backward)
            if zero_bubble:
                pending_w.append(stage)
                if op - warmup >= rank:
                    out.add(pending_w.pop(0), "W")
    for stage in pending_w:
        out.add(stage, "W")
    return out.tasks


def _zbv(rank: int, p: int, n: int) -> list[Action]:
    """ZB-V on rank ``rank``: chunks r (down) and 2p-1-r (up); every I followed by its W in steady state."""
    c0, c1 = rank, 2 * p - 1 - rank
    n_micro = max(2 * p - 1, n)  # the order needs 2p-1 micro-batches to fill; extras are dropped below
    out = _Counter()
    for _ in range(2 * (p - rank) - 1):
        out.add(c0, "F")
    for _ in range(rank):
        out.add(c1, "F")
        out.add(c0, "F")
    for _ in range(p - rank):
        out.add(c1, "F")
        out.add(c1, "I")
        out.add(c1, "W")
    while out.next[(c1, "F")] < out.next[(c0, "F")] or out.next[(c0, "F")] < n_micro:
        if out.next[(c0, "F")] < n_micro:
            out.add(c0, "F")
        out.add(c0, "I")
        out.add(c0, "W")
        out.add(c1, "F")
        out.add(c1, "I")
        out.add(c1, "W")
    for _ in range(rank):  # cool-down: defer W of the up chunk, so its I reaches the previous rank sooner
        out.add(c0, "I")
        out.add(c1, "I")
    for _ in range(p - rank):
        out.add(c0, "I")
        out.add(c0, "W")
    for chunk in (c1, c0):
        while out.next[(chunk, "W")] < out.next[(chunk, "I")]:
            out.add(chunk, "W")
    return [t for t in out.tasks if t.index < n]


def _dualpipev(rank: int, p: int, n: int) -> list[Action]:
    """DualPipeV on rank ``rank`` (chunks r and 2p-1-r); torch's overlapped F+B pairs run one after the other."""
    if n < 2 * p:
        raise ValueError(f"accumulate={n}: DualPipeV needs at least as many micro-batches as stages ({2 * p})")
    c0, c1 = rank, 2 * p - 1 - rank
    out = _Counter()
    pending_w: list[tuple[int, int]] = []

    def backward(stage: int, split: bool) -> None:
        if split:
            pending_w.append((stage, out.add(stage, "I")))
        else:  # a full backward advances the I and W counters together, as torch's does
            out.next[(stage, "W")] += 1
            out.tasks.append(Action(stage, "B", out.next[(stage, "I")]))
            out.next[(stage, "I")] += 1

    def weight_if_pending() -> None:
        if pending_w:
            stage, index = pending_w.pop(0)
            out.tasks.append(Action(stage, "W", index))

    for _ in range(2 * (p - rank - 1)):
        out.add(c0, "F")
    for _ in range(rank + 1):
        out.add(c0, "F")
        out.add(c1, "F")
    for _ in range(p - rank - 1):
        backward(c1, split=True)
        weight_if_pending()
        out.add(c1, "F")
    for _ in range(n - 2 * p + rank + 1):
        out.add(c0, "F")
        backward(c1, split=False)
        out.add(c1, "F")
        backward(c0, split=False)
    for _ in range(p - rank - 1):
        backward(c1, split=False)
        out.add(c1, "F")
        backward(c0, split=False)
    split = False
    half = (rank + 1) // 2
    for i in range(rank + 1):
        split = split or (i == half and rank % 2 == 1)
        backward(c1, split)
        split = split or (i == half and rank % 2 == 0)
        backward(c0, split)
    for _ in range(p - rank - 1):
        weight_if_pending()
        backward(c0, split)
    for _ in range(rank + 1):
        weight_if_pending()
    return out.tasks
