"""PipelineMonitor: its metric keys, its agreement with the simulator, and its timeline files."""

from __future__ import annotations

import csv
import json
import statistics
import time
import types
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lit_efficient import GradientAccumulation, PACIStrategy, PipelineMonitor
from lit_efficient.callbacks.pipeline_monitor import (
    TIMELINE_JSON,
    TIMELINE_PNG,
    Row,
    TimelineEvent,
    aggregate,
    chrome_trace,
    draw_gantt,
)
from lit_efficient.models import GPT
from lit_efficient.runtime.actions import Action
from lit_efficient.tools.simulate import simulate
from tests.support.modules import token_dataset as _tokens

PIPELINE_KEYS = {
    "pipeline/utilization_stage0", "pipeline/utilization_stage1", "pipeline/bubble_fraction",
    "pipeline/drift_max_stage0", "pipeline/drift_max_stage1", "pipeline/drift_mean", "pipeline/skipped_steps",
}  # fmt: skip
COMMON_KEYS = {"throughput/tokens_per_sec", "throughput/samples_per_sec", "memory/peak_bytes_stage0"}
# The pipeline run: 8 windows of 4 micro-batches of 8 x 128 tokens, ~80 ms of compute per stage and
# micro-batch, so that the fixed costs the simulator leaves out (Lightning between micro-batches,
# ~1 ms; jitter) stay a few percent.
MICRO_BATCHES, N, BLOCK, BATCH = 32, 4, 128, 8


def _metrics(log_dir: Path) -> list[dict[str, str]]:
    with open(log_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------- pure parts


def test_arguments_are_checked():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"logging_interval={bad!r} must be an integer >= 1"):
            PipelineMonitor(logging_interval=bad)
    with pytest.raises(ValueError, match=r"timeline='yes'\) must be True or False"):
        PipelineMonitor(timeline="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"grad_norm='false'\) must be True or False"):
        PipelineMonitor(grad_norm="false")  # type: ignore[arg-type]


def test_aggregate_averages_replicas_and_counts_each_replica_once():
    # 2 stages x 2 replicas. (stage, replica, pipeline, busy, elapsed, drift_max, drift_sum, backwards,
    # tokens, samples, peak_bytes)
    rows = [
        Row(1, 0, True, 9.0, 10.0, 0, 0, 8, 512, 8, 100),
        Row(0, 0, True, 8.0, 10.0, 1, 2, 8, 512, 8, 300),
        Row(1, 1, True, 7.0, 10.0, 0, 0, 8, 256, 4, 200),
        Row(0, 1, True, 6.0, 10.0, 1, 4, 8, 256, 4, 400),
    ]
    m = aggregate(rows, wall_seconds=2.0)
    assert set(m) == PIPELINE_KEYS | COMMON_KEYS | {"memory/peak_bytes_stage1"}
    assert m["pipeline/utilization_stage0"] == pytest.approx(0.7)
    assert m["pipeline/utilization_stage1"] == pytest.approx(0.8)
    assert m["pipeline/bubble_fraction"] == pytest.approx(0.25)
    assert (m["pipeline/drift_max_stage0"], m["pipeline/drift_max_stage1"]) == (1, 0)
    assert m["pipeline/drift_mean"] == pytest.approx(6 / 32)
    assert m["throughput/tokens_per_sec"] == pytest.approx(384.0)  # (512 + 256) / 2 s: stage 0 of each replica
    assert m["throughput/samples_per_sec"] == pytest.approx(6.0)
    assert (m["memory/peak_bytes_stage0"], m["memory/peak_bytes_stage1"]) == (400, 200)
    # The whole pipeline in one process (one host): its stages take turns on one device, over one interval. Each
    # stage's share of it, and the device's idle share as the bubble (1 - the mean of the shares was 0.65 here).
    one = aggregate([Row(s, 0, True, b, 10.0, 0, 0, 8, 512, 8, 100, host=0) for s, b in ((0, 4.0), (1, 3.0))], 2.0)
    assert (one["pipeline/utilization_stage0"], one["pipeline/utilization_stage1"]) == (0.4, 0.3)
    assert one["pipeline/bubble_fraction"] == pytest.approx(0.3)
    ddp = aggregate([Row(0, r, False, 0, 0, 0, 0, 0, 100, 2, 10 + r) for r in range(2)], wall_seconds=1.0)
    assert ddp == {"throughput/tokens_per_sec": 200, "throughput/samples_per_sec": 4, "memory/peak_bytes_stage0": 11}


