"""Timing on the device and host syncs on the hot path, without a GPU.

The CPU path runs as it is. The CUDA path runs with a fake of the two calls `CudaClock` makes
(``torch.cuda.Event`` and ``torch.cuda.current_stream``): the fake device finishes nothing until the
host waits, so a test can tell an event that was recorded from one that was waited for, and count the
waits. With it a real pipeline (CPU tensors, CUDA clocks) shows that events are recorded per action
and resolved only when the numbers are read. tests/test_gpu.py checks the same on a real GPU.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

import lit_efficient.runtime.clock as clock_module
from lit_efficient.runtime.clock import CudaClock, HostClock, Spans, clock_for
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.transport.local import local_pipeline
from tests.support.runtime_runs import demo_stage as _stage
from tests.support.runtime_runs import runtime_batches as _data


class FakeDevice:
    """A CUDA device that runs behind the host: an event completes only when the host waits for it (or a
    later one), or when the test lets the device catch up. Its clock is the host's, read at record."""

    def __init__(self) -> None:
        self.recorded: list[FakeEvent] = []
        self.syncs = 0  # Event.synchronize calls that had to wait

    def catch_up(self, upto: FakeEvent | None = None) -> None:
        """Complete every event recorded up to ``upto`` (all of them if None), in stream order."""
        for event in self.recorded:
            event.completed = True
            if event is upto:
                return


class FakeEvent:
    """What `CudaClock` calls on a ``torch.cuda.Event``, on a `FakeDevice`."""

    device: FakeDevice

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "timing needs enable_timing=True"
        self.time: float | None = None
        self.completed = False
        self.stream = None

    def record(self, stream=None) -> None:
        self.time, self.stream = time.perf_counter(), stream
        self.device.recorded.append(self)

    def query(self) -> bool:
        return self.completed

    def synchronize(self) -> None:
        if not self.completed:
            self.device.syncs += 1
            self.device.catch_up(self)

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.completed and end.completed):  # what CUDA answers: cudaErrorNotReady
            raise RuntimeError("CUDA error: device not ready")
        return (end.time - self.time) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeDevice:
    device = FakeDevice()
    event = type("BoundFakeEvent", (FakeEvent,), {"device": device})
    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    return device


# ---------------------------------------------------------------- the clocks


def test_clock_for_picks_events_on_cuda_and_the_host_clock_elsewhere():
    assert isinstance(clock_for("cpu"), HostClock) and isinstance(clock_for(torch.device("meta")), HostClock)
    assert isinstance(clock_for("cuda:1"), CudaClock) and clock_for("cuda:1").device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="CudaClock times a CUDA device, not cpu"):
        CudaClock("cpu")


def test_host_spans_are_summed_at_once():
    spans = Spans(HostClock())
    spans.add("forward", 1.0, 1.5)
    spans.add("forward", 2.0, 2.25)
    spans.add("step", 3.0, 3.125)
    assert spans.pending == 0
    assert spans.totals() == {"forward": 0.75, "step": 0.125} and spans.total("backward") == 0.0


def test_cuda_spans_wait_only_when_read(fake_cuda):
    clock = CudaClock("cuda:0")
    spans = Spans(clock)
    for _ in range(5):
        start = clock.mark()
        time.sleep(0.002)
        spans.add("forward", start, clock.mark())
    assert len(fake_cuda.recorded) == 10 and fake_cuda.recorded[0].stream == "stream of cuda:0"
    assert fake_cuda.syncs == 0 and spans.pending == 5  # recorded, not waited for
    total = spans.total("forward")
    assert fake_cuda.syncs == 1 and spans.pending == 0  # one wait, for the newest event
    assert 0.010 <= total < 1.0
    assert spans.total("forward") == total and fake_cuda.syncs == 1  # nothing left to wait for


def test_cuda_spans_fold_what_the_device_finished_without_waiting(fake_cuda):
    """A run nobody reads keeps a bounded number of events: the finished ones are folded in, never waited for."""
    clock = CudaClock("cuda:0")
    spans = Spans(clock)
    for k in range(3 * clock_module._FOLD_AT):
        start = clock.mark()
        spans.add("backward", start, clock.mark())
        if k % 7 == 0:
            fake_cuda.catch_up(start)  # the device runs a little behind the host
        assert spans.pending <= clock_module._FOLD_AT
    assert fake_cuda.syncs == 0


def test_cuda_host_seconds_places_events_on_the_perf_counter_axis(fake_cuda):
    clock = CudaClock("cuda:0")
    marks = [clock.mark() for _ in range(3)]
    times = [m.time for m in marks]
    placed = clock.host_seconds(marks)
    assert fake_cuda.syncs == 1  # the anchor
    assert placed == pytest.approx(times, abs=1e-3) and placed == sorted(placed)


# ---------------------------------------------------------------- a pipeline on either clock


def _pipeline(stages: int, accumulate: int, fake: bool):
    parts = [_stage(stages, s, False, "mean") for s in range(stages)]
    if fake:
        for stage in parts:  # CPU tensors, CUDA clocks: the timing path of a GPU run
            stage.clock = CudaClock("cuda:0")
            stage.reset_stats()
    pipe = local_pipeline(parts, "paci", accumulate, lambda b: b[0])
    return pipe


def _feed(pipe, data) -> None:
    for j, batch in enumerate(data):
        pipe.feed(batch, j)
    pipe.drain()


