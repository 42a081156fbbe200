"""Regression guard: the working tree's PACI throughput against a pinned earlier revision, in alternation.

Nothing else compares one commit with an earlier one, and on these shared 2-core VMs two runs of the same code
differ by 10-20% (between processes, and between objects built at different times in one process), so a 10%
slowdown can land unnoticed, and a single comparison can show one that is not there. This benchmark loads both
revisions into ONE pair of ranks (``torchrun``, gloo, one intra-op thread each; the pinned revision's package
renamed, see `package_of`) and runs timed fits of each in turn, A B B A A B ... (`benchmarks.revision_worker`:
the Lightning Trainer with its defaults, ``PACIStrategy(schedule="paci")``, S=2, N=4, by default Hugging Face's
GPT-2 blocks 8 x 256 with a tied embedding, micro-batch 8 x 32 tokens, SGD; 2 warm-up and 8 timed optimizer
steps; ``sync_start_steps=0`` and ``staleness_correction=None`` where the revision has them, so that both time
the PACI path every run shares: `benchmarks.revision_worker.steady_state`; ``--corrections defaults`` keeps each
revision's own correction, so that with ``--optimizer module`` (AdamW) the ratio shows the tree's weight
prediction's cost; the synchronous start stays off). Every fit builds its own model, so both revisions meet the
same conditions. Per round (one fit of each):

- ``window``: stage 0's median optimizer-step window (the last rank holds stage 0 in both revisions); the ratio
  baseline / candidate (> 1: the candidate is faster). The median of the round's windows ignores a burst of
  another process's work.
- ``wall``: the same over the whole timed span.
- ``cpu``: CPU seconds per micro-batch of the last rank's process (stage 0's, all its threads); baseline /
  candidate.

The summary is the median over rounds with its range. A revision is any git revision (its ``lit_efficient/`` is
extracted with ``git archive`` under ``benchmarks/.revisions/``, which git ignores) or ``tree``. The worker uses
only the public API (``PACIStrategy``, ``models.GPT``, ``models.HFCausalLM``, ``strategy.runtime.stats()``),
so a pinned revision runs the very same measurement.

    python -m benchmarks.revision_guard                       # tree against the pinned baseline, 6 rounds (~3 min)
    python -m benchmarks.revision_guard --quick               # 2 rounds
    python -m benchmarks.revision_guard --model gpt --optimizer module   # the package's GPT with its AdamW
    python -m benchmarks.revision_guard --model gpt --optimizer module --corrections defaults --fail-below 0
    python -m benchmarks.revision_guard --baseline 9e7fed1 --candidate 28e8dc4 --rounds 12   # a bisect step

Exit status 1 when the median window ratio is under ``--fail-below`` (default 0.95), so a script can stop on it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import machine, write_json

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "revision_worker.py"
CACHE = Path(__file__).resolve().parent / ".revisions"
# The pinned baseline: the last commit before the 11% PACI slowdown was noticed (2026-12-01). Move it forward
# only to a revision measured at least as fast as this one, and say so in the benchmark report.
BASELINE = "9e7fed172405810327feba32628e226e6f74bba5"


def package_of(revision: str) -> tuple[str, Path]:
    """The import name and the folder to put on ``sys.path`` of the package at ``revision``.

    ``tree`` is the working tree's ``lit_efficient``. A git revision's ``lit_efficient/`` is extracted with
    ``git archive`` and renamed ``le_<sha>`` (every ``lit_efficient`` name in its sources), so both revisions
    load into one process.
    """
    if revision == "tree":
        return "lit_efficient", ROOT
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{revision}^{{commit}}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    name = f"le_{sha[:10]}"
    folder = CACHE / sha
    if not (folder / name / "__init__.py").exists():
        with tempfile.TemporaryDirectory() as tmp:
            archive = subprocess.run(["git", "archive", sha, "lit_efficient"], cwd=ROOT, check=True,
                                     capture_output=True).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            for source in Path(tmp, "lit_efficient").rglob("*.py"):
                source.write_text(re.sub(r"\blit_efficient\b", name, source.read_text()))
            folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(folder / name, ignore_errors=True)
            shutil.move(os.path.join(tmp, "lit_efficient"), folder / name)
    return name, folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alternate(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One torchrun of the worker: ``args.rounds`` timed fits of each revision, alternating in the same ranks."""
    (base, base_dir), (cand, cand_dir) = package_of(args.baseline), package_of(args.candidate)
    if base == cand:
        raise ValueError(f"--baseline {args.baseline} and --candidate {args.candidate} are the same package")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        path = os.pathsep.join(dict.fromkeys([str(cand_dir), str(base_dir)]))
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.stages),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER), "--out", out,
            "--packages", base, cand, "--segments", str(args.rounds),
            "--model", args.model, "--optimizer", args.optimizer, "--schedule", args.schedule,
            "--layers", str(args.layers), "--dim", str(args.dim), "--block", str(args.block),
            "--batch-size", str(args.batch_size), "--accumulate", str(args.accumulate),
            "--warm", str(args.warm), "--steps", str(args.steps), *(["--bare-trainer"] if args.bare_trainer else []),
            "--corrections", args.corrections,
        ]  # fmt: skip
        done = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            raise RuntimeError(f"the timed fits failed ({done.returncode}):\n{done.stderr[-4000:]}")
        # The last rank holds stage 0, which feeds every window: its window is the pipeline's pace.
        lines = Path(f"{out}.{args.stages - 1}").read_text().splitlines()
    return pair_rounds([json.loads(line) for line in lines], base, cand)


