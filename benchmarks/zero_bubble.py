"""PACI against the zero-bubble family and every other torch.distributed.pipelining schedule, side by side (S=2).

What is measured, and how:

- One pair of processes (gloo, one intra-op thread each: S=2 real-compute ranks on a 2-core
  machine) runs every variant, interleaved in rounds (order rotated per round), on the same GPT
  (n_layer 4: ``embed, b0..b3, head``), micro-batch and N:

  ``trainer_paci`` ``Trainer(strategy=PACIStrategy(schedule="paci"))`` in the same process group;
  ``bare_paci`` / ``bare_flush`` the `PipelineRuntime` without Lightning; and torch's schedules
  over ``PipelineStage(nn.Sequential(<layers>))``: ``torch_gpipe``, ``torch_1f1b`` (one stage per
  rank, ``[embed, b0, b1] | [b2, b3, head]``), ``torch_looped_bfs``, ``torch_interleaved_1f1b``,
  ``torch_zb1p`` (`ScheduleInterleavedZeroBubble`) with 2 stages per rank in a loop (stages
  ``[embed, b0] [b1] [b2] [b3, head]``, stage c on rank c mod 2), and ``torch_zbv``,
  ``torch_dualpipev`` on the same 4 stages in a V (rank 0: stages 0 and 3). A variant that torch
  refuses or that fails records its error instead of numbers.
- tokens/s: steady state on the rank holding the last stage, between the ends of optimizer-step
  windows (after ``warm`` windows): `benchmarks.trainer_vs_torch_pipelining`'s method.
- busy / elapsed per rank: CPU time of the rank's main thread (which runs every forward and
  backward in every variant; waits for a transfer block it) over the timed span: one accounting
  for every variant. The runtime's own wall-clock busy / elapsed is given too for PACI and flush.
- Peak saved-activation bytes per rank: `layer_costs.DetachedMeter` (bytes of distinct storages
  autograd keeps for backward, parameters excluded) is active in every segment of every variant
  and its peak is taken over the timed windows.
- Load: ``os.getloadavg()`` before each segment and the foreign load (cores other processes used
  during it: /proc/stat busy time minus both ranks' CPU), min / median / max per N in the JSON.
- Bubble-free bound: 512 tokens / the busiest rank's busy time per micro-batch of ``bare_paci``.
- Per-layer costs F, B, I, W (torch's own split-backward functions) and saved bytes, measured on
  rank 0 while rank 1 waits; the simulator fed with them and the measured link latency predicts
  the same S=2 comparison and S=4 / S=8 (`benchmarks.layer_costs`).

    python -m benchmarks.zero_bubble            # full run, ~8 minutes on 2 busy cores
    python -m benchmarks.zero_bubble --quick    # smoke run (< 1 minute); what the test runs
    python -m benchmarks.zero_bubble --predict-from zero_bubble.json   # redo the predictions only
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.harness import RESULTS, add_gpt_timing_args, envelope, machine, write_json
from benchmarks.layer_costs import DetachedMeter, measure_layers, predict
from benchmarks.runtime_throughput import RankSetup, TimedStage, link_latency, machine_cpu_seconds, run_segment
from benchmarks.runtime_throughput import wait_for_quiet as wait_quiet
from benchmarks.trainer_vs_torch_pipelining import (
    BALANCE,
    WindowClock,
    build_data,
    build_model,
    foreign_load,
    spawn_pair,
)
from lit_efficient.runtime.partition import stage_bounds
from lit_efficient.runtime.topology import Topology
from lit_efficient.transport.process import PointToPoint

S = 2
QUIET_CORES = 0.5  # a segment is "quiet" when other processes used under this many cores during it
CHUNK_BALANCE = (2, 1, 1, 2)  # four stages over the six layers: [embed, b0] [b1] [b2] [b3, head]
TORCH = {  # variant -> (torch class, placement of its stages)
    "torch_gpipe": ("ScheduleGPipe", "one"),
    "torch_1f1b": ("Schedule1F1B", "one"),
    "torch_looped_bfs": ("ScheduleLoopedBFS", "loop"),
    "torch_interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "torch_zb1p": ("ScheduleInterleavedZeroBubble", "loop"),
    "torch_zbv": ("ScheduleZBVZeroBubble", "v"),
    "torch_dualpipev": ("ScheduleDualPipeV", "v"),
}
VARIANTS = ("trainer_paci", "bare_paci", "bare_flush", *TORCH)
PACI = ("trainer_paci", "bare_paci")


# -- variants (inside a rank) ----------------------------------------------------------------------


class MeteredClock(WindowClock):
    """`WindowClock` that also meters saved activations and the main thread's CPU over the timed windows."""

    def __init__(self, accumulate: int, warm: int) -> None:
        super().__init__(accumulate, warm)
        self.cpu: list[float] = []
        self.meter: DetachedMeter | None = None

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: D102
        self.meter = DetachedMeter(list(pl_module.parameters())).__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: D102
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if (batch_idx + 1) % self.accumulate == 0:
            self.cpu.append(time.thread_time())
            if len(self.marks) == self.warm:
                self.meter.reset_peak()

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: D102
        self.meter.__exit__(None, None, None)


