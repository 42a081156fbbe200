"""The stages one process hosts: k = 1 on processes, k = S when the whole pipeline runs in one process.

`StageHost` is the one runtime type a strategy and its callbacks talk to, whatever k is: the modes differ in
the transport its runtimes were built over (`transport.process` or `transport.local`) and in k, nothing else.

PACI's numerics do not depend on timing: each stage runs a fixed action stream and stages meet only
through messages. So the S stages of one pipeline can run in one process, through the same
`PipelineStage`, schedules and `PipelineRuntime` as on S processes, and produce bit-identical
parameters, optimizer states, losses and drift. No threads: a runtime pauses before a receive whose
message is not there yet (`interpreter`), and the host gives each stage its turn until every one
is quiescent (waiting for the next micro-batch). If a round gives no stage anything to do while some
still wait, the schedule deadlocks, and `PipelineDeadlockError` says who waits for what. Over blocking
links (processes) a runtime is quiescent whenever a call returns, so the turns are that one call.

A stage can also need another stage's message in the middle of an action: under 1F1B-flush a weight
tied between the first and the last stage is all-reduced inside both stages' optimizer steps
(`transport.local.LocalTiedLink`), and the last stage gets there first. Its rank would
block in the collective; here `run_others_until` gives the other stages their turns, the same turns
as above, until the message is there, and the step continues. Only stages not inside an action of
their own take turns, so no stage is re-entered.

What one process hosting every stage costs: the memory of the unsplit model plus the activations in flight
(each stage keeps those of up to S-s micro-batches, as on S devices; stage-boundary tensors are shared, not
copied), and the time of the whole model's compute, serialized: no bubble to hide and none to save.
Uses: previewing what PACI's staleness does to a model before buying S devices, debugging a split
in one process, fast tests, and training on one device with exactly the numerics of S.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lit_efficient.runtime.interpreter import PipelineRuntime
from lit_efficient.runtime.schedules import ScheduleName
from lit_efficient.runtime.stage import Payload, PipelineStage


class PipelineDeadlockError(RuntimeError):
    """No stage of an in-process pipeline can progress while some still wait for a message."""


class StageHost:
    """The stages this process hosts, driven through the calls a strategy makes (``feed``, ``drain``,
    ``evaluate``, ``start_epoch``, ``stats``...), whatever their number and transport.

    On processes it hosts one stage over blocking links, and each call is that stage's runtime's; in one
    process it hosts every stage of the pipeline over in-process links and gives them their turns (module
    docstring). Per-stage numbers are in ``runtimes[k]``; `stage` and `stats` describe the last hosted stage
    (on global rank 0, and in one process, the last stage of the pipeline: it holds the loss).

    Args:
        runtimes: One runtime per hosted stage, in stage order.
    """

    def __init__(self, runtimes: Sequence[PipelineRuntime]) -> None:
        stages = [rt.stage.stage for rt in runtimes]
        if not stages or stages != sorted(set(stages)):
            raise ValueError(f"StageHost needs at least one runtime and distinct stages in order, got stages {stages}")
        self.runtimes = list(runtimes)
        self._acting: list[PipelineRuntime] = []  # the stages inside an action now, outermost first
        # The call (feed, drain) each hosted stage has yet to get, by its position in `runtimes`. Every stage gets it
        # before the stages settle; one that waits inside an action gives it to the others first (a
        # partial window's tied-weight exchange at an epoch's end needs the peer's drain to have begun).
        self._calls: dict[int, Callable[[PipelineRuntime], None]] = {}

    # -- the runtime's calls, for the whole pipeline ------------------------------------------------

    def feed(self, batch: Any, index: int | None = None) -> Tensor | None:
        """Micro-batch ``index`` into every hosted stage; returns its loss (detached) when this process hosts the
        last stage, None elsewhere."""
        self._call_every_stage(lambda rt: rt.feed(batch, index))
        return self.runtimes[-1].last_loss

    def drain(self, step_partial_window: bool = False) -> None:
        """Finish every micro-batch in flight on every hosted stage (see `PipelineRuntime.drain`).

        The last stage gets the call first. A partial window's step is the only one the last stage does not
        reach first by itself (its backwards ran at the feeds; stage 0's last one can run once it is called),
        and under flush with a tied weight and norm clipping stage 0 must not be inside its step first: it
        would wait there for the last stage's tied gradient, which then could not complete its own step
        without stage 0's squared norm (`LocalStageSum`). The order changes no number.

        With autograd on whatever the caller's mode: Lightning drains at a validation's start inside its loop's
        no_grad, where a recomputed forward built no graph and the backwards of the micro-batches in flight added
        nothing to their window (1e-2 in the weights, flush too).
        """
        with torch.enable_grad():
            self._call_every_stage(lambda rt: rt.drain(step_partial_window), last_first=True)

    def run_others_until(self, done: Callable[[], bool], what: str) -> None:
        """Called from inside a stage's action that needs ``what`` from another stage: give every stage that
        is not inside an action its turns (first the call the pipeline got, if it has not had it yet) until
        ``done()``; a round without progress is a deadlock."""
        self._settle(done, what)

    def evaluate(self, batch: Any, index: int) -> Payload | None:
        """Forward-only pass of one batch through the hosted stages in order; the outputs when this process
        hosts the last stage, None elsewhere."""
        out = None
        for rt in self.runtimes:  # stage s's activations are in its mailbox before stage s+1 asks
            out = rt.evaluate(batch, index)
        return out

    def switch_schedule(self, schedule: ScheduleName) -> None:
        """Run ``schedule`` from the next feed on, on every hosted stage: drains first (closing the segment on every
        transport, as a validation's drain does), so the next micro-batch starts the new schedule's stream. Every
        rank must switch at the same micro-batch (PACIStrategy's synchronous start: between two windows)."""
        self.drain()
        for rt in self.runtimes:
            rt.schedule = schedule

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
    def stages(self) -> list[PipelineStage]:
        """The hosted stages, in stage order."""
        return [rt.stage for rt in self.runtimes]

    @property
    def stage(self) -> PipelineStage:
        """The last hosted stage (the pipeline's last in one process: it holds the loss)."""
        return self.runtimes[-1].stage

    @property
    def last_loss(self) -> Tensor | None:
        """The loss (detached) of the micro-batch fed last, when this process hosts the last stage."""
        return self.runtimes[-1].last_loss

    @property
    def timeline(self) -> list[tuple[str, float, float]] | None:
        """The last hosted stage's recorded actions (see `PipelineRuntime.record_timeline`)."""
        return self.runtimes[-1].timeline

    def stats(self) -> dict[str, float]:
        """The last hosted stage's measured numbers; ``stage_stats`` has every hosted stage's.

        With several stages in one process, times are those of the stages taking turns: busy times are each
        stage's own, but waits and utilization describe the turn-taking, not a pipeline on S devices.
        """
        return self.runtimes[-1].stats()

    def stage_stats(self) -> list[dict[str, float]]:
        """Every hosted stage's measured numbers (drift per stage among them), in stage order."""
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
            called = [k for k in self._calls if self.runtimes[k] in free]
            for k in called:  # in the order of `_calls` (stage order, or the last stage first)
                rt, call = self.runtimes[k], self._calls.pop(k, None)
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
                    "no stage hosted in this process can progress: "
                    + "; ".join([*blocked, *(str(rt.waiting_for()) for rt in waiting)])
                )