def test_host_clock_pipeline_times_are_consistent():
    pipe = _pipeline(2, 2, fake=False)
    pipe.record_timeline(True)
    _feed(pipe, _data(6))
    for st in pipe.stage_stats():
        assert 0 < st["busy_seconds"] <= st["elapsed_seconds"]
        assert st["forward_seconds"] > 0 and st["backward_seconds"] > 0 and st["step_seconds"] > 0
    # One process runs the stages in turn: their busy times add up to at most the span.
    stats = pipe.stage_stats()
    assert sum(st["busy_seconds"] for st in stats) <= max(st["elapsed_seconds"] for st in stats)
    timeline = pipe.timeline
    assert timeline is not None and [a for a, _, _ in timeline][:2] == ["1F0", "1B0"]
    assert all(start <= end for _, start, end in timeline)
    assert [s for _, s, _ in timeline] == sorted(s for _, s, _ in timeline)


def test_cuda_clock_pipeline_records_events_per_action_and_resolves_them_when_read(fake_cuda):
    """The stages and runtimes record their events as they run, never wait, and resolve at the read."""
    pipe = _pipeline(2, 2, fake=True)
    pipe.record_timeline(True)
    _feed(pipe, _data(6))
    stages = [rt.stage for rt in pipe.runtimes]
    actions = [st.stats.forwards + st.stats.backwards + st.stats.steps for st in stages]
    assert actions == [6 + 6 + 3, 6 + 6 + 3]
    # Each stage action left its (start, end) pair pending: recorded per action, not resolved.
    assert [st.stats.times.pending for st in stages] == actions
    # 2 events per stage action, 1-2 per runtime action, 2 per receive: recorded as they ran.
    assert len(fake_cuda.recorded) >= sum(4 * a for a in actions)
    assert fake_cuda.syncs == 0, "a host sync on the hot path"
    stats = pipe.stage_stats()  # the monitor's read, at its logging interval
    assert 1 <= fake_cuda.syncs <= 2 * len(stages)  # at most a wait per stage and per runtime read
    assert [st.stats.times.pending for st in stages] == [0, 0]
    for st in stats:
        assert 0 < st["busy_seconds"] <= st["elapsed_seconds"] and st["wait_seconds"] >= 0
    timeline = pipe.timeline
    assert timeline is not None and len(timeline) == actions[1]
    assert all(isinstance(t, float) and start <= end for _, start, end in timeline for t in (start, end))


# ---------------------------------------------------------------- host syncs per optimizer step


def _count_host_reads(monkeypatch) -> list[str]:
    """Record every read of a tensor's value into Python made from lit_efficient's code (the host syncs of
    a CUDA run; on CPU the same calls, free), as ``module.function`` of the caller."""
    reads: list[str] = []

    def counting(name: str):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith("lit_efficient"):
                reads.append(f"{module}.{caller.f_code.co_name}")
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("tolist", "item", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    return reads


@pytest.mark.parametrize("schedule", ["paci", "1f1b_flush"])
def test_one_host_read_per_optimizer_step_and_none_per_micro_batch(monkeypatch, schedule):
    """The stage's only host sync is the NaN decision of `_check_finite`, once per local optimizer step."""
    parts = [_stage(2, s, False, "tokens") for s in range(2)]
    pipe = local_pipeline(parts, schedule, 2, lambda b: b[0])
    data = _data(6)  # its sampling reads tensors: before counting
    reads = _count_host_reads(monkeypatch)
    for j, batch in enumerate(data[:2]):  # one window: the first stage's step waits for its last backward
        pipe.feed(batch, j)
    after_window = len(reads)
    for j, batch in enumerate(data[2:], start=2):
        pipe.feed(batch, j)
    pipe.drain()
    steps = sum(rt.stage.stats.steps for rt in pipe.runtimes)
    assert steps == 2 * 3
    assert reads == ["lit_efficient.runtime.stage._check_finite"] * steps, reads
    assert after_window <= 2  # at most the two steps of window 0 so far: nothing per micro-batch


def test_a_stage_reset_keeps_its_clock(fake_cuda):
    stage = PipelineStage([torch.nn.Identity()], 0, 2, None, device="cpu")
    stage.clock = CudaClock("cuda:0")
    stage.reset_stats()
    assert stage.stats.times.clock is stage.clock


# ---------------------------------------------------------------- the monitor, whole pipeline in one process


def test_monitor_in_one_process_logs_and_draws_every_stage(tmp_path):
    """devices=1 with S=2: a row and a timeline per stage (not only the stage the strategy reports)."""
    import csv
    import json

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lit_efficient import PACIStrategy, PipelineMonitor
    from lit_efficient.callbacks.pipeline_monitor import TIMELINE_JSON
    from lit_efficient.runtime.actions import Action
    from tests.support.modules import token_dataset as _tokens

    L.seed_everything(0)
    from lit_efficient.models import GPT

    model = GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16, max_steps=4)
    logger = CSVLogger(tmp_path, name="local")
    monitor = PipelineMonitor(logging_interval=2, timeline=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=2, sync_start_steps=0), max_steps=6,
        logger=logger,
        accumulate_grad_batches=2, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[monitor],
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(_tokens(48, 16), batch_size=4))
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("pipeline/utilization_stage0")]
    assert [int(r["step"]) for r in rows] == [1, 3, 5]  # windows 2, 4, 6 at their train_loss rows (global_step - 1)
    for row in rows:
        for s in (0, 1):
            assert 0 < float(row[f"pipeline/utilization_stage{s}"]) <= 1
        assert float(row["pipeline/drift_max_stage0"]) == 1 and float(row["pipeline/drift_max_stage1"]) == 0
    trace = json.loads((Path(logger.log_dir) / TIMELINE_JSON).read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["tid"], Action.parse(e["name"]).kind) for e in spans} == {
        (s, k) for s in (0, 1) for k in ("F", "B", "STEP")
    }
