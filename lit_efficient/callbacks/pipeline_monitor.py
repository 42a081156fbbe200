"""The `PipelineMonitor` callback: utilization, bubble, weight-version drift, throughput, memory, timeline.

This file owns what the monitor measures on each rank, the one collective that brings every rank's
numbers to global rank 0 every ``logging_interval`` optimizer steps, how rank 0 combines them into
metrics, and the timeline picture (a Gantt PNG and a Chrome-trace JSON of forward / backward /
optimizer step per stage). It measures nothing itself inside the pipeline: the numbers come from
`PipelineRuntime.stats` (busy time inside a stage's compute, weight-version drift) and the runtime's action
timeline; the monitor resets the runtime's stats at the start of training and after every logged interval, so
each logged value covers one interval: on each rank, from the previous log's gather to this log point.

Every time is taken on the device's clock (`lit_efficient.runtime.clock`): host time on CPU, CUDA
events on a GPU, where host time around asynchronous kernels would measure their launch. The events
are recorded per action without waiting and read only here, at the logging interval (one host sync
per interval, beside the gather's), and once per fit for the timeline.

Metric keys (logged from global rank 0 through ``trainer.loggers``, at the step Lightning logs the same window's
``train_loss`` at, ``trainer.global_step - 1``):

- ``pipeline/utilization_stage{s}``: the share of the interval stage s spent computing (busy / the interval, one
  time base for every stage of a rank, so the idle time before a stage's first action counts: 1F1B-flush's bubble
  reads its schedule's (S-1)/(N+S-1), plus Lightning's time between micro-batches, at any ``logging_interval``),
  averaged over its replicas; training's time alone (validation inside fit and, under PACIStrategy, which times
  them, checkpoint saves are left out of it, as is their time from the throughputs' wall);
- ``pipeline/bubble_fraction``: 1 - the mean of the devices' busy shares: with a stage per process, 1 - the mean of
  the stages' utilizations; with the whole pipeline in one process, the share of the interval that device idled
  (its stages take turns: their utilizations add up to at most 1);
- ``pipeline/drift_max_stage{s}``: the largest weight-version drift at stage s (max over replicas);
- ``pipeline/drift_mean``: drift averaged over every backward every rank ran in the interval (stage s's
  backwards lag the last stage's window end by up to S-1-s micro-batches, and an epoch's last interval holds its
  drain: an interval's mean is not one window's; over a run it is the schedule's mean drift);
- ``pipeline/skipped_steps``: optimizer steps skipped as non-finite (``on_nonfinite="skip"``) since the fit started,
  every stage skipping the same ones (a rise on the chart is where they were);
- ``throughput/tokens_per_sec``, ``throughput/samples_per_sec``: over rank 0's wall time of the
  interval, counted across data-parallel replicas (the first interval holds the first micro-batch's one-time
  costs, allocation and warm-up: it reads low). Tokens are the ``numel`` of the batch's first
  tensor (the input ids of a ``(x, y)`` batch), samples its first dimension;
- ``memory/peak_bytes_stage{s}`` on GPU: CUDA ``max_memory_allocated`` of stage s's processes (max over
  replicas) since training started (reset at train start), not per interval; on CPU the metric is
  ``memory/peak_rss_bytes_stage{s}``, the process's peak resident set size since the process started
  (interpreter and libraries included), named so on the chart as it is not the same quantity.

- with ``grad_norm=True``, ``grad/norm``: the whole model's gradient 2-norm at the interval's last optimizer step,
  before clipping, as Lightning's ``grad_norm(module, 2)`` in ``on_before_optimizer_step`` gives it on one device
  (a hook PACIStrategy never runs): reduced over the replicas and normalized by the window, a tied weight counted
  once; and under PACIStrategy ``grad/norm_stage{s}``, stage s's share, whose squares sum to the whole's square.
  Under 1F1B-flush every stage's last step is the same window's, and ``grad/norm`` equals one device's; under PACI
  stage s's last step may be up to ceil((S-1-s)/N) windows older than the last stage's at a window's end. Under
  LocalSGD/DiLoCo, whose replicas step on their own gradients, the replicas' root mean square.

Under a strategy without a pipeline (single device, DDP) only throughput, memory (``stage0``) and ``grad/norm``
apply.
With the whole pipeline in one process (``Trainer(devices=1)``) every stage has its row and its timeline,
as S ranks would; utilization there is each stage's share of that device's time (they take turns), the bubble
fraction the device's idle share, and every stage's memory key holds that device's peak.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_efficient.checks import check_flags, is_count
from lit_efficient.runtime.actions import Action
from lit_efficient.runtime.clock import Clock, Mark, clock_for
from lit_efficient.runtime.host import StageHost
from lit_efficient.runtime.tied import squared_grad_norm
from lit_efficient.strategy.paci import PACIStrategy
from lit_efficient.strategy.runs import free_path, run_dir
from lit_efficient.strategy.trainer_glue import first_tensor

# The timeline records a bounded window: _TIMELINE_STEPS optimizer steps from the first window end at
# or after step _TIMELINE_START (a resumed fit: its first window end). Skipping the first window leaves
# out one-time costs (allocator warm-up, first kernel launches); a few steps show the schedule's
# pattern while keeping memory bounded (one tuple per action).
_TIMELINE_START = 1
_TIMELINE_STEPS = 4
TIMELINE_PNG = "pipeline_timeline.png"
TIMELINE_JSON = "pipeline_timeline.json"
# What a rank keeps of its timeline window until fit ends: per stage it runs (None: the rank's own stage)
# its actions as (action, start, end) in perf_counter seconds.
_Recorded = list[tuple[int | None, list[tuple[str, float, float]]]]
_COLORS = {"F": "#4C72B0", "B": "#55A868", "STEP": "#C44E52"}
_LABELS = {"F": "forward", "B": "backward", "STEP": "optimizer step"}


class Row(NamedTuple):
    """One rank's numbers for one interval: one row of the gathered tensor."""

    stage: int
    replica: int
    pipeline: bool
    busy: float
    elapsed: float
    drift_max: float
    drift_sum: float
    backwards: float
    tokens: float
    samples: float
    peak_bytes: float
    grad_sq: float = math.nan  # the squared gradient norm of the stage's last step (grad_norm=True; NaN: not measured)
    sum_replicas: bool = False  # grad_sq is the stage's share of this replica (a sharded optimizer state's chunk)
    skipped: float = 0.0  # optimizer steps the stage skipped as non-finite since the fit started
    host: float = math.nan  # the global rank holding the stage: rows of one rank share its device's time (NaN: alone)


