"""Steady-state utilization against pipeline depth S and micro-batches per step N: simulator and measurements.

What is computed, and how:

- The simulator (`lit_efficient.tools.simulate`) runs the real schedule generators for S in
  {2, 4, 8, 16} and N in 1..32, forward 1, backward 2, free transfers, free optimizer step.
  Steady-state utilization is measured the way the benchmarks measure throughput: the extra
  makespan of ``extra`` windows after ``base`` windows (so PACI's one-time fill and drain cancel,
  flush's per-window fill and drain do not): ``extra * N * (f + b) / (makespan(base + extra) -
  makespan(base))``. Theory: flush N / (N + S - 1), PACI 1.
- Measured points on top: S=2, real compute, from ``results/trainer_vs_torch_pipelining.json``
  (the Trainer runs' runtime utilization, busy / elapsed per stage over the timed windows); S=4/8, emulated
  compute (sleep stages, real processes and gloo), from ``results/emulated_pipeline.json`` when it
  exists (micro-batches/s x (forward + backward) of the emulated stage). Both are read, not rerun.

    python -m benchmarks.scaling            # a few seconds
    python -m benchmarks.scaling --quick    # S in {2, 8}, fewer N
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import PLOTS, RESULTS, machine, pyplot, save_figure, write_json
from lit_efficient.tools.simulate import simulate

COLORS = {2: "tab:blue", 4: "tab:orange", 8: "tab:green", 16: "tab:red"}


def steady_utilization(schedule: str, stages: int, accumulate: int, base: int = 4, extra: int = 4) -> float:
    """Busy fraction of a stage in steady state, from the difference of two simulated makespans."""
    spans = [
        simulate(schedule, stages, accumulate, w * accumulate, forward=1.0, backward=2.0).makespan
        for w in (base, base + extra)
    ]
    return extra * accumulate * 3.0 / (spans[1] - spans[0])


def measured_points() -> list[dict[str, Any]]:
    """Utilization points from the other benchmarks' JSON results (missing files are skipped)."""
    points = []
    trainer = RESULTS / "trainer_vs_torch_pipelining.json"
    if trainer.exists():
        for row in json.loads(trainer.read_text())["rows"]:
            for variant, schedule in (("trainer_paci", "paci"), ("trainer_flush", "1f1b_flush")):
                # The runtime's own busy / elapsed per stage (mean of stages, median of rounds): both
                # terms come from the same segment, so it is less exposed to other processes than
                # throughput over a bound measured in other segments.
                util = row.get("runtime_utilization", {}).get(variant)
                if util is not None:
                    points.append(
                        {"S": 2, "N": row["N"], "schedule": schedule, "utilization": util, "source": "trainer (real)"}
                    )
    emulated = RESULTS / "emulated_pipeline.json"
    if emulated.exists():
        data = json.loads(emulated.read_text())
        cfg = data["config"]
        per_mb = (cfg["forward_ms"] + cfg["backward_ms"]) / 1e3
        for row in data["rows"]:
            for schedule, rate in row["rate"].items():
                points.append({
                    "S": row["S"], "N": row["N"], "schedule": schedule, "utilization": rate * per_mb,
                    "source": "emulated",
                })  # fmt: skip
    return points


