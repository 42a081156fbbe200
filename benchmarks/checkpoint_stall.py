"""How long a checkpoint stalls a PACI pipeline: the drain, the gather to rank 0 and the write, in steps.

One Trainer run (S=2, PACI, GPT, spawned ranks, one thread each) saves a checkpoint every
``--every`` optimizer steps with `ModelCheckpoint(every_n_train_steps)`. Every rank times, per save,
the drain (finishing the micro-batches in flight, in ``lightning_module_state_dict``) and the rest of
``save_checkpoint`` (every stage's share gathered to global rank 0, which writes one file; a barrier
so nobody proceeds before it exists), and the wall time of the windows between saves. The stall is
reported in units of the median optimizer step of the same run, so the ratio holds on a noisy machine.

``--compare`` runs the three ways to save one after the other on a smaller model, each in fresh ranks:
the single file (rank 0 gathers and writes), the sharded folder (every rank writes its share), and the
sharded folder written in the background (``async_checkpoint=True``: the save returns once the share is
copied; what training still waits for is the drain and the copy, plus a save still in flight when the
next one starts).

    python -m benchmarks.checkpoint_stall            # ~1-2 minutes on 2 cores
    python -m benchmarks.checkpoint_stall --quick    # smoke run
    python -m benchmarks.checkpoint_stall --compare  # file, sharded, sharded + async (~4 minutes)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from benchmarks.harness import envelope, machine, write_json
from lit_efficient import PACIStrategy
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT


class TimedPACI(PACIStrategy):
    """PACIStrategy recording how long each checkpoint's drain and save take on this rank."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.drains: list[float] = []
        self.saves: list[float] = []

    def lightning_module_state_dict(self) -> dict[str, Any]:
        start = time.perf_counter()
        if self.runtime is not None:
            self.runtime.drain()
        self.drains.append(time.perf_counter() - start)
        return super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        start = time.perf_counter()
        super().save_checkpoint(checkpoint, filepath, storage_options)
        self.saves.append(time.perf_counter() - start)


class StepClock(Callback):
    """Wall time of every optimizer step (window of N micro-batches), checkpoint saves excluded."""

    def __init__(self, out: Path) -> None:
        self.out, self.steps, self._start, self._saving = out, [], None, 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        now = time.perf_counter()
        saved = sum(trainer.strategy.drains) + sum(trainer.strategy.saves)
        if self._start is not None:
            self.steps.append(now - self._start - (saved - self._saving))
        self._start, self._saving = now, saved

    def on_train_end(self, trainer, pl_module) -> None:
        s = trainer.strategy
        record = {"rank": trainer.global_rank, "stage": s.stage, "steps": self.steps, "drains": s.drains,
                  "saves": s.saves}  # fmt: skip
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


VARIANTS = {"file": {}, "sharded": {"checkpoint_format": "sharded"},
            "sharded_async": {"checkpoint_format": "sharded", "async_checkpoint": True}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small model, few steps")
    parser.add_argument("--compare", action="store_true", help="file, sharded and sharded + async, side by side")
    args = parser.parse_args()
    if args.compare:
        return compare(args.quick)
    config = (
        dict(n_layer=2, n_embd=64, steps=12, every=4, accumulate=4, batch=8, block=64)
        if args.quick
        else dict(n_layer=6, n_embd=256, steps=60, every=10, accumulate=4, batch=16, block=128)
    )
    before, start = machine(), time.perf_counter()
    per_rank, step, size, saves = run(config)
    payload = envelope(
        "checkpoint_stall", args.quick, before, config, start, checkpoint_bytes=size, median_step_seconds=step,
        saves=saves, ranks=per_rank,
    )  # fmt: skip
    path = write_json("checkpoint_stall_quick.json" if args.quick else "checkpoint_stall.json", payload)
    print(json.dumps(per_rank, indent=2), f"\ncheckpoint {size / 2**20:.1f} MiB; written to {path}")


def compare(quick: bool) -> None:
    """The three variants on the same model, data and schedule of saves, each in fresh ranks."""
    config = (
        dict(n_layer=2, n_embd=64, steps=12, every=4, accumulate=4, batch=8, block=64)
        if quick
        else dict(n_layer=4, n_embd=256, steps=30, every=5, accumulate=4, batch=8, block=128)
    )
    before, start = machine(), time.perf_counter()
    results = {}
    for name, options in VARIANTS.items():
        per_rank, step, size, saves = run(config, **options)
        results[name] = {"checkpoint_bytes": size, "median_step_seconds": step, "saves": saves, "ranks": per_rank}
        stalls = ", ".join(f"rank {r['rank']}: {r['stall_in_steps']:.3f}" for r in per_rank)
        print(f"{name}: median step {step:.3f} s, stall in steps {stalls}")
    payload = envelope("checkpoint_stall", quick, before, config, start, variants=results)
    payload["command"] = "python -m benchmarks.checkpoint_stall --compare" + (" --quick" if quick else "")
    path = write_json("checkpoint_stall_compare_quick.json" if quick else "checkpoint_stall_compare.json", payload)
    print(f"written to {path}")


def run(config: dict[str, Any], **options: Any) -> tuple[list[dict[str, Any]], float, float, int]:
    """One Trainer run saving every ``config["every"]`` steps: (per-rank numbers, median step, bytes, saves)."""
    with tempfile.TemporaryDirectory() as tmp:
        L.seed_everything(0)
        model = GPT(n_layer=config["n_layer"], n_head=4, n_embd=config["n_embd"], block_size=config["block"],
                    warmup_steps=5, max_steps=config["steps"])  # fmt: skip
        data = TextDataModule(block_size=config["block"], batch_size=config["batch"], max_bytes=2_000_000)
        ckpt = ModelCheckpoint(dirpath=tmp, every_n_train_steps=config["every"], save_top_k=-1)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=TimedPACI(pipeline_stages=2, start_method="spawn", **options),
            max_steps=config["steps"], accumulate_grad_batches=config["accumulate"], logger=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            callbacks=[ckpt, StepClock(Path(tmp))],
        )  # fmt: skip
        trainer.fit(model, datamodule=data)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
        saved = list(Path(tmp).glob("*.ckpt"))
        size = sum(_bytes(p) for p in saved) / max(1, len(saved))
    step = statistics.median(t for r in ranks for t in r["steps"])
    per_rank = [
        {
            "rank": r["rank"],
            "stage": r["stage"],
            "median_step_seconds": statistics.median(r["steps"]),
            "median_drain_seconds": statistics.median(r["drains"]),
            "median_save_seconds": statistics.median(r["saves"]),
            "stall_in_steps": (statistics.median(r["drains"]) + statistics.median(r["saves"])) / step,
        }
        for r in ranks
    ]
    return per_rank, step, size, len(ranks[0]["saves"])


def _bytes(path: Path) -> int:
    """A checkpoint's size: the file, or every file of a sharded folder."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


if __name__ == "__main__":
    main()
