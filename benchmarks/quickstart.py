"""The quickstart as a user runs it, PACI against its flush overlay, in alternating rounds.

    python -m benchmarks.quickstart [--rounds 2] [--quick]

Each round runs ``lit-efficient fit --config configs/quickstart.yaml`` (PACI with its defaults) and the same with
``--config configs/flush.yaml``, one after the other, each in a fresh temporary folder (its runs/ and W&B files),
and records the command's wall time (start to exit: launch, imports, data, fit, validation, checkpoint) and the last
``val_loss`` the progress bar shows. The ratio flush / PACI is taken round by round, so a machine whose speed drifts
moves both alike. ``--quick``: 4 optimizer steps, a smoke run of the script. Writes results/quickstart.json.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.harness import envelope, machine, write_json

CONFIGS = Path(__file__).parent.parent / "configs"
RUNS = {"paci": [], "flush": ["--config", str(CONFIGS / "flush.yaml")]}


def run_once(extra: list[str], quick: bool) -> dict[str, float]:
    """One ``lit-efficient fit`` of the quickstart (plus ``extra``) in a fresh folder: wall seconds, last val_loss."""
    argv = ["lit-efficient", "fit", "--config", str(CONFIGS / "quickstart.yaml"), *extra]
    if quick:
        argv += ["--trainer.max_steps", "4", "--trainer.val_check_interval", "16", "--trainer.limit_val_batches", "2"]
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    losses = re.findall(r"val_loss:? ([0-9.]+)", (done.stdout + done.stderr).replace("\r", "\n"))
    return {"seconds": seconds, "val_loss": float(losses[-1]) if losses else float("nan")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds of (PACI, flush)")
    p.add_argument("--quick", action="store_true", help="4 optimizer steps: a smoke run")
    p.add_argument("--out", default="quickstart.json", help="file name under benchmarks/results/")
    args = p.parse_args(argv)
    before, start = machine(), time.perf_counter()
    rounds = [{name: run_once(extra, args.quick) for name, extra in RUNS.items()} for _ in range(args.rounds)]
    ratios = [r["flush"]["seconds"] / r["paci"]["seconds"] for r in rounds]
    summary = {
        "seconds": {name: statistics.median(r[name]["seconds"] for r in rounds) for name in RUNS},
        "val_loss": {name: rounds[-1][name]["val_loss"] for name in RUNS},
        "flush_over_paci": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }
    print(summary)
    config = {"rounds": args.rounds, "quick": args.quick}
    print("wrote", write_json(args.out, envelope("quickstart", args.quick, before, config, start, rounds=rounds,
                                                  summary=summary)))  # fmt: skip


if __name__ == "__main__":
    main()
