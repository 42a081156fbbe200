"""A whole pipeline in one process: S runtimes over an in-process transport, driven round-robin.

PACI's numerics do not depend on timing: each stage runs a fixed action stream and stages meet only
through messages. So the S stages of one pipeline can run in one process, through the same
`PipelineStage`, schedules and `PipelineRuntime` as on S processes, and produce bit-identical
parameters, optimizer states, losses and drift. No threads: a runtime pauses before a receive whose
message is not there yet (runtime.py), and `LocalPipeline` gives each stage its turn until every one
is quiescent (waiting for the next micro-batch). If a round gives no stage anything to do while some
still wait, the schedule deadlocks, and `PipelineDeadlockError` says who waits for what.

What it costs: the memory of the unsplit model plus the activations in flight (each stage keeps
those of up to S-s micro-batches, as on S devices; stage-boundary tensors are shared, not copied),
and the time of the whole model's compute, serialized: no bubble to hide and none to save.

Uses: previewing what PACI's staleness does to a model before buying S devices, debugging a split
in one process, fast tests, and training on one device with exactly the numerics of S.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from lit_efficient.pipeline.comm import LocalExchange, Payload
from lit_efficient.pipeline.runtime import InputFn, PipelineRuntime
from lit_efficient.pipeline.schedules import ScheduleName
from lit_efficient.pipeline.stage import PipelineStage
from lit_efficient.pipeline.topology import Topology


def local_pipeline(
    stages: Sequence[PipelineStage], schedule: ScheduleName, accumulate: int, input_fn: InputFn
) -> LocalPipeline:
    """Runtimes for ``stages`` (stage 0 first) over one `LocalExchange`, each playing the rank it would
    have in a one-replica pipeline of processes, driven by a `LocalPipeline`."""
    topo = Topology(len(stages))
    exchange = LocalExchange()
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

    # -- the runtime's calls, for the whole pipeline ------------------------------------------------

    def feed(self, batch: Any, index: int | None = None) -> Tensor | None:
        """Micro-batch ``index`` into every stage; returns its loss (detached) from the last stage."""
        for rt in self.runtimes:
            rt.feed(batch, index)
        self._settle()
        return self.runtimes[-1].last_loss

    def drain(self, step_partial_window: bool = False) -> None:
        """Finish every micro-batch in flight on every stage (see `PipelineRuntime.drain`)."""
        for rt in self.runtimes:
            rt.drain(step_partial_window)
        self._settle()

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

    def _settle(self) -> None:
        """Give every stage turns until all are quiescent; a round in which none runs is a deadlock."""
        while True:
            waiting = [rt for rt in self.runtimes if not rt.quiescent]
            if not waiting:
                return
            # Last stage first: backwards (which free memory) run as soon as their gradients exist.
            progressed = False
            for rt in reversed(waiting):
                progressed |= rt.resume()
            if not progressed:
                raise PipelineDeadlockError(
                    "no stage of the in-process pipeline can progress: "
                    + "; ".join(str(rt.waiting_for()) for rt in waiting)
                )