class TimelineEvent(NamedTuple):
    """One executed action of one rank, in seconds on a clock shared by all ranks."""

    stage: int
    replica: int
    action: str
    start: float
    end: float


class PipelineMonitor(Callback):
    """Logs pipeline utilization, bubble, drift, throughput and peak memory; optionally draws the timeline.

    Every ``logging_interval`` optimizer steps (a window end: the same batch on every rank) each rank
    contributes a few numbers to one small all-gather, and global rank 0 logs the combined metrics.
    With ``timeline=True`` the runtime records every action for a few optimizer steps after the first;
    rank 0 then writes ``pipeline_timeline.png`` (Gantt chart per stage) and ``pipeline_timeline.json``
    (Chrome trace, opens in Perfetto) into ``trainer.log_dir`` (or ``default_root_dir``) and logs the
    picture to W&B when a ``WandbLogger`` is attached; with W&B, whose ``log_dir`` is the ``save_dir``
    every run shares, they go to the run's own ``<save_dir>/<project>/<run id>/``, beside its checkpoints.

    Args:
        logging_interval: Optimizer steps between two logged values (each covers its interval).
        timeline: Record a bounded window of the pipeline's actions and write the timeline files.
        grad_norm: Also log the gradient norm before clipping (``grad/norm``; under PACIStrategy also
            ``grad/norm_stage{s}`` per stage), at each interval's last optimizer step: what Lightning's ``grad_norm``
            in ``on_before_optimizer_step`` shows on one device, a hook PACIStrategy never runs. On one device and
            under DDP too; not under FSDP or DeepSpeed (sharded gradients: said). Costs one pass over each stage's
            gradients per optimizer step (as norm clipping does).
    """

    def __init__(self, logging_interval: int = 50, timeline: bool = False, grad_norm: bool = False) -> None:
        super().__init__()
        if not is_count(logging_interval):
            raise ValueError(
                f"logging_interval={logging_interval!r} must be an integer >= 1 (optimizer steps between logs)"
            )
        check_flags("PipelineMonitor", timeline=timeline, grad_norm=grad_norm)
        self.logging_interval = logging_interval
        self.timeline = timeline
        self.grad_norm = grad_norm
        self._measures_module = False  # on_before_optimizer_step measures (no pipeline; set at each fit's start)
        # Each measured stage's squared gradient norm at its last optimizer step, on its device (read at the log).
        self._grad_sq: dict[int, torch.Tensor] = {}
        self.timeline_paths: list[Path] = []  # files written (rank 0), for the caller
        self._tokens = 0
        self._samples = 0
        self._clock: Clock | None = None  # the root device's (see _device_clock)
        self._clock_device: torch.device | None = None
        self._interval_start: Mark | None = None
        self._last_step = -1
        self._logged_step = -1
        self._logging = True  # whether rank 0 has a logger for the rows (decided at each fit's start)
        self._recording = False
        self._stop_step = 0
        # Time inside the current interval that is not training: validation inside fit (here) and checkpoint saves
        # (`PACIStrategy.pause_spans`), as (start, end) marks of the root device's clock. None outside fit.
        self._pauses: list[tuple[Mark, Mark]] | None = None
        self._validation_start: Mark | None = None
        self._timeline_done = False
        self._recorded: _Recorded | None = None  # this rank's window, until fit ends

    # -- hooks -------------------------------------------------------------------------------------

    def check_before_launch(self, trainer: Trainer, layers_may_come_later: bool) -> None:
        """`setup`'s refusal in the launching process: PACIStrategy calls it before any rank starts (after the
        launch it came in every rank's traceback)."""
        self.setup(trainer, trainer.lightning_module, "fit")

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        monitors = [cb for cb in trainer.callbacks if isinstance(cb, PipelineMonitor)]
        if len(monitors) > 1:
            # Each resets the pipeline's shared counters when it logs: the other's rows would cover part of its
            # interval, or read zeros, under the same keys and steps.
            raise ValueError(
                f"{len(monitors)} PipelineMonitor callbacks on one Trainer: they share the pipeline's counters, and "
                "each one's rows would read the other's resets. Keep one (one from a config file and one from code "
                "add up to two); its logging_interval sets how often it logs."
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        runtime = _runtime(trainer)
        if runtime is not None:
            runtime.reset_stats()  # measure training only (not profiling or a sanity check)
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self._tokens = self._samples = 0
        clock = self._device_clock(trainer)
        self._interval_start, self._pauses = clock.mark(), []
        # Rank 0's loggers decide for every rank (the gather below is collective; another rank may have none).
        self._logging = bool(trainer.strategy.broadcast(bool(trainer.loggers)))
        if isinstance(trainer.strategy, PACIStrategy) and self._logging:
            trainer.strategy.pause_spans = []  # the strategy times its saves from here to on_train_end
        self._last_step = self._logged_step = trainer.global_step
        self._grad_sq = {}
        if self.grad_norm and runtime is not None:
            for rt in runtime.runtimes:
                rt.stage.measure_gradients = functools.partial(self._measure, rt.stage.stage, rt.stage.device)
        self._measures_module = self.grad_norm and runtime is None and _whole_gradients(trainer.strategy)
        if self.grad_norm and runtime is None and not self._measures_module:
            rank_zero_warn(
                f"PipelineMonitor(grad_norm=True) measures the gradient norm under PACIStrategy, on one device and "
                f"under DDP; {type(trainer.strategy).__name__} shards the gradients, so grad/norm is not logged. Use "
                "its own gradient-norm tools, or set grad_norm=False."
            )
        self._timeline_done = not self.timeline
        self._recording, self._recorded = False, None
        if not self._logging:
            rank_zero_warn(
                "PipelineMonitor: the Trainer has no logger (logger=False), so its metrics (utilization, bubble, "
                "drift, throughput, memory) go nowhere and are not computed"
                + (", only the timeline files are written" if self.timeline else "")
                + ". Give the Trainer a logger (CSVLogger needs nothing installed), or remove the callback."
            )
        if self.timeline and runtime is None:
            rank_zero_warn(
                f"PipelineMonitor(timeline=True) draws a pipeline's actions; {type(trainer.strategy).__name__} runs "
                "none. Use PACIStrategy, or set timeline=False."
            )
            self._timeline_done = True

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        tokens, samples = _tokens_and_samples(batch)  # shapes only: no host sync
        self._tokens += tokens
        self._samples += samples
        step = trainer.global_step
        if step == self._last_step:
            return  # inside a window
        self._last_step = step
        runtime = _runtime(trainer)
        if not self._timeline_done:
            if not self._recording and step >= _TIMELINE_START:
                self._start_recording(runtime, step)
            elif self._recording and step >= self._stop_step:
                self._stop_recording(runtime)
        if step % self.logging_interval == 0 and self._logging:
            self._log(trainer, runtime)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # Without a pipeline (one device, DDP): Lightning's own hook, where its grad_norm reads the gradients. Under
        # PACIStrategy it never runs; the stages measure theirs in their steps (`_measure`).
        if self._measures_module:
            self._measure(0, trainer.strategy.root_device, list(pl_module.parameters()))

    def _measure(self, stage: int, device: torch.device, params: list[torch.nn.Parameter] | None) -> None:
        # None: the step was skipped (a non-finite window): no norm of this step, not the one before it.
        if params is None:
            self._grad_sq[stage] = torch.full((1,), math.nan, device=device)
        else:
            self._grad_sq[stage] = squared_grad_norm(params, device)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validation_start = self._device_clock(trainer).mark()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Validation inside fit: keep it out of the interval's training time (``trainer.training`` is False while
        # it runs: Lightning's stage is then VALIDATING; the sanity check runs before the interval starts).
        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        if fitting and self._pauses is not None and self._validation_start is not None:
            self._pauses.append((self._validation_start, self._device_clock(trainer).mark()))
        self._validation_start = None

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Every rank runs this hook, so the collectives below match. Log the unlogged tail of the run.
        runtime = _runtime(trainer)
        if self._recording:
            self._stop_recording(runtime)
        if trainer.global_step > self._logged_step and self._logging:
            self._log(trainer, runtime)
        if self._recorded is not None:
            self._write_timeline(trainer, self._recorded)
            self._recorded = None
        # Events are no state to keep (nor to pickle into a later fit's ranks): the next fit starts afresh.
        self._clock = self._interval_start = self._pauses = self._validation_start = None
        self._grad_sq = {}
        if isinstance(trainer.strategy, PACIStrategy):
            trainer.strategy.pause_spans = None
        if runtime is not None:
            for rt in runtime.runtimes:
                rt.stage.measure_gradients = None

    # -- metrics -----------------------------------------------------------------------------------

    def _log(self, trainer: Trainer, runtime: StageHost | None) -> None:
        # Host sync (CUDA), once per interval: reading the runtime's stats waits for the events recorded
        # since the last log. This rank's copy of the row to the device below would wait as well.
        assert self._interval_start is not None and self._pauses is not None  # set in on_train_start
        clock = self._device_clock(trainer)
        saves = trainer.strategy.pause_spans if isinstance(trainer.strategy, PACIStrategy) else None
        spans = self._pauses + (saves or [])
        if saves:
            saves.clear()
        pauses = _merged(clock.host_seconds([m for span in spans for m in span]))
        start, end = clock.host_seconds([self._interval_start, clock.mark()])  # this rank's interval, before the gather
        grad_sq = {stage: float(squared) for stage, squared in self._grad_sq.items()}  # a host sync on a GPU
        rows = _local_rows(trainer, runtime, self._tokens, self._samples, (start, end), pauses, grad_sq)
        device = trainer.strategy.root_device
        local = torch.tensor(rows, dtype=torch.float32 if device.type == "mps" else torch.float64, device=device)
        # Synchronization point every `logging_interval` optimizer steps: one all-gather of a few
        # floats per rank, at a window end (the same batch on every rank). Under PACI it stalls the
        # faster stages until the slowest reaches this batch; at one per interval (default 50 windows)
        # that costs far less than the bubble it measures. The `.tolist()` below is rank 0's host sync.
        gathered = trainer.strategy.all_gather(local) if trainer.world_size > 1 else local
        wall = clock.seconds(self._interval_start, clock.mark()) - sum(end - start for start, end in pauses)
        if trainer.is_global_zero:
            everyone = [Row(*r) for r in gathered.reshape(-1, len(Row._fields)).tolist()]
            metrics = aggregate(everyone, wall, memory_name(trainer.strategy.root_device))
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=_row_step(trainer))
        if runtime is not None:
            runtime.reset_stats()
        self._tokens = self._samples = 0
        self._interval_start, self._pauses = clock.mark(), []
        self._logged_step = trainer.global_step

    def _device_clock(self, trainer: Trainer) -> Clock:
        """The clock of the root device (CUDA events on a GPU), made once; validation hooks may need it
        before ``on_train_start`` (the sanity check)."""
        device = trainer.strategy.root_device
        if self._clock is None or self._clock_device != device:
            self._clock, self._clock_device = clock_for(device), device
        return self._clock

    # -- timeline ----------------------------------------------------------------------------------

    def _start_recording(self, runtime: StageHost | None, step: int) -> None:
        # _TIMELINE_STEPS windows from here, also when a resumed fit starts past _TIMELINE_START.
        if runtime is not None:
            runtime.record_timeline(True)
            self._recording, self._stop_step = True, step + _TIMELINE_STEPS

    def _stop_recording(self, runtime: StageHost | None) -> None:
        # Keep the window on this rank; gathering and drawing wait for the end of fit, so they neither
        # stall the pipeline nor land inside a measured interval.
        self._recording, self._timeline_done = False, True
        if runtime is not None:
            # On CUDA reading the timeline waits for its events: one host sync, once per fit.
            self._recorded = [(rt.stage.stage, list(rt.timeline or [])) for rt in runtime.runtimes]
            runtime.record_timeline(False)

    def _write_timeline(self, trainer: Trainer, local: _Recorded) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, PACIStrategy)
        mine = list(local)
        # Ranks on different hosts have different perf_counter origins: each reports its clock right
        # after a barrier, and rank 0 shifts every rank's events onto its own clock (skew: the
        # barrier's exit spread, well under one action). Two collectives, once per fit.
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            dist.barrier()
            payload = (strategy.replica, time.perf_counter(), mine)
            gathered: list[Any] | None = [None] * trainer.world_size if trainer.is_global_zero else None
            dist.gather_object(payload, gathered, dst=0)
        else:
            gathered = [(strategy.replica, time.perf_counter(), mine)]
        if not trainer.is_global_zero:
            return
        assert gathered is not None
        folder = run_dir(trainer)
        reference = gathered[0][1]
        events = [
            TimelineEvent(s, r, action, start + reference - now, end + reference - now)
            for r, now, per_stage in gathered
            for s, recorded in per_stage
            for action, start, end in recorded
        ]
        if not events:  # an empty trace and a blank picture, silently, for a run of one step (or fast_dev_run)
            rank_zero_warn(
                f"PipelineMonitor(timeline=True) recorded no action: it records from optimizer step {_TIMELINE_START} "
                f"on (the first window's one-time costs left out) and this run ended at step {trainer.global_step}. "
                f"Train at least {_TIMELINE_START + 1} optimizer steps for a timeline."
            )
            return
        folder.mkdir(parents=True, exist_ok=True)
        # A later fit into the same run (a resume) keeps the earlier timeline, as the CLI keeps the earlier config.
        png_path = free_path(folder / TIMELINE_PNG, also=(Path(TIMELINE_JSON).suffix,))
        json_path = png_path.with_suffix(Path(TIMELINE_JSON).suffix)
        json_path.write_text(json.dumps(chrome_trace(events)))
        draw_gantt(events, png_path)
        self.timeline_paths = [png_path, json_path]
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):  # it imports wandb only inside log_image
                logger.log_image(key="pipeline/timeline", images=[str(png_path)], step=_row_step(trainer))


