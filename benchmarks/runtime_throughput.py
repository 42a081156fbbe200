"""Pipeline runtime throughput: PACI against 1F1B-flush on a 2-stage real-compute pipeline (CPU, gloo).

What is measured, and how:

- Two spawned processes, one stage each, one intra-op thread each, talking over gloo (file://
  rendezvous in a temporary directory); the demo byte-level transformer split uniformly
  (embedding + 2 blocks | 2 blocks + head + loss), driven by the real `PipelineRuntime`.
- For every N, the two schedules run in alternating segments in the SAME process pair
  (A B B A A B ...), after one discarded segment each. A segment feeds ``warm`` windows of N
  micro-batches, then ``windows`` timed windows, then drains. Throughput is measured on the last
  stage between the end of the warm windows and the end of the last timed window (end of that
  stage's optimizer step), so it is the steady state: PACI's one-time fill and drain are outside
  the timed span, flush's per-window fill and drain are inside it, which is what (N+S-1)/N
  compares. The reported ratio is the median over rounds of PACI/flush measured in adjacent
  segments, so slow drift of a shared machine cancels.
- The machine is shared (2 cores, other people's tests): each round waits (a bounded time) for
  the machine to look idle, and every segment records the foreign load, i.e. the CPU that other
  processes used during it (/proc/stat busy time minus this benchmark's processes, in cores).
  Rounds whose two segments both saw under 0.15 cores of foreign load are "quiet"; their median
  ratio is reported next to the all-rounds one. Each stage's forward/backward also records its
  thread's CPU time: wall time above CPU time is time the stage waited for a core.
- Per stage, forward / backward / optimizer-step time per micro-batch (stage timers) and
  utilization (`runtime.stats()`, busy / elapsed over the timed windows). The simulator
  (`lit_efficient.tools.simulate`) is fed those measured wall-clock costs (per-segment
  medians, the mean of the two schedules' medians) plus the one-way transfer latency of an
  activation, measured by a ping-pong through the same `PointToPoint` between idle processes,
  and predicts the same timed span for the same micro-batch count.
- Activation memory per stage: the peak bytes of distinct tensor storages that autograd keeps
  for backward (`torch.autograd.graph.saved_tensors_hooks`, parameters excluded), in a separate,
  untimed segment per schedule. It does not count in-flight outputs held only by the stage,
  optimizer state or allocator slack; `ru_maxrss` (process-lifetime, both schedules) is in the
  JSON for context only.

Also the shared harness of `benchmarks.emulated_pipeline`: spawning, segments, interleaving, the
simulator's prediction of a timed span, and the per-N summary (machine description: `benchmarks.harness`).

    python -m benchmarks.runtime_throughput            # full run: ~3 min on a quiet 2-core machine,
                                                       # up to ~12 min when each round waits 15 s
    python -m benchmarks.runtime_throughput --quick    # smoke run, ~30-50 s
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks.harness import PLOTS, machine, pyplot, save_figure, write_json
from lit_efficient.runtime.interpreter import PipelineRuntime
from lit_efficient.runtime.partition import partition_uniform, stage_bounds
from lit_efficient.runtime.schedules import ScheduleName
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.topology import Topology
from lit_efficient.tools.corpus import embedded_corpus
from lit_efficient.tools.demo import batches, build_layers, lm_loss
from lit_efficient.tools.simulate import simulate
from lit_efficient.transport.process import PointToPoint
from tests.support.multiproc import spawn as run_ranks
from tests.support.multiproc import values

QUIET = 0.15  # a round is "quiet" when other processes used under this many cores during both segments
SCHEDULE_PAIR: tuple[ScheduleName, ScheduleName] = ("1f1b_flush", "paci")

# -- processes -------------------------------------------------------------------------------------


def spawn(worker: Callable[..., Any], world: int, config: dict[str, Any], timeout: float) -> list[Any]:
    """Run ``worker(rank, world, config)`` on ``world`` gloo ranks (tests/support/multiproc.py's harness, one
    thread per rank); their return values, rank 0 first, or an error with every rank's traceback."""
    return values(run_ranks(worker, world, config, timeout=timeout))


