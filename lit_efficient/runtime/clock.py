"""Timing on the device the work runs on: the host's clock on CPU, CUDA events on a GPU.

A stage's forward on a GPU launches its kernels and returns long before the GPU has run them, so
host time around it measures the launch, not the compute: utilization, bubble and the timeline would
describe the Python thread, not the device. This file owns the one timing mechanism the stage, the
runtime and `PipelineMonitor` share; `clock_for(device)` picks the clock, and both clocks answer the
same calls:

- `mark()`: a point on the device's timeline. On CPU `time.perf_counter()`. On CUDA an event recorded
  on the device's current stream: queued behind the work launched so far, no wait.
- `seconds(start, end)`: the time between two marks. On CUDA it waits for both events: a host sync,
  so only code that reads results calls it, never the hot path.
- `host_seconds(marks)`: marks placed on the host's `perf_counter` axis (the timeline's time axis).

`Spans` sums named (start, end) spans and resolves them lazily: on CUDA the events are read when a
total is asked for (the monitor's logging interval, a benchmark's end), the only place that waits for
the device. In between, spans whose events the device has already passed are folded in without
waiting (`Event.query`), so a run that nobody reads holds a bounded number of events. On CPU every
span is folded in at once: the same code, with marks that are plain floats.

This module never imports lightning.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import torch

Mark = Any  # a float (HostClock) or a recorded torch.cuda.Event (CudaClock)

# Spans waiting on the device before a non-blocking fold is tried at every add. A CUDA stream runs at
# most its launch queue (~1000 kernels) behind the host, so the pending count stays near this bound.
_FOLD_AT = 256


class Clock(Protocol):
    """Marks points on one device's timeline and measures between them (see the module docstring)."""

    lazy: bool  # whether marks resolve later (events) or are numbers already

    def mark(self) -> Mark:
        """A point on this device's timeline, now (in stream order), without waiting."""
        ...

    def done(self, mark: Mark) -> bool:
        """Whether the device has passed ``mark`` (never waits)."""
        ...

    def wait(self, mark: Mark) -> None:
        """Block until the device has passed ``mark`` (and, in stream order, every earlier mark)."""
        ...

    def seconds(self, start: Mark, end: Mark) -> float:
        """Seconds from ``start`` to ``end``; may wait for the device."""
        ...

    def host_seconds(self, marks: Sequence[Mark]) -> list[float]:
        """``marks`` on the host's ``time.perf_counter()`` axis; may wait for the device."""
        ...


class HostClock:
    """`time.perf_counter`: for CPU stages, whose compute runs synchronously in the calling thread."""

    lazy = False

    def mark(self) -> float:
        """The host's clock now."""
        return time.perf_counter()

    def done(self, mark: Mark) -> bool:
        """Always: a host mark is a number already."""
        return True

    def wait(self, mark: Mark) -> None:
        """Nothing to wait for."""

    def seconds(self, start: Mark, end: Mark) -> float:
        """``end - start``."""
        return end - start

    def host_seconds(self, marks: Sequence[Mark]) -> list[float]:
        """The marks themselves: they are on that axis."""
        return list(marks)


class CudaClock:
    """CUDA events on the current stream of ``device``: the time the GPU spent, not the launches.

    A span between two events is the time the stream took from the first to the second, gaps in which
    it waited for the host's next launch included: on a launch-bound stage that is still the stage's
    time, which is what utilization divides. Events are created per mark (a few microseconds each on
    the host, no device work) and dropped once resolved.

    Args:
        device: The CUDA device whose current stream the events are recorded on.
    """

    lazy = True

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaClock times a CUDA device, not {self.device}; use clock_for(device)")

    def mark(self) -> Any:
        """An event recorded on the device's current stream (queued: no wait)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def done(self, mark: Any) -> bool:
        """``Event.query()``: whether the stream has passed the event, without waiting."""
        return bool(mark.query())

    def wait(self, mark: Any) -> None:
        """Host sync: block until the stream has passed the event (a no-op once it has)."""
        _wait(mark)

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between the events; waits for them first (a host sync, at read time only)."""
        _wait(end)  # the later one first: on one stream, the earlier is then done as well
        _wait(start)
        return start.elapsed_time(end) / 1e3

    def host_seconds(self, marks: Sequence[Any]) -> list[float]:
        """Each event on the host's clock, through one anchor event.

        Host sync: the anchor is recorded now and waited for, and ``perf_counter()`` read the moment it
        completes (the error is the wake-up latency, microseconds); every mark is then the anchor's host
        time less the GPU time between the mark and the anchor. One sync per call (once per timeline).
        """
        anchor = self.mark()
        anchor.synchronize()
        now = time.perf_counter()
        out = []
        for m in marks:
            _wait(m)  # on another stream than the anchor's it may still be pending
            out.append(now - m.elapsed_time(anchor) / 1e3)
        return out


def _wait(event: Any) -> None:
    # The host sync every CUDA read ends in: a no-op for an event the stream has passed already.
    if not event.query():
        event.synchronize()


def clock_for(device: torch.device | str) -> Clock:
    """The clock for work on ``device``: CUDA events on a CUDA device, the host's clock elsewhere."""
    device = torch.device(device)
    return CudaClock(device) if device.type == "cuda" else HostClock()


class Spans:
    """Per-name sums of (start, end) spans on one clock, resolved when read.

    ``add`` never waits; ``total`` / ``totals`` resolve every pending span (on CUDA: a host sync, so
    call them where a result is read, not per action).

    Args:
        clock: The clock the marks come from.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._totals: dict[str, float] = {}
        self._pending: deque[tuple[str, Mark, Mark]] = deque()

    def add(self, name: str, start: Mark, end: Mark) -> None:
        """Count the span from ``start`` to ``end`` under ``name`` (no wait)."""
        self._pending.append((name, start, end))
        if not self.clock.lazy or len(self._pending) >= _FOLD_AT:
            self._fold(wait=False)

    def total(self, name: str) -> float:
        """Seconds counted under ``name`` so far (resolves every pending span)."""
        self._fold(wait=True)
        return self._totals.get(name, 0.0)

    def totals(self) -> dict[str, float]:
        """Every name's seconds so far (resolves every pending span)."""
        self._fold(wait=True)
        return dict(self._totals)

    @property
    def pending(self) -> int:
        """Spans not resolved yet (always 0 on the host clock)."""
        return len(self._pending)

    def _fold(self, wait: bool) -> None:
        if wait and self._pending:
            self.clock.wait(self._pending[-1][2])  # one wait, for the newest event: the rest precede it
        while self._pending:
            name, start, end = self._pending[0]
            if not wait and not self.clock.done(end):
                break  # a stream passes its events in order: the later ones are pending too
            self._totals[name] = self._totals.get(name, 0.0) + self.clock.seconds(start, end)
            self._pending.popleft()
