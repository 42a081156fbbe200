"""Draw 1F1B-flush and PACI side by side from the discrete-event simulator (the README's picture).

    python examples/draw_schedules.py                      # writes schedules.png here
    python examples/draw_schedules.py --out docs/schedules.png   # the README's picture, from the repository root
    python examples/draw_schedules.py --stages 8 --accumulate 8 --windows 2 --out sched.png

Pure simulation (`lit_efficient.tools.simulate`): no processes, no training; about 2 s on CPU,
mostly importing matplotlib. Each row is a stage; blue boxes are forwards, green backwards (twice as
long, the usual cost ratio), red ticks the local optimizer steps; the number in a box is its micro-batch.
Flush idles (S-1)/(N+S-1) of every window; PACI fills those slots with the next window's forwards.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402

from lit_efficient.tools.simulate import SimulationResult, flush_utilization, simulate  # noqa: E402

COLORS = {"F": "#4C72B0", "B": "#55A868", "STEP": "#C44E52"}


def draw(ax: plt.Axes, result: SimulationResult, title: str, makespan: float) -> None:
    """One schedule's Gantt chart on `ax`: stage 0 on top."""
    for slot in result.timeline:
        y = result.num_stages - 1 - slot.stage
        if slot.action.kind == "STEP":  # costs ~0 here: a tick, drawn above the boxes
            ax.vlines(slot.end, y + 0.02, y + 0.98, colors=COLORS["STEP"], linewidth=2.5, zorder=3)
            continue
        width = slot.end - slot.start
        ax.broken_barh([(slot.start, width)], (y + 0.1, 0.8), facecolors=COLORS[slot.action.kind], edgecolor="white")
        ax.text(slot.start + width / 2, y + 0.5, str(slot.action.index), ha="center", va="center", fontsize=7,
                color="white")  # fmt: skip
    ax.set_yticks([result.num_stages - 1 - s + 0.5 for s in range(result.num_stages)])
    ax.set_yticklabels([f"stage {s}" for s in range(result.num_stages)])
    ax.set_xlim(0, makespan)
    utilization = sum(result.utilization) / result.num_stages
    ax.set_title(f"{title}: {result.makespan:.0f} time units, mean utilization {utilization:.0%}", fontsize=10)


def main(argv: list[str] | None = None) -> Path:
    """Simulate both schedules and write the picture; returns its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages S")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step N")
    parser.add_argument("--windows", type=int, default=3, help="optimizer steps to simulate")
    # Here, not beside the script: an install's package folder is no place to write (it wrote the repository's
    # docs/schedules.png from wherever it was run).
    parser.add_argument("--out", type=Path, default=Path("schedules.png"), help="the picture to write")
    args = parser.parse_args(argv)
    s, n = args.stages, args.accumulate
    runs = {name: simulate(name, s, n, n * args.windows, forward=1.0, backward=2.0) for name in ("1f1b_flush", "paci")}
    makespan = max(r.makespan for r in runs.values())
    fig, axes = plt.subplots(2, 1, figsize=(12, 1.0 + 0.55 * s * 2), sharex=True)
    bubble = 1 - flush_utilization(s, n)
    draw(axes[0], runs["1f1b_flush"], f"1F1B-flush (bubble (S-1)/(N+S-1) = {bubble:.0%})", makespan)
    draw(axes[1], runs["paci"], "PACI (no flush; drift <= ceil((S-1-s)/N))", makespan)
    axes[1].set_xlabel(f"time (forward = 1, backward = 2); S={s} stages, N={n} micro-batches per step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, ["forward", "backward", "optimizer step"], loc="upper right", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    plt.close(fig)
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
