"""Throughput of PACIStrategy in the Trainer against the bare runtime and torch.distributed.pipelining.

What is measured, and how:

- One pair of processes (spawned here, gloo, one intra-op thread each: S=2 real-compute stages on
  a 2-core machine) runs every variant, interleaved in rounds, on the same GPT (``embed, blocks,
  head`` split ``balance=[3, 3]`` for n_layer=4: embed + 2 blocks | 2 blocks + head) with the same
  micro-batch size and N:

  (a) ``Trainer(devices=2, accelerator="cpu", strategy=PACIStrategy(schedule="paci"))``
  (b) the same with ``schedule="1f1b_flush"``
  (c) the bare `PipelineRuntime` with ``paci`` (no Lightning), fed batches from the same data
  (d) ``torch.distributed.pipelining.Schedule1F1B`` and (e) ``ScheduleGPipe`` driving a
      ``PipelineStage(nn.Sequential(<the stage's GPT layers>))``: ``step(x)`` on stage 0 with the
      N micro-batches concatenated, ``step(target=y, losses=[])`` on the last, then the GPT's own
      AdamW (its ``configure_optimizers`` groups), as every variant.

  The Trainer runs inside the already-initialized process group (Lightning sees ``LOCAL_RANK`` and
  launches nothing), so no variant pays process start-up inside its timing and all share a pair.
- Timing is steady state, in the ranks, on the LAST stage (it closes every window): the time of the
  end of each optimizer-step window (a callback's ``on_train_batch_end`` after every N-th batch for
  the Trainer; after ``runtime.feed`` of the N-th micro-batch for the bare runtime; after
  ``schedule.step`` + ``optimizer.step`` for torch). ``warm`` windows are discarded, ``windows``
  windows are timed. tokens/s = timed windows x N x batch x block / span.
- Per (N, round) the variants run in a rotated order; the table reports medians over rounds and
  the ratios of medians; the per-round ratios are in the JSON.
- Bubble-free bound: the largest per-stage busy time (forward + backward + step/N per micro-batch,
  `runtime.stats()` of the bare PACI segments) -> tokens/s if no stage ever waited.
- Load: ``os.getloadavg()`` before each segment, in the JSON; the machine is shared.

    python -m benchmarks.trainer_vs_torch_pipelining            # full run, ~5 minutes on 2 cores
    python -m benchmarks.trainer_vs_torch_pipelining --quick    # smoke run, ~1 minute
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
import math
import os
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn

from benchmarks.harness import add_gpt_timing_args, envelope, machine, write_json
from benchmarks.runtime_throughput import RankSetup, TimedStage, machine_cpu_seconds, run_segment, wait_for_quiet
from lit_efficient.runtime.partition import stage_bounds
from lit_efficient.runtime.topology import Topology
from lit_efficient.transport.process import PointToPoint
from tests.support.multiproc import spawn as run_ranks
from tests.support.multiproc import values

S = 2
QUIET_CORES = 0.5  # a round is "quiet" when other processes used under this many cores in every segment
VARIANTS = ("trainer_paci", "trainer_flush", "bare_paci", "torch_1f1b", "torch_gpipe")


# -- processes -------------------------------------------------------------------------------------


def _quiet_lightning(worker: Any, rank: int, world: int, config: dict[str, Any]) -> Any:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    return worker(rank, world, config)


def spawn_pair(worker: Any, config: dict[str, Any], timeout: float, world: int = S) -> list[Any]:
    """Run ``worker(rank, world, config)`` on ``world`` gloo ranks that Lightning may also use
    (tests/support/multiproc.py's harness with torchrun's environment, one thread per rank)."""
    return values(run_ranks(functools.partial(_quiet_lightning, worker), world, config, timeout=timeout,
                            torchrun_env=True))  # fmt: skip


# -- the model and data (identical in every variant) -------------------------------------------


def build_model(config: dict[str, Any], max_steps: int):
    """A fresh GPT with the benchmark's seed."""
    import lightning as L

    from lit_efficient.models import GPT

    L.seed_everything(config["seed"], verbose=False)
    return GPT(
        n_layer=config["layers"], n_head=config["heads"], n_embd=config["dim"], block_size=config["block"],
        dropout=0.0, learning_rate=3e-4, warmup_steps=2, max_steps=max(max_steps, 3),
    )  # fmt: skip


