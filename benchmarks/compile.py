"""torch.compile through the pipeline: tokens/s of inductor-compiled stages against eager, side by side.

The demo GPT split into S=2 stages runs whole in this process (`lit_efficient.runtime.host`: the same
stages, schedules and runtimes as on processes, so the compute per stage is what a stage process does),
once with eager layers and once with ``PipelineStage.compile_layers(torch.compile)`` (inductor, torch's
defaults; what ``PACIStrategy(compile_layers=True)`` does). Each variant first trains ``--warmup``
windows (the compiled one compiles there; its compile time is reported apart), then the rounds alternate
eager and compiled, ``--windows`` timed windows each, so the machine's drift hits both alike.

Run: ``python benchmarks/compile.py`` (about 5 minutes on 2 cores, most of it compiling); ``--quick``
checks the script. Results: benchmarks/results/compile.json and BENCHMARKS.md, "torch.compile".
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import machine, write_json  # noqa: E402
from lit_efficient.runtime.partition import partition_uniform, stage_bounds  # noqa: E402
from lit_efficient.runtime.stage import PipelineStage  # noqa: E402
from lit_efficient.tools.corpus import embedded_corpus  # noqa: E402
from lit_efficient.tools.demo import batches, build_layers, lm_loss  # noqa: E402
from lit_efficient.transport.local import local_pipeline  # noqa: E402


def _pipeline(layers, args, compiled: bool):
    stages = []
    for s, (lo, hi) in enumerate(stage_bounds(partition_uniform(len(layers), args.stages))):
        mine = layers[lo:hi]
        opt = torch.optim.AdamW([p for layer in mine for p in layer.parameters()], lr=args.lr)
        stage = PipelineStage(mine, s, args.stages, opt, lm_loss, first_layer=lo)
        if compiled:
            stage.compile_layers(torch.compile)
        stages.append(stage)
    return local_pipeline(stages, args.schedule, args.accumulate, lambda b: b[0])


def _train(pipeline, data, start: int) -> float:
    t0 = time.perf_counter()
    for j, batch in enumerate(data, start=start):
        pipeline.feed(batch, j)
    pipeline.drain()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, one round: checks the script")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--schedule", default="paci")
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=3, help="windows before timing (the compile happens here)")
    p.add_argument("--windows", type=int, default=6, help="timed windows per round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.quick:
        args.dim, args.block, args.windows, args.rounds, args.warmup = 64, 32, 2, 1, 2
    torch.manual_seed(0)
    layers = build_layers(n_layer=args.layers, dim=args.dim, heads=args.heads, block=args.block)
    variants = {name: _pipeline(copy.deepcopy(layers), args, name == "compiled") for name in ("eager", "compiled")}
    micro = args.accumulate
    stream = batches(embedded_corpus(2_000_000), args.block, args.batch_size, 0)
    warm = list(itertools.islice(stream, args.warmup * micro))
    warmup_seconds = {}
    next_index = {}
    for name, pipeline in variants.items():
        warmup_seconds[name] = _train(pipeline, warm, 0)
        next_index[name] = len(warm)
    # Same weights after the same windows: the compiled layers compute the eager function.
    diffs = [
        (a - b).abs().max().item()
        for sa, sb in zip(variants["eager"].runtimes, variants["compiled"].runtimes, strict=True)
        for a, b in zip(sa.stage.parameters(), sb.stage.parameters(), strict=True)
    ]
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    tokens = args.windows * micro * args.batch_size * args.block
    for _ in range(args.rounds):
        data = list(itertools.islice(stream, args.windows * micro))
        for name, pipeline in variants.items():
            seconds = _train(pipeline, data, next_index[name])
            next_index[name] += len(data)
            rounds[name].append(tokens / seconds)
    ratios = [c / e for c, e in zip(rounds["compiled"], rounds["eager"], strict=True)]
    result = {
        "tokens_per_second": rounds,
        "compiled_over_eager_per_round": ratios,
        "median_ratio": statistics.median(ratios),
        "warmup_seconds": warmup_seconds,
        "max_parameter_difference_after_warmup": max(diffs),
    }
    print(
        f"tokens/s eager {[round(x) for x in rounds['eager']]}, compiled {[round(x) for x in rounds['compiled']]}; "
        f"compiled/eager per round {[round(r, 3) for r in ratios]} (median {result['median_ratio']:.3f}); warm-up "
        f"(compile included) {warmup_seconds['compiled']:.1f} s vs {warmup_seconds['eager']:.1f} s eager; "
        f"max parameter difference after warm-up {max(diffs):.2e}"
    )
    path = write_json("compile_quick.json" if args.quick else "compile.json",
                      {"machine": machine(), "config": vars(args), "results": result})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