# -- one rank --------------------------------------------------------------------------------------


class TimedStage(PipelineStage):
    """A `PipelineStage` that splits its busy time into forward, backward and step (same code path)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reset_timers()

    def reset_timers(self) -> None:
        """Start the per-kind clocks afresh: [wall seconds, this thread's CPU seconds, calls]."""
        self.timers = {kind: [0.0, 0.0, 0] for kind in ("forward", "backward", "step")}

    def per_call(self) -> dict[str, float]:
        """Mean wall seconds of one forward / backward / step since `reset_timers`, and CPU seconds (``*_cpu``).

        Wall above CPU means the stage's thread was waiting for a core (another process had it).
        """
        out = {}
        for kind, (wall, cpu, count) in self.timers.items():
            out[kind] = wall / count if count else 0.0
            out[f"{kind}_cpu"] = cpu / count if count else 0.0
        return out

    def _timed(self, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        timer = self.timers[kind]
        timer[0] += time.perf_counter() - start
        timer[1] += time.thread_time() - cpu
        timer[2] += 1
        return out

    # Pass-through signatures: the timing must not depend on PipelineStage's argument lists.
    def forward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102 - PipelineStage.forward, timed
        return self._timed("forward", super().forward, *args, **kwargs)

    def backward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102 - PipelineStage.backward, timed
        return self._timed("backward", super().backward, *args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102 - PipelineStage.step, timed
        return self._timed("step", super().step, *args, **kwargs)


class SavedTensorMeter:
    """Live and peak bytes of distinct storages autograd saves for backward (parameters excluded).

    Every saved tensor is wrapped in a small holder whose release (when its graph is freed after
    backward) decrements a per-storage reference count, so views of one buffer count once.
    """

    def __init__(self, exclude: Sequence[Tensor]) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def reset_peak(self) -> None:
        """Measure the peak from now on."""
        self.peak = self.current

    def _pack(self, t: Tensor) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._exclude or storage.nbytes() == 0:
            return t
        entry = self._live.get(ptr)
        if entry is None:
            self._live[ptr] = [1, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        return _Held(t.detach(), ptr, self)  # detached: holding the output itself would tie it to its own graph

    @staticmethod
    def _unpack(held: Any) -> Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[ptr]


class _Held:
    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, tensor: Tensor, ptr: int, meter: SavedTensorMeter) -> None:
        self.tensor, self.ptr, self.meter = tensor, ptr, meter

    def __del__(self) -> None:
        self.meter._release(self.ptr)


@dataclass
class RankSetup:
    """What one rank needs to run segments: its stage, transfers, neighbours and data."""

    stage: TimedStage
    comm: PointToPoint | None
    prev_rank: int | None
    next_rank: int | None
    input_fn: Callable[[Any], Any]
    data: list[Any]


def link_latency(setup: RankSetup, forward: tuple[Tensor, ...], backward: tuple[Tensor, ...], iters: int) -> float:
    """One-way latency of an activation/gradient transfer on the link to the next stage (ping-pong).

    Links are measured one after another while the other ranks wait; returns NaN on the last stage.
    This is the latency of an idle pair of processes: the simulator's ``comm``.
    """
    stage, num_stages = setup.stage.stage, setup.stage.num_stages
    latency = math.nan
    for link in range(num_stages - 1):
        if stage == link:
            trips = []
            for i in range(iters + 3):
                start = time.perf_counter()
                setup.comm.send(forward, setup.next_rank, i, "ping")
                setup.comm.recv(setup.next_rank, i, "pong")
                trips.append(time.perf_counter() - start)
            # Median: robust to a round trip that another process on the machine delayed. The first
            # round trips set up the connection's buffers and are not counted.
            latency = statistics.median(trips[3:]) / 2
        elif stage == link + 1:
            for i in range(iters + 3):
                setup.comm.recv(setup.prev_rank, i, "ping")
                setup.comm.send(backward, setup.prev_rank, i, "pong")
        if setup.comm is not None:
            setup.comm.flush()
    return latency


def run_segment(
    setup: RankSetup, schedule: ScheduleName, accumulate: int, warm: int, windows: int, meter: SavedTensorMeter | None
) -> dict[str, Any]:
    """Feed ``warm`` + ``windows`` windows of micro-batches through a fresh runtime, then drain.

    Returns the times at the end of each timed window (and of the warm-up) on this rank, the
    runtime's stats over the timed windows (taken before the drain), per-call stage costs, and
    the saved-tensor peak when a meter is given.
    """
    runtime = PipelineRuntime(
        setup.stage, schedule, accumulate, setup.input_fn, setup.comm, setup.prev_rank, setup.next_rank
    )
    data = itertools.cycle(setup.data)
    index = 0
    for _ in range(warm * accumulate):
        runtime.feed(next(data), index)
        index += 1
    runtime.reset_stats()
    setup.stage.reset_timers()
    if meter is not None:
        meter.reset_peak()
    machine_before, cpu_before, thread_before = machine_cpu_seconds(), time.process_time(), time.thread_time()
    marks = [time.perf_counter()]
    for _ in range(windows):
        for _ in range(accumulate):
            runtime.feed(next(data), index)
            index += 1
        marks.append(time.perf_counter())
    cpu, thread_cpu = time.process_time() - cpu_before, time.thread_time() - thread_before
    machine_busy = [b - a for a, b in zip(machine_before, machine_cpu_seconds(), strict=True)]
    stats = runtime.stats()  # before the drain: the timed windows only
    costs = setup.stage.per_call()
    runtime.drain()
    out = {
        "schedule": schedule,
        "marks": [m - marks[0] for m in marks],
        "stats": stats,
        "costs": costs,
        "cpu_seconds": cpu,  # this process, all threads (compute, gloo I/O), over the timed span
        "main_thread_cpu_seconds": thread_cpu,  # the thread running the runtime; the rest is gloo's threads
        "machine_busy_seconds": machine_busy[0],  # every process on the machine, same span
        "machine_steal_seconds": machine_busy[1],
    }
    if meter is not None:
        out["saved_peak_bytes"] = meter.peak
    return out


def machine_cpu_seconds() -> tuple[float, float]:
    """CPU seconds spent so far by everything on the machine (busy, stolen by the hypervisor); /proc/stat.

    The benchmark runs on shared machines: busy CPU minus the benchmark's own processes is the
    foreign load that competed with it, reported per segment. Resolution one clock tick (10 ms).
    """
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return (math.nan, math.nan)
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return ((user + nice + system + irq + softirq) / tick, steal / tick)


def wait_for_quiet(max_wait: float, threshold: float = QUIET) -> float:
    """Hold every rank until the machine's busy CPU over 0.5 s is under ``threshold`` cores (or ``max_wait``).

    Global rank 0 polls /proc/stat while the others block in a barrier (they use no CPU), so what
    it sees is other people's work. Returns the last load seen on rank 0 (NaN elsewhere).
    """
    load = math.nan
    if dist.get_rank() == 0 and max_wait > 0:
        deadline = time.monotonic() + max_wait
        while True:
            before = machine_cpu_seconds()[0]
            time.sleep(0.5)
            load = (machine_cpu_seconds()[0] - before) / 0.5
            if load < threshold or time.monotonic() > deadline:
                break
    dist.barrier()
    return load


def interleaved(
    setup: RankSetup, accumulate: int, rounds: int, warm: int, windows: int, quiet_wait: float
) -> list[dict[str, Any]]:
    """One discarded segment per schedule, then ``rounds`` rounds in A B / B A order.

    Each round starts once the machine looks quiet (at most ``quiet_wait`` seconds of waiting).
    """
    for schedule in SCHEDULE_PAIR:
        run_segment(setup, schedule, accumulate, warm, 1, None)
    segments = []
    for r in range(rounds):
        wait_for_quiet(quiet_wait)
        order = SCHEDULE_PAIR if r % 2 == 0 else SCHEDULE_PAIR[::-1]
        for schedule in order:
            segment = run_segment(setup, schedule, accumulate, warm, windows, None)
            segment["round"] = r
            segments.append(segment)
    return segments


def memory_segments(setup: RankSetup, accumulate: int, warm: int) -> dict[str, int]:
    """Saved-for-backward peak of each schedule over two windows after warm-up (untimed)."""
    params = list(setup.stage.parameters())
    out = {}
    for schedule in SCHEDULE_PAIR:
        with SavedTensorMeter(params) as meter:
            out[schedule] = run_segment(setup, schedule, accumulate, warm, 2, meter)["saved_peak_bytes"]
    return out


# -- analysis (parent process) ---------------------------------------------------------------------


def simulated_span(
    schedule: ScheduleName,
    num_stages: int,
    accumulate: int,
    warm: int,
    windows: int,
    costs: list[dict[str, float]],
    comm: float,
) -> float:
    """The simulator's duration of the timed span of `run_segment` (last stage, end of step to end of step)."""
    result = simulate(
        schedule,
        num_stages,
        accumulate,
        (warm + windows) * accumulate,
        forward=[c["forward"] for c in costs],
        backward=[c["backward"] for c in costs],
        comm=comm,
        step=[c["step"] for c in costs],
    )
    ends = {s.action.index: s.end for s in result.timeline if s.stage == num_stages - 1 and s.action.kind == "STEP"}
    return ends[warm + windows - 1] - ends[warm - 1]


def summarize(
    per_rank: list[dict[str, Any]], num_stages: int, accumulate: int, warm: int, windows: int, items: int
) -> dict[str, Any]:
    """Throughput, ratios, simulator prediction, utilization and memory for one N from every rank's segments.

    ``per_rank[r]`` holds rank r's ``segments`` (same order on every rank), ``stage`` and
    ``latency``; ``items`` is what one micro-batch counts as (tokens, or 1).
    """
    by_stage = sorted(per_rank, key=lambda r: r["stage"])
    last = by_stage[-1]
    rate: dict[str, list[float]] = {s: [] for s in SCHEDULE_PAIR}
    foreign: dict[str, list[float]] = {s: [] for s in SCHEDULE_PAIR}
    rounds: dict[int, dict[str, tuple[float, float]]] = {}
    raw: list[dict[str, Any]] = []
    for k, seg in enumerate(last["segments"]):
        span = seg["marks"][-1]
        value = windows * accumulate * items / span
        # Cores' worth of CPU used by other processes during the span (ranks' spans coincide to ~1 action).
        load = (seg["machine_busy_seconds"] - sum(r["segments"][k]["cpu_seconds"] for r in by_stage)) / span
        rate[seg["schedule"]].append(value)
        foreign[seg["schedule"]].append(load)
        raw.append(
            {
                "round": seg["round"],
                "schedule": seg["schedule"],
                "span_seconds": span,
                "rate": value,
                "foreign_load_cores": load,
                "steal_cores": seg["machine_steal_seconds"] / span,
                # Per stage: CPU of the runtime's thread and of the process's other (gloo) threads, per micro-batch.
                "main_thread_cpu_ms_per_mb": [
                    1e3 * r["segments"][k]["main_thread_cpu_seconds"] / (windows * accumulate) for r in by_stage
                ],
                "other_threads_cpu_ms_per_mb": [
                    1e3
                    * (r["segments"][k]["cpu_seconds"] - r["segments"][k]["main_thread_cpu_seconds"])
                    / (windows * accumulate)
                    for r in by_stage
                ],
                "utilization": [r["segments"][k]["stats"]["utilization"] for r in by_stage],
                "costs_ms": [{c: 1e3 * v for c, v in r["segments"][k]["costs"].items()} for r in by_stage],
            }
        )
        rounds.setdefault(seg["round"], {})[seg["schedule"]] = (value, load)
    paired = [r["paci"][0] / r["1f1b_flush"][0] for r in rounds.values()]
    round_loads = [(r["paci"][1] + r["1f1b_flush"][1]) / 2 for r in rounds.values()]
    quiet = [
        r["paci"][0] / r["1f1b_flush"][0] for r in rounds.values() if max(r["paci"][1], r["1f1b_flush"][1]) < QUIET
    ]
    costs: dict[str, list[dict[str, float]]] = {}
    util: dict[str, list[float]] = {}
    for schedule in SCHEDULE_PAIR:
        costs[schedule] = [_median_costs(r["segments"], schedule) for r in by_stage]
        util[schedule] = [
            statistics.median(s["stats"]["utilization"] for s in r["segments"] if s["schedule"] == schedule)
            for r in by_stage
        ]
    pooled = [{k: (a[k] + b[k]) / 2 for k in a} for a, b in zip(costs["1f1b_flush"], costs["paci"], strict=True)]
    latencies = [r["latency"] for r in by_stage if not math.isnan(r["latency"])]
    comm = statistics.fmean(latencies) if latencies else 0.0
    sim = {s: simulated_span(s, num_stages, accumulate, warm, windows, pooled, comm) for s in SCHEDULE_PAIR}
    sim_free = {s: simulated_span(s, num_stages, accumulate, warm, windows, pooled, 0.0) for s in SCHEDULE_PAIR}
    out = {
        "N": accumulate,
        "S": num_stages,
        "rate": {s: statistics.median(v) for s, v in rate.items()},
        "rate_all": rate,
        "ratio_measured": statistics.median(paired),
        "ratio_rounds": paired,
        "foreign_load_rounds": round_loads,  # mean of the round's two segments, cores
        "ratio_quiet": statistics.median(quiet) if quiet else math.nan,
        "quiet_rounds": len(quiet),
        "foreign_load_cores": foreign,
        "segments": raw,
        "ratio_simulated": sim["1f1b_flush"] / sim["paci"],
        "ratio_simulated_free_comm": sim_free["1f1b_flush"] / sim_free["paci"],
        "ratio_ideal": (accumulate + num_stages - 1) / accumulate,
        "rate_simulated": {s: windows * accumulate * items / v for s, v in sim.items()},
        "utilization": util,
        "costs": costs,
        "comm_latency": comm,
        "wait_seconds": {
            s: [
                statistics.median(x["stats"]["wait_seconds"] for x in r["segments"] if x["schedule"] == s)
                for r in by_stage
            ]
            for s in SCHEDULE_PAIR
        },
    }
    if all("memory" in r for r in by_stage):
        out["saved_peak_bytes"] = {s: [r["memory"][s] for r in by_stage] for s in SCHEDULE_PAIR}
    return out


def summarize_all(
    ranks: list[dict[str, Any]],
    stages: int,
    accumulate: Sequence[int],
    plan: dict[int, tuple[int, int]],
    items: int,
) -> list[dict[str, Any]]:
    """`summarize` for every N in ``accumulate``, in order, from the ranks' results of one process group.

    ``ranks[r]`` holds rank r's ``stage``, ``latency`` and ``per_n[N]`` (its ``segments``, and
    optionally ``memory``); ``plan[N]`` is (warm windows, timed windows). Each row also gets them.
    """
    rows = []
    for n in accumulate:
        warm, windows = plan[n]
        per_rank = [{"stage": r["stage"], "latency": r["latency"], **r["per_n"][n]} for r in ranks]
        rows.append(summarize(per_rank, stages, n, warm, windows, items) | {"warm": warm, "windows": windows})
    return rows


def _median_costs(segments: list[dict[str, Any]], schedule: str) -> dict[str, float]:
    # Medians, not means: one segment slowed by another process must not move the simulator's input.
    mine = [s["costs"] for s in segments if s["schedule"] == schedule]
    return {k: statistics.median(c[k] for c in mine) for k in mine[0]}


def fmt_pair(values: Sequence[float], scale: float = 1.0, spec: str = ".0f") -> str:
    """Per-stage values joined with ' / ', stage 0 first."""
    return " / ".join(format(v * scale, spec) for v in values)


def plot_ratios(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """Left: measured, simulated and ideal PACI/flush per configuration. Right: every round's ratio
    over the ideal against the foreign load it ran under (what makes a shared machine miss theory).
    """
    plt = pyplot()
    series = [
        ("ratio_measured", "measured, all rounds"),
        ("ratio_quiet", "measured, quiet rounds"),
        ("ratio_simulated", "simulator"),
        ("ratio_ideal", "ideal (N+S-1)/N"),
    ]
    width = 0.8 / len(series)
    fig, (ax, scatter) = plt.subplots(
        1, 2, figsize=(max(4.5, 1.3 * len(rows) + 1.5) + 4.0, 3.8), gridspec_kw={"width_ratios": [1.6, 1]}
    )
    for k, (key, name) in enumerate(series):
        offsets = [i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(offsets, [r[key] for r in rows], width, label=name)
    ax.set_xticks(range(len(rows)), [f"S={r['S']}\nN={r['N']}" for r in rows])
    ax.set_ylabel("PACI / 1F1B-flush throughput")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    finite = [r[key] for r in rows for key, _ in series if math.isfinite(r[key])]
    ax.set_ylim(min(0.8, min(finite) - 0.05), max(finite) + 0.1)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    for r in rows:
        scatter.scatter(
            r["foreign_load_rounds"],
            [x / r["ratio_ideal"] for x in r["ratio_rounds"]],
            s=14,
            label=f"S={r['S']} N={r['N']}",
        )
    scatter.axhline(1.0, color="grey", linewidth=0.8)
    scatter.axhline(0.95, color="grey", linewidth=0.8, linestyle="--")
    scatter.set_xlim(left=-0.05)
    scatter.set_xlabel("foreign load during the round (cores of 2)")
    scatter.set_ylabel("measured ratio / ideal, per round")
    scatter.legend(fontsize=7)
    save_figure(fig, path, 120)


# -- the real-compute benchmark ---------------------------------------------------------------------


def _worker(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    topo = Topology.for_world(world, world)
    s = topo.stage_of(rank)
    layers = build_layers(config["layers"], config["dim"], config["heads"], config["block"], 0.0, config["seed"])
    lo, hi = stage_bounds(partition_uniform(len(layers), world))[s]
    mine = layers[lo:hi]
    optimizer = torch.optim.AdamW([p for layer in mine for p in layer.parameters()], lr=1e-3, weight_decay=0.0)
    stage = TimedStage(mine, s, world, optimizer, loss_fn=lm_loss)
    comm = PointToPoint(s, topo.stage_of, torch.device("cpu"), timeout=120.0)
    prev_rank, next_rank = topo.neighbours(rank)
    stream = batches(embedded_corpus(2_000_000), config["block"], config["batch_size"], config["seed"])
    data = list(itertools.islice(stream, 64))
    setup = RankSetup(stage, comm, prev_rank, next_rank, lambda b: b[0], data)
    act = torch.randn(config["batch_size"], config["block"], config["dim"])
    latency = link_latency(setup, (act,), (act, torch.ones((), dtype=torch.float64)), iters=30)
    per_n = {}
    for n in config["accumulate"]:
        warm, windows = config["plan"][n]
        per_n[n] = {
            "segments": interleaved(setup, n, config["rounds"], warm, windows, config["quiet_wait"]),
            "memory": memory_segments(setup, n, warm),
        }
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"stage": s, "layers": [lo, hi], "latency": latency, "per_n": per_n, "ru_maxrss_kib": usage.ru_maxrss}


def plan(accumulate: int, num_stages: int, timed_microbatches: int) -> tuple[int, int]:
    """(warm windows, timed windows): at least 2S warm micro-batches, about ``timed_microbatches`` timed."""
    warm = max(1, math.ceil(2 * num_stages / accumulate))
    return warm, max(1, round(timed_microbatches / accumulate))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, fewer micro-batches")
    p.add_argument("--accumulate", type=int, nargs="+", default=[2, 4, 8], help="values of N")
    p.add_argument("--rounds", type=int, default=8, help="flush/PACI segment pairs per N")
    p.add_argument("--timed-microbatches", type=int, default=32, help="micro-batches timed per segment")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (2 per stage)")
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=128, help="sequence length")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet-wait", type=float, default=15.0, help="max seconds to wait for a quiet machine per round")
    p.add_argument("--out", default="runtime_throughput.json", help="file name under benchmarks/results/")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the markdown table, write the JSON (and the plot)."""
    args = parse_args(argv)
    if args.quick:
        args.rounds, args.timed_microbatches, args.quiet_wait = 2, 16, 0.0
    stages = 2
    torch.manual_seed(args.seed)
    config = vars(args) | {"plan": {n: plan(n, stages, args.timed_microbatches) for n in args.accumulate}}
    before = machine()
    start = time.perf_counter()
    ranks = spawn(_worker, stages, config, timeout=1800)
    wall = time.perf_counter() - start
    items = args.batch_size * args.block
    rows = summarize_all(ranks, stages, args.accumulate, config["plan"], items)
    result = {
        "benchmark": "runtime_throughput",
        "command": "python -m benchmarks.runtime_throughput " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": before | {"loadavg_after": os.getloadavg()},
        "config": {k: v for k, v in config.items() if k != "plan"}
        | {"plan": config["plan"], "tokens_per_microbatch": items},
        "stage_layers": {r["stage"]: r["layers"] for r in ranks},
        "ru_maxrss_kib_per_stage": {r["stage"]: r["ru_maxrss_kib"] for r in ranks},
        "wall_seconds": wall,
        "rows": rows,
    }
    print(table(rows))
    print(f"\nwall time {wall:.0f} s; machine {before['nproc']} x {before['cpu']}, torch {before['torch']}")
    path = write_json(args.out, result)
    print(f"wrote {path}")
    if not args.no_plot:
        plot_ratios(rows, f"S=2 real compute, {before['nproc']} CPU cores", PLOTS / "runtime_throughput.png")
    return result


def ratio_cells(r: dict[str, Any]) -> str:
    """Table cells shared by both benchmarks: measured (all and quiet rounds), simulator, ideal, foreign load."""
    rounds = r["ratio_rounds"]
    quiet = (
        f"{r['ratio_quiet']:.3f} ({r['quiet_rounds']}/{len(rounds)})" if r["quiet_rounds"] else f"- (0/{len(rounds)})"
    )
    load = [statistics.median(r["foreign_load_cores"][s]) for s in SCHEDULE_PAIR]
    return (
        f"| {r['ratio_measured']:.3f} ({min(rounds):.3f}-{max(rounds):.3f}) | **{quiet}** "
        f"| {r['ratio_simulated']:.3f} | {r['ratio_ideal']:.3f} | {fmt_pair(load, 1, '.2f')} |"
    )


RATIO_HEADER = (
    "PACI/flush, all rounds: median (min-max) | PACI/flush, quiet rounds (count) | simulator | ideal (N+S-1)/N "
    "| foreign load, cores: flush / PACI |"
)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown tables of the real-compute runs: throughput and ratios, then per-stage numbers."""
    lines = [f"| N | tokens/s flush | tokens/s PACI | {RATIO_HEADER}", "|---" * 8 + "|"]
    for r in rows:
        lines.append(f"| {r['N']} | {r['rate']['1f1b_flush']:.0f} | {r['rate']['paci']:.0f} " + ratio_cells(r))
    lines += [
        "",
        "| N | F / B / step wall ms (F+B CPU share), s0 | same, s1 | utilization s0 / s1, flush | same, PACI "
        "| saved-activation peak MiB s0 / s1, flush | same, PACI |",
        "|---" * 7 + "|",
    ]
    for r in rows:
        pooled = [
            {k: (a[k] + b[k]) / 2 for k in a} for a, b in zip(r["costs"]["1f1b_flush"], r["costs"]["paci"], strict=True)
        ]
        cost = [
            fmt_pair([c["forward"], c["backward"], c["step"]], 1e3, ".1f")
            + f" (CPU {(c['forward_cpu'] + c['backward_cpu']) / (c['forward'] + c['backward']):.0%})"
            for c in pooled
        ]
        mem = r.get("saved_peak_bytes", {s: [math.nan, math.nan] for s in SCHEDULE_PAIR})
        lines.append(
            f"| {r['N']} | {cost[0]} | {cost[1]} "
            f"| {fmt_pair(r['utilization']['1f1b_flush'], 100)} % | {fmt_pair(r['utilization']['paci'], 100)} % "
            f"| {fmt_pair(mem['1f1b_flush'], 2**-20, '.1f')} | {fmt_pair(mem['paci'], 2**-20, '.1f')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