# ------------------------------------------------------------------------ pure parts (unit-tested)


def memory_name(device: torch.device) -> str:
    """The memory metric's name says what it measures: the allocator's peak on CUDA, the process's peak resident
    set on CPU (the process's whole footprint since it started: interpreter, libraries, every stage it hosts)."""
    return "memory/peak_bytes" if device.type == "cuda" else "memory/peak_rss_bytes"


def aggregate(rows: Sequence[Row], wall_seconds: float, memory: str = "memory/peak_bytes") -> dict[str, float]:
    """Rank 0's metrics from every rank's `Row` of one interval of ``wall_seconds``."""
    stages = sorted({int(r.stage) for r in rows})
    by_stage = {s: [r for r in rows if int(r.stage) == s] for s in stages}
    metrics: dict[str, float] = {}
    if any(r.pipeline for r in rows):
        utilization = {}
        for s in stages:
            values = [r.busy / r.elapsed if r.elapsed > 0 else 0.0 for r in by_stage[s]]
            utilization[s] = sum(values) / len(values)
            metrics[f"pipeline/utilization_stage{s}"] = utilization[s]
            metrics[f"pipeline/drift_max_stage{s}"] = max(r.drift_max for r in by_stage[s])
        # Per device: the stages of one process take turns on it (the whole pipeline in one process: its idle share).
        devices: dict[float, list[Row]] = {}
        for i, r in enumerate(rows):
            devices.setdefault(-1.0 - i if math.isnan(r.host) else r.host, []).append(r)
        used = [min(1.0, sum(r.busy for r in held) / held[0].elapsed) if held[0].elapsed > 0 else 0.0
                for held in devices.values()]  # fmt: skip
        metrics["pipeline/bubble_fraction"] = 1.0 - sum(used) / len(used)
        backwards = sum(r.backwards for r in rows)
        metrics["pipeline/drift_mean"] = sum(r.drift_sum for r in rows) / backwards if backwards else 0.0
        metrics["pipeline/skipped_steps"] = max(r.skipped for r in rows)
    # Every stage of a replica sees the same micro-batches: count each replica once, at its first stage.
    first = by_stage[stages[0]] if stages else []
    per_sec = 1.0 / wall_seconds if wall_seconds > 0 else 0.0
    metrics["throughput/tokens_per_sec"] = sum(r.tokens for r in first) * per_sec
    metrics["throughput/samples_per_sec"] = sum(r.samples for r in first) * per_sec
    for s in stages:
        metrics[f"{memory}_stage{s}"] = max(r.peak_bytes for r in by_stage[s])
    # A stage's norm where each of its replicas measured one (under PACI stage 0 takes its first step ceil((S-1)/N)
    # windows late; a skipped window measures none); the whole model's where every stage has one. Replicas reduced
    # their gradients alike (their mean is each one's), hold their chunk of a sharded state (their sum is the
    # stage's), or under LocalSGD/DiLoCo step on their own (their root mean square).
    squares = {
        s: (sum if by_stage[s][0].sum_replicas else statistics.fmean)(r.grad_sq for r in by_stage[s])
        for s in stages
        if not any(math.isnan(r.grad_sq) for r in by_stage[s])
    }
    if any(r.pipeline for r in rows):
        metrics.update({f"grad/norm_stage{s}": math.sqrt(sq) for s, sq in squares.items()})
    if squares and len(squares) == len(stages):
        metrics["grad/norm"] = math.sqrt(sum(squares.values()))
    return metrics


