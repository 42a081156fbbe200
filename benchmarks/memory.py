"""Peak memory per stage: PACI against 1F1B-flush, keep-graph against recompute (S=2, real GPT layers).

What is measured, and how (on CPU there is no allocator peak counter, so two honest proxies):

- Each of the four configurations (schedule x ``recompute``) runs in a FRESH pair of spawned
  processes (gloo, one intra-op thread each), driving the real `PipelineRuntime` / `PipelineStage`
  on the GPT's layers (embed + 2 blocks | 2 blocks + head), ``warm + windows`` windows of N
  micro-batches, then a drain.
- **tracked bytes** (exact, deterministic): parameters + gradients + AdamW state of the stage, plus
  the peak of (a) the distinct storages autograd saved for backward (``saved_tensors_hooks``:
  `SavedTensorMeter` of `benchmarks.runtime_throughput`; with ``recompute`` this is the one
  micro-batch being recomputed) and (b) the stage inputs a recompute stage holds per micro-batch in
  flight (sampled after every feed). Not counted: tensors in transit in gloo, allocator slack.
- **peak RSS growth** (noisy, everything): ``ru_maxrss`` at the end minus ``ru_maxrss`` after the
  model and data were built and before the first micro-batch: activations, gradients, optimizer
  state, gloo buffers and glibc's allocator caching. A fresh process pair per configuration, so
  one configuration's peak cannot hide another's.

- PACI's default staleness correction (``"auto"``: the in-place first-step weight prediction) and its stashing
  form (``"weight_prediction_first_step"``) run as plain PACI keep-graph with the correction on the stage;
  the stash they keep between stale forwards is counted in the tracked bytes, and the in-place form's chunk
  temporaries show in the RSS growth only.

    python -m benchmarks.memory            # full run, ~1-2 minutes on 2 cores
    python -m benchmarks.memory --quick    # smoke run, small model
"""

from __future__ import annotations

import argparse
import itertools
import resource
import time
from typing import Any

import torch

from benchmarks.harness import envelope, machine, write_json
from benchmarks.runtime_throughput import SavedTensorMeter
from benchmarks.trainer_vs_torch_pipelining import build_data, build_model, spawn_pair, stage_layers
from lit_efficient.runtime.interpreter import PipelineRuntime
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.staleness import make_correction
from lit_efficient.runtime.topology import Topology
from lit_efficient.transport.process import PointToPoint

# (schedule, recompute, staleness correction): plain PACI, and PACI's default correction ("auto": the in-place
# first-step weight prediction) against its stashing form (a copy of the stage's weights during stale forwards).
CONFIGS = [
    ("1f1b_flush", False, None), ("paci", False, None), ("1f1b_flush", True, None), ("paci", True, None),
    ("paci", False, "auto"), ("paci", False, "weight_prediction_first_step"),
]  # fmt: skip


def _bytes(tensors: Any) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor))


