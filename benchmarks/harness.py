"""Shared benchmark plumbing: output folders, machine description, JSON and figures."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
PLOTS = Path(__file__).parent / "plots"


def add_gpt_timing_args(p: Any, rounds: int, quick: str) -> None:
    """The options of the S=2 real-compute throughput benchmarks (trainer_vs_torch_pipelining, zero_bubble):
    the same GPT, corpus, segment length and quiet-machine wait, so their numbers compare."""
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--accumulate", type=int, nargs="+", default=[2, 4, 8], help="values of N")
    p.add_argument("--rounds", type=int, default=rounds, help="rounds of every variant per N")
    p.add_argument("--timed-microbatches", type=int, default=16, help="micro-batches timed per segment")
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=128, help="sequence length")
    p.add_argument("--batch-size", type=int, default=4, help="micro-batch size")
    p.add_argument("--max-bytes", type=int, default=1_000_000, help="corpus bytes read")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet-wait", type=float, default=10.0, help="max seconds to wait for a quiet machine per round")


def machine() -> dict[str, Any]:
    """The machine the numbers come from (cores, CPU model, versions, load)."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu": model,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg": os.getloadavg(),
    }


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` under benchmarks/results/ and return the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    return path


def envelope(
    name: str, quick: bool, before: dict[str, Any], config: dict[str, Any], start: float, **extra: Any
) -> dict[str, Any]:
    """A result's common head (benchmark, command, machine, end load, config, wall time), then ``extra``.

    ``before`` is `machine()` taken at the start, ``start`` the `time.perf_counter()` of the start.
    """
    return {
        "benchmark": name,
        "command": f"python -m benchmarks.{name}" + (" --quick" if quick else ""),
        "machine": before,
        "loadavg_end": os.getloadavg(),
        "config": config,
        "wall_seconds": time.perf_counter() - start,
        **extra,
    }


def record(name: str, quick: bool, before: dict[str, Any], config: dict[str, Any], start: float, **extra: Any) -> Path:
    """Write `envelope`'s result to ``<name>.json`` (``<name>_quick.json`` for a smoke run), the command as run
    (its options too: a ``--repeats`` given was left out of the recorded command), and return the path."""
    payload = envelope(name, quick, before, config, start, **extra)
    payload["command"] = " ".join(["python -m benchmarks." + name, *sys.argv[1:]])
    return write_json(f"{name}_quick.json" if quick else f"{name}.json", payload)


def pyplot() -> Any:
    """matplotlib's pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int) -> None:
    """Lay ``fig`` out, write it to ``path`` (creating its folder) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
