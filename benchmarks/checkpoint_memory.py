"""Per-rank peak host memory while saving and loading a checkpoint, against the rank's own share (issue 19).

S=2 and S=4, PACI, a GPT of 4 blocks x 512 (12.9M parameters; AdamW: weights and two moments, a 148 MiB
checkpoint, 1/S of it per rank), both checkpoint formats. For each S and format, two Trainer runs on fresh
forkserver ranks (one thread each):

- **save**: one optimizer step and a ``ModelCheckpoint`` at step 1. Each rank resets its peak resident
  set size (``VmHWM``, through ``/proc/self/clear_refs``) just before ``strategy.save_checkpoint`` and
  reads it after: the growth is the peak minus the resident size just before (the drain and Lightning's
  dict of references come before; the gather, rank by rank, and the writes are inside).
- **load**: a run resuming from that checkpoint. The peak from just before ``load_checkpoint`` until the
  restore is done (``on_train_start``: weights, optimizer, schedulers and loops restored, Lightning's
  loaded dict released), minus the resident size just before.

A rank's share is the bytes of its stage's parameters and optimizer state. Resident size counts the file
pages a memory-mapped load touches, so the "file" load figures are an upper bound on what stays resident.

    python -m benchmarks.checkpoint_memory            # ~3 minutes on 2 cores
    python -m benchmarks.checkpoint_memory --quick    # smoke run, small model
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from benchmarks.harness import envelope, machine, write_json
from lit_efficient import PACIStrategy
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT

MIB = 2**20


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: now; VmHWM: the peak since the last reset)."""
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


class MeasuredPACI(PACIStrategy):
    """PACIStrategy recording this rank's peak host-memory growth in save_checkpoint and in the restore."""

    def __init__(self, out: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out = out
        self.record: dict[str, Any] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        before = _status("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        super().save_checkpoint(checkpoint, filepath, storage_options)
        self.record.update(save_growth=_status("VmHWM") - before, save_seconds=time.perf_counter() - start)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.record["load_before"] = _status("VmRSS")
        _reset_peak()
        self.record["load_start"] = time.perf_counter()
        return super().load_checkpoint(checkpoint_path, weights_only)

    def on_train_start(self) -> None:
        super().on_train_start()
        if "load_before" in self.record:
            self.record["load_growth"] = _status("VmHWM") - self.record.pop("load_before")
            self.record["load_seconds"] = time.perf_counter() - self.record.pop("load_start")

    def on_train_end(self) -> None:
        # After a step, so AdamW's moments exist: the share is what this rank's checkpoint entries hold.
        weights = sum(p.numel() * p.element_size() for p in self.runtime.stage.parameters())
        state = self.optimizers[0].state.values()
        moments = sum(t.numel() * t.element_size() for s in state for t in s.values() if torch.is_tensor(t))
        self.record.update(rank=self.global_rank, stage=self.stage, share=weights + moments)
        super().on_train_end()
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(self.record))


def _run(stages: int, fmt: str, root: Path, config: dict[str, Any], resume: bool) -> list[dict[str, Any]]:
    out = root / f"{fmt}-{'load' if resume else 'save'}"
    out.mkdir(parents=True)
    L.seed_everything(0, verbose=False)
    model = GPT(n_layer=config["n_layer"], n_head=config["n_head"], n_embd=config["n_embd"],
                block_size=config["block"], warmup_steps=1, max_steps=10)  # fmt: skip
    strategy = MeasuredPACI(str(out), pipeline_stages=stages, checkpoint_format=fmt, start_method="forkserver")
    ckpt = ModelCheckpoint(dirpath=root / fmt, every_n_train_steps=1, filename="{step}", save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu", devices=stages, strategy=strategy, max_steps=2 if resume else 1,
        accumulate_grad_batches=config["accumulate"], logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[] if resume else [ckpt],
        enable_checkpointing=not resume,
    )  # fmt: skip
    data = TextDataModule(block_size=config["block"], batch_size=config["batch"], max_bytes=200_000)
    trainer.fit(model, datamodule=data, ckpt_path=str(root / fmt / "step=1.ckpt") if resume else None)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(stages)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small model")
    args = parser.parse_args()
    config = (
        dict(n_layer=2, n_head=2, n_embd=64, block=32, batch=2, accumulate=2)
        if args.quick
        else dict(n_layer=4, n_head=8, n_embd=512, block=64, batch=2, accumulate=2)
    )
    multiprocessing.set_forkserver_preload(["torch", "lightning.pytorch", "lit_efficient.strategy"])
    before, start = machine(), time.perf_counter()
    rows = []
    for stages, fmt in itertools.product((2, 4), ("file", "sharded")):
        with tempfile.TemporaryDirectory() as tmp:
            saved = _run(stages, fmt, Path(tmp), config, resume=False)
            loaded = _run(stages, fmt, Path(tmp), config, resume=True)
            path = Path(tmp, fmt, "step=1.ckpt")
            size = sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size
            for save, load in zip(saved, loaded, strict=True):
                share = save["share"]
                rows.append({
                    "stages": stages, "format": fmt, "rank": save["rank"], "stage": save["stage"],
                    "checkpoint_bytes": size,
                    "share_bytes": share, "save_growth_bytes": save["save_growth"],
                    "save_seconds": save["save_seconds"], "load_growth_bytes": load["load_growth"],
                    "load_seconds": load["load_seconds"], "save_growth_per_share": save["save_growth"] / share,
                    "load_growth_per_share": load["load_growth"] / share,
                })  # fmt: skip
    payload = envelope("checkpoint_memory", args.quick, before, config, start, ranks=rows)
    path = write_json("checkpoint_memory_quick.json" if args.quick else "checkpoint_memory.json", payload)
    print("| S | format | rank (stage) | checkpoint | share | save: growth | x share | load: growth | x share |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['stages']} | {r['format']} | {r['rank']} ({r['stage']}) | {r['checkpoint_bytes'] / MIB:.0f} MiB | "
            f"{r['share_bytes'] / MIB:.0f} MiB | {r['save_growth_bytes'] / MIB:+.0f} MiB | "
            f"{r['save_growth_per_share']:.2f} | {r['load_growth_bytes'] / MIB:+.0f} MiB | "
            f"{r['load_growth_per_share']:.2f} |"
        )
    print(f"written to {path}")


if __name__ == "__main__":
    main()
