"""Interprets this rank's action stream, one micro-batch at a time.

The caller (the Lightning strategy, the demo, a test) feeds micro-batches in order. After being
fed micro-batch ``j`` the runtime executes its stage's stream up to, but not including, the first
forward of a micro-batch it does not have yet: in 1F1B order that is ``F(j)`` plus the backwards
and steps that precede ``F(j+1)``. Every rank of a pipeline is fed the same stream, so they stay
in step through the blocking receives alone: no barrier, no coordinator.

`drain` finishes every micro-batch in flight. It switches to the finite stream for the
micro-batches fed so far, which agrees with the unbounded one on everything already executed
(checked), so it is exact at any point: before evaluation, checkpoints and the end of training,
and at an epoch's end, where it also steps a partial last window.

Over an in-process transport (a whole pipeline in one process, `transport.local`) a stage must not wait for
a message another stage of the same process has yet to send: before every action that receives, the
runtime asks the transport whether the message is there and, if not, pauses and returns; `resume`
continues, and `lit_efficient.runtime.host.StageHost` round-robins the stages until each is
quiescent. Over processes the question is always answered yes and the receive blocks, as before: the
same stream, the same actions, in the same order on each stage.

Receives are posted before they are needed wherever the next message is certain (why that matters:
`transport.process`): a stage's gradient receive while it has micro-batches in flight, and its next activation
receive as soon as the current one arrives, which `drain` matches with an end-of-segment marker
when no further micro-batch comes, so nothing stays posted once the pipeline is drained.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from torch import Tensor

from lit_efficient.runtime.actions import Action
from lit_efficient.runtime.clock import Mark, Spans
from lit_efficient.runtime.schedules import ScheduleName, stage_actions
from lit_efficient.runtime.stage import Payload, PipelineStage

_END_OF_SEGMENT = -1  # the micro-batch index drain()'s marker message carries
_SEGMENT_END: Any = object()  # drain()'s last pseudo-action: exchange the end-of-segment markers
InputFn = Callable[[Any], "Tensor | tuple[Tensor, ...]"]


class Transport(Protocol):
    """What a runtime needs of the links to its neighbours: `transport.process.PointToPoint` between processes,
    `transport.local.LocalPointToPoint` between stages of one process."""

    def connect(self, peers: Sequence[int]) -> None: ...
    def ready(self, src: int) -> bool: ...
    def prepost(self, src: int) -> None: ...
    def send(self, tensors: Payload, dst: int, microbatch: int, what: str) -> None: ...
    def recv(self, src: int, microbatch: int, what: str) -> Payload: ...
    def flush(self) -> None: ...


class PipelineRuntime:
    """Runs one stage's share of a pipeline schedule.

    Args:
        stage: This rank's stage.
        schedule: ``"paci"`` or ``"1f1b_flush"``.
        accumulate: Micro-batches per optimizer step (N).
        input_fn: First stage only: the batch -> what layer 0 consumes (``pipeline_input``).
        comm: Transfers to the neighbours; None for a one-stage pipeline.
        prev_rank: Global rank of the previous stage, None on the first.
        next_rank: Global rank of the next stage, None on the last.
    """

    def __init__(
        self,
        stage: PipelineStage,
        schedule: ScheduleName,
        accumulate: int,
        input_fn: InputFn | None = None,
        comm: Transport | None = None,
        prev_rank: int | None = None,
        next_rank: int | None = None,
    ) -> None:
        if accumulate < 1:
            raise ValueError(f"accumulate={accumulate} must be >= 1 (micro-batches per optimizer step)")
        if stage.is_first and input_fn is None:
            raise ValueError("the first stage needs input_fn (the module's pipeline_input)")
        if stage.num_stages > 1 and comm is None:
            raise ValueError("a stage of a multi-stage pipeline needs a transport (comm) to its neighbours")
        self.stage = stage
        self.schedule: ScheduleName = schedule
        self.accumulate = accumulate
        self.input_fn = input_fn
        self.comm = comm
        if comm is not None:  # every rank builds its runtime at the same point: create its links now
            comm.connect([r for r in (prev_rank, next_rank) if r is not None])
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self._segment_start = 0  # first micro-batch of the current (undrained) segment
        self._fed = 0  # micro-batches fed so far (in this epoch's numbering)
        self._stream: Iterator[Action] | None = None
        self._next_action: Action | None = None
        self._draining: Iterator[Action] | None = None  # drain()'s remaining actions while it runs
        # Count and last of the actions run in this segment: what drain() must skip and check.
        self._executed = 0
        self._last_executed: Action | None = None
        self._batch: Any = None
        self._last_loss: Tensor | None = None
        # Every time below is a mark on the stage's clock (lit_efficient.runtime.clock: the host's on
        # CPU, CUDA events on a GPU), resolved only when stats() or the timeline is read.
        self._clock_start: Mark | None = None
        self._clock_end: Mark | None = None
        self._waits = Spans(stage.clock)
        # (action, start, end) marks, recorded only when asked: the monitor's timeline picture. None
        # keeps the hot path free of the bookkeeping.
        self._timeline: list[tuple[str, Mark, Mark]] | None = None
        # Wraps every action and receive in a named span of a profiler (Lightning's `trainer.profiler.profile`,
        # set by the strategy when one is configured); the default does nothing.
        self.profile: Callable[[str], contextlib.AbstractContextManager[Any]] = _no_profile

    # -- training --------------------------------------------------------------------------------

    def feed(self, batch: Any, index: int | None = None) -> Tensor | None:
        """Give the pipeline micro-batch ``index`` (default: the next one) and run what it allows.

        Returns the micro-batch's loss (detached) on the last stage, None elsewhere. Over a transport
        whose receives block (processes) it returns with the stage quiescent; over an in-process one
        it may return paused, waiting for a message, and `resume` continues (`StageHost` drives it).
        """
        if not self.quiescent:
            raise RuntimeError(f"stage {self.stage.stage} was fed while paused: resume() until quiescent first")
        index = self._fed if index is None else index
        if index != self._fed:
            if not self.drained:
                raise RuntimeError(
                    f"stage {self.stage.stage} was fed micro-batch {index} while micro-batches up to "
                    f"{self._fed - 1} are still in flight; drain() before jumping"
                )
            self._stream = None
        if self._stream is None:
            self._segment_start = index
            self._stream = stage_actions(
                self.schedule, self.stage.stage, self.stage.num_stages, self.accumulate, start=index
            )
            self._next_action = next(self._stream)
            self._executed, self._last_executed = 0, None
        self._batch = batch
        self._fed = index + 1
        self._last_loss = None
        self.resume()
        return self._last_loss

    def drain(self, step_partial_window: bool = False) -> None:
        """Finish every micro-batch in flight; optionally step the partial window they leave.

        Args:
            step_partial_window: Step even if the last window is incomplete (end of an epoch).
                Otherwise its gradients stay accumulated and the window continues at the next feed.
        """
        if not self.quiescent:
            raise RuntimeError(f"stage {self.stage.stage} was drained while paused: resume() until quiescent first")
        if self._stream is not None:
            finite = stage_actions(
                self.schedule,
                self.stage.stage,
                self.stage.num_stages,
                self.accumulate,
                start=self._segment_start,
                stop=self._fed,
                step_at_stop=step_partial_window,
            )
            skipped = None
            for _ in range(self._executed):
                skipped = next(finite)
            if skipped != self._last_executed:
                raise RuntimeError(f"drain: the finite stream has {skipped} where {self._last_executed} ran")
            self._draining = itertools.chain(finite, [_SEGMENT_END] if self.comm is not None else [])
        elif step_partial_window and self.stage.window_weight is not None:
            self._draining = iter([Action(self.stage.stage, "STEP", max(self._fed - 1, 0) // self.accumulate)])
        else:
            self._draining = iter(())
        self._next_action = next(self._draining, None)
        self.resume()

    def resume(self) -> bool:
        """Run the stage's actions until it needs an unfed micro-batch, a message not yet arrived, or (while
        draining) has nothing left. Returns whether any action ran."""
        ran = False
        while True:
            action = self._next_action
            if self._draining is None:
                if action is None or self._needs_unfed(action):
                    self._batch = None  # its forward ran: the stage no longer needs it
                    return ran
            elif action is None:
                self._finish_drain()
                return ran
            if not self._can_run(action):
                return ran
            if action is _SEGMENT_END:
                self._end_segment()
            else:
                self._execute(action)
            ran = True
            stream = self._draining if self._draining is not None else self._stream
            self._next_action = next(stream, None)  # type: ignore[arg-type]

    @property
    def quiescent(self) -> bool:
        """Nothing runnable is left without a new micro-batch: not paused in a feed or a drain."""
        if self._draining is not None:
            return False
        return self._next_action is None or self._needs_unfed(self._next_action)

    def waiting_for(self) -> str | None:
        """What a paused stage waits for, in words (for the deadlock error); None if it is not paused."""
        if self.quiescent:
            return None
        action = self._next_action
        src = self._source(action) if action is not None else None
        what = "the end-of-segment marker" if action is _SEGMENT_END else f"{action} (its input)"
        return f"stage {self.stage.stage} waits for {what} from rank {src}"

    def _finish_drain(self) -> None:
        self._draining = None
        self._stream = None
        self._next_action = None
        self._executed, self._last_executed = 0, None
        self._segment_start = self._fed
        if self.comm is not None:
            self.comm.flush()

    def start_epoch(self) -> None:
        """Number micro-batches from 0 again (windows are aligned to the epoch, as in Lightning)."""
        if not self.drained:
            raise RuntimeError("start_epoch() with micro-batches in flight: drain() first")
        self._fed = self._segment_start = 0

    @property
    def last_loss(self) -> Tensor | None:
        """The loss (detached) of the micro-batch fed last, on the last stage once its forward ran."""
        return self._last_loss

    @property
    def drained(self) -> bool:
        """No micro-batch is in flight on this stage."""
        return self.stage.in_flight == 0

    # -- evaluation ------------------------------------------------------------------------------

    def evaluate(self, batch: Any, index: int) -> Payload | None:
        """Forward-only streaming of one batch; returns the outputs on the last stage."""
        if self._stream is not None:
            raise RuntimeError("evaluate() with a training segment open: drain() first")
        if not self.quiescent:
            raise RuntimeError("evaluate() while paused: resume() until quiescent first")
        self._tick()
        if self.stage.is_first:
            inputs = _as_payload(self.input_fn(batch))  # type: ignore[misc]
        else:
            inputs = self._recv(self.prev_rank, index, "activations")
        outputs = self.stage.evaluate(inputs)
        self._tock()
        if self.stage.is_last:
            return outputs
        self.comm.send(outputs, self.next_rank, index, "activations")  # type: ignore[union-attr]
        return None

    # -- accounting ------------------------------------------------------------------------------

    @property
    def wait_seconds(self) -> float:
        """Time this stage spent receiving (waiting for a neighbour's message) since the last `reset_stats`.

        On CUDA this resolves the pending events (waits for the device): read it where results are read.
        """
        return self._waits.total("wait")

    @property
    def timeline(self) -> list[tuple[str, float, float]] | None:
        """The recorded actions as ``(action, start, end)`` in ``time.perf_counter()`` seconds, or None
        when not recording. On CUDA this waits for the device once (the events' times): read it once."""
        if self._timeline is None:
            return None
        clock = self.stage.clock
        times = iter(clock.host_seconds([m for _, start, end in self._timeline for m in (start, end)]))
        return [(action, next(times), next(times)) for action, _, _ in self._timeline]

    def stats(self) -> dict[str, float]:
        """Measured numbers of this stage since the last `reset_stats`.

        Times are the stage clock's (device time on CUDA); on CUDA reading them waits for the device once,
        for the events recorded since the last read: the logging interval's sync, never one per action.
        """
        s = self.stage.stats
        started = self._clock_start is not None and self._clock_end is not None
        elapsed = self.stage.clock.seconds(self._clock_start, self._clock_end) if started else 0.0
        return {
            "stage": self.stage.stage,
            "forwards": s.forwards,
            "backwards": s.backwards,
            "steps": s.steps,
            "in_flight": self.stage.in_flight,
            "max_in_flight": s.max_in_flight,
            "busy_seconds": s.busy_seconds,
            "forward_seconds": s.forward_seconds,
            "backward_seconds": s.backward_seconds,
            "step_seconds": s.step_seconds,
            "wait_seconds": self.wait_seconds,
            "elapsed_seconds": elapsed,
            "utilization": s.busy_seconds / elapsed if elapsed > 0 else 0.0,
            "drift_max": s.drift_max,
            "drift_mean": s.drift_sum / s.backwards if s.backwards else 0.0,
        }

    def reset_stats(self) -> None:
        """Start measuring afresh (after warm-up, or per logging interval)."""
        self.stage.reset_stats()
        self._clock_start = self._clock_end = None
        self._waits = Spans(self.stage.clock)

    # -- internals -------------------------------------------------------------------------------

    def _needs_unfed(self, action: Action) -> bool:
        return action is not _SEGMENT_END and action.kind == "F" and action.index >= self._fed

    def _source(self, action: Action) -> int | None:
        """The rank ``action`` receives from before it can run, or None."""
        if action is _SEGMENT_END:
            return None if self.stage.is_first else self.prev_rank
        if action.kind == "F":
            return None if self.stage.is_first else self.prev_rank
        if action.kind == "B":
            return None if self.stage.is_last else self.next_rank
        return None

    def _can_run(self, action: Action) -> bool:
        # Blocking transports always say yes (the receive waits); the in-process one says whether the
        # message is there, so a stage pauses instead of waiting on a stage of the same process.
        src = self._source(action)
        return src is None or self.comm.ready(src)  # type: ignore[union-attr]

    def record_timeline(self, enabled: bool = True) -> None:
        """Start (or stop) recording every executed action with its start and end time."""
        self._timeline = [] if enabled else None

    def _execute(self, action: Action) -> None:
        with self.profile(f"[pipeline] stage {self.stage.stage} {_ACTION_NAMES[action.kind]}"):
            self._run(action)

    def _run(self, action: Action) -> None:
        self._tick()
        start = self.stage.clock.mark() if self._timeline is not None else None
        stage, j = self.stage, action.index
        if action.kind == "F":
            if stage.is_first:
                # From the stage's own stream, as its layers' draws: a random masking drawn from the process's
                # advanced stage 0's rank alone, and the stages' next epoch shuffled apart (the first batches'
                # check stopped the run, blaming the data).
                with stage.own_rng():
                    inputs = _as_payload(self.input_fn(self._batch))  # type: ignore[misc]
            else:
                inputs = self._recv(self.prev_rank, j, "activations")
                # What the previous stage sends next is the next micro-batch's activations or, if none
                # is fed before drain(), the end-of-segment marker: certain either way, so post it now,
                # before this stage's own sends keep the link busy.
                self.comm.prepost(self.prev_rank)  # type: ignore[union-attr, arg-type]
            # Windows that close before B(j): every one from the oldest micro-batch in flight's to j's own
            # (1F1B backwards in order, a STEP right after each window's last backward).
            oldest = stage.oldest_in_flight
            pending = j // self.accumulate - (j if oldest is None else oldest) // self.accumulate
            out = stage.forward(j, inputs, self._batch, pending_steps=pending)
            if stage.is_last:
                self._last_loss = out  # type: ignore[assignment]
            else:
                self.comm.send(out, self.next_rank, j, "activations")  # type: ignore[arg-type, union-attr]
                self._prepost_gradients()
        elif action.kind == "B":
            grads = None if stage.is_last else self._recv(self.next_rank, j, "gradients")
            input_grads = stage.backward(j, grads)
            self._prepost_gradients()
            if not stage.is_first:
                self.comm.send(input_grads, self.prev_rank, j, "gradients")  # type: ignore[union-attr]
        elif action.kind == "STEP":
            stage.step(j)
        else:  # I/W: the split backward of the schedules this package is compared with (tools.schedule_plans)
            raise ValueError(f"the runtime runs F, B and STEP actions, not {action}")
        self._executed += 1
        self._last_executed = action
        self._tock()
        if self._timeline is not None:
            self._timeline.append((str(action), start, self._clock_end))

    def _end_segment(self) -> None:
        # Matches the activation receive the last forward left posted (see _execute). Every rank of the
        # pipeline drains at the same point of the same stream, so the markers pair up.
        if self.comm is None:
            return
        if not self.stage.is_last:
            self.comm.send((), self.next_rank, _END_OF_SEGMENT, "end-of-segment marker")  # type: ignore[arg-type]
        if not self.stage.is_first:
            self.comm.recv(self.prev_rank, _END_OF_SEGMENT, "end-of-segment marker")  # type: ignore[arg-type]

    def _prepost_gradients(self) -> None:
        # Every micro-batch forwarded here gets its gradients back (drain() guarantees it), so while
        # one is in flight the next gradient message is certain and its receive can wait posted,
        # off the critical path (see `transport.process`). Nothing stays posted once the stage is drained.
        if not self.stage.is_last and self.stage.in_flight > 0:
            self.comm.prepost(self.next_rank)  # type: ignore[union-attr, arg-type]

    def _recv(self, src: int | None, microbatch: int, what: str) -> Payload:
        # On CUDA the span is the stream's: from where it finished the work before the receive to where
        # the received tensors are usable on it, i.e. the time the device waited, not the host.
        start = self.stage.clock.mark()
        with self.profile(f"[pipeline] stage {self.stage.stage} receive {what}"):
            out = self.comm.recv(src, microbatch, what)  # type: ignore[union-attr, arg-type]
        self._waits.add("wait", start, self.stage.clock.mark())
        return out

    def _tick(self) -> None:
        if self._clock_start is None:
            self._clock_start = self.stage.clock.mark()

    def _tock(self) -> None:
        self._clock_end = self.stage.clock.mark()  # on CUDA one event per action; only the last is kept


_ACTION_NAMES = {"F": "forward", "B": "backward", "STEP": "optimizer step"}


def _no_profile(name: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def _as_payload(x: Tensor | tuple[Tensor, ...]) -> Payload:
    return x if isinstance(x, tuple) else (x,)