def _worker(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    topo = Topology.for_world(world, world)
    s = topo.stage_of(rank)
    datamodule = build_data(config)
    datamodule.setup("fit")
    data = list(itertools.islice(iter(datamodule.train_dataloader()), 32))
    model = build_model(config, 1000)
    layers = stage_layers(model, s)
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.0)
    stage = PipelineStage(layers, s, world, optimizer, loss_fn=model.pipeline_loss, recompute=config["recompute"])
    stage.correction = make_correction(
        config["correction"], config["schedule"], s, world, config["accumulate"], 100, optimizer
    )
    comm = PointToPoint(s, topo.stage_of, torch.device("cpu"), timeout=300.0)
    prev_rank, next_rank = topo.neighbours(rank)
    runtime = PipelineRuntime(
        stage, config["schedule"], config["accumulate"], model.pipeline_input, comm, prev_rank, next_rank
    )
    rss_base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    held_peak = 0
    with SavedTensorMeter(params) as meter:
        for index, batch in enumerate(
            itertools.islice(itertools.cycle(data), config["windows"] * config["accumulate"])
        ):
            runtime.feed(batch, index)
            if config["recompute"]:  # what a recompute stage keeps per micro-batch: its detached inputs
                held = _bytes(t for record in stage._in_flight.values() for t in record.inputs)
                held_peak = max(held_peak, held)
        runtime.drain()
        saved_peak = meter.peak
    state = [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return {
        "stage": s,
        "param_bytes": _bytes(params),
        "grad_bytes": _bytes(p.grad for p in params),
        "optimizer_bytes": _bytes(state),
        "saved_peak_bytes": saved_peak,
        "held_inputs_peak_bytes": held_peak,
        "max_in_flight": stage.stats.max_in_flight,
        # The correction's persistent buffer (the stashing prediction's copy of the weights; None in place).
        "prediction_stash_bytes": _bytes(getattr(stage.correction, "_stash", None) or ()),
        "rss_growth_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_base) * 1024,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: small model, 2 windows")
    p.add_argument("--accumulate", type=int, default=8, help="micro-batches per optimizer step (N)")
    p.add_argument("--windows", type=int, default=3, help="windows of N micro-batches per configuration")
    p.add_argument("--layers", type=int, default=4, help="GPT blocks (split [embed + 2 | 2 + head])")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=256, help="sequence length")
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch size")
    p.add_argument("--max-bytes", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="memory.json", help="file name under benchmarks/results/")
    args = p.parse_args(argv)
    if args.layers != 4:
        p.error("--layers must be 4 (the split is fixed to [3, 3])")
    if args.quick:
        args.dim, args.block, args.batch_size, args.windows, args.accumulate = 128, 128, 4, 2, 4
        if args.out == "memory.json":  # a smoke run never replaces the full result
            args.out = "memory_quick.json"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    before = machine()
    rows = []
    for schedule, recompute, correction in CONFIGS:
        config = {**vars(args), "schedule": schedule, "recompute": recompute, "correction": correction}
        ranks = sorted(spawn_pair(_worker, config, timeout=600), key=lambda r: r["stage"])
        for r in ranks:
            r["tracked_bytes"] = (
                r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] + r["saved_peak_bytes"]
                + r["held_inputs_peak_bytes"] + r["prediction_stash_bytes"]
            )  # fmt: skip
        rows.append({"schedule": schedule, "recompute": recompute, "correction": correction, "stages": ranks})
        print(f"{schedule} recompute={recompute} correction={correction}: "
              + ", ".join(f"{r['tracked_bytes'] / 2**20:.1f} MiB" for r in ranks))  # fmt: skip
    by = {(r["schedule"], r["recompute"], r["correction"]): r for r in rows}
    ratios = {}
    for key, paci in (
        ("keep_graph", ("paci", False, None)), ("recompute", ("paci", True, None)),
        ("default", ("paci", False, "auto")), ("stashing_prediction", ("paci", False, "weight_prediction_first_step")),
    ):  # fmt: skip
        p, f = by[paci]["stages"], by[("1f1b_flush", paci[1], None)]["stages"]
        ratios[key] = {
            "tracked": [a["tracked_bytes"] / b["tracked_bytes"] for a, b in zip(p, f, strict=True)],
            "rss_growth": [a["rss_growth_bytes"] / max(b["rss_growth_bytes"], 1) for a, b in zip(p, f, strict=True)],
        }
    payload = envelope("memory", args.quick, before, vars(args), start, rows=rows, paci_over_flush=ratios)
    path = write_json(args.out, payload)
    print(table(payload))
    print(f"wrote {path} in {payload['wall_seconds']:.0f} s")
    return payload


def table(payload: dict[str, Any]) -> str:
    mib = 2**20
    lines = [
        "| schedule | recompute | correction | stage | params+grads+AdamW, MiB | saved-for-backward peak, MiB "
        "| held inputs peak, MiB | prediction stash, MiB | tracked total, MiB | peak RSS growth, MiB | max in flight |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in payload["rows"]:
        for r in row["stages"]:
            static = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
            lines.append(
                f"| {row['schedule']} | {row['recompute']} | {row.get('correction')} | {r['stage']} | "
                f"{static / mib:.1f} | {r['saved_peak_bytes'] / mib:.1f} | {r['held_inputs_peak_bytes'] / mib:.2f} | "
                f"{r.get('prediction_stash_bytes', 0) / mib:.1f} | "
                f"{r['tracked_bytes'] / mib:.1f} | {r['rss_growth_bytes'] / mib:.1f} | {r['max_in_flight']} |"
            )
    for key, ratio in payload["paci_over_flush"].items():
        lines.append(
            f"\nPACI / flush ({key}), stage 0 / stage 1: tracked "
            + " / ".join(f"{x:.3f}" for x in ratio["tracked"]) + "; RSS growth "
            + " / ".join(f"{x:.2f}" for x in ratio["rss_growth"])
        )  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
