"""A whole pipeline in one process: S runtimes over an in-process transport, driven round-robin.

PACI's numerics do not depend on timing: each stage runs a fixed action stream and stages meet only
through messages. So the S stages of one pipeline can run in one process, through the same
`PipelineStage`, schedules and `PipelineRuntime` as on S processes, and produce bit-identical
parameters, optimizer states, losses and drift. No threads: a runtime pauses before a receive whose
message is not there yet (runtime.py), and `LocalPipeline` gives each stage its turn until every one
is quiescent (waiting for the next micro-batch). If a round gives no stage anything to do while some
still wait, the schedule deadlocks, and `PipelineDeadlockError` says who waits for what.

A stage can also need another stage's message in the middle of an action: under 1F1B-flush a weight
tied between the first and the last stage is all-reduced inside both stages' optimizer steps
(`lit_efficient.pipeline.tied.LocalTiedLink`), and the last stage gets there first. Its rank would
block in the collective; here `run_others_until` gives the other stages their turns, the same turns
as above, until the message is there, and the step continues. Only stages not inside an action of
their own take turns, so no stage is re-entered.

What it costs: the memory of the unsplit model plus the activations in flight (each stage keeps
those of up to S-s micro-batches, as on S devices; stage-boundary tensors are shared, not copied),
and the time of the whole model's compute, serialized: no bubble to hide and none to save.

Uses: previewing what PACI's staleness does to a model before buying S devices, debugging a split
in one process, fast tests, and training on one device with exactly the numerics of S.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor

from lit_efficient.pipeline.comm import LocalExchange, Payload, sum_in_order
from lit_efficient.pipeline.runtime import InputFn, PipelineRuntime
from lit_efficient.pipeline.schedules import ScheduleName
from lit_efficient.pipeline.stage import PipelineStage
from lit_efficient.pipeline.topology import Topology
from lit_efficient.pipeline.wire import WireFormat


def local_pipeline(
    stages: Sequence[PipelineStage],
    schedule: ScheduleName,
    accumulate: int,
    input_fn: InputFn,
    wire: WireFormat | None = None,
) -> LocalPipeline:
    """Runtimes for ``stages`` (stage 0 first) over one `LocalExchange`, each playing the rank it would
    have in a one-replica pipeline of processes, driven by a `LocalPipeline`. ``wire``: the processes' wire
    format (bf16 on the wire rounds the boundary tensors here as it would there)."""
    topo = Topology(len(stages))
    exchange = LocalExchange(wire)
    runtimes = []
    for stage in stages:
        rank = topo.rank_of(stage.stage)
        prev_rank, next_rank = topo.neighbours(rank)
        comm = exchange.endpoint(rank, stage.stage, topo.stage_of) if len(stages) > 1 else None
        first_input = input_fn if stage.is_first else None
        runtimes.append(PipelineRuntime(stage, schedule, accumulate, first_input, comm, prev_rank, next_rank))
    return LocalPipeline(runtimes)


class PipelineDeadlockError(RuntimeError):
    """No stage of an in-process pipeline can progress while some still wait for a message."""


class LocalPipeline:
    """Drives the runtimes of every stage of one pipeline, in one process.

    It answers the calls a strategy makes on a single stage's `PipelineRuntime` (``feed``, ``drain``,
    ``evaluate``, ``start_epoch``, ``stats``...), for the whole pipeline; per-stage numbers are in
    ``runtimes[s]``. Which stage `stage` and `stats` describe is `selected` (the last by default: it
    holds the loss, as rank 0 does across processes).

    Args:
        runtimes: One runtime per stage, stage 0 first, over one `LocalExchange`.
    """

    def __init__(self, runtimes: Sequence[PipelineRuntime]) -> None:
        if [rt.stage.stage for rt in runtimes] != list(range(len(runtimes))):
            raise ValueError("LocalPipeline needs one runtime per stage, stage 0 first")
        self.runtimes = list(runtimes)
        self.selected = len(runtimes) - 1
        self._acting: list[PipelineRuntime] = []  # the stages inside an action now, outermost first
        # The call (feed, drain) of the pipeline each stage has yet to get, by stage. Every stage gets it
        # before the stages settle; one that waits inside an action gives it to the others first (a
        # partial window's tied-weight exchange at an epoch's end needs the peer's drain to have begun).
        self._calls: dict[int, Callable[[PipelineRuntime], None]] = {}

    # -- the runtime's calls, for the whole pipeline ------------------------------------------------

    def feed(self, batch: Any, index: int | None = None) -> Tensor | None:
        """Micro-batch ``index`` into every stage; returns its loss (detached) from the last stage."""
        self._call_every_stage(lambda rt: rt.feed(batch, index))
        return self.runtimes[-1].last_loss

    def drain(self, step_partial_window: bool = False) -> None:
        """Finish every micro-batch in flight on every stage (see `PipelineRuntime.drain`).

        The last stage gets the call first. A partial window's step is the only one the last stage does not
        reach first by itself (its backwards ran at the feeds; stage 0's last one can run once it is called),
        and under flush with a tied weight and norm clipping stage 0 must not be inside its step first: it
        would wait there for the last stage's tied gradient, which then could not complete its own step
        without stage 0's squared norm (`LocalStageSum`). The order changes no number.
        """
        self._call_every_stage(lambda rt: rt.drain(step_partial_window), last_first=True)

    def run_others_until(self, done: Callable[[], bool], what: str) -> None:
        """Called from inside a stage's action that needs ``what`` from another stage: give every stage that
        is not inside an action its turns (first the call the pipeline got, if it has not had it yet) until
        ``done()``; a round without progress is a deadlock."""
        self._settle(done, what)

    def evaluate(self, batch: Any, index: int) -> Payload | None:
        """Forward-only pass of one batch through the stages in order; the last stage's outputs."""
        out = None
        for rt in self.runtimes:  # stage s's activations are in its mailbox before stage s+1 asks
            out = rt.evaluate(batch, index)
        return out

    def start_epoch(self) -> None:
        """Number micro-batches from 0 again on every stage."""
        for rt in self.runtimes:
            rt.start_epoch()

    @property
    def drained(self) -> bool:
        """No micro-batch is in flight on any stage."""
        return all(rt.drained for rt in self.runtimes)

    @property
    def accumulate(self) -> int:
        """Micro-batches per optimizer step (N), the same on every stage."""
        return self.runtimes[0].accumulate

    @accumulate.setter
    def accumulate(self, value: int) -> None:
        for rt in self.runtimes:
            rt.accumulate = value

    @property
    def stage(self) -> PipelineStage:
        """The selected stage."""
        return self.runtimes[self.selected].stage

    @property
    def timeline(self) -> list[tuple[str, float, float]] | None:
        """The selected stage's recorded actions (see `PipelineRuntime.record_timeline`)."""
        return self.runtimes[self.selected].timeline

    def stats(self) -> dict[str, float]:
        """The selected stage's measured numbers; ``stage_stats`` has every stage's.

        Times are those of one process running every stage in turn: busy times are each stage's own,
        but waits and utilization describe the turn-taking, not a pipeline on S devices.
        """
        return self.runtimes[self.selected].stats()

    def stage_stats(self) -> list[dict[str, float]]:
        """Every stage's measured numbers (drift per stage among them), stage 0 first."""
        return [rt.stats() for rt in self.runtimes]

    def reset_stats(self) -> None:
        """Start measuring afresh on every stage."""
        for rt in self.runtimes:
            rt.reset_stats()

    def record_timeline(self, enabled: bool = True) -> None:
        """Start (or stop) recording every stage's actions."""
        for rt in self.runtimes:
            rt.record_timeline(enabled)

    # -- internals ------------------------------------------------------------------------------------

    def _call_every_stage(self, call: Callable[[PipelineRuntime], None], last_first: bool = False) -> None:
        order = range(len(self.runtimes))
        self._calls = dict.fromkeys(reversed(order) if last_first else order, call)  # given in this order
        self._settle()

    @contextmanager
    def _turn(self, rt: PipelineRuntime) -> Iterator[None]:
        self._acting.append(rt)
        try:
            yield
        finally:
            self._acting.pop()

    def _settle(self, done: Callable[[], bool] | None = None, what: str = "") -> None:
        """Give every stage not inside an action its call and then turns until all are quiescent (or until
        ``done()``); a round in which none runs while something is still awaited is a deadlock."""
        while done is None or not done():
            free = [rt for rt in self.runtimes if all(rt is not a for a in self._acting)]
            called = [self.runtimes[s] for s in self._calls if self.runtimes[s] in free]
            for rt in called:  # in the order of `_calls` (stage order, or the last stage first)
                call = self._calls.pop(rt.stage.stage, None)
                if call is not None:  # a stage waiting inside its call may have given it already
                    with self._turn(rt):
                        call(rt)
                if done is not None and done():
                    return
            waiting = [rt for rt in free if not rt.quiescent]
            # Last stage first: backwards (which free memory) run as soon as their gradients exist.
            progressed = bool(called)
            for rt in reversed(waiting):
                with self._turn(rt):
                    progressed |= rt.resume()
                if done is not None and done():
                    return
            if not progressed:
                if done is None and not waiting:
                    return
                blocked = [f"stage {self._acting[-1].stage.stage} waits for {what}"] if done is not None else []
                raise PipelineDeadlockError(
                    "no stage of the in-process pipeline can progress: "
                    + "; ".join([*blocked, *(str(rt.waiting_for()) for rt in waiting)])
                )


class LocalStageSum:
    """The all-reduce over a pipeline's stages (``all_reduce_flat`` over the pipeline group on processes), for
    a pipeline that runs in one process: 1F1B-flush's gradient-norm clipping sums every stage's squared norm
    inside each stage's optimizer step.

    Each stage's k-th `all_reduce` joins the k-th round; a stage whose round is not complete calls `wait`
    (`LocalPipeline.run_others_until`, set by the driver), so the other stages take their turns until they
    have contributed. A stage may `post` its contribution before it has to wait for anything else (the last
    stage's squared norm, before it waits for stage 0's tied gradient: stage 0's step, run while the last
    stage waits, needs that norm); its next `all_reduce` then only waits and reads.
    Every stage gets the same sum, added in the order of ``ranks`` (the stages in the order of their ranks on
    processes) by `sum_in_order`, as `all_reduce_in_rank_order` adds them on processes: the same bits at any S.

    Args:
        ranks: The stages in rank order (``[Topology.stage_of(r) for r in range(S)]``).
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = list(ranks)
        self._rounds: dict[int, dict[int, Tensor]] = {}  # round -> the stages' contributions so far
        self._calls = dict.fromkeys(self.ranks, 0)  # stage -> rounds it has joined
        self._read: dict[int, int] = {}  # round -> stages that have read its sum
        self._posted: dict[int, int] = {}  # stage -> the round it has posted to and not yet read
        self.wait: Callable[[Callable[[], bool], str], None] | None = None

    def post(self, stage: int, t: Tensor) -> None:
        """Contribute ``t`` to ``stage``'s next round without waiting; its next `all_reduce` reads the sum."""
        if stage in self._posted:
            raise RuntimeError(f"stage {stage} posted to round {self._posted[stage]} twice without reading it")
        k = self._calls[stage]
        self._calls[stage] += 1
        self._rounds.setdefault(k, {})[stage] = t.detach().clone()
        self._posted[stage] = k

    def has_posted(self, stage: int) -> bool:
        """Whether ``stage`` has posted to a round it has not read yet (its next `all_reduce` only reads)."""
        return stage in self._posted

    def all_reduce(self, stage: int, t: Tensor) -> None:
        """Sum ``t`` in place with the other stages' tensors of the same round (waiting for them if needed); after
        a `post`, the posted tensor is this stage's contribution and ``t`` only receives the sum."""
        if stage not in self._posted:
            self.post(stage, t)
        k = self._posted.pop(stage)
        contributions = self._rounds[k]
        if len(contributions) < len(self.ranks):
            if self.wait is None:
                raise RuntimeError("a stage sum waits for other stages and nothing runs them (LocalStageSum.wait)")
            self.wait(lambda: len(contributions) == len(self.ranks), f"the stage-sum of round {k}")
        t.copy_(sum_in_order([contributions[s] for s in self.ranks]))
        self._read[k] = self._read.get(k, 0) + 1
        if self._read[k] == len(self.ranks):  # every stage has its sum: the round is done
            del self._rounds[k], self._read[k]