def test_timeline_files_are_well_formed(tmp_path):
    events = [
        TimelineEvent(0, 0, "0F0", 10.000, 10.010),
        TimelineEvent(1, 0, "1F0", 10.011, 10.020),
        TimelineEvent(1, 0, "1B0", 10.020, 10.040),
        TimelineEvent(0, 0, "0B0", 10.041, 10.060),
        TimelineEvent(0, 0, "0STEP0", 10.060, 10.062),
    ]
    trace = json.loads(json.dumps(chrome_trace(events)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["0F0", "1F0", "1B0", "0B0", "0STEP0"]
    assert all({"name", "ph", "ts", "dur", "pid", "tid"} <= e.keys() for e in spans)
    assert spans[0]["ts"] == 0 and spans[2]["ts"] == pytest.approx(20_000) and spans[2]["dur"] == pytest.approx(20_000)
    assert {e["tid"] for e in spans} == {0, 1}
    path = tmp_path / "t.png"
    assert draw_gantt(events, path) == ["0", "0", "0", "0", "s0"]  # micro-batches and the step, as the trace
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_too_short_for_a_timeline_says_so_and_writes_none(tmp_path):
    """A run of one optimizer step (or fast_dev_run) wrote an empty trace and a blank picture, silently: recording
    starts after the first window."""
    model = GPT(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)
    monitor = PipelineMonitor(timeline=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=2), max_steps=1, accumulate_grad_batches=2,
        logger=CSVLogger(tmp_path), callbacks=[monitor], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"recorded no action: .* this run ended at step 1\. Train at least 2"):
        trainer.fit(model, DataLoader(_tokens(8, 16), batch_size=2))
    assert monitor.timeline_paths == [] and not list(tmp_path.rglob("pipeline_timeline.*"))


def test_two_monitors_on_one_trainer_are_refused(tmp_path, monkeypatch):
    """Two monitors (one from a config file, one from code) reset each other's counters: one's rows covered part of
    its interval, the other's read zeros, under the same keys, silently (a monitor audit)."""
    model = GPT(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=2), max_steps=2, logger=CSVLogger(tmp_path),
        callbacks=[PipelineMonitor(logging_interval=4), PipelineMonitor(logging_interval=1)],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"2 PipelineMonitor callbacks on one Trainer: they share the pipeline's "):
        trainer.fit(model, DataLoader(_tokens(8, 16), batch_size=2))
    # On processes, refused once in the launching process, before any rank starts (not in every rank's traceback).
    from lightning.pytorch.strategies.launchers import subprocess_script

    def no_rank(*args, **kwargs):
        raise AssertionError("rank 1 was started before the refusal")

    monkeypatch.setattr(subprocess_script.subprocess, "Popen", no_rank)
    two = [PipelineMonitor(), PipelineMonitor()]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PACIStrategy(pipeline_stages=2), max_steps=2,
                        logger=False, callbacks=two, default_root_dir=tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match=r"2 PipelineMonitor callbacks on one Trainer"):
        trainer.fit(model, DataLoader(_tokens(8, 16), batch_size=2))


def test_a_resumed_fit_into_the_same_run_keeps_the_earlier_timeline(tmp_path):
    """A resume into the same run folder overwrote the earlier fit's pipeline_timeline.png/.json (the CLI keeps its
    config as config-1.yaml): the second fit's pair is numbered instead."""

    def fit(steps: int, ckpt_path=None) -> L.Trainer:
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=2), max_steps=steps,
            accumulate_grad_batches=2, logger=CSVLogger(tmp_path, version=0),
            callbacks=[PipelineMonitor(timeline=True)], enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0,
        )  # fmt: skip
        model = GPT(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)
        trainer.fit(model, DataLoader(_tokens(24, 16), batch_size=2), ckpt_path=ckpt_path)
        return trainer

    first = fit(3)
    folder = tmp_path / "lightning_logs" / "version_0"
    kept = {p.name: p.read_bytes() for p in folder.glob("pipeline_timeline*")}
    assert kept.keys() == {TIMELINE_PNG, TIMELINE_JSON}
    fit(6, ckpt_path=first.checkpoint_callback.best_model_path)
    names = {p.name for p in folder.glob("pipeline_timeline*")}
    assert names == {TIMELINE_PNG, TIMELINE_JSON, "pipeline_timeline-1.png", "pipeline_timeline-1.json"}, names
    assert all((folder / name).read_bytes() == data for name, data in kept.items())


