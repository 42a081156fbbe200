"""PACI against 1F1B-flush on the same model, data and seed: loss per step, loss per second, throughput.

    python examples/compare_schedules.py                   # writes runs/compare_schedules.png
    python examples/compare_schedules.py --steps 300 --out paci_vs_flush.png
    python examples/compare_schedules.py --sync-start-steps 0   # plain PACI from the first step

Each schedule trains a 2-stage pipeline (2 processes on CPU) for the same optimizer steps. Both see
the same micro-batches in the same windows; PACI has no flush, so with one device per stage it needs
less wall time: ideally (N+S-1)/N = 1.25x less at S=2, N=4. PACI as PACIStrategy runs it by default
starts with 40 optimizer steps in 1F1B-flush order (its synchronous start, for the loss: the first
steps move the weights the most, and a stale forward then costs the most), so in a short run the ideal
is lower; the plot's title counts it.

Measured on 2 CPU cores, nothing else running (2026-12-05), twice: the default 150 steps, 73 s wall
time for both runs: PACI 29.1 s / 27.7 s, flush 32.2 s / 33.2 s (1.11x / 1.20x: these machines are
noisy; ideal with the synchronous start 1.17x), final window loss 2.441 against 2.443 both times. With
``--sync-start-steps 0``: PACI 25.9 s against 33.0 s, but a final loss of 2.565 against 2.443 at this
learning rate (3e-3): what the synchronous start is for. The run warns that its synchronous start is a
large share of it (27%): the reason the ideal is 1.17x, not 1.25x. BENCHMARKS.md
has the throughput measurements. The ranks are re-launched copies of this script
(``start_method="popen"``), so global rank 0 is this very process and holds the recorded numbers; only
it draws.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch import Callback, LightningModule, Trainer

from lit_efficient import GradientAccumulation, PACIStrategy
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT

ACCUMULATE = 4
STAGES = 2


class LossHistory(Callback):
    """Records, on the rank holding the last stage, (optimizer step, seconds since start, window loss)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float, float]] = []
        self.seconds = 0.0
        self._window: list[float] = []
        self._start = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if isinstance(outputs, dict) and outputs.get("loss") is not None:
            self._window.append(float(outputs["loss"]))  # host sync per micro-batch: fine for a picture
        if (i + 1) % ACCUMULATE == 0 and self._window:
            elapsed = time.perf_counter() - self._start
            self.rows.append((trainer.global_step, elapsed, sum(self._window) / len(self._window)))
            self._window.clear()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.seconds = time.perf_counter() - self._start


def train(
    schedule: str, steps: int, batch_size: int, block_size: int, sync_start_steps: int | str
) -> tuple[LossHistory, Trainer]:
    """One run of `schedule`; returns its history (filled on global rank 0) and its trainer."""
    L.seed_everything(0)  # the same initial weights and data order for both schedules
    history = LossHistory()
    trainer = Trainer(
        accelerator="cpu", devices=STAGES, max_steps=steps,
        strategy=PACIStrategy(pipeline_stages=STAGES, schedule=schedule, sync_start_steps=sync_start_steps),
        callbacks=[GradientAccumulation(steps=ACCUMULATE), history],
        logger=False, enable_checkpointing=False, limit_val_batches=0, enable_model_summary=False,
    )  # fmt: skip
    model = GPT(n_layer=4, n_embd=128, learning_rate=3e-3, warmup_steps=10)
    trainer.fit(model, datamodule=TextDataModule(block_size=block_size, batch_size=batch_size))
    return history, trainer


def plot(histories: dict[str, LossHistory], tokens_per_step: int, out: Path, flush_steps: int) -> None:
    """Loss per step, loss per second and tokens per second of each schedule, in one PNG; ``flush_steps``: PACI's
    steps in flush order (its synchronous start)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time, speed) = plt.subplots(1, 3, figsize=(15, 4))
    rates = {}
    for name, history in histories.items():
        steps, seconds, losses = zip(*history.rows, strict=True)
        by_step.plot(steps, losses, label=name)
        by_time.plot(seconds, losses, label=name)
        rates[name] = len(history.rows) * tokens_per_step / history.seconds
    speed.bar(list(rates), list(rates.values()), color=["#4C72B0", "#C44E52"])
    ratio = rates["paci"] / rates["1f1b_flush"]
    steps = len(histories["paci"].rows)
    flush_steps = min(flush_steps, steps)
    ideal = (
        steps
        * (ACCUMULATE + STAGES - 1)
        / (flush_steps * (ACCUMULATE + STAGES - 1) + (steps - flush_steps) * ACCUMULATE)
    )
    speed.set_title(f"throughput: PACI / flush = {ratio:.2f}x (ideal {ideal:.2f}x)")
    speed.set_ylabel("tokens per second")
    by_step.set(xlabel="optimizer step", ylabel="train loss (nats per byte)", title="loss per step")
    by_time.set(xlabel="seconds", ylabel="train loss (nats per byte)", title="loss per wall-clock second")
    by_step.legend()
    by_time.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _sync_start(value: str) -> int | str:
    if value == "auto" or (value.isdigit() and int(value) >= 0):
        return value if value == "auto" else int(value)
    raise argparse.ArgumentTypeError(f"{value!r} is neither auto nor a count of optimizer steps >= 0")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per schedule")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--block-size", type=int, default=64, help="bytes per sequence")
    parser.add_argument("--out", type=Path, default=Path("runs/compare_schedules.png"))
    parser.add_argument(
        "--sync-start-steps",
        type=_sync_start,
        default="auto",
        help="PACI's first steps in flush order: auto (PACIStrategy's default) or a count",
    )
    args = parser.parse_args(argv)
    sync_start = args.sync_start_steps
    histories: dict[str, LossHistory] = {}
    flush_steps = 0
    trainer = None
    for schedule in ("paci", "1f1b_flush"):
        histories[schedule], trainer = train(schedule, args.steps, args.batch_size, args.block_size, sync_start)
        if schedule == "paci":
            flush_steps = trainer.strategy.sync_start  # as resolved at setup ("auto": 40 steps)
    if trainer is not None and trainer.is_global_zero:
        plot(histories, args.batch_size * args.block_size * ACCUMULATE, args.out, flush_steps)
        for name, history in histories.items():
            print(f"{name:>10}: {history.seconds:6.1f} s, final window loss {history.rows[-1][2]:.3f}")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