def run_trainer(config: dict[str, Any], n: int, warm: int, windows: int) -> dict[str, Any]:
    import lightning as L

    from lit_efficient import PACIStrategy

    clock = MeteredClock(n, warm)
    trainer = L.Trainer(
        accelerator="cpu", devices=S, max_steps=warm + windows, accumulate_grad_batches=n,
        strategy=PACIStrategy(pipeline_stages=S, schedule="paci", balance=list(BALANCE)),
        callbacks=[clock], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(build_model(config, warm + windows), datamodule=build_data(config))
    torch.set_num_threads(1)
    span = clock.marks[-1] - clock.marks[warm - 1]
    return {
        "span": span, "windows": len(clock.marks) - warm, "saved_peak": clock.meter.peak,
        "busy_fraction": (clock.cpu[-1] - clock.cpu[warm - 1]) / span,
        "runtime_utilization": clock.stats["utilization"],
    }  # fmt: skip


def run_bare(setup: RankSetup, schedule: str, n: int, warm: int, windows: int) -> dict[str, Any]:
    with DetachedMeter(list(setup.stage.parameters())) as meter:
        seg = run_segment(setup, schedule, n, warm, windows, meter)  # type: ignore[arg-type]
    span = seg["marks"][-1]
    return {
        "span": span, "windows": windows, "saved_peak": seg["saved_peak_bytes"],
        "busy_fraction": seg["main_thread_cpu_seconds"] / span, "runtime_utilization": seg["stats"]["utilization"],
        "busy_per_microbatch": seg["stats"]["busy_seconds"] / max(seg["stats"]["backwards"], 1),
    }  # fmt: skip


def torch_stages(variant: str, rank: int) -> list[int]:
    """The stage indices this rank holds under ``variant``'s placement."""
    placement = TORCH[variant][1]
    return {"one": [rank], "loop": [rank, rank + S], "v": [rank, 2 * S - 1 - rank]}[placement]


def run_torch(model: Any, rank: int, data: list[Any], variant: str, n: int, warm: int, windows: int) -> dict[str, Any]:
    import torch.distributed.pipelining as pp

    mine = torch_stages(variant, rank)
    balance = BALANCE if len(mine) == 1 else CHUNK_BALANCE
    layers = list(model.pipeline_layers())
    bounds = stage_bounds(list(balance))
    modules = [nn.Sequential(*layers[bounds[i][0] : bounds[i][1]]) for i in mine]
    stages = [pp.PipelineStage(m, i, len(balance), torch.device("cpu")) for m, i in zip(modules, mine, strict=True)]
    vocab = model.hparams.vocab_size

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float().view(-1, vocab), target.reshape(-1))

    cls = getattr(pp, TORCH[variant][0])
    schedule = cls(stages[0] if len(mine) == 1 else stages, n_microbatches=n, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=3e-4, weight_decay=0.0)
    chunks = itertools.cycle(data)
    marks, cpu = [], []
    with DetachedMeter([p for m in modules for p in m.parameters()]) as meter:
        for w in range(warm + windows):
            batch = [next(chunks) for _ in range(n)]
            args = (torch.cat([b[0] for b in batch]),) if 0 in mine else ()
            kwargs = {"target": torch.cat([b[1] for b in batch]), "losses": []} if len(balance) - 1 in mine else {}
            optimizer.zero_grad()
            schedule.step(*args, **kwargs)
            optimizer.step()
            marks.append(time.perf_counter())
            cpu.append(time.thread_time())
            if w == warm - 1:
                meter.reset_peak()
    span = marks[-1] - marks[warm - 1]
    return {
        "span": span, "windows": windows, "saved_peak": meter.peak,
        "busy_fraction": (cpu[-1] - cpu[warm - 1]) / span, "runtime_utilization": None,
        "last_stage": len(balance) - 1 in mine, "first_stage": 0 in mine,
    }  # fmt: skip