def test_without_a_logger_it_says_so_and_computes_nothing(tmp_path, monkeypatch):
    """With logger=False it gathered every rank's row each interval and dropped it, silently."""
    model = GPT(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)
    monkeypatch.setattr(PipelineMonitor, "_log", lambda *args: pytest.fail("computed a row no logger takes"))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=2), max_steps=3, logger=False,
        callbacks=[PipelineMonitor(logging_interval=1)], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"PipelineMonitor: the Trainer has no logger \(logger=False\).*CSVLogger"):
        trainer.fit(model, DataLoader(_tokens(8, 16), batch_size=2))
    assert trainer.global_step == 3


@pytest.mark.parametrize("rank_zero_logs", [True, False])
def test_whether_it_logs_is_rank_zeros_answer_on_every_rank(rank_zero_logs):
    """Its gather is collective: a rank without a logger beside a rank 0 with one (a user's rank-dependent logger)
    gathers too, and none does when rank 0 has none."""
    from types import SimpleNamespace

    strategy = SimpleNamespace(root_device=torch.device("cpu"), broadcast=lambda obj: rank_zero_logs)
    for own in ([], [object()]):  # this rank's loggers: no say
        monitor = PipelineMonitor()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            monitor.on_train_start(SimpleNamespace(global_step=0, strategy=strategy, loggers=own), None)
        assert monitor._logging is rank_zero_logs
        assert any("has no logger" in str(w.message) for w in caught) is not rank_zero_logs


# ---------------------------------------------------------------- single device (in-process)


def test_aggregate_combines_the_stages_gradient_norms_as_the_replicas_hold_them():
    def row(stage, replica, grad_sq, pipeline=True, sharded=False):
        return Row(stage, replica, pipeline, 1.0, 1.0, 0, 0, 1, 8, 1, 1, grad_sq, sharded)

    # Replicas that reduced their gradients hold the same (mean = each); under LocalSGD their root mean square.
    m = aggregate([row(1, 0, 9.0), row(0, 0, 16.0), row(1, 1, 9.0), row(0, 1, 4.0)], wall_seconds=1.0)
    assert (m["grad/norm_stage1"], m["grad/norm_stage0"]) == (3.0, pytest.approx(10.0**0.5))
    assert m["grad/norm"] == pytest.approx(19.0**0.5)
    # A sharded optimizer state: each replica holds its chunk of the stage's gradient, the stage's square their sum.
    sharded = aggregate([row(0, r, sq, sharded=True) for r, sq in enumerate((1.0, 3.0))], wall_seconds=1.0)
    assert sharded["grad/norm_stage0"] == sharded["grad/norm"] == 2.0
    ddp = aggregate([row(0, r, 4.0, pipeline=False) for r in range(2)], wall_seconds=1.0)
    assert ddp["grad/norm"] == 2.0 and not any(k.startswith("grad/norm_stage") for k in ddp)
    assert not any(k.startswith("grad/") for k in aggregate([row(0, 0, float("nan"))], wall_seconds=1.0))
    # A stage not measured yet (PACI's stage 0 steps late), or one replica's skipped window: no whole-model norm.
    late = aggregate([row(1, 0, 9.0), row(0, 0, float("nan"))], wall_seconds=1.0)
    assert late["grad/norm_stage1"] == 3.0 and "grad/norm_stage0" not in late and "grad/norm" not in late
    skipped = aggregate([row(0, 0, 4.0), row(0, 1, float("nan"))], wall_seconds=1.0)
    assert not any(k.startswith("grad/") for k in skipped)


def test_the_gradient_norm_is_measured_where_a_rank_holds_the_whole_gradients():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    from lit_efficient.callbacks.pipeline_monitor import _whole_gradients

    assert _whole_gradients(SingleDeviceStrategy(torch.device("cpu"))) and _whole_gradients(DDPStrategy())
    assert not _whole_gradients(FSDPStrategy())  # a shard: its squares would be averaged as replicas', not summed


