"""bf16 on the wire: what rounding every stage-boundary tensor to bfloat16 costs, against float32 transfers.

Two S=2 pipelines of the demo GPT on real processes (gloo, CPU), identical but for
``WireFormat(float32_as=...)``, on the same data from the same initial weights:

- *gradient error*: one window of N micro-batches from the initial weights, every stage's accumulated
  gradient under the bf16 wire against the fp32 wire (relative L2 error per stage, and cosine);
- *training*: W windows of AdamW under 1F1B-flush (exact, so the only difference is the wire) and PACI;
  the mean training loss of the last windows, and the held-out loss at the end, per wire format;
- *bytes*: what each stage sent per micro-batch (`PointToPoint.bytes_sent`).

Run: ``python benchmarks/wire_dtype.py`` (about 4 minutes on 2 cores); ``--quick`` for a smoke run.
Results: benchmarks/results/wire_dtype.json and BENCHMARKS.md, "bf16 on the wire".
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import machine, write_json  # noqa: E402
from lit_efficient.runtime.interpreter import PipelineRuntime  # noqa: E402
from lit_efficient.runtime.partition import partition_uniform, stage_bounds  # noqa: E402
from lit_efficient.runtime.stage import PipelineStage  # noqa: E402
from lit_efficient.runtime.topology import Topology  # noqa: E402
from lit_efficient.tools.corpus import embedded_corpus  # noqa: E402
from lit_efficient.tools.demo import batches, build_layers, lm_loss  # noqa: E402
from lit_efficient.transport.process import LinkGroups, PointToPoint  # noqa: E402
from lit_efficient.transport.wire import WireFormat  # noqa: E402
from tests.support.multiproc import spawn, values  # noqa: E402

WIRES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _run(rank, world, args, wire_name, schedule, windows):
    topo = Topology.for_world(world, world)
    s = topo.stage_of(rank)
    layers = build_layers(n_layer=args.layers, dim=args.dim, heads=args.heads, block=args.block, seed=args.seed)
    lo, hi = stage_bounds(partition_uniform(len(layers), world))[s]
    params = [p for layer in layers[lo:hi] for p in layer.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    grads: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: grads.append([p.grad.clone() for p in params]) if not grads else None)
    stage = PipelineStage(layers[lo:hi], s, world, opt, lm_loss)
    comm = PointToPoint(s, topo.stage_of, torch.device("cpu"), 300.0, groups=LinkGroups.create(),
                        wire=WireFormat(WIRES[wire_name]))  # fmt: skip
    runtime = PipelineRuntime(stage, schedule, args.accumulate, lambda b: b[0], comm, *topo.neighbours(rank))
    stream = batches(embedded_corpus(args.max_bytes), args.block, args.batch_size, args.seed)
    data = list(itertools.islice(stream, windows * args.accumulate + args.eval_batches))
    train, held_out = data[: windows * args.accumulate], data[windows * args.accumulate :]
    losses = []
    for j, batch in enumerate(train):
        loss = runtime.feed(batch, j)
        if loss is not None:
            losses.append(float(loss))  # host sync per micro-batch: a benchmark, not the hot path
    runtime.drain()
    eval_losses = []
    for i, batch in enumerate(held_out):
        out = runtime.evaluate(batch, i)
        if out is not None:
            eval_losses.append(float(lm_loss(out[0], batch)[0]))
    comm.flush()  # evaluation's sends are not waited on by the runtime; the rank exits after this
    return {
        "stage": s,
        "first_window_grads": grads[0],
        "losses": losses,
        "eval_loss": sum(eval_losses) / len(eval_losses) if eval_losses else None,
        "bytes_per_microbatch": comm.bytes_sent / len(train),
    }


def _grad_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
    diff = math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True)))
    norm = math.sqrt(sum(float(x.pow(2).sum()) for x in a))
    dot = sum(float((x * y).sum()) for x, y in zip(a, b, strict=True))
    other = math.sqrt(sum(float(y.pow(2).sum()) for y in b))
    return {"relative_l2": diff / norm, "cosine": dot / (norm * other)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few windows: checks the script, measures nothing")
    p.add_argument("--windows", type=int, default=150, help="optimizer steps of the training runs")
    p.add_argument("--accumulate", type=int, default=4, help="N")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    windows = 3 if args.quick else args.windows
    results: dict[str, dict] = {}
    for schedule in ("1f1b_flush", "paci"):
        for wire in WIRES:
            ranks = values(spawn(_run, 2, args, wire, schedule, windows, timeout=1800.0))
            results[f"{schedule}/{wire}"] = {r["stage"]: r for r in ranks}
    tail = max(1, windows // 10)
    report: dict[str, dict] = {}
    for schedule in ("1f1b_flush", "paci"):
        fp32, bf16 = results[f"{schedule}/float32"], results[f"{schedule}/bfloat16"]
        last = 1  # the last stage holds the loss
        row = {
            "grad_error_per_stage": {
                s: _grad_error(fp32[s]["first_window_grads"], bf16[s]["first_window_grads"]) for s in (0, 1)
            },
            "train_loss_tail": {
                w: sum(r[last]["losses"][-tail:]) / tail for w, r in (("float32", fp32), ("bfloat16", bf16))
            },
            "eval_loss": {"float32": fp32[last]["eval_loss"], "bfloat16": bf16[last]["eval_loss"]},
            "bytes_per_microbatch": {
                w: {s: r[s]["bytes_per_microbatch"] for s in (0, 1)} for w, r in (("float32", fp32), ("bfloat16", bf16))
            },
        }  # fmt: skip
        row["eval_loss_relative_difference"] = row["eval_loss"]["bfloat16"] / row["eval_loss"]["float32"] - 1
        report[schedule] = row
        print(f"{schedule}: grad error (relative L2) per stage "
              + ", ".join(f"s{s} {e['relative_l2']:.2e} (cos {e['cosine']:.6f})"
                          for s, e in row["grad_error_per_stage"].items())
              + f"; eval loss fp32 {row['eval_loss']['float32']:.4f} bf16 {row['eval_loss']['bfloat16']:.4f} "
              f"({row['eval_loss_relative_difference']:+.3%}); bytes/micro-batch stage 0 "
              f"{row['bytes_per_microbatch']['float32'][0]:.0f} -> "
              f"{row['bytes_per_microbatch']['bfloat16'][0]:.0f}")  # fmt: skip
    config = {k: v for k, v in vars(args).items()}
    config["windows"] = windows
    path = write_json("wire_dtype_quick.json" if args.quick else "wire_dtype.json",
                      {"machine": machine(), "config": config, "results": report})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