def build_data(config: dict[str, Any]):
    from lit_efficient.data import TextDataModule

    return TextDataModule(
        block_size=config["block"], batch_size=config["batch_size"], max_bytes=config["max_bytes"], seed=config["seed"]
    )


def stage_layers(model: Any, stage: int) -> list[nn.Module]:
    """This stage's GPT layers under the benchmark's fixed balance."""
    lo, hi = stage_bounds(list(BALANCE))[stage]
    return list(model.pipeline_layers())[lo:hi]


BALANCE = (3, 3)  # n_layer=4: [embed, b0, b1] | [b2, b3, head]


def module_optimizer(model: Any, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The GPT's own optimizer (``configure_optimizers``: AdamW, decayed and undecayed groups) over
    ``params``, as the strategy builds it for a stage: every variant steps the same optimizer as the
    Trainer (the LR schedule aside), so the comparison measures the pipeline, not the optimizer."""
    from lit_efficient.cli.plan import _stand_in_trainer, optimizer_factory

    with _stand_in_trainer(model, 1000, 1):
        make = optimizer_factory(model, foreach=False)
    return make(list(dict.fromkeys(params)))


# -- variants (inside a rank) ----------------------------------------------------------------------


class WindowClock(Callback):
    """The time at the end of every window of N training batches, on this rank; and this thread's CPU time
    there, in total and inside the runtime's ``feed`` (the rest is the Lightning layer: loop, hooks, logging)."""

    def __init__(self, accumulate: int, warm: int) -> None:
        self.accumulate, self.warm = accumulate, warm
        self.marks: list[float] = []
        self.cpu_marks: list[tuple[float, float]] = []  # (thread CPU, of it inside feed) at each window end
        self.threads = 0
        self.stats: dict[str, float] = {}
        self._inside = 0.0

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: D102
        runtime, feed = trainer.strategy.runtime, trainer.strategy.runtime.feed

        def timed_feed(*args, **kwargs):
            start = time.thread_time()
            try:
                return feed(*args, **kwargs)
            finally:
                self._inside += time.thread_time() - start

        runtime.feed = timed_feed

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: D102
        if (batch_idx + 1) % self.accumulate == 0:
            self.marks.append(time.perf_counter())
            self.cpu_marks.append((time.thread_time(), self._inside))
            if len(self.marks) == self.warm:
                trainer.strategy.runtime.reset_stats()  # the runtime's busy/wait over the timed windows
            self.stats = trainer.strategy.runtime.stats()
        self.threads = torch.get_num_threads()


def run_trainer(config: dict[str, Any], schedule: str, accumulate: int, warm: int, windows: int) -> dict[str, Any]:
    import lightning as L

    from lit_efficient import PACIStrategy

    clock = WindowClock(accumulate, warm)
    steps = warm + windows
    trainer = L.Trainer(
        accelerator="cpu", devices=S, max_steps=steps, accumulate_grad_batches=accumulate,
        strategy=PACIStrategy(pipeline_stages=S, schedule=schedule, balance=list(BALANCE)),
        callbacks=[clock], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(build_model(config, steps), datamodule=build_data(config))
    torch.set_num_threads(1)
    marks = clock.marks[warm - 1 : warm + windows]
    (cpu0, in0), (cpu1, in1) = clock.cpu_marks[warm - 1], clock.cpu_marks[warm + windows - 1]
    return {
        "span": marks[-1] - marks[0], "windows": len(marks) - 1, "threads": clock.threads, "stats": clock.stats,
        "main_thread_cpu_seconds": cpu1 - cpu0, "lightning_cpu_seconds": (cpu1 - cpu0) - (in1 - in0),
    }  # fmt: skip


def run_bare(setup: RankSetup, accumulate: int, warm: int, windows: int) -> dict[str, Any]:
    seg = run_segment(setup, "paci", accumulate, warm, windows, None)
    return {
        "span": seg["marks"][-1], "windows": windows, "stats": seg["stats"], "costs": seg["costs"],
        "main_thread_cpu_seconds": seg["main_thread_cpu_seconds"],
    }  # fmt: skip


def run_torch(
    model: Any, rank: int, data: list[Any], kind: str, accumulate: int, warm: int, windows: int
) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    # torch maps stage i to group rank i (our runtime puts the last stage on rank 0; on CPU the two
    # processes are symmetric, so the placement does not matter).
    stage_index = rank
    module = nn.Sequential(*stage_layers(model, stage_index))
    stage = PipelineStage(module, stage_index, S, torch.device("cpu"))
    vocab = model.hparams.vocab_size

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float().view(-1, vocab), target.reshape(-1))

    cls = Schedule1F1B if kind == "torch_1f1b" else ScheduleGPipe
    schedule = cls(stage, n_microbatches=accumulate, loss_fn=loss_fn)
    optimizer = module_optimizer(model, list(module.parameters()))
    chunks = itertools.cycle(data)
    marks = []
    for _ in range(warm + windows):
        batch = [next(chunks) for _ in range(accumulate)]
        optimizer.zero_grad()
        if stage_index == 0:
            schedule.step(torch.cat([b[0] for b in batch]))
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=torch.cat([b[1] for b in batch]), losses=losses)
        optimizer.step()
        marks.append(time.perf_counter())
    marks = marks[warm - 1 :]
    return {"span": marks[-1] - marks[0], "windows": len(marks) - 1, "last_stage": stage_index == S - 1}