def test_single_device_logs_throughput_and_memory(tmp_path):
    L.seed_everything(0)
    model = GPT(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16, max_steps=4)
    logger = CSVLogger(tmp_path, name="single")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=4, logger=logger, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        callbacks=[GradientAccumulation(2), PipelineMonitor(logging_interval=2, timeline=True)],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(_tokens(32, 16), batch_size=4))
    messages = [str(w.message) for w in caught]
    assert [m for m in messages if "timeline=True) draws a pipeline's actions" in m], messages
    rows = [r for r in _metrics(Path(logger.log_dir)) if r.get("throughput/tokens_per_sec")]
    # windows 2 and 4 on the step axis of their own train_loss rows (Lightning logs a window at global_step - 1)
    losses = [int(r["step"]) for r in _metrics(Path(logger.log_dir)) if r.get("train_loss")]
    assert [int(r["step"]) for r in rows] == [1, 3] and losses == [0, 1, 2, 3]
    for row in rows:
        assert not any(k.startswith("pipeline/") and row[k] for k in row)
        assert float(row["throughput/tokens_per_sec"]) == pytest.approx(16 * float(row["throughput/samples_per_sec"]))
        assert float(row["memory/peak_rss_bytes_stage0"]) > 1e6  # on CPU the name says resident set


def test_steps_skipped_as_non_finite_rise_on_the_chart_where_they_were(tmp_path):
    """on_nonfinite="skip" said its count only at the fit's end: on the chart nothing showed where the skipped windows
    were (the previous session's numerics audit left it out)."""
    from tests.strategy.test_reliability import _NaNLossAt

    poison = _NaNLossAt(4)  # micro-batch 4: the third window's first (N=2), optimizer step 3
    logger = CSVLogger(tmp_path, name="skip")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=5, accumulate_grad_batches=2, logger=logger, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=PACIStrategy(pipeline_stages=2, on_nonfinite="skip"),
        callbacks=[poison, PipelineMonitor(logging_interval=1)],
    )  # fmt: skip
    with pytest.warns(UserWarning, match="skipped 1 optimizer step"):
        trainer.fit(GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16), DataLoader(_tokens(40, 16)))
    rows = [r for r in _metrics(Path(logger.log_dir)) if r.get("pipeline/skipped_steps")]
    assert [(int(r["step"]), float(r["pipeline/skipped_steps"])) for r in rows] == [
        (0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0)
    ]  # fmt: skip


# ---------------------------------------------------------------- the pipeline (spawned)


