"""PipelineMonitor's bubble fraction with a checkpoint save every step, against the same run without saves.

A save's writes and collectives stall every stage; they are no pipeline bubble, and the monitor leaves the
strategy's timed saves out (as it leaves validation out). The schedule's bubble of 1F1B-flush at S=2, N=4 is
(S-1)/(N+S-1) = 0.20. The two runs (2 spawned ranks, one thread each, GPT 4x128, block 64, micro-batch 16, 20
steps, `PipelineMonitor(logging_interval=5)`) alternate ``--rounds`` times, so the machine's noise falls on both.

    python -m benchmarks.monitor_saves              # 2 rounds, ~3 minutes on 2 cores
    python -m benchmarks.monitor_saves --quick      # smoke run
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from benchmarks.harness import envelope, machine, write_json
from lit_efficient import PACIStrategy, PipelineMonitor
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT


def run(config: dict[str, Any], saving: bool) -> list[float]:
    """One fit: the logged ``pipeline/bubble_fraction`` of each interval."""
    with tempfile.TemporaryDirectory() as tmp:
        L.seed_everything(0)
        model = GPT(n_layer=config["n_layer"], n_head=4, n_embd=config["n_embd"], block_size=config["block"],
                    warmup_steps=2, max_steps=config["steps"])  # fmt: skip
        data = TextDataModule(block_size=config["block"], batch_size=config["batch"], max_bytes=2_000_000)
        saves = [ModelCheckpoint(dirpath=Path(tmp, "ckpt"), every_n_train_steps=1)] if saving else []
        logger = CSVLogger(tmp, name="run", version=0)  # the spawned rank 0 writes it: the parent must not pick anew
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_steps=config["steps"], accumulate_grad_batches=4, logger=logger,
            strategy=PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", start_method="spawn"),
            enable_checkpointing=saving, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            callbacks=[PipelineMonitor(logging_interval=config["interval"]), *saves],
        )  # fmt: skip
        trainer.fit(model, datamodule=data)
        with open(Path(logger.log_dir, "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
    return [float(r["pipeline/bubble_fraction"]) for r in rows if r.get("pipeline/bubble_fraction")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small model, few steps")
    parser.add_argument("--rounds", type=int, default=2, help="alternated pairs of runs (default 2)")
    args = parser.parse_args()
    config = (
        dict(n_layer=2, n_embd=64, block=32, batch=8, steps=6, interval=3)
        if args.quick
        else dict(n_layer=4, n_embd=128, block=64, batch=16, steps=20, interval=5)
    )
    before, start = machine(), time.perf_counter()
    runs: dict[str, list[list[float]]] = {"without_saves": [], "save_every_step": []}
    for _ in range(args.rounds):
        runs["without_saves"].append(run(config, saving=False))
        runs["save_every_step"].append(run(config, saving=True))
    medians = {name: statistics.median(v for r in rounds for v in r) for name, rounds in runs.items()}
    for name, rounds in runs.items():
        print(f"{name}: bubble fraction per interval {rounds}, median {medians[name]:.3f}")
    payload = envelope("monitor_saves", args.quick, before, config, start, runs=runs, medians=medians)
    payload["command"] = "python -m benchmarks.monitor_saves" + (" --quick" if args.quick else "")
    path = write_json("monitor_saves_quick.json" if args.quick else "monitor_saves.json", payload)
    print(json.dumps(medians), f"written to {path}")


if __name__ == "__main__":
    main()