def _worker(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    topo = Topology.for_world(world, S)  # the strategy's layout: last stage on rank 0
    s = topo.stage_of(rank)
    datamodule = build_data(config)
    datamodule.setup("fit")
    data = list(itertools.islice(iter(datamodule.train_dataloader()), 64))
    comm = PointToPoint(s, topo.stage_of, torch.device("cpu"), timeout=300.0)
    prev_rank, next_rank = topo.neighbours(rank)

    def fresh_setup() -> RankSetup:
        # Every variant builds its model and optimizer in its own segment, as the Trainer's fit must: objects built
        # at another point of a long-lived process run up to 20% faster or slower on these VMs (benchmarks.zero_bubble).
        model = build_model(config, 1000)
        mine = stage_layers(model, s)
        optimizer = module_optimizer(model, [p for layer in mine for p in layer.parameters()])
        stage = TimedStage(mine, s, S, optimizer, loss_fn=model.pipeline_loss)
        return RankSetup(stage, comm, prev_rank, next_rank, model.pipeline_input, data)

    segments = []
    for n in config["accumulate"]:
        warm, windows = config["plan"][str(n)]
        for r in range(config["rounds"]):
            wait_for_quiet(config["quiet_wait"])
            shift = r % len(VARIANTS)
            for variant in [v for v in VARIANTS[shift:] + VARIANTS[:shift] if v in config["variants"]]:
                dist.barrier()
                load = os.getloadavg()[0]
                busy0, cpu0, t0 = machine_cpu_seconds()[0], time.process_time(), time.perf_counter()
                if variant.startswith("trainer"):
                    out = run_trainer(config, variant.split("_")[1].replace("flush", "1f1b_flush"), n, warm, windows)
                    last = s == S - 1
                elif variant == "bare_paci":
                    out = run_bare(fresh_setup(), n, warm, windows)
                    last = s == S - 1
                else:
                    out = run_torch(build_model(config, 1000), rank, data, variant, n, warm, windows)
                    last = out["last_stage"]
                out.update(variant=variant, N=n, round=r, loadavg=load, last_stage=last)
                # Machine-wide busy CPU over the segment and this rank's own CPU: the parent subtracts
                # both ranks' CPU to get the foreign load (cores other processes used meanwhile).
                out.update(
                    seconds=time.perf_counter() - t0,
                    machine_busy=machine_cpu_seconds()[0] - busy0,
                    own_cpu=time.process_time() - cpu0,
                )
                segments.append(out)
    return {"stage": s, "segments": segments}


# -- analysis (parent) -----------------------------------------------------------------------------


def foreign_load(results: list[dict[str, Any]]) -> dict[tuple[int, int, str], float]:
    """Cores used by other processes during each segment: machine busy CPU minus both ranks' CPU."""
    own: dict[tuple[int, int, str], float] = {}
    out = {}
    for res in results:
        for seg in res["segments"]:
            key = (seg["N"], seg["round"], seg["variant"])
            own[key] = own.get(key, 0.0) + seg["own_cpu"]
    for seg in results[0]["segments"]:
        key = (seg["N"], seg["round"], seg["variant"])
        out[key] = (seg["machine_busy"] - own[key]) / seg["seconds"]
    return out


def summarize(results: list[dict[str, Any]], config: dict[str, Any]) -> list[dict[str, Any]]:
    tokens_mb = config["batch_size"] * config["block"]
    foreign = foreign_load(results)
    rows = []
    for n in config["accumulate"]:
        rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
        per_round: dict[int, dict[str, float]] = {}
        busy: list[list[float]] = [[] for _ in range(S)]
        trainer_stats: dict[str, list[dict[str, float]]] = {}
        foreign_n: list[float] = []
        round_foreign: dict[int, list[float]] = {}
        loads = []
        # Main-thread CPU ms per micro-batch, per variant and stage (and of it the Lightning layer's): load on
        # other cores barely changes it, so it says what a quiet machine's throughput ratio would be.
        cpu_ms: dict[str, list[list[float]]] = {v: [[] for _ in range(S)] for v in ("trainer_paci", "bare_paci")}
        lightning_ms: list[list[float]] = [[] for _ in range(S)]
        for res in results:
            for seg in res["segments"]:
                if seg["N"] != n:
                    continue
                if seg["variant"] in cpu_ms and "main_thread_cpu_seconds" in seg:
                    per = 1e3 / (seg["windows"] * n)
                    cpu_ms[seg["variant"]][res["stage"]].append(seg["main_thread_cpu_seconds"] * per)
                    if "lightning_cpu_seconds" in seg:
                        lightning_ms[res["stage"]].append(seg["lightning_cpu_seconds"] * per)
                if "stats" in seg:  # Trainer and bare runtime: the runtime's own busy / elapsed per stage
                    trainer_stats.setdefault(seg["variant"], []).append({"stage": res["stage"], **_brief(seg["stats"])})
                if seg["variant"] == "bare_paci":
                    st = seg["stats"]
                    busy[res["stage"]].append(st["busy_seconds"] / max(st["backwards"], 1))
                if not seg["last_stage"]:
                    continue
                rate = seg["windows"] * n * tokens_mb / seg["span"]
                rates[seg["variant"]].append(rate)
                per_round.setdefault(seg["round"], {})[seg["variant"]] = rate
                loads.append(seg["loadavg"])
                foreign_n.append(foreign[(n, seg["round"], seg["variant"])])
                round_foreign.setdefault(seg["round"], []).append(foreign_n[-1])
        med = {v: statistics.median(x) for v, x in rates.items() if x}
        bound = tokens_mb / max(statistics.median(b) for b in busy) if all(busy) else math.nan

        rows.append({
            "N": n, "S": S, "tokens_per_s": med, "tokens_per_s_all": rates, "bound_tokens_per_s": bound,
            "busy_per_microbatch_s": [statistics.median(b) for b in busy],
            "ideal_paci_over_flush": (n + S - 1) / n,
            "paci_over_flush": _ratio("trainer_paci", "trainer_flush", med, per_round, round_foreign),
            "paci_over_torch_1f1b": _ratio("trainer_paci", "torch_1f1b", med, per_round, round_foreign),
            "bare_paci_over_torch_1f1b": _ratio("bare_paci", "torch_1f1b", med, per_round, round_foreign),
            "paci_over_torch_gpipe": _ratio("trainer_paci", "torch_gpipe", med, per_round, round_foreign),
            "trainer_over_bare": _ratio("trainer_paci", "bare_paci", med, per_round, round_foreign),
            "utilization": {v: m / bound for v, m in med.items()},
            "stage_stats": trainer_stats,
            # busy / elapsed of the runtime, averaged over stages, median over rounds: a second estimate
            # of the schedules' ratio that is less sensitive to other processes taking a core.
            "runtime_utilization": {
                v: statistics.median(x["utilization"] for x in st) for v, st in trainer_stats.items()
            },
            "cpu_ms_per_microbatch": {
                v: [statistics.median(x) if x else math.nan for x in per_stage] for v, per_stage in cpu_ms.items()
            },
            "lightning_layer_cpu_ms_per_microbatch": [statistics.median(x) if x else math.nan for x in lightning_ms],
            "loadavg": [min(loads), statistics.median(loads), max(loads)],
            "foreign_load_cores": [min(foreign_n), statistics.median(foreign_n), max(foreign_n)],
            "foreign_load_per_round": {r: max(x) for r, x in round_foreign.items()},
        })  # fmt: skip
    return rows


def _ratio(
    a: str,
    b: str,
    med: dict[str, float],
    per_round: dict[int, dict[str, float]],
    round_foreign: dict[int, list[float]],
) -> dict[str, Any] | None:
    """Variant a over variant b: ratio of medians, per round, and over quiet rounds only."""
    if a not in med or b not in med:
        return None
    rounds = [p[a] / p[b] for p in per_round.values()]
    quiet = [p[a] / p[b] for r, p in per_round.items() if max(round_foreign[r]) < QUIET_CORES]
    return {
        "of_medians": med[a] / med[b], "rounds": rounds, "median_of_rounds": statistics.median(rounds),
        "quiet_rounds": quiet, "median_of_quiet_rounds": statistics.median(quiet) if quiet else math.nan,
    }  # fmt: skip


def _brief(stats: dict[str, float]) -> dict[str, float]:
    keys = ("utilization", "busy_seconds", "wait_seconds", "elapsed_seconds", "backwards", "drift_max")
    return {k: stats[k] for k in keys}


def _util_ratio(row: dict[str, Any]) -> str:
    u = row["runtime_utilization"]
    return f"{u['trainer_paci'] / u['trainer_flush']:.2f}" if "trainer_flush" in u and "trainer_paci" in u else "-"


def _cell(ratio: dict[str, Any] | None) -> str:
    return "-" if ratio is None else f"{ratio['of_medians']:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| N | Trainer paci | Trainer flush | bare paci | torch 1F1B | torch GPipe | bound | paci/flush (ideal) "
        "| paci/flush busy-ratio | paci/Schedule1F1B | Trainer/bare | load avg | foreign cores |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        t = {v: r["tokens_per_s"].get(v, math.nan) for v in VARIANTS}
        lines.append(
            f"| {r['N']} | {t['trainer_paci']:.0f} | {t['trainer_flush']:.0f} | {t['bare_paci']:.0f} | "
            f"{t['torch_1f1b']:.0f} | {t['torch_gpipe']:.0f} | {r['bound_tokens_per_s']:.0f} | "
            f"{_cell(r['paci_over_flush'])} ({r['ideal_paci_over_flush']:.2f}) | {_util_ratio(r)} | "
            f"{_cell(r['paci_over_torch_1f1b'])} | {_cell(r['trainer_over_bare'])} | "
            f"{r['loadavg'][1]:.1f} | {r['foreign_load_cores'][1]:.2f} |"
        )
    return head + "\n".join(lines)


def cpu_table(rows: list[dict[str, Any]]) -> str:
    """Main-thread CPU ms per micro-batch per stage, Trainer against bare, and the Lightning layer's part."""
    head = (
        "| N | stage | Trainer paci CPU ms/mb | bare paci CPU ms/mb | bare / Trainer | Lightning layer CPU ms/mb |\n"
        "|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        cpu = r["cpu_ms_per_microbatch"]
        for s in range(S):
            t, b = cpu["trainer_paci"][s], cpu["bare_paci"][s]
            lines.append(
                f"| {r['N']} | {s} | {t:.2f} | {b:.2f} | {b / t:.3f} | "
                f"{r['lightning_layer_cpu_ms_per_microbatch'][s]:.2f} |"
            )
    return head + "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_gpt_timing_args(p, rounds=4, quick="smoke run: 1 round, N in {2, 4}, few windows")
    p.add_argument("--layers", type=int, default=4, help="GPT blocks; the split is [embed + 2 | 2 + head]")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="diagnostics only")
    p.add_argument("--out", default="trainer_vs_torch_pipelining.json", help="file name under benchmarks/results/")
    args = p.parse_args(argv)
    if args.layers != 4:
        p.error("--layers must be 4: the fixed split is [embed, b0, b1] | [b2, b3, head]")
    if args.quick:
        args.rounds, args.timed_microbatches, args.accumulate = 1, 8, [2, 4]
        if args.out == "trainer_vs_torch_pipelining.json":  # a smoke run never replaces the full result
            args.out = "trainer_vs_torch_pipelining_quick.json"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    plan = {str(n): (2, max(2, args.timed_microbatches // n)) for n in args.accumulate}
    config = {**vars(args), "plan": plan, "tokens_per_microbatch": args.batch_size * args.block}
    start = time.perf_counter()
    before = machine()
    results = spawn_pair(_worker, config, timeout=1500)
    rows = summarize(results, config)
    payload = envelope("trainer_vs_torch_pipelining", args.quick, before, config, start, rows=rows, raw=results)
    path = write_json(args.out, payload)
    print(table(rows))
    if {"trainer_paci", "bare_paci"} <= set(args.variants):
        print(cpu_table(rows))
    print(f"wrote {path} in {payload['wall_seconds']:.0f} s; load {before['loadavg']} -> {payload['loadavg_end']}")
    return payload


if __name__ == "__main__":
    main()
