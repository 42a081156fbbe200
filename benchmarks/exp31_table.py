"""Issue 31: one table from the exp31_*.json grid results: final validation loss and gap against flush per
candidate and grid line (flush does not depend on S: the in-process pipeline is bit-identical to flush's
unsplit order, so one flush run per (N, lr, seed) serves every S), with the median over seeds where 3 ran.

    python -m benchmarks.exp31_table
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
GRID_STEPS = 1200  # micro-batches per run of the grid (equal tokens for every N)


def main() -> None:
    runs = {}
    for path in sorted(RESULTS.glob("exp31_*.json")):
        payload = json.loads(path.read_text())
        # exp31_diag_*: a grid run observed, not changed (its wrappers only read weights and moments); the
        # other diagnosis files (perturb, oracle, subset) changed their runs and are not grid results.
        found = payload.get("runs") or ([payload["result"]] if path.name.startswith("exp31_diag_") else [])
        for r in found:
            if r.get("steps", GRID_STEPS // r["N"]) * r["N"] != GRID_STEPS:
                continue  # a longer run (exp31_default_long_*): its own file's numbers, not this table's
            runs[(r["S"], r["N"], r["lr"], r["seed"], r["run"])] = r["final_val_loss"]
    flush = {(n, lr, seed): v for (s, n, lr, seed, run), v in runs.items() if run == "flush"}
    lines = sorted({(s, n, lr) for (s, n, lr, seed, run) in runs if run != "flush"})
    names = sorted({run for *_, run in runs if run != "flush"})
    print("| candidate | S | N | lr | warmup | seeds: final (gap vs flush) | median gap |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        for s, n, lr in lines:
            cells, gaps = [], []
            for seed in (0, 1, 2):
                v = runs.get((s, n, lr, seed, name))
                f = flush.get((n, lr, seed))
                if v is None or f is None:
                    continue
                gaps.append((v - f) / f)
                cells.append(f"s{seed} {v:.4f} ({gaps[-1]:+.2%})")
            if cells:
                med = f"{statistics.median(gaps):+.2%}" if len(gaps) == 3 else "-"
                print(f"| {name} | {s} | {n} | {lr:g} | 1% | " + "; ".join(cells) + f" | {med} |")
    print()
    print("flush:", "; ".join(f"N={n} lr={lr:g} s{seed}: {v:.4f}" for (n, lr, seed), v in sorted(flush.items())))
    print()
    print(time_to_accuracy_table("paci_default"))


def time_to_accuracy_table(name: str) -> str:
    """Simulated time to flush's targets at S=8 for run ``name`` (`paci_at_depth.time_to_accuracy`: the layer costs
    measured with the run's file, a synchronous start's steps at flush's pace), against flush's runs of any file
    (flush does not depend on S)."""
    from benchmarks.paci_at_depth import time_to_accuracy

    found, flush, costs = {}, {}, None
    for path in sorted(RESULTS.glob("exp31_*.json")):
        payload = json.loads(path.read_text())
        for r in payload.get("runs") or []:
            if r["steps"] * r["N"] != GRID_STEPS:
                continue
            if r["run"] == "flush":
                flush[(r["N"], r["lr"], r["seed"])] = r
            elif r["run"] == name and r["S"] == 8:
                found[(r["N"], r["lr"], r["seed"])] = r
                costs = costs or payload.get("layer_costs")
    runs = list(found.values())
    rows = time_to_accuracy(runs + [{**flush[(r["N"], r["lr"], r["seed"])], "S": 8} for r in runs], costs or {})
    lines = ["| S | N | lr | seed | run | throughput | to 80% | to 95% | to final |", "|" + "---|" * 9]
    for r in rows:
        cells = [f"{r[k]['ratio']:.2f}" if r[k]["ratio"] == r[k]["ratio"] else "never" for k in ("80%", "95%", "final")]
        lines.append(f"| 8 | {r['N']} | {r['lr']:g} | {r['seed']} | {r['run']} | {r['throughput_ratio']:.2f} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