def _costs(model: Any, data: list[Any], reps: int) -> dict[str, dict[str, float]]:
    layers = list(model.pipeline_layers())
    x, y = data[0]
    vocab = model.hparams.vocab_size

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float().view(-1, vocab), target.reshape(-1))

    return measure_layers({"embed": layers[0], "block": layers[1], "head": layers[-1]}, x, y, loss, reps)


def _worker(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    topo = Topology.for_world(world, S)  # the strategy's layout: last stage on rank 0
    s = topo.stage_of(rank)
    datamodule = build_data(config)
    datamodule.setup("fit")
    data = list(itertools.islice(iter(datamodule.train_dataloader()), 64))
    comm = PointToPoint(s, topo.stage_of, torch.device("cpu"), timeout=300.0)
    prev_rank, next_rank = topo.neighbours(rank)

    def fresh_setup() -> RankSetup:
        # Every variant builds its model and optimizer inside its own segment, as the Trainer's fit must: objects
        # built at another point of a long-lived process run up to 20% faster or slower on these VMs (where the
        # allocator put them), so a variant reusing objects built at start is not comparable with one that
        # builds afresh. Measured before this rule: Trainer PACI at 0.80 of the bare runtime in separate
        # segments, 0.99 when both ran on the same objects (benchmarks.lightning_overhead).
        model = build_model(config, 1000)
        lo, hi = stage_bounds(list(BALANCE))[s]
        mine = list(model.pipeline_layers())[lo:hi]
        optimizer = torch.optim.AdamW([p for layer in mine for p in layer.parameters()], lr=3e-4, weight_decay=0.0)
        stage = TimedStage(mine, s, S, optimizer, loss_fn=model.pipeline_loss)
        return RankSetup(stage, comm, prev_rank, next_rank, model.pipeline_input, data)

    setup = fresh_setup()
    activation = torch.zeros(config["batch_size"], config["block"], config["dim"])
    latency = link_latency(setup, (activation,), (activation,), 20)
    costs = _costs(build_model(config, 1000), data, config["cost_reps"]) if rank == 0 else None
    dist.barrier()
    steps: list[float] = []
    failed: dict[tuple[str, int], str] = {}
    segments = []
    for n in config["accumulate"]:
        warm, windows = config["plan"][str(n)]
        for r in range(config["rounds"]):
            wait_quiet(config["quiet_wait"])
            shift = r % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                if (variant, n) in failed:
                    continue
                dist.barrier()
                load = os.getloadavg()[0]
                busy0, cpu0, t0 = machine_cpu_seconds()[0], time.process_time(), time.perf_counter()
                try:
                    if variant == "trainer_paci":
                        out = run_trainer(config, n, warm, windows)
                    elif variant.startswith("bare"):
                        setup = fresh_setup()
                        out = run_bare(setup, variant.replace("bare_", "").replace("flush", "1f1b_flush"), n, warm,
                                       windows)  # fmt: skip
                        steps.append(setup.stage.per_call()["step"])
                    else:
                        out = run_torch(build_model(config, 1000), rank, data, variant, n, warm, windows)
                    error = None
                except Exception as err:  # noqa: BLE001 - recorded in the JSON: a torch schedule may refuse CPU/this model
                    out, error = {}, f"{type(err).__name__}: {err}".split("\n")[0][:300]
                # Both ranks learn either's error, so they skip the same variants from now on.
                errors = [None] * world
                dist.all_gather_object(errors, error)
                if any(errors):
                    failed[(variant, n)] = next(e for e in errors if e)
                    continue
                out.setdefault("last_stage", s == S - 1)
                out.setdefault("first_stage", s == 0)
                # Machine-wide busy CPU and this rank's own CPU over the segment: the parent subtracts both
                # ranks' CPU to get the foreign load (cores other processes used meanwhile).
                out.update(seconds=time.perf_counter() - t0, machine_busy=machine_cpu_seconds()[0] - busy0,
                           own_cpu=time.process_time() - cpu0)  # fmt: skip
                segments.append({**out, "variant": variant, "N": n, "round": r, "loadavg": load})
    step = max(steps) if steps else math.nan
    return {"rank": rank, "stage": s, "segments": segments, "costs": costs, "latency": latency,
            "step": step, "failed": [[v, n, e] for (v, n), e in failed.items()]}  # fmt: skip


# -- analysis (parent) -----------------------------------------------------------------------------


def summarize(results: list[dict[str, Any]], config: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per N: per variant tokens/s, busy fraction and saved peak per rank, ratios and errors.

    Per-rank lists start with the rank that holds the first model stage (the one with the most in flight).
    """
    tokens = config["batch_size"] * config["block"]
    errors = {(v, n): e for res in results for v, n, e in res["failed"]}
    foreign = foreign_load(results)
    rows = []
    for n in config["accumulate"]:
        variants: dict[str, Any] = {}
        per_round: dict[int, dict[str, float]] = {}
        busy_mb: list[float] = []
        for v in VARIANTS:
            segs = [(res["rank"], seg) for res in results for seg in res["segments"] if seg["N"] == n
                    and seg["variant"] == v]  # fmt: skip
            rates = []
            for _, seg in segs:
                if seg["last_stage"]:
                    rates.append(seg["windows"] * n * tokens / seg["span"])
                    per_round.setdefault(seg["round"], {})[v] = rates[-1]
            # Per rank, the rank holding the first model stage first (our runtime puts it on rank 1, torch on 0).
            by_rank = sorted(([seg for rk, seg in segs if rk == r] for r in range(S)),
                             key=lambda x: not (x and x[0]["first_stage"]))  # fmt: skip
            if v == "bare_paci":
                busy_mb = [statistics.median(seg["busy_per_microbatch"] for seg in segs_r) for segs_r in by_rank]
            variants[v] = {
                "error": errors.get((v, n)),
                "tokens_per_s": statistics.median(rates) if rates else None,
                "tokens_per_s_rounds": rates,
                "busy_fraction_per_rank": [_median(seg["busy_fraction"] for seg in x) for x in by_rank],
                "runtime_utilization_per_rank": [_median(seg["runtime_utilization"] for seg in x) for x in by_rank],
                "saved_peak_bytes_per_rank": [max((seg["saved_peak"] for seg in x), default=None) for x in by_rank],
            }
        bound = tokens / max(busy_mb) if busy_mb else math.nan
        for v in variants.values():
            v["of_bound"] = v["tokens_per_s"] / bound if v["tokens_per_s"] else None
        rows.append({
            "N": n, "S": S, "bound_tokens_per_s": bound, "variants": variants,
            "paci_over": {p: {v: _ratio(p, v, per_round, foreign, n) for v in VARIANTS if v != p} for p in PACI},
            "loadavg": _spread([seg["loadavg"] for res in results for seg in res["segments"] if seg["N"] == n]),
            "foreign_load_cores": _spread([f for (n_, _, _), f in foreign.items() if n_ == n]),
        })  # fmt: skip
    return rows


def _median(values: Any) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _spread(values: list[float]) -> list[float]:
    return [min(values), statistics.median(values), max(values)] if values else []


def _ratio(
    a: str, b: str, per_round: dict[int, dict[str, float]], foreign: dict[tuple[int, int, str], float], n: int
) -> dict[str, Any]:
    """a's tokens/s over b's per round (segments of one round run minutes apart at most) and the median;
    the same over the rounds where both segments were quiet. None where either failed."""
    both = {r: p[a] / p[b] for r, p in per_round.items() if a in p and b in p}
    quiet = [x for r, x in both.items() if max(foreign[(n, r, a)], foreign[(n, r, b)]) < QUIET_CORES]
    return {
        "rounds": list(both.values()), "median": statistics.median(both.values()) if both else None,
        "quiet_rounds": quiet, "median_quiet": statistics.median(quiet) if quiet else None,
    }  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown per N and variant: tokens/s, Trainer PACI over it (median of rounds), busy and saved peak per rank."""
    head = "| N | variant | tokens/s | of bound | Trainer PACI / it | busy/elapsed per rank | saved peak MiB per rank |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for row in rows:
        for v, x in row["variants"].items():
            if x["error"]:
                lines.append(f"| {row['N']} | {v} | failed: {x['error'][:80]} | | | | |")
                continue
            ratio = row["paci_over"]["trainer_paci"].get(v, {}).get("median")
            busy = " / ".join(f"{b:.2f}" for b in x["busy_fraction_per_rank"] if b is not None)
            mem = " / ".join(f"{b / 2**20:.1f}" for b in x["saved_peak_bytes_per_rank"] if b is not None)
            lines.append(
                f"| {row['N']} | {v} | {x['tokens_per_s']:.0f} | {x['of_bound']:.2f} | "
                f"{'-' if ratio is None else f'{ratio:.2f}'} | {busy} | {mem} |"
            )
    return "\n".join(lines)


def prediction_table(predictions: list[dict[str, Any]]) -> str:
    """Markdown: the simulator's steady state per (S, N, schedule) from the measured layer costs."""
    lines = [
        "| S | N | schedule | throughput / bound | PACI speedup | own busy / period | peak activations MiB, "
        "first rank / max | transfers per micro-batch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in predictions:
        if r["error"]:
            lines.append(f"| {r['S']} | {r['N']} | {_name(r)} | refused: {r['error'][:60]} | | | | |")
            continue
        peak = [b / 2**20 for b in r["peak_activation_bytes_per_rank"]]
        lines.append(
            f"| {r['S']} | {r['N']} | {_name(r)} | {r['of_bound']:.2f} | {r['paci_speedup']:.2f} | "
            f"{r['utilization']:.2f} | {peak[0]:.0f} / {max(peak):.0f} | {r['transfers_per_microbatch']} |"
        )
    return "\n".join(lines)


def _name(row: dict[str, Any]) -> str:
    return row["schedule"] + (" (I+W = B)" if row["split_costs"] == "as_fused" else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_gpt_timing_args(p, rounds=3, quick="smoke run: 1 round, N=4, few windows, a GPT of width 64 on 32 tokens")
    p.add_argument("--cost-reps", type=int, default=7, help="repetitions of each per-layer cost measurement")
    p.add_argument("--out", default="zero_bubble.json", help="file name under benchmarks/results/ (or a path)")
    p.add_argument("--predict-from", help="only redo the simulator's predictions from the costs in this result file")
    args = p.parse_args(argv)
    args.layers = 4  # the fixed splits above are for 4 blocks
    if args.quick:
        args.rounds, args.timed_microbatches, args.accumulate, args.cost_reps, args.quiet_wait = 1, 8, [4], 2, 0.0
        args.dim, args.block = 64, 32  # every key the full run writes, in a third less time (the suite runs it)
        if args.out == "zero_bubble.json":  # a smoke run never replaces the full result
            args.out = "zero_bubble_quick.json"
    return args


def _predictions(costs: dict[str, Any], accumulate: list[int]) -> list[dict[str, Any]]:
    return predict(costs["layers"], [2, 4, 8], sorted({*accumulate, 16, 32}), costs["link_latency_s"], costs["step_s"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.predict_from:  # no processes: the simulator only, on the costs an earlier run measured
        path = RESULTS / args.predict_from
        payload = json.loads(path.read_text())
        payload["predictions"] = _predictions(payload["costs"], payload["config"]["accumulate"])
        path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
        print(prediction_table(payload["predictions"]))
        return payload
    plan = {str(n): (1 if args.quick else 2, max(2, args.timed_microbatches // n)) for n in args.accumulate}
    config = {**vars(args), "plan": plan, "tokens_per_microbatch": args.batch_size * args.block}
    start = time.perf_counter()
    before = machine()
    results = sorted(spawn_pair(_worker, config, timeout=1500), key=lambda r: r["rank"])
    rows = summarize(results, config)
    latency = next(r["latency"] for r in results if not math.isnan(r["latency"]))  # NaN on the last stage
    measured = {"layers": results[0]["costs"], "link_latency_s": latency, "step_s": max(r["step"] for r in results)}
    predictions = _predictions(measured, args.accumulate)
    payload = envelope("zero_bubble", args.quick, before, config, start, costs=measured, rows=rows,
                       predictions=predictions, raw=results)  # fmt: skip
    path = write_json(args.out, payload)
    print(table(rows))
    print(prediction_table(predictions))
    print(f"wrote {path} in {payload['wall_seconds']:.0f} s; load {before['loadavg']} -> {payload['loadavg_end']}")
    return payload


if __name__ == "__main__":
    main()
