"""EMULATED deep pipelines: PACI against 1F1B-flush at S = 4 and 8 stages on a 2-core CPU machine.

EMULATION. A 2-core machine cannot run 4 or 8 real-compute stages side by side, so each stage's
compute is an emulated device: one layer whose forward sleeps ``forward_ms`` and whose backward
(a custom `torch.autograd.Function`) sleeps ``backward_ms``. Everything else is real: S spawned
processes, the real `PipelineStage` / `PipelineRuntime` / `PointToPoint` code path with autograd,
an optimizer step per window, and gloo transfers of a realistic activation (and its gradient)
between neighbouring stages. What this measures is therefore the schedule and the runtime's
overhead (Python, transfers, the OS waking S processes on 2 cores), not arithmetic throughput.

Method (shared with `benchmarks.runtime_throughput`): per S one process group; per N the two
schedules alternate in segments (A B B A ...) after a discarded segment each; throughput is
micro-batches per second on the last stage over the timed windows (steady state: PACI's one-time
fill/drain outside, flush's per-window fill/drain inside); the ratio is the median over rounds of
PACI/flush from adjacent segments. The simulator gets the measured per-stage forward / backward /
step times and the measured one-way transfer latency.

    python -m benchmarks.emulated_pipeline            # full run, ~3.5 minutes (at most ~5 with waits)
    python -m benchmarks.emulated_pipeline --quick    # smoke run, ~1 minute
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.harness import PLOTS, machine, write_json
from benchmarks.runtime_throughput import (
    RATIO_HEADER,
    RankSetup,
    TimedStage,
    fmt_pair,
    interleaved,
    link_latency,
    plan,
    plot_ratios,
    ratio_cells,
    spawn,
    summarize_all,
)
from lit_efficient.runtime.topology import Topology
from lit_efficient.transport.process import PointToPoint


class _SleepFunction(torch.autograd.Function):
    """Identity on the activation whose forward and backward take a fixed wall time (no CPU)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, forward_s: float, backward_s: float) -> Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()  # a fresh output, as a real layer makes (one memcpy of the activation)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, grad.new_zeros(()), None, None


class EmulatedDevice(nn.Module):
    """A stage's compute, emulated: sleeps ``forward_s`` in forward and ``backward_s`` in backward.

    Args:
        forward_s: Seconds one micro-batch's forward takes.
        backward_s: Seconds one micro-batch's backward takes.
    """

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        if forward_s < 0 or backward_s < 0:
            raise ValueError(f"forward_s={forward_s} and backward_s={backward_s} must be >= 0 seconds")
        self.forward_s, self.backward_s = forward_s, backward_s
        # One parameter, so the output requires grad on the first stage and the optimizer steps.
        self.weight = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        return _SleepFunction.apply(x, self.weight, self.forward_s, self.backward_s)


def _loss(output: Tensor, batch: Any) -> Tensor:
    return output.mean()


def _worker(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    topo = Topology.for_world(world, world)
    s = topo.stage_of(rank)
    device = EmulatedDevice(config["forward_ms"] / 1e3, config["backward_ms"] / 1e3)
    optimizer = torch.optim.SGD(device.parameters(), lr=0.0)
    stage = TimedStage([device], s, world, optimizer, loss_fn=_loss)
    comm = PointToPoint(s, topo.stage_of, torch.device("cpu"), timeout=120.0)
    prev_rank, next_rank = topo.neighbours(rank)
    torch.manual_seed(config["seed"])
    act = torch.randn(*config["activation"])
    setup = RankSetup(stage, comm, prev_rank, next_rank, lambda b: b, [act])
    latency = link_latency(setup, (act,), (act, torch.ones((), dtype=torch.float64)), iters=20)
    per_n = {}
    for n in config["accumulate"]:
        warm, windows = config["plan"][n]
        per_n[n] = {"segments": interleaved(setup, n, config["rounds"], warm, windows, config["quiet_wait"])}
    return {"stage": s, "latency": latency, "per_n": per_n}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, fewer micro-batches")
    p.add_argument("--stages", type=int, nargs="+", default=[4, 8], help="values of S")
    p.add_argument("--accumulate", type=int, nargs="+", default=[4, 8, 16], help="values of N")
    p.add_argument("--rounds", type=int, default=4, help="flush/PACI segment pairs per (S, N)")
    p.add_argument("--timed-microbatches", type=int, default=24, help="micro-batches timed per segment")
    p.add_argument("--forward-ms", type=float, default=10.0, help="emulated forward time per micro-batch")
    p.add_argument("--backward-ms", type=float, default=20.0, help="emulated backward time per micro-batch")
    p.add_argument("--activation", type=int, nargs=3, default=[8, 128, 256], help="transferred fp32 tensor shape")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet-wait", type=float, default=3.0, help="max seconds to wait for a quiet machine per round")
    p.add_argument("--out", default="emulated_pipeline.json", help="file name under benchmarks/results/")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the emulated benchmark, print the markdown table, write the JSON (and the plot)."""
    args = parse_args(argv)
    if args.quick:
        args.rounds, args.timed_microbatches, args.quiet_wait = 2, 16, 0.0
    before = machine()
    start = time.perf_counter()
    rows = []
    for stages in args.stages:
        config = vars(args) | {"plan": {n: plan(n, stages, args.timed_microbatches) for n in args.accumulate}}
        ranks = spawn(_worker, stages, config, timeout=1800)
        rows += summarize_all(ranks, stages, args.accumulate, config["plan"], 1)
    wall = time.perf_counter() - start
    result = {
        "benchmark": "emulated_pipeline",
        "emulation": "stage compute is time.sleep (forward/backward), not real layers; processes and gloo are real",
        "command": "python -m benchmarks.emulated_pipeline " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": before | {"loadavg_after": os.getloadavg()},
        "config": vars(args),
        "wall_seconds": wall,
        "rows": rows,
    }
    print(table(rows))
    print(f"\nwall time {wall:.0f} s; machine {before['nproc']} x {before['cpu']}, torch {before['torch']}")
    path = write_json(args.out, result)
    print(f"wrote {path}")
    if not args.no_plot:
        title = f"EMULATED compute ({args.forward_ms:g}/{args.backward_ms:g} ms), {before['nproc']} CPU cores"
        plot_ratios(rows, title, PLOTS / "emulated_pipeline.png")
    return result


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the emulated runs."""
    lines = [
        f"| S | N | mb/s flush | mb/s PACI | {RATIO_HEADER} mean utilization flush / PACI |",
        "|---" * 10 + "|",
    ]
    for r in rows:
        util = [sum(r["utilization"][s]) / r["S"] for s in ("1f1b_flush", "paci")]
        lines.append(
            f"| {r['S']} | {r['N']} | {r['rate']['1f1b_flush']:.1f} | {r['rate']['paci']:.1f} "
            + ratio_cells(r)
            + f" {fmt_pair(util, 100)} % |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