class _Probe(L.Callback):
    """Test-side setup and measurements of the spawned pipeline run, one file per rank.

    - One thread per stage: two stages share the machine's two cores.
    - The point-to-point latency of one activation tensor (median of 10 ping-pongs before training),
      given to the simulator as its ``comm`` cost.
    - The runtime's whole-run stats at the last batch (this callback comes before the monitor, which
      resets them once it has logged), and the CPU time the training thread got meanwhile: compute is
      single-threaded, so CPU time well below busy time means the stage shared its core.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.stats: dict = {}
        self.latency = 0.0
        self.cpu_start = self.cpu = 0.0

    def setup(self, trainer, pl_module, stage) -> None:
        torch.set_num_threads(1)

    def on_train_start(self, trainer, pl_module) -> None:
        hp = pl_module.hparams
        activation = torch.zeros(BATCH, hp.block_size, hp.n_embd)
        peer, trips = 1 - trainer.global_rank, []
        for _ in range(10):
            start = time.perf_counter()
            first, second = (dist.send, dist.recv) if trainer.global_rank == 0 else (dist.recv, dist.send)
            first(activation, peer)
            second(activation, peer)
            trips.append(time.perf_counter() - start)
        self.latency = statistics.median(trips) / 2
        self.cpu_start = time.thread_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.stats = trainer.strategy.runtime.stats()
        self.cpu = time.thread_time() - self.cpu_start

    def on_train_end(self, trainer, pl_module) -> None:
        record = {**self.stats, "latency": self.latency, "cpu_seconds": self.cpu}
        Path(self.folder, f"stats{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.multiproc
@pytest.mark.alone  # its utilization is checked against the simulator: no other test on the cores
def test_pipeline_run_logs_every_key_matches_simulator_and_draws_timeline(tmp_path):
    """One spawned PACI run (2 balanced stages, N=4, M=32 micro-batches, one epoch) checks three things.

    Keys: every metric key is in the CSVLogger's metrics.csv. Timeline: the Chrome trace loads and
    holds forwards, backwards and steps of both stages; the PNG exists.

    Utilization: "measured utilization" is what the monitor logs, busy / the interval of each stage: busy is
    the time inside the stage's forward/backward/step compute, the interval is the rank's training time since
    the fit started (one log), so it also holds waiting for the neighbour, transfers and Lightning's work
    between two micro-batches. Logging once, at the last window (after the epoch-end drain), makes it
    cover the whole run, warm-up and drain included. The simulator gets this run's own costs: per
    stage, the mean duration of the actions that never wait (stage 0's forwards, stage 1's backwards,
    steps) from the recorded timeline, the other kind solved from the stage's measured busy time, and
    the measured point-to-point latency; its utilization is taken over its whole run (the makespan).
    Agreement within 10% says that the schedule runs as modelled and that what the model leaves out
    (Lightning between micro-batches, the runtime's bookkeeping, jitter) stays under a tenth.

    A balanced 2-stage PACI pipeline has no slack: a stage delayed by anything makes the other wait.
    On a machine whose two cores other processes share, every preemption becomes such a delay, so when
    a stage's thread got less than 90% of a core while it was not waiting the timing is inconclusive and
    the comparison is skipped, with the measurements in the reason (the other checks still run).
    """
    L.seed_everything(0)
    model = GPT(vocab_size=256, block_size=BLOCK, n_layer=4, n_head=4, n_embd=256, max_steps=100)
    logger = CSVLogger(tmp_path, name="paci")
    # PACI from the first step (no synchronous start): the monitor against the simulator's PACI.
    strategy = PACIStrategy(pipeline_stages=2, schedule="paci", sync_start_steps=0, start_method="forkserver")
    monitor = PipelineMonitor(logging_interval=MICRO_BATCHES // N, timeline=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=logger, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[_Probe(tmp_path), GradientAccumulation(N), monitor], log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(model, DataLoader(_tokens(MICRO_BATCHES * BATCH, BLOCK), batch_size=BATCH))
    log_dir = tmp_path / "paci" / "version_0"

    rows = [r for r in _metrics(log_dir) if r.get("pipeline/utilization_stage0")]
    assert len(rows) == 1 and int(rows[0]["step"]) == MICRO_BATCHES // N - 1  # the last window's train_loss step
    logged = {k: float(v) for k, v in rows[0].items() if v}
    on_cpu = {k.replace("peak_bytes", "peak_rss_bytes") for k in COMMON_KEYS | {"memory/peak_bytes_stage1"}}
    assert PIPELINE_KEYS | on_cpu <= logged.keys() and not any("memory/peak_bytes" in k for k in logged)
    assert logged["pipeline/drift_max_stage0"] == 1 and logged["pipeline/drift_max_stage1"] == 0
    assert logged["throughput/samples_per_sec"] > 0 and logged["memory/peak_rss_bytes_stage1"] > 1e6

    trace = json.loads((log_dir / TIMELINE_JSON).read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all({"name", "ph", "ts", "dur", "pid", "tid"} <= e.keys() for e in spans)
    assert {(e["tid"], Action.parse(e["name"]).kind) for e in spans} == {
        (s, k) for s in (0, 1) for k in ("F", "B", "STEP")
    }
    assert (log_dir / TIMELINE_PNG).stat().st_size > 1000

    stats = sorted((json.loads((tmp_path / f"stats{r}.json").read_text()) for r in range(2)), key=lambda x: x["stage"])
    costs = []
    for st in stats:
        s = st["stage"]
        mean = {
            k: statistics.mean(e["dur"] * 1e-6 for e in spans if e["tid"] == s and Action.parse(e["name"]).kind == k)
            for k in ("F", "B", "STEP")
        }
        known, unknown = ("F", "B") if s == 0 else ("B", "F")  # the first stage never waits in F, the last in B
        rest = st["busy_seconds"] - st["forwards"] * mean[known] - st["steps"] * mean["STEP"]
        costs.append({known: mean[known], unknown: rest / st["forwards"], "STEP": mean["STEP"]})
    sim = simulate(
        "paci", 2, N, MICRO_BATCHES, forward=[c["F"] for c in costs], backward=[c["B"] for c in costs],
        step=statistics.mean(c["STEP"] for c in costs), comm=statistics.mean(st["latency"] for st in stats),
    )  # fmt: skip
    makespan = max(x.end for x in sim.timeline) - min(x.start for x in sim.timeline)
    expected = [sim.busy[s] / makespan for s in (0, 1)]
    measured = [logged[f"pipeline/utilization_stage{s}"] for s in (0, 1)]
    # What the simulator leaves out, measured, as fractions of each stage's span: time outside the
    # runtime between two actions (Lightning) and time waiting for the neighbour.
    outside = [1 - sum(e["dur"] for e in spans if e["tid"] == s) / _span(spans, s) for s in (0, 1)]
    waiting = [st["wait_seconds"] / st["elapsed_seconds"] for st in stats]
    report = (
        f"measured {measured}, simulated {expected}, costs {costs}, latency {[st['latency'] for st in stats]}; "
        f"outside the runtime {outside}, waiting {waiting}"
    )
    # The core each stage's thread got while it had work (its span less its waits): a stage preempted in its compute
    # or in Lightning's work between two actions makes its neighbour wait, which the simulator does not model. (CPU
    # time against busy time alone missed the second: 99-102% in a CI run whose stages waited 9.4-9.8% of the span.)
    core_share = [st["cpu_seconds"] / (st["elapsed_seconds"] - st["wait_seconds"]) for st in stats]
    report += f"; CPU time / time not waiting of each stage's thread {core_share}"
    if min(core_share) < 0.9:
        pytest.skip(f"timing inconclusive, the stages shared their cores with other processes: {report}")
    # The 10%. Measured on a shared 2-core machine: -2% to -4% on both stages (4 runs); with
    # 64-token sequences -5% to -9%; before receives were posted ahead (comm.py), -8% to -11%.
    for s in (0, 1):
        assert abs(measured[s] - expected[s]) <= 0.10 * expected[s], report


def _span(spans: list[dict], stage: int) -> float:
    mine = [e for e in spans if e["tid"] == stage]
    return max(e["ts"] + e["dur"] for e in mine) - min(e["ts"] for e in mine)


class _RecordingRuntime:
    """Just what the monitor's timeline bookkeeping touches on the strategy's runtime (a `StageHost` hosting one
    stage, itself standing in for that stage's runtime)."""

    def __init__(self) -> None:
        self.timeline = None
        self.runtimes = [self]
        self.stage = types.SimpleNamespace(stage=0)

    def record_timeline(self, enabled: bool = True) -> None:
        self.timeline = [] if enabled else None

    def reset_stats(self) -> None:
        pass


@pytest.mark.parametrize("resumed_at", [0, 7])
def test_timeline_records_the_same_number_of_windows_after_a_resume(resumed_at, monkeypatch):
    """A fit resumed at step 7 records as many windows as a fresh one, starting after its first window."""
    from types import SimpleNamespace

    import lit_efficient.callbacks.pipeline_monitor as pm

    runtime = _RecordingRuntime()
    monkeypatch.setattr(pm, "_runtime", lambda trainer: runtime)
    strategy = SimpleNamespace(root_device=torch.device("cpu"), broadcast=lambda obj: obj)
    trainer = SimpleNamespace(global_step=resumed_at, strategy=strategy, loggers=[])
    monitor = PipelineMonitor(logging_interval=1000, timeline=True)
    monitor.on_train_start(trainer, None)
    recorded = []
    for step in range(resumed_at + 1, resumed_at + 10):
        trainer.global_step = step
        monitor.on_train_batch_end(trainer, None, None, torch.zeros(2, 3), 0)
        if runtime.timeline is not None:
            recorded.append(step)
    assert recorded == list(range(max(resumed_at + 1, 1), max(resumed_at + 1, 1) + 4)), recorded


def test_a_stages_row_leaves_validation_inside_fit_out(monkeypatch):
    """A rank's interval spans a validation inside fit, and a stage's busy time counts the evaluation forwards: both
    entered pipeline/utilization_stage{s} and the bubble fraction. The row keeps training's alone, over the rank's
    interval, the same for every stage it hosts."""
    from lit_efficient.callbacks import pipeline_monitor

    stage = types.SimpleNamespace(
        stage=0, stats=types.SimpleNamespace(drift_sum=0.0, evaluate_seconds=1.0), skipped_windows=0
    )
    stats = {"busy_seconds": 3.0, "elapsed_seconds": 5.0, "drift_max": 0.0, "backwards": 4}
    monkeypatch.setattr(pipeline_monitor, "PACIStrategy", types.SimpleNamespace)  # a stand-in strategy, set up
    strategy = types.SimpleNamespace(replica=0, root_device=torch.device("cpu"), shard_optimizer_state=False)
    trainer = types.SimpleNamespace(strategy=strategy, global_rank=3)
    runtime = types.SimpleNamespace(runtimes=[types.SimpleNamespace(stage=stage, stats=lambda: stats)])
    (row,) = pipeline_monitor._local_rows(trainer, runtime, 64, 4, (100.0, 110.0), pauses=[(103.0, 107.0)])
    # 3 s busy less 1 s of evaluation; the interval's 10 s less 4 s of validation (not the stage's own 5 s span)
    assert (row.busy, row.elapsed, row.host) == (2.0, 6.0, 3)
    # Only what lies inside the interval: a save after its end, or one straddling its start.
    (row,) = pipeline_monitor._local_rows(
        trainer, runtime, 64, 4, (100.0, 110.0), pauses=[(98.0, 101.0), (110.0, 115.0)]
    )
    assert row.elapsed == 9.0


def test_checkpoint_saves_inside_fit_are_left_out_of_the_stages_time(tmp_path, monkeypatch):
    """A save every optimizer step stalls every stage while it writes; the monitor counted that as bubble (a save per
    step took flush's bubble fraction from 0.20 to ~0.65 on 2 processes). The strategy times each save (weights-only
    ones too, which Lightning's callback hooks never see) for the monitor, whose rows leave out what of it falls
    inside a logged interval (the test above); the last step's saves come after the last logged interval."""
    from lit_efficient.callbacks import pipeline_monitor
    from lit_efficient.strategy import stage_checkpoints

    saves, pauses = [], []
    write, rows = stage_checkpoints.save, pipeline_monitor._local_rows

    def slow_write(*args, **kwargs):
        start = time.perf_counter()
        time.sleep(0.05)  # the writes and collectives of a save on processes
        out = write(*args, **kwargs)
        saves.append((start, time.perf_counter()))
        return out

    def seen_rows(trainer, runtime, tokens, samples, interval, paused, *rest):
        pauses.extend(paused)
        return rows(trainer, runtime, tokens, samples, interval, paused, *rest)

    monkeypatch.setattr(stage_checkpoints, "save", slow_write)
    monkeypatch.setattr(pipeline_monitor, "_local_rows", seen_rows)
    L.seed_everything(0)
    model = GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16, max_steps=100)
    logger = CSVLogger(tmp_path, name="saving")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"), max_steps=6,
        logger=logger, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        default_root_dir=tmp_path, val_check_interval=4, num_sanity_val_steps=0,
        callbacks=[
            GradientAccumulation(2), PipelineMonitor(logging_interval=3),
            L.pytorch.callbacks.ModelCheckpoint(every_n_train_steps=1, save_top_k=-1),
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=tmp_path / "weights", monitor="train_loss", every_n_train_steps=1, save_top_k=-1,
                save_weights_only=True,
            ),
        ],
    )  # fmt: skip
    data = DataLoader(_tokens(6 * 2 * 4, 16), batch_size=4)
    trainer.fit(model, data, DataLoader(_tokens(8, 16), batch_size=4))
    assert len(saves) == 12  # two saves per step, one of weights only
    inside = [any(p_start <= start and end <= p_end for p_start, p_end in pauses) for start, end in saves]
    assert inside == [True] * 10 + [False] * 2, (saves, pauses)
    bubbles = [r for r in _metrics(Path(logger.log_dir)) if r.get("pipeline/bubble_fraction")]
    assert len(bubbles) == 2
