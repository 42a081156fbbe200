"""What ``PipelineMonitor(grad_norm=True)`` costs a step: one squared norm of a stage's gradients per optimizer step.

Each stage measures its step's gradients with `lit_efficient.runtime.tied.squared_grad_norm` (the function flush's
norm clipping calls too) once per optimizer step. Against it, one micro-batch's forward and backward of the same
layers on one thread: a step is N of those, so the cost of a step is ``norm / (N x micro-batch)``. Medians of
``--repeats`` alternated pairs after one warm-up each.

    python -m benchmarks.grad_norm            # the quickstart's GPT (6x128, block 128, micro-batch 8), ~1 minute
    python -m benchmarks.grad_norm --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from benchmarks.harness import machine, record
from lit_efficient.models import GPT
from lit_efficient.runtime.tied import squared_grad_norm

SHAPE = dict(vocab_size=256, block_size=128, n_layer=6, n_head=4, n_embd=128)


def measure(shape: dict[str, Any], batch_size: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(**shape)
    tokens = torch.randint(0, shape["vocab_size"], (batch_size, shape["block_size"]))
    params = list(model.parameters())
    cpu = torch.device("cpu")

    def micro_batch() -> None:
        loss, _ = model.pipeline_loss(model(tokens), (tokens, tokens))
        loss.backward()

    micro_batch()  # warm-up; leaves gradients for the norm
    squared_grad_norm(params, cpu)
    norms, micro_batches = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        squared_grad_norm(params, cpu).item()
        norms.append(time.perf_counter() - start)
        start = time.perf_counter()
        micro_batch()
        micro_batches.append(time.perf_counter() - start)
    norm, step = statistics.median(norms), statistics.median(micro_batches)
    return {
        "parameters": sum(p.numel() for p in params), "tensors": len(params),
        "norm_s": norms, "micro_batch_s": micro_batches,
        "norm_median_ms": 1e3 * norm, "micro_batch_median_ms": 1e3 * step,
        "share_of_a_step": {n: norm / (n * step) for n in (1, 4, 8)},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: a 2-layer model, two repeats")
    parser.add_argument("--repeats", type=int, default=20, help="alternated norm/micro-batch pairs (default 20)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = {**SHAPE, "n_layer": 2} if args.quick else SHAPE
    config = {"batch_size": 8, "threads": 1, "shape": shape, "repeats": 2 if args.quick else args.repeats}
    before, start = machine(), time.perf_counter()
    result = measure(shape, 8, config["repeats"])
    shares = ", ".join(f"{v:.2%}" for v in result["share_of_a_step"].values())
    print(f"{result['parameters']:,} parameters in {result['tensors']} tensors: norm {result['norm_median_ms']:.2f} "
          f"ms, one micro-batch's forward+backward {result['micro_batch_median_ms']:.0f} ms; a step's share at "
          f"N=1/4/8: {shares}")  # fmt: skip
    path = record("grad_norm", args.quick, before, config, start, result=result)
    print(json.dumps(result["share_of_a_step"]), f"written to {path}")


if __name__ == "__main__":
    main()