def pair_rounds(records: list[dict[str, Any]], base: str, cand: str) -> list[dict[str, Any]]:
    """The worker's records (one per timed fit) as rounds: one fit of each package, and their ratios."""
    rounds = []
    for segment in sorted({r["segment"] for r in records}):
        pair = {r["package"]: r for r in records if r["segment"] == segment}
        b, c = pair[base], pair[cand]
        rounds.append({
            "baseline": b, "candidate": c, "first": "baseline" if segment % 2 == 0 else "candidate",
            "window_ratio": b["window"] / c["window"], "wall_ratio": b["wall"] / c["wall"],
            "cpu_ratio": b["cpu_per_microbatch"] / c["cpu_per_microbatch"],
        })  # fmt: skip
    return rounds


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=BASELINE, help="git revision or 'tree' (default: the pinned baseline)")
    p.add_argument("--candidate", default="tree", help="git revision or 'tree' (default: the working tree)")
    p.add_argument("--quick", action="store_true", help="2 rounds")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--model", choices=["gpt", "gpt_tied", "hf_gpt2"], default="hf_gpt2")
    p.add_argument("--schedule", default="paci")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--optimizer", choices=["sgd", "module"], default="sgd", help="SGD or the model's own")
    p.add_argument("--bare-trainer", action="store_true", help="no logger, progress bar, checkpoint, summary")
    p.add_argument(
        "--corrections",
        choices=["off", "defaults"],
        default="off",
        help="'off': each revision's staleness correction off where it has one (the path both share); 'defaults': "
        "each revision's own (with AdamW the tree's weight prediction's cost shows); the synchronous start is off "
        "either way",
    )
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--fail-below", type=float, default=0.95, help="exit 1 under this median window ratio")
    p.add_argument("--out", help="file name under benchmarks/results/ (default: revision_guard_<model>[_quick].json)")
    args = p.parse_args()
    if args.quick:
        args.rounds = 2
    if args.out is None:
        args.out = f"revision_guard_{args.model}{'_quick' if args.quick else ''}.json"
    start, before = time.perf_counter(), machine()
    rounds = alternate(args)
    for r, row in enumerate(rounds):
        b, c = row["baseline"], row["candidate"]
        print(
            f"round {r + 1}: median window {b['window'] * 1e3:.0f} -> {c['window'] * 1e3:.0f} ms "
            f"(x{row['window_ratio']:.3f}), wall x{row['wall_ratio']:.3f}, cpu/micro-batch x{row['cpu_ratio']:.3f}"
        )
    result = {key: spread([row[key] for row in rounds]) for key in ("window_ratio", "wall_ratio", "cpu_ratio")}
    result["rounds"] = rounds
    config = {k: v for k, v in vars(args).items() if k not in ("out", "quick")}
    payload = {
        "benchmark": "revision_guard", "command": " ".join(["python -m benchmarks.revision_guard", *sys.argv[1:]]),
        "machine": before, "loadavg_end": os.getloadavg(), "config": config,
        "wall_seconds": time.perf_counter() - start, **result,
    }  # fmt: skip
    path = write_json(args.out, payload)
    w, c = result["window_ratio"], result["cpu_ratio"]
    print(f"{args.candidate} against {args.baseline[:12]}: throughput x{w['median']:.3f} "
          f"({w['min']:.3f}-{w['max']:.3f}) per window, x{c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f}) "
          f"CPU per micro-batch, {args.rounds} rounds -> {path}")  # fmt: skip
    sys.exit(1 if w["median"] < args.fail_below else 0)


if __name__ == "__main__":
    main()
