"""How long a checkpoint stalls a PACI pipeline: the drain, the gather to rank 0 and the write, in steps.

One Trainer run (S=2, PACI, GPT, spawned ranks, one thread each) saves a checkpoint every
``--every`` optimizer steps with `ModelCheckpoint(every_n_train_steps)`. Every rank times, per save,
the drain (finishing the micro-batches in flight, in ``lightning_module_state_dict``) and the rest of
``save_checkpoint`` (every stage's share gathered to global rank 0, which writes one file; a barrier
so nobody proceeds before it exists), and the wall time of the windows between saves. The stall is
reported in units of the median optimizer step of the same run, so the ratio holds on a noisy machine.
Saving is synchronous (no async save).

    python -m benchmarks.checkpoint_stall            # ~1-2 minutes on 2 cores
    python -m benchmarks.checkpoint_stall --quick    # smoke run
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small model, few steps")
    args = parser.parse_args()
    config = (
        dict(n_layer=2, n_embd=64, steps=12, every=4, accumulate=4, batch=8, block=64)
        if args.quick
        else dict(n_layer=6, n_embd=256, steps=60, every=10, accumulate=4, batch=16, block=128)
    )
    before, start = machine(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        L.seed_everything(0)
        model = GPT(n_layer=config["n_layer"], n_head=4, n_embd=config["n_embd"], block_size=config["block"],
                    warmup_steps=5, max_steps=config["steps"])  # fmt: skip
        data = TextDataModule(block_size=config["block"], batch_size=config["batch"], max_bytes=2_000_000)
        ckpt = ModelCheckpoint(dirpath=tmp, every_n_train_steps=config["every"], save_top_k=-1)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=TimedPACI(pipeline_stages=2, start_method="spawn"),
            max_steps=config["steps"], accumulate_grad_batches=config["accumulate"], logger=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            callbacks=[ckpt, StepClock(Path(tmp))],
        )  # fmt: skip
        trainer.fit(model, datamodule=data)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
        size = sum(p.stat().st_size for p in Path(tmp).glob("*.ckpt")) / max(1, len(list(Path(tmp).glob("*.ckpt"))))
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
    payload = envelope(
        "checkpoint_stall", args.quick, before, config, start, checkpoint_bytes=size, median_step_seconds=step,
        saves=len(ranks[0]["saves"]), ranks=per_rank,
    )  # fmt: skip
    path = write_json("checkpoint_stall_quick.json" if args.quick else "checkpoint_stall.json", payload)
    print(json.dumps(per_rank, indent=2), f"\ncheckpoint {size / 2**20:.1f} MiB; written to {path}")


if __name__ == "__main__":
    main()
