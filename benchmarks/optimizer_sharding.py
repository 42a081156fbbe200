"""Optimizer state per rank with and without ``PACIStrategy(shard_optimizer_state=True)`` (issue 20 item 1).

S=2 stages x R=2 and R=4 replicas (4 and 8 forkserver ranks, one thread each), PACI, a GPT of 4 blocks x
512 (12.9M parameters, AdamW with two parameter groups), four optimizer steps, sharded and not. Each rank
records, at the end of training:

- the bytes of the tensors in its optimizer's state (`sharded_optimizer.optimizer_state_bytes`: AdamW's two
  moments and step counts; sharded, its chunk's);
- the bytes it handed to each replica collective of the step, counted by wrapping ``torch.distributed``'s
  all-reduce, reduce-scatter and all-gather in the rank (the buffer sizes, not a network capture);
- its stage's time in local optimizer steps (reduction, checks, clipping, the step, the all-gather), from
  the stage's own clock.

Beside them: what the memory plan (`lit_efficient.cli.plan.plan`) gives each stage's row, and what
``ZeroRedundancyOptimizer``'s whole-parameter partition would leave on its largest replica
(`memory_plan.replica_shares` of the plan's per-parameter bytes).

With ``--readme-plans`` it plans instead docs/memory-plan.md's sharded layouts (GPT-2 Medium on 2 nodes as 8 x 2, the
Llama-3-8B-shaped config as 8 x 1, 4 x 2 and 2 x 4; `benchmarks.memory_plan.layout_plans`), whole and
sharded, into ``results/optimizer_sharding_plans.json``.

    python -m benchmarks.optimizer_sharding                  # ~2 minutes on 2 cores
    python -m benchmarks.optimizer_sharding --quick          # smoke run, small model, R=2 only
    python -m benchmarks.optimizer_sharding --readme-plans   # ~2 minutes: fake tensors only
    python -m benchmarks.optimizer_sharding --collectives    # gloo's three collectives on a 24 MiB buffer

``--collectives`` times what the step's collectives cost on gloo alone: an all-reduce of a stage's
gradient-sized fp32 buffer (6.4M elements, 24.4 MiB) against a reduce-scatter of it and an all-gather of
its chunks, R=2 and 4 ranks, 10 calls each after one warm-up, into ``results/optimizer_sharding_gloo.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from benchmarks.harness import envelope, machine, write_json
from lit_efficient import PACIStrategy
from lit_efficient.cli.plan import plan
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT
from lit_efficient.replicas import sharded_optimizer
from lit_efficient.replicas.sharded_optimizer import optimizer_state_bytes
from lit_efficient.tools.memory_plan import replica_shares

MIB = 2**20
_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "reduce_scatter_single": "reduce_scatter",
    "all_gather_single": "all_gather",
}


class MeasuredPACI(PACIStrategy):
    """PACIStrategy writing this rank's optimizer bytes, collective payloads and step time at the end of fit."""

    def __init__(self, out: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out = out
        self.handed: dict[str, int] = defaultdict(int)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        group = self._dp_groups[self.stage]
        for name, kind in _COLLECTIVES.items():  # what the step hands to its replica group, by buffer size
            _count(dist, name, kind, group, self.handed)
            _count(sharded_optimizer, f"_{kind}", kind, group, self.handed)

    def on_train_end(self) -> None:
        stats = self.runtime.stage.stats
        record = {
            "rank": self.global_rank, "stage": self.stage, "replica": self.replica, "steps": stats.steps,
            "optimizer_bytes": optimizer_state_bytes(self.optimizers[0]),
            "handed_per_step": {k: v // max(1, stats.steps) for k, v in self.handed.items()},
            "step_seconds": stats.step_seconds / max(1, stats.steps),
        }  # fmt: skip
        super().on_train_end()
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(record))


def _count(owner: Any, name: str, kind: str, group: Any, handed: dict[str, int]) -> None:
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_counted", False):
        return

    def counted(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("group") is group:
            tensor = args[1] if kind != "all_reduce" else args[0]  # the input: what this rank contributes
            handed[kind] += tensor.numel() * tensor.element_size()
        return original(*args, **kwargs)

    counted._counted = True  # type: ignore[attr-defined]
    setattr(owner, name, counted)


def _model(config: dict[str, Any]) -> GPT:
    L.seed_everything(0, verbose=False)
    return GPT(n_layer=config["n_layer"], n_head=config["n_head"], n_embd=config["n_embd"],
               block_size=config["block"], warmup_steps=1, max_steps=10)  # fmt: skip


def _run(replicas: int, shard: bool, root: Path, config: dict[str, Any]) -> list[dict[str, Any]]:
    out = root / f"R{replicas}-{'sharded' if shard else 'whole'}"
    out.mkdir(parents=True)
    strategy = MeasuredPACI(
        str(out), pipeline_stages=2, shard_optimizer_state=shard, start_method="forkserver", checkpoint_format="file"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2 * replicas, strategy=strategy, max_steps=config["steps"],
        accumulate_grad_batches=config["accumulate"], logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, enable_checkpointing=False,
    )  # fmt: skip
    data = TextDataModule(block_size=config["block"], batch_size=config["batch"], max_bytes=400_000)
    trainer.fit(_model(config), datamodule=data)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2 * replicas)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small model, R=2 only")
    parser.add_argument(
        "--readme-plans", action="store_true", help="plan docs/memory-plan.md's sharded layouts instead"
    )
    parser.add_argument("--collectives", action="store_true", help="time gloo's three collectives instead")
    args = parser.parse_args()
    if args.readme_plans:
        return readme_plans()
    if args.collectives:
        return collectives()
    config = (
        dict(n_layer=2, n_head=2, n_embd=64, block=32, batch=2, accumulate=2, steps=2, replicas=[2])
        if args.quick
        else dict(n_layer=4, n_head=8, n_embd=512, block=64, batch=2, accumulate=2, steps=4, replicas=[2, 4])
    )
    multiprocessing.set_forkserver_preload(["torch", "lightning.pytorch", "lit_efficient.strategy"])
    before, start = machine(), time.perf_counter()
    batch = (torch.zeros(config["batch"], config["block"], dtype=torch.long),) * 2
    rows = []
    for replicas in config["replicas"]:
        planned = {
            shard: plan(_model(config), batch, PACIStrategy(pipeline_stages=2, shard_optimizer_state=shard),
                        accumulate=config["accumulate"], replicas=replicas, accelerator="cpu")
            for shard in (False, True)
        }  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            runs = {shard: _run(replicas, shard, Path(tmp), config) for shard in (False, True)}
        for whole, sharded in zip(runs[False], runs[True], strict=True):
            stage = whole["stage"]
            row_whole, row_sharded = planned[False].stages[stage], planned[True].stages[stage]
            rows.append({
                "replicas": replicas, "rank": whole["rank"], "stage": stage, "replica": whole["replica"],
                "whole_bytes": whole["optimizer_bytes"], "sharded_bytes": sharded["optimizer_bytes"],
                "sharded_per_whole": sharded["optimizer_bytes"] / whole["optimizer_bytes"],
                "plan_whole_bytes": row_whole.optimizer, "plan_sharded_bytes": row_sharded.optimizer,
                "whole_handed_per_step": whole["handed_per_step"],
                "sharded_handed_per_step": sharded["handed_per_step"],
                "whole_step_seconds": whole["step_seconds"], "sharded_step_seconds": sharded["step_seconds"],
            })  # fmt: skip
        rows_zero = _zero_partition(config, replicas)
        for r in rows:
            if r["replicas"] == replicas:
                r["zero_largest_bytes"] = rows_zero[r["stage"]]
    payload = envelope("optimizer_sharding", args.quick, before, config, start, ranks=rows)
    path = write_json("optimizer_sharding_quick.json" if args.quick else "optimizer_sharding.json", payload)
    print("| R | rank (stage, replica) | AdamW state: whole | sharded | x whole | plan | ZeRO partition | "
          "handed per step: whole | sharded | step: whole / sharded |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---|---|---:|")
    for r in rows:
        hw, hs = r["whole_handed_per_step"], r["sharded_handed_per_step"]
        print(
            f"| {r['replicas']} | {r['rank']} ({r['stage']}, {r['replica']}) | {r['whole_bytes'] / MIB:.2f} MiB "
            f"| {r['sharded_bytes'] / MIB:.2f} MiB | {r['sharded_per_whole']:.3f} "
            f"| {r['plan_sharded_bytes'] / MIB:.2f} MiB | {r['zero_largest_bytes'] / MIB:.2f} MiB "
            f"| all-reduce {hw.get('all_reduce', 0) / MIB:.2f} MiB | "
            f"reduce-scatter {hs.get('reduce_scatter', 0) / MIB:.2f} + all-gather {hs.get('all_gather', 0) / MIB:.2f} "
            f"MiB (+{hs.get('all_reduce', 0)} B) | {r['whole_step_seconds'] * 1e3:.0f} / "
            f"{r['sharded_step_seconds'] * 1e3:.0f} ms |"
        )
    print(f"written to {path}")


def readme_plans() -> None:
    """docs/memory-plan.md's sharded layouts, whole and sharded (memory_plan.json's predate the element-wise split)."""
    from benchmarks.memory_plan import GPT2_MEDIUM, LLAMA_8B, layout_plans, plans_table

    torch.set_num_threads(1)
    before, start = machine(), time.perf_counter()
    gpt2 = ["--config", str(GPT2_MEDIUM["paci"])]
    plans = {
        "gpt2_medium_2_nodes": layout_plans([*gpt2, "--trainer.num_nodes=2"], [(8, 2)], True),
        "llama3_8b": layout_plans(["--config", str(LLAMA_8B)], [(8, 1), (4, 2), (2, 4)], True),
    }
    payload = envelope("optimizer_sharding", False, before, {"readme_plans": True}, start, plans=plans)
    payload["command"] += " --readme-plans"
    path = write_json("optimizer_sharding_plans.json", payload)
    for name, rows in plans.items():
        print(f"\n{name}\n{plans_table(rows)}")
    print(f"written to {path}")


def collectives() -> None:
    """Seconds per call of gloo's all-reduce, reduce-scatter and all-gather on one stage-sized buffer."""
    from tests.support.multiproc import spawn, values

    before, start = machine(), time.perf_counter()
    rows = []
    for replicas in (2, 4):
        per_rank = values(spawn(_time_collectives, replicas, 6_400_000, 10, timeout=600))
        rows.append({"replicas": replicas, **{k: max(r[k] for r in per_rank) for k in per_rank[0]}})
    payload = envelope("optimizer_sharding", False, before, {"collectives": True}, start, rows=rows)
    payload["command"] += " --collectives"
    path = write_json("optimizer_sharding_gloo.json", payload)
    print("| R | all-reduce (24.4 MiB) | reduce-scatter | all-gather | reduce-scatter + all-gather |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        both = r["reduce_scatter"] + r["all_gather"]
        print(f"| {r['replicas']} | {r['all_reduce'] * 1e3:.0f} ms | {r['reduce_scatter'] * 1e3:.0f} ms | "
              f"{r['all_gather'] * 1e3:.0f} ms | {both * 1e3:.0f} ms |")  # fmt: skip
    print(f"written to {path}")


def _time_collectives(rank: int, world: int, numel: int, calls: int) -> dict[str, float]:
    flat = torch.randn(numel)
    chunk, full = torch.empty(numel // world), torch.empty(numel)
    ops = {
        "all_reduce": lambda: dist.all_reduce(flat),
        "reduce_scatter": lambda: sharded_optimizer._reduce_scatter(chunk, flat),
        "all_gather": lambda: sharded_optimizer._all_gather(full, chunk),
    }
    out = {}
    for name, op in ops.items():
        op()  # warm-up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            op()
        dist.barrier()
        out[name] = (time.perf_counter() - start) / calls
    return out


def _zero_partition(config: dict[str, Any], replicas: int) -> list[int]:
    """Per stage: the largest replica's bytes under ZeroRedundancyOptimizer's whole-parameter partition."""
    from lit_efficient.cli.plan import measure

    batch = (torch.zeros(config["batch"], config["block"], dtype=torch.long),) * 2
    measures, _ = measure(_model(config), batch, PACIStrategy(pipeline_stages=2), config["accumulate"], "32-true",
                          None, None, "cpu", 1000)  # fmt: skip
    return [max(replica_shares(m.optimizer_per_parameter, replicas)) for m in measures]


if __name__ == "__main__":
    main()
