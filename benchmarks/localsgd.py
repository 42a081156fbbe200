"""LocalSGD and DiLoCo against synchronous data parallelism: traffic per step and loss per token.

What is measured, and how:

- Every run is a real ``Trainer.fit`` of the same small `GPT` (same seed, same init) on the
  embedded corpus (`TextDataModule()`'s standard-library text, same shuffle seed) over 2
  data-parallel replicas: ``PACIStrategy(pipeline_stages=1)``, i.e. plain data parallelism, two
  spawned processes on gloo, one intra-op thread each. Inner optimizer: the model's AdamW with
  warmup + cosine (its state stays local to each replica). N micro-batches per optimizer step.
- Runs: synchronous DP (``local_sgd_steps=None``: gradient all-reduce every step), LocalSGD with
  H in {4, 16} (parameter averaging every H steps), DiLoCo (H=16, outer Nesterov SGD, lr 0.7,
  momentum 0.9), and a short H=1 run for its traffic only.
- Bytes per optimizer step, measured on global rank 0 (the only stage of replica 0): LocalSGD/DiLoCo
  read `ReplicaAverager.bytes_per_step` (payload handed to the sync all-reduces divided by local
  steps, the one-time broadcast at construction excluded; the number the strategy logs as
  ``localsgd/bytes_per_step``). Synchronous DP counts the payload of the gradient all-reduce calls
  (`all_reduce_flat`, wrapped in the child) divided by steps. Payload, not wire bytes.
- Validation loss against training tokens (tokens = steps x N x batch x block x replicas), measured
  on rank 0 every ``eval_every`` steps, a multiple of 16: right after a sync for every H, so each
  point is the replicas' common model, not one replica's drifted copy. Before training: the
  sanity-check evaluation (same batches).
- Divergence: `ReplicaAverager.last_divergence` (relative L2 distance of replica 0 to the mean just
  before a sync) at every sync, on rank 0.
- Wall time per run is recorded for context only: on a shared 2-core machine with gloo over
  loopback, communication is nearly free and the times say nothing about the savings on a network.

    python -m benchmarks.localsgd            # full run, ~5-8 minutes on 2 cores
    python -m benchmarks.localsgd --quick    # smoke run, ~2 minutes
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from benchmarks.harness import PLOTS, machine, pyplot, save_figure, write_json
from lit_efficient import PACIStrategy
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT

REPLICAS = 2


class _Recorder(Callback):
    """In every spawned rank: counts gradient all-reduce bytes (synchronous DP); on rank 0 records
    validation losses, sync divergences and traffic, written to ``<out>/rank0.json`` at the end."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.record: dict[str, Any] = {"val": [], "divergence": []}
        self.reduced_bytes = 0
        self._last_step = 0

    def setup(self, trainer, pl_module, stage) -> None:
        # The stage's gradient reduction (strategy/step_hooks.py) looks all_reduce_flat up at call time: count
        # what it sends.
        import lit_efficient.strategy.step_hooks as step_hooks

        inner = step_hooks.all_reduce_flat

        def counting(tensors, group=None):
            sent = inner(tensors, group)
            self.reduced_bytes += sent
            return sent

        step_hooks.all_reduce_flat = counting

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        averager = trainer.strategy.averager
        if trainer.global_rank != 0 or averager is None or averager.step == self._last_step:
            return
        self._last_step = averager.step
        if averager.is_sync_step(averager.step):
            self.record["divergence"].append([averager.step, averager.last_divergence])

    def on_validation_end(self, trainer, pl_module) -> None:
        # Not on_validation_epoch_end: Lightning fills callback_metrics with this evaluation's epoch
        # values only after that hook.
        if trainer.global_rank == 0 and "val_loss" in trainer.callback_metrics:
            self.record["val"].append([trainer.global_step, trainer.callback_metrics["val_loss"].item()])

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0:
            return
        s = trainer.strategy
        stage = s.runtime.stage
        steps = stage.stats.steps
        averager = s.averager
        self.record.update(
            steps=steps,
            train_seconds=time.perf_counter() - self._start,
            param_bytes=sum(p.numel() * p.element_size() for p in stage.parameters()),
            bytes_per_step=averager.bytes_per_step if averager is not None else self.reduced_bytes / max(steps, 1),
            logged={k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("localsgd/")},
        )
        Path(self.out, "rank0.json").write_text(json.dumps(self.record))


