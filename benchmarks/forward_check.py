"""What the forward check costs a fit: one trace of ``forward`` on fake tensors at the fit's first batch, on rank 0.

`lit_efficient.strategy.forward_check` follows the tensors of a forward run on fake tensors (shapes only, no
arithmetic), so its time grows with the number of operations, not their size. Against it, one real forward of a
single sample of the same batch on one thread: what a numerical check of forward against the chain would cost at
least (twice, with the chain). Median of ``--repeats`` calls after one warm-up, alternated.

    python -m benchmarks.forward_check            # GPT 6x256 block 256 and GPT-2 small's shape, ~1 minute
    python -m benchmarks.forward_check --quick    # smoke run
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
from lit_efficient.strategy.forward_check import forward_outside_layers

SHAPES = {
    "gpt_6x256_block256": dict(n_layer=6, n_head=8, n_embd=256, block_size=256, vocab_size=256),
    "gpt2_small_12x768_block1024": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
}


def measure(shape: dict[str, Any], batch_size: int, repeats: int) -> dict[str, Any]:
    model = GPT(**shape)
    layers = list(model.pipeline_layers())
    tokens = torch.zeros(batch_size, shape["block_size"], dtype=torch.long)
    batch = (tokens, tokens)
    said = forward_outside_layers(model, layers, batch)  # warm-up; GPT's forward chains its layers
    traces, forwards = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        forward_outside_layers(model, layers, batch)
        traces.append(time.perf_counter() - start)
        with torch.no_grad():
            start = time.perf_counter()
            model(tokens[:1])
            forwards.append(time.perf_counter() - start)
    return {
        "said": said, "trace_s": traces, "one_sample_forward_s": forwards,
        "trace_median_ms": 1e3 * statistics.median(traces),
        "one_sample_forward_median_ms": 1e3 * statistics.median(forwards),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: the small shape only, one repeat")
    parser.add_argument("--repeats", type=int, default=3, help="alternated trace/forward pairs (default 3)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = {"gpt_6x256_block256": SHAPES["gpt_6x256_block256"]} if args.quick else SHAPES
    config = {"batch_size": 8, "threads": 1, "shapes": shapes, "repeats": 1 if args.quick else args.repeats}
    before, start = machine(), time.perf_counter()
    results = {name: measure(shape, 8, config["repeats"]) for name, shape in shapes.items()}
    for name, r in results.items():
        print(f"{name}: trace {r['trace_median_ms']:.0f} ms, one sample's real forward "
              f"{r['one_sample_forward_median_ms']:.0f} ms, said {r['said']!r}")  # fmt: skip
    path = record("forward_check", args.quick, before, config, start, results=results)
    print(json.dumps({k: r["trace_median_ms"] for k, r in results.items()}), f"written to {path}")


if __name__ == "__main__":
    main()