def chrome_trace(events: Sequence[TimelineEvent]) -> dict[str, Any]:
    """Chrome-trace / Perfetto JSON of ``events``: one process per replica, one thread per stage, µs from 0."""
    origin = min((e.start for e in events), default=0.0)
    trace: list[dict[str, Any]] = []
    for replica in sorted({e.replica for e in events}):
        trace.append({"name": "process_name", "ph": "M", "pid": replica, "args": {"name": f"replica {replica}"}})
    for replica, stage in sorted({(e.replica, e.stage) for e in events}):
        name = {"name": f"stage {stage}"}
        trace.append({"name": "thread_name", "ph": "M", "pid": replica, "tid": stage, "args": name})
    for e in sorted(events, key=lambda e: e.start):
        kind = Action.parse(e.action).kind
        trace.append({
            "name": e.action, "cat": _LABELS[kind], "ph": "X", "ts": (e.start - origin) * 1e6,
            "dur": max(0.0, e.end - e.start) * 1e6, "pid": e.replica, "tid": e.stage,
        })  # fmt: skip
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def draw_gantt(events: Sequence[TimelineEvent], path: Path) -> list[str]:
    """A Gantt chart of ``events`` (one row per replica x stage, stage 0 on top) written to ``path`` (PNG); returns
    the labels written in the bars: the micro-batch of a forward or backward, ``s<k>`` on the k-th optimizer step
    (the Chrome trace names every action; the picture labels the bars wide enough to hold a number)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg: no display, no pyplot global state
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = sorted({(e.replica, e.stage) for e in events})
    origin = min((e.start for e in events), default=0.0)
    fig = Figure(figsize=(12, 1.0 + 0.5 * max(1, len(rows))), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for y, (replica, stage) in enumerate(rows):
        for kind, color in _COLORS.items():
            spans = [
                ((e.start - origin) * 1e3, max(0.0, e.end - e.start) * 1e3)
                for e in events
                if (e.replica, e.stage) == (replica, stage) and Action.parse(e.action).kind == kind
            ]
            if spans:
                ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=color)
    span = max((e.end for e in events), default=origin) - origin
    labels = []
    for e in events:
        if e.end - e.start < 0.012 * span:
            continue  # too narrow for a number at this width
        action = Action.parse(e.action)
        label = f"s{action.index}" if action.kind == "STEP" else str(action.index)
        y = rows.index((e.replica, e.stage))
        ax.text((e.start + e.end - 2 * origin) / 2 * 1e3, y, label, ha="center", va="center", fontsize=7, color="white")
        labels.append(label)
    replicas = {r for r, _ in rows}
    ax.set_yticks(range(len(rows)), [f"replica {r} stage {s}" if len(replicas) > 1 else f"stage {s}" for r, s in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms); in the bars: micro-batch, s<k> the k-th optimizer step")
    ax.set_title("pipeline timeline", loc="left")
    handles = [Patch(color=c, label=_LABELS[k]) for k, c in _COLORS.items()]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    return labels


# ------------------------------------------------------------------------ measurements of this rank


def _row_step(trainer: Trainer) -> int:
    """The logger step of the window that just ended: Lightning logs its ``train_loss`` and learning rates before it
    counts the window (``_batches_that_stepped``), at ``global_step - 1``, and the rows of a window share a step."""
    return max(0, trainer.global_step - 1)


def _whole_gradients(strategy: Any) -> bool:
    """Whether every rank holds the whole model's gradients at ``on_before_optimizer_step`` (one device, DDP), as
    the monitor's measure there assumes; FSDP and DeepSpeed hold a shard."""
    return isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) and not isinstance(strategy, DeepSpeedStrategy)