def plot(grid: dict[str, Any], points: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, curve in grid.items():
        schedule, stages = key.split("/")
        stages = int(stages)
        ns = sorted(int(n) for n in curve)
        style = "-" if schedule == "paci" else "--"
        ax.plot(ns, [curve[str(n)] for n in ns], style, color=COLORS.get(stages), label=f"{schedule} S={stages} (sim)")
    for p in points:
        marker = "o" if p["schedule"] == "paci" else "x"
        face = COLORS.get(p["S"]) if p["source"] != "emulated" else "none"
        ax.scatter(p["N"], p["utilization"], marker=marker, s=45, color=COLORS.get(p["S"]), facecolors=face
                   if marker == "o" else None, zorder=3)  # fmt: skip
    ax.scatter([], [], marker="o", color="gray", label="measured PACI (filled: S=2 Trainer, hollow: emulated)")
    ax.scatter([], [], marker="x", color="gray", label="measured 1F1B-flush")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per optimizer step N")
    ax.set_ylabel("steady-state utilization (throughput / bubble-free bound)")
    ax.set_ylim(0, max([1.08] + [p["utilization"] + 0.05 for p in points]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    ax.set_title(title, fontsize=9)
    save_figure(fig, path, 110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="S in {2, 8}, N in {1, 2, 4, 8, 16, 32}")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--max-accumulate", type=int, default=32, help="N runs over 1..this")
    p.add_argument("--out", default="scaling.json", help="file name under benchmarks/results/")
    p.add_argument("--plot", default="scaling.png", help="file name under benchmarks/plots/")
    args = p.parse_args(argv)
    args.accumulate = list(range(1, args.max_accumulate + 1))
    if args.quick:
        args.stages, args.accumulate = [2, 8], [1, 2, 4, 8, 16, 32]
        if args.out == "scaling.json":  # a smoke run never replaces the full result
            args.out, args.plot = "scaling_quick.json", "scaling_quick.png"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    grid: dict[str, dict[str, float]] = {}
    checks = []
    for schedule in ("1f1b_flush", "paci"):
        for stages in args.stages:
            curve = grid.setdefault(f"{schedule}/{stages}", {})
            for n in args.accumulate:
                curve[str(n)] = util = steady_utilization(schedule, stages, n)
                theory = n / (n + stages - 1) if schedule == "1f1b_flush" else 1.0
                checks.append(abs(util - theory))
    points = measured_points()
    payload = {
        "benchmark": "scaling",
        "command": "python -m benchmarks.scaling" + (" --quick" if args.quick else ""),
        "machine": machine(), "config": {k: v for k, v in vars(args).items() if k != "accumulate"},
        "costs": {"forward": 1.0, "backward": 2.0, "comm": 0.0, "step": 0.0},
        "simulated": grid, "max_abs_deviation_from_theory": max(checks), "measured": points,
        "ratio_paper_s8": {"paci_over_flush_ideal": {str(n): (n + 7) / n for n in (4, 8, 16, 32)},
                           "paper_time_to_accuracy": {"global batch 128": 1.69, "global batch 256": 1.41}},
        "wall_seconds": time.perf_counter() - start,
    }  # fmt: skip
    path = write_json(args.out, payload)
    plot(
        grid, points, PLOTS / args.plot, "Steady-state utilization: simulator (lines, f=1, b=2, free comm) and measured"
    )
    print(table(payload))
    print(f"wrote {path} in {payload['wall_seconds']:.1f} s")
    return payload


def table(payload: dict[str, Any]) -> str:
    grid = payload["simulated"]
    stages = sorted({int(k.split("/")[1]) for k in grid})
    ns = [n for n in (1, 2, 4, 8, 16, 32) if str(n) in grid[f"paci/{stages[0]}"]]
    lines = ["| S | " + " | ".join(f"N={n} flush / paci" for n in ns) + " |", "|---" * (len(ns) + 1) + "|"]
    for s in stages:
        cells = [f"{grid[f'1f1b_flush/{s}'][str(n)]:.2f} / {grid[f'paci/{s}'][str(n)]:.2f}" for n in ns]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines.append("\nmeasured (S=2: runtime busy / elapsed in the Trainer; S=4/8: emulated throughput / bound):")
    lines.append("| S | N | schedule | utilization | simulated | source |\n|---|---|---|---|---|---|")
    for p in sorted(payload["measured"], key=lambda p: (p["S"], p["N"], p["schedule"])):
        sim = grid.get(f"{p['schedule']}/{p['S']}", {}).get(str(p["N"]), math.nan)
        lines.append(f"| {p['S']} | {p['N']} | {p['schedule']} | {p['utilization']:.2f} | {sim:.2f} | {p['source']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