def _run(name: str, strategy_kwargs: dict[str, Any], args: argparse.Namespace, steps: int, evaluate: bool) -> dict:
    out = Path(args.tmp, name)
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(args.seed)
    model = GPT(
        n_layer=args.layers, n_head=args.heads, n_embd=args.dim, block_size=args.block, learning_rate=args.lr,
        warmup_steps=args.warmup, max_steps=args.steps, min_lr_ratio=0.1,
    )  # fmt: skip
    data = TextDataModule(block_size=args.block, batch_size=args.batch_size, max_bytes=args.max_bytes, seed=args.seed)
    trainer = L.Trainer(
        accelerator="cpu", devices=REPLICAS, max_steps=steps, accumulate_grad_batches=args.accumulate,
        strategy=PACIStrategy(pipeline_stages=1, start_method="spawn", **strategy_kwargs),
        callbacks=[_Recorder(str(out))], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=args.val_batches if evaluate else 0,
        num_sanity_val_steps=args.val_batches if evaluate else 0,
        val_check_interval=args.eval_every * args.accumulate, check_val_every_n_epoch=None,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    record = json.loads(Path(out, "rank0.json").read_text())
    record.update(name=name, config=strategy_kwargs, wall_seconds=time.perf_counter() - start)
    tokens_per_step = REPLICAS * args.accumulate * args.batch_size * args.block
    record["val"] = [[step * tokens_per_step, loss] for step, loss in record["val"]]
    print(f"{name}: {record['bytes_per_step']:.0f} B/step, val {record['val'][-1:]} ({record['wall_seconds']:.0f} s)")
    return record


RUNS: list[tuple[str, dict[str, Any], bool]] = [
    ("sync DP", {}, True),
    ("LocalSGD H=1", {"local_sgd_steps": 1}, False),
    ("LocalSGD H=4", {"local_sgd_steps": 4}, True),
    ("LocalSGD H=16", {"local_sgd_steps": 16}, True),
    ("DiLoCo H=16", dict(local_sgd_steps=16, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9), True),
]


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    """Validation loss against training tokens, one line per run."""
    curves = [run for run in runs if len(run["val"]) > 1]
    if not curves:
        return
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for run in curves:
        tokens, loss = zip(*run["val"], strict=True)
        ax.plot([t / 1e3 for t in tokens], loss, marker="o", markersize=3, label=run["name"])
    # The untrained loss (the first point, shared by every run) would flatten the differences.
    start = max(run["val"][0][1] for run in curves)
    later = [loss for run in curves for _, loss in run["val"][1:]]
    ax.set_ylim(min(later) - 0.05, max(later) + 0.05)
    ax.set_xlabel("training tokens (thousands, both replicas)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"{title}\nloss before training {start:.2f} (off the chart)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path, 120)


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown table of traffic and final loss per run."""
    base = next((r for r in runs if r["name"] == "sync DP"), runs[0])
    lines = [
        "| run | bytes / optimizer step | vs sync DP | final val loss | mean divergence at sync | wall s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        div = [d for _, d in r["divergence"]]
        lines.append(
            f"| {r['name']} | {r['bytes_per_step']:,.0f} | {r['bytes_per_step'] / base['bytes_per_step']:.3f} | "
            f"{r['val'][-1][1] if r['val'] else float('nan'):.4f} | "
            f"{(sum(div) / len(div)) if div else 0.0:.2e} | {r['wall_seconds']:.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 48 steps")
    p.add_argument("--steps", type=int, default=256, help="optimizer steps per run")
    p.add_argument("--h1-steps", type=int, default=16, help="optimizer steps of the traffic-only H=1 run")
    p.add_argument("--eval-every", type=int, default=16, help="optimizer steps between evaluations (multiple of 16)")
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step (N)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="+", help="run only these runs (names as in the table, e.g. 'sync DP')")
    p.add_argument("--out", default="localsgd.json", help="file name under benchmarks/results/")
    p.add_argument("--plot", default="localsgd_val_loss.png", help="file name under benchmarks/plots/")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.h1_steps, args.val_batches = 48, 4, 4
        if args.out == "localsgd.json":
            args.out = "localsgd_quick.json"
        if args.plot == "localsgd_val_loss.png":
            args.plot = "localsgd_val_loss_quick.png"
    if args.eval_every % 16:
        p.error(f"--eval-every={args.eval_every} must be a multiple of 16 (a sync step for every H)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import tempfile

    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        runs = [
            _run(name, kwargs, args, args.steps if evaluate else args.h1_steps, evaluate)
            for name, kwargs, evaluate in RUNS
            if not args.only or name in args.only
        ]
    del args.tmp
    about = machine()
    result = {
        "config": vars(args),
        "machine": {k: about[k] for k in ("nproc", "torch", "python", "loadavg")},
        "runs": runs,
        "table": table(runs),
    }
    path = write_json(args.out, result)
    title = (
        f"GPT {args.layers}x{args.dim}, 2 replicas, N={args.accumulate}, batch {args.batch_size}x{args.block}, "
        f"AdamW {args.lr} (inner)"
    )
    plot(runs, PLOTS / args.plot, title)
    print(result["table"])
    print(f"results: {path}\nplot: {PLOTS / args.plot}")
    return result


if __name__ == "__main__":
    main()
