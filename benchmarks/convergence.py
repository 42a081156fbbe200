"""Convergence of PACI against 1F1B-flush: validation loss against tokens and against wall time.

What is measured, and how:

- Real ``Trainer.fit`` runs of the same small `GPT` (same seed, same init, same data order:
  `TextDataModule()`'s embedded standard-library text) with ``PACIStrategy(pipeline_stages=2)``
  and N micro-batches per optimizer step, one with ``schedule="1f1b_flush"``, one with ``schedule="paci"``
  as a user writes it (its staleness defaults on), and with ``--runs ... paci_plain`` plain PACI (no weight
  prediction, no synchronous start). All run in ONE pair of spawned processes (gloo, one intra-op thread
  each), one after the other in ``--runs`` order (flush first), so none pays process start-up.
- Validation loss (``val_loss``, the same ``--val-batches`` batches every time) on rank 0 (the
  last stage) every ``--eval-every`` optimizer steps, including before training.
- Wall time is training time only: the time spent in validation (which for PACI includes the
  drain before it) is measured and subtracted, so the clock is what training alone costs.
- Time-to-target: the training time at which each run's validation loss first reaches a target
  (linear interpolation between evaluations). Targets: the points 80% and 95% of the way from
  the initial loss to the higher of the two runs' best losses, so both runs reach both.
- Final validation loss difference at equal tokens: (paci - flush) / flush at the last evaluation.
- The machine is shared: the load average at the start and the end of each run is recorded.
  Runs cannot be interleaved, so the wall-time ratio carries the load drift between the runs;
  the tokens axis does not.

    python -m benchmarks.convergence            # full run, ~5 minutes on 2 cores
    python -m benchmarks.convergence --quick    # smoke run, ~1 minute
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.harness import PLOTS, envelope, machine, pyplot, save_figure, write_json
from benchmarks.trainer_vs_torch_pipelining import spawn_pair

SCHEDULES = ("1f1b_flush", "paci")
# Run name -> PACIStrategy's arguments. "paci" is PACI as a user writes it (its staleness defaults on);
# "paci_plain" is PACI without them (no weight prediction, no synchronous start): what "paci" measured before
# the defaults existed; "paci_recompute" is a diagnostic: plain PACI with the forward recomputed at backward,
# so each stage's weight gradient uses its current weights throughout.
_PLAIN = {"staleness_correction": None, "sync_start_steps": 0}
RUNS: dict[str, dict[str, Any]] = {
    "1f1b_flush": {"schedule": "1f1b_flush"},
    "paci": {"schedule": "paci"},
    "paci_plain": {"schedule": "paci", **_PLAIN},
    "paci_recompute": {"schedule": "paci", "recompute": True, **_PLAIN},
}


class Recorder(Callback):
    """On every rank: training-only wall time; on rank 0: validation loss at each evaluation."""

    def __init__(self) -> None:
        self.val: list[tuple[int, float, float]] = []  # (optimizer step, training seconds, val loss)
        self.eval_seconds = 0.0
        self._start = 0.0
        self._eval_start = 0.0

    def _train_seconds(self) -> float:
        return time.perf_counter() - self._start - self.eval_seconds if self._start else 0.0

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: D102
        self._start, self.eval_seconds = time.perf_counter(), 0.0

    def on_validation_start(self, trainer, pl_module) -> None:  # noqa: D102
        self._eval_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: D102
        # Not on_validation_epoch_end: callback_metrics holds this evaluation's value only after it.
        if self._start:
            self.eval_seconds += time.perf_counter() - self._eval_start
        if trainer.global_rank == 0 and "val_loss" in trainer.callback_metrics:
            self.val.append((trainer.global_step, self._train_seconds(), trainer.callback_metrics["val_loss"].item()))


def _fit(config: dict[str, Any], name: str) -> dict[str, Any]:
    import lightning as L

    from lit_efficient import PACIStrategy
    from lit_efficient.data import TextDataModule
    from lit_efficient.models import GPT

    L.seed_everything(config["seed"], verbose=False)
    model = GPT(
        n_layer=config["layers"], n_head=config["heads"], n_embd=config["dim"], block_size=config["block"],
        dropout=0.0, learning_rate=config["lr"], warmup_steps=config["warmup"], max_steps=config["steps"],
        min_lr_ratio=0.1,
    )  # fmt: skip
    data = TextDataModule(
        block_size=config["block"], batch_size=config["batch_size"], max_bytes=config["max_bytes"], seed=config["seed"]
    )
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=config["steps"], accumulate_grad_batches=config["accumulate"],
        strategy=PACIStrategy(pipeline_stages=2, balance=[3, 3], **RUNS[name]),
        callbacks=[recorder],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=config["val_batches"], num_sanity_val_steps=config["val_batches"],
        val_check_interval=config["eval_every"] * config["accumulate"], check_val_every_n_epoch=None,
    )  # fmt: skip
    load = os.getloadavg()
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    torch.set_num_threads(1)
    return {
        "schedule": name, "val": recorder.val, "fit_seconds": time.perf_counter() - start,
        "eval_seconds": recorder.eval_seconds, "loadavg": [load, os.getloadavg()],
    }  # fmt: skip


def _worker(rank: int, world: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    return [_fit(config, name) for name in config["runs"]]


def time_to(val: list[list[float]], target: float) -> float:
    """Training seconds at which the loss first reaches ``target`` (interpolated); NaN if never."""
    for (_, t0, l0), (_, t1, l1) in zip(val, val[1:], strict=False):
        if l1 <= target:
            return t1 if l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return float("nan")


def summarize(runs: dict[str, dict[str, Any]], tokens_per_step: int) -> dict[str, Any]:
    flush, paci = runs["1f1b_flush"]["val"], runs["paci"]["val"]
    initial = flush[0][2]
    floor = max(min(v[2] for v in flush), min(v[2] for v in paci))
    targets = {}
    for frac in (0.8, 0.95):
        target = initial - frac * (initial - floor)
        t_flush, t_paci = time_to(flush, target), time_to(paci, target)
        targets[f"{int(frac * 100)}%"] = {
            "loss": target, "flush_seconds": t_flush, "paci_seconds": t_paci, "speedup": t_flush / t_paci,
        }  # fmt: skip
    others = {name: run["val"][-1][2] for name, run in runs.items() if name not in ("1f1b_flush", "paci")}
    return {
        "tokens_per_step": tokens_per_step,
        "final_tokens": flush[-1][0] * tokens_per_step,
        "final_val_loss": {"1f1b_flush": flush[-1][2], "paci": paci[-1][2], **others},
        "final_relative_difference": (paci[-1][2] - flush[-1][2]) / flush[-1][2],
        "final_relative_difference_of": {name: (loss - flush[-1][2]) / flush[-1][2] for name, loss in others.items()},
        "train_seconds": {"1f1b_flush": flush[-1][1], "paci": paci[-1][1]},
        "train_time_ratio": flush[-1][1] / paci[-1][1],
        "targets": targets,
    }


def plot(runs: dict[str, dict[str, Any]], tokens_per_step: int, path: Path, title: str) -> None:
    plt = pyplot()
    fig, (ax_tok, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    for schedule, run in runs.items():
        steps, seconds, losses = zip(*run["val"], strict=True)
        ax_tok.plot([s * tokens_per_step / 1e3 for s in steps], losses, marker=".", label=schedule)
        ax_time.plot(seconds, losses, marker=".", label=schedule)
    ax_tok.set_xlabel("training tokens (thousands)")
    ax_time.set_xlabel("training wall time, s (evaluation excluded)")
    for ax in (ax_tok, ax_time):
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path, 110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 24 steps")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step (N)")
    p.add_argument("--eval-every", type=int, default=20, help="optimizer steps between evaluations")
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--layers", type=int, default=4, help="GPT blocks (split [embed + 2 | 2 + head])")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch size")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--runs",
        nargs="+",
        default=["1f1b_flush", "paci"],
        choices=list(RUNS),
        help="runs, in this order (the summary needs 1f1b_flush and paci)",
    )
    p.add_argument("--out", default="convergence.json", help="file name under benchmarks/results/")
    p.add_argument("--plot", default="convergence.png", help="file name under benchmarks/plots/")
    args = p.parse_args(argv)
    if args.layers != 4:
        p.error("--layers must be 4 (the split is fixed to balance=[3, 3])")
    if args.quick:
        args.steps, args.eval_every, args.val_batches, args.block = 24, 6, 4, 64
        if args.out == "convergence.json":  # a smoke run never replaces the full result
            args.out, args.plot = "convergence_quick.json", "convergence_quick.png"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    config = vars(args)
    tokens_per_step = args.accumulate * args.batch_size * args.block
    start = time.perf_counter()
    before = machine()
    rank0 = spawn_pair(_worker, config, timeout=1800)[0]
    runs = {run["schedule"]: run for run in rank0}
    summary = summarize(runs, tokens_per_step) if {"1f1b_flush", "paci"} <= set(runs) else {}
    payload = envelope("convergence", args.quick, before, config, start, summary=summary, runs=runs)
    path = write_json(args.out, payload)
    title = (
        f"GPT {args.layers}x{args.dim}, block {args.block}, S=2, N={args.accumulate}, micro-batch {args.batch_size}; "
        f"{before['nproc']} shared cores, load {before['loadavg'][0]:.1f}"
    )
    plot(runs, tokens_per_step, PLOTS / args.plot, title)
    if summary:
        print(table(summary))
    for name, run in runs.items():
        print(name, "val loss at steps", [(v[0], round(v[2], 4)) for v in run["val"]])
    print(f"wrote {path} in {payload['wall_seconds']:.0f} s")
    return payload


def table(summary: dict[str, Any]) -> str:
    f, t = summary["final_val_loss"], summary["train_seconds"]
    lines = [
        "| | 1F1B-flush | PACI | PACI vs flush |",
        "|---|---|---|---|",
        f"| final val loss ({summary['final_tokens'] / 1e3:.0f}k tokens) | {f['1f1b_flush']:.4f} | {f['paci']:.4f} "
        f"| {summary['final_relative_difference']:+.2%} |",
        f"| training time, s | {t['1f1b_flush']:.1f} | {t['paci']:.1f} | {summary['train_time_ratio']:.2f}x faster |",
    ]
    for name, gap in summary.get("final_relative_difference_of", {}).items():
        lines.append(f"| final val loss, {name} | | {f[name]:.4f} | {gap:+.2%} |")
    for name, tg in summary["targets"].items():
        lines.append(
            f"| time to val loss {tg['loss']:.3f} ({name} of the descent), s | {tg['flush_seconds']:.1f} "
            f"| {tg['paci_seconds']:.1f} | {tg['speedup']:.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