def _runtime(trainer: Trainer) -> StageHost | None:
    return trainer.strategy.runtime if isinstance(trainer.strategy, PACIStrategy) else None


def _local_rows(
    trainer: Trainer, runtime: StageHost | None, tokens: int, samples: int, interval: tuple[float, float],
    pauses: Sequence[tuple[float, float]], grad_sq: dict[int, float] | None = None,
) -> list[Row]:  # fmt: skip
    """This process's rows: one per hosted stage (one on a rank, every stage in one process). Each stage's busy
    time is taken over the rank's ``interval`` (from the last log's gather to this log point, on the host's
    ``perf_counter`` axis), every stage's over the same: a stage's own first-to-last action left out the time it
    waited before its first one (flush's last stage read utilization 1.0 at logging_interval=1, the bubble fraction
    half the schedule's; review). Training's alone: a stage's evaluation forwards are left out of its busy time, and
    the ``pauses`` (validation inside fit, saves; disjoint) out of the interval, as far as they lie inside it.
    ``grad_sq``: each measured stage's squared gradient norm at its last step."""
    peak = _peak_bytes(trainer.strategy.root_device)
    grad_sq = grad_sq or {}
    if runtime is None:
        measured = grad_sq.get(0, math.nan)
        return [Row(0, trainer.global_rank, False, 0.0, 0.0, 0.0, 0.0, 0.0, tokens, samples, peak, measured)]
    strategy = trainer.strategy
    assert isinstance(strategy, PACIStrategy)
    sharded = strategy.shard_optimizer_state and strategy.topology is not None and strategy.topology.num_replicas > 1
    elapsed = max(0.0, interval[1] - interval[0] - _seconds_inside(interval, pauses))
    rows = []
    for rt in runtime.runtimes:
        s = rt.stats()
        busy = s["busy_seconds"] - rt.stage.stats.evaluate_seconds
        rows.append(Row(
            rt.stage.stage, strategy.replica, True, busy, elapsed, s["drift_max"], rt.stage.stats.drift_sum,
            s["backwards"], tokens, samples, peak, grad_sq.get(rt.stage.stage, math.nan), sharded,
            rt.stage.skipped_windows, trainer.global_rank,
        ))  # fmt: skip
    return rows


def _merged(marks: Sequence[float]) -> list[tuple[float, float]]:
    """Consecutive (start, end) pairs of ``marks`` as disjoint spans (a save inside a validation counted once)."""
    spans: list[tuple[float, float]] = []
    for start, end in sorted(zip(marks[::2], marks[1::2], strict=True)):
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))
    return spans


def _seconds_inside(measured: tuple[float, float], pauses: Sequence[tuple[float, float]]) -> float:
    """Seconds of the disjoint ``pauses`` inside the ``measured`` range."""
    low, high = measured
    return sum(max(0.0, min(high, end) - max(low, start)) for start, end in pauses)


def _peak_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    try:
        import resource
    except ImportError:  # Windows: no getrusage
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def _tokens_and_samples(batch: Any) -> tuple[int, int]:
    """(tokens, samples) of a batch: numel and first dimension of its first tensor."""
    first = first_tensor(batch)
    return (0, 0) if first is None else (first.numel(), int(first.shape[0]))
