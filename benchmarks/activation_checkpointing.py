"""Activation checkpointing: bytes kept for backward and step time, none / selective / full (CPU).

What is measured, and how:

- One GPT (default n_layer=4, n_embd=256, block_size=256, batch 8, vocab 256) in three copies with the
  same weights: unwrapped, wrapped by ``ActivationCheckpointing(mode="selective")`` and by
  ``ActivationCheckpointing(mode="full")`` (every block).
- Saved bytes: one untimed forward per mode under `SavedActivationMeter` (distinct tensor storages
  autograd keeps for backward, parameters excluded, selective mode's cached matmul/attention outputs
  included), for the whole model (embedding, blocks, head, loss) and for the block stack alone.
- Step time: forward + loss + backward of one micro-batch (no optimizer step), modes interleaved
  round-robin (none, selective, full, none, ...) after one discarded step each, so drift of a shared
  machine hits every mode alike; the median per mode is reported, with its ratio to none.

    python -m benchmarks.activation_checkpointing            # ~1 minute on 2 cores
    python -m benchmarks.activation_checkpointing --quick    # smoke run, a few seconds
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from typing import Any

import torch

from benchmarks.harness import write_json
from lit_efficient.callbacks import ActivationCheckpointing
from lit_efficient.callbacks.activation_checkpointing import SavedActivationMeter
from lit_efficient.models import GPT

MODES = ("none", "selective", "full")


def build(args: argparse.Namespace) -> dict[str, GPT]:
    torch.manual_seed(0)
    base = GPT(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout
    ).train()
    models = {}
    for mode in MODES:
        model = copy.deepcopy(base)
        if mode != "none":
            ActivationCheckpointing(mode=mode).wrap(model)
        models[mode] = model
    return models


def step(model: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    loss, _ = model.pipeline_loss(model(batch[0]), batch)
    loss.backward()


def saved_bytes(model: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int]:
    """(whole model, block stack only) bytes kept for backward by one forward."""
    with SavedActivationMeter(exclude=[model]) as meter:
        loss, _ = model.pipeline_loss(model(batch[0]), batch)
    del loss
    hidden = model.embed(batch[0]).detach().requires_grad_()
    with SavedActivationMeter(exclude=[model]) as blocks:
        for block in model.blocks:
            hidden = block(hidden)
    return meter.bytes, blocks.bytes


def run(args: argparse.Namespace) -> dict[str, Any]:
    models = build(args)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.batch, args.block_size + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])

    result: dict[str, Any] = {"modes": {}}
    for mode, model in models.items():
        model_bytes, block_bytes = saved_bytes(model, batch)
        result["modes"][mode] = {"saved_bytes_model": model_bytes, "saved_bytes_blocks": block_bytes, "step_s": []}
        step(model, batch)  # warm-up, discarded
    for _ in range(args.repeats):
        for mode, model in models.items():
            t0 = time.perf_counter()
            step(model, batch)
            result["modes"][mode]["step_s"].append(time.perf_counter() - t0)

    none = result["modes"]["none"]
    none_median = statistics.median(none["step_s"])
    for entry in result["modes"].values():
        entry["step_s_median"] = statistics.median(entry["step_s"])
        entry["time_vs_none"] = entry["step_s_median"] / none_median
        entry["saved_model_vs_none"] = entry["saved_bytes_model"] / none["saved_bytes_model"]
        entry["saved_blocks_vs_none"] = entry["saved_bytes_blocks"] / none["saved_bytes_blocks"]
    result["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    result["machine"] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor(),
    }
    return result


def table(result: dict[str, Any]) -> str:
    mib = 2**20
    rows = [
        "| mode | saved, blocks (MiB) | vs none | saved, model (MiB) | vs none | step fwd+bwd (s, median) | vs none |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, e in result["modes"].items():
        rows.append(
            f"| {mode} | {e['saved_bytes_blocks'] / mib:.1f} | {e['saved_blocks_vs_none']:.2f}x "
            f"| {e['saved_bytes_model'] / mib:.1f} | {e['saved_model_vs_none']:.2f}x "
            f"| {e['step_s_median']:.3f} | {e['time_vs_none']:.2f}x |"
        )
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.0, help="0 takes CPU's fused SDPA kernel; >0 the math path")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per mode, interleaved")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 repeats: a smoke run")
    p.add_argument("--out", default="activation_checkpointing.json", help="file name under benchmarks/results/")
    args = p.parse_args(argv)
    if args.quick:
        args.n_layer, args.n_embd, args.block_size, args.batch, args.repeats = 2, 64, 64, 2, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    print(
        f"GPT n_layer={args.n_layer} n_embd={args.n_embd} block_size={args.block_size} batch={args.batch} "
        f"dropout={args.dropout}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.repeats} interleaved repeats\n"
    )
    print(table(result))
    path = write_json(args.out, result)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
