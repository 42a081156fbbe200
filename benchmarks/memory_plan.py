"""The memory plan against measurement, its speed, and the plans docs/memory-plan.md shows.

Three parts (BENCHMARKS.md, "Memory plan"; docs/memory-plan.md):

- **agreement**: for GPT and Hugging Face Llama models on CPU, each stage's activation bytes and state
  bytes (weights + gradients + optimizer state) in the plan (`lit_efficient.cli.plan.plan`, fake tensors)
  against a real run of the same pipeline (the bare runtime, all stages in this process,
  `local_pipeline`), for paci and 1f1b_flush, with and without ``recompute``, and with
  ActivationCheckpointing. What the real run measures (`StageMeter`): per stage, the peak over the run
  of the distinct storages autograd saved for that stage's micro-batches still in flight plus the
  inputs, outputs, losses and RNG states its in-flight records hold (a storage once); the largest sum of
  its gradients; its parameters, buffers and optimizer state after the run.
- **speed**: wall time of the GPT-2 Medium 8-stage plans (``configs/gpt2_medium_8stage_*.yaml``).
- **tables**: the plans of those configs and of a Llama-3-8B-shaped HFCausalLM
  (``benchmarks/memory_plan_llama3_8b.yaml``) on 8 x 80 GiB, PACI against flush, sharded optimizer
  state and recompute on and off.

    python -m benchmarks.memory_plan              # ~3-6 minutes on 2 shared cores
    python -m benchmarks.memory_plan --quick      # agreement on small models only
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor
from torch.utils._pytree import tree_flatten

from benchmarks.harness import envelope, machine, write_json
from lit_efficient.callbacks import activation_checkpointing as ac
from lit_efficient.cli.plan import (
    _stand_in_trainer,
    describe,
    load_config,
    measure,
    optimizer_factory,
    plan,
    plan_config,
)
from lit_efficient.runtime.partition import stage_bounds
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.strategy.paci import PACIStrategy
from lit_efficient.tools.memory_plan import MemoryPlan, format_bytes, plan_memory
from lit_efficient.transport.local import local_pipeline

ROOT = Path(__file__).resolve().parents[1]
LLAMA_8B = Path(__file__).resolve().parent / "memory_plan_llama3_8b.yaml"
GPT2_MEDIUM = {s: ROOT / "configs" / f"gpt2_medium_8stage_{s}.yaml" for s in ("paci", "flush")}


class StageMeter:
    """What each stage of a real in-process pipeline keeps for backward, live and at its peak (bytes).

    Saved tensors are attributed to the stage whose forward (or recompute, inside its backward) saved them;
    each is held by a small object whose release, when its graph is freed, drops the storage's count. A
    sample (after every action and every saved tensor) adds the tensors the stage's in-flight records hold.
    Storages are keyed by address, so views count once. Parameters and buffers are excluded.
    """

    def __init__(self, stages: Sequence[PipelineStage]) -> None:
        self.stages = list(stages)
        self._exclude = {t.untyped_storage().data_ptr() for st in stages for layer in st.layers
                         for t in (*layer.parameters(), *layer.buffers())}  # fmt: skip
        self._saved: list[dict[int, list[int]]] = [{} for _ in stages]
        self._recomputing: list[Any] = [None] * len(stages)
        self._recomputed: list[Any] = [None] * len(stages)
        self._microbatch: list[int] = [-1] * len(stages)
        self._cached: list[dict[int, list[int]]] = [{} for _ in stages]
        self._current: int | None = None
        self.peak = [0] * len(stages)
        self.gradients = [0] * len(stages)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        for st in self.stages:
            self._wrap(st)

    def __enter__(self) -> StageMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _wrap(self, st: PipelineStage) -> None:
        s = st.stage
        forward, backward, recompute = st.forward, st.backward, st._recompute

        def timed(call: Any, forward: bool) -> Any:
            def run(microbatch: int, *args: Any, **kwargs: Any) -> Any:
                outer, self._current = self._current, s
                self._microbatch[s] = microbatch
                try:
                    return call(microbatch, *args, **kwargs)
                finally:
                    self._current = outer
                    if not forward:  # the checkpoint frames of this micro-batch are gone with its backward
                        for ptr in self._cached[s].pop(microbatch, []):
                            self._release(s, ptr)
                    self._recomputing[s] = self._recomputed[s] = None
                    self._sample(s)
                    grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                             for p in st.parameters() if p.grad is not None}  # fmt: skip
                    self.gradients[s] = max(self.gradients[s], sum(grads.values()))

            return run

        def recomputing(record: Any) -> Any:
            # Popped from the in-flight records: its inputs, RNG state and recomputed outputs are held here
            # until its backward is done.
            self._recomputing[s] = record
            result = recompute(record)
            self._recomputed[s] = result
            self._sample(s)
            return result

        st.forward, st.backward, st._recompute = timed(forward, True), timed(backward, False), recomputing  # type: ignore[method-assign]

    def add(self, t: Tensor) -> None:
        """Selective checkpointing's cache reports a kept output here (`ActivationCheckpointing`'s meter protocol):
        held until the micro-batch's backward ends."""
        s = self._current
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if s is None or ptr in self._exclude or nbytes == 0:
            return
        self._saved[s].setdefault(ptr, [0, nbytes])[0] += 1
        self._cached[s].setdefault(self._microbatch[s], []).append(ptr)
        self._sample(s)

    def _pack(self, t: Tensor) -> Any:
        s = self._current
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if s is None or ptr in self._exclude or nbytes == 0:
            return t
        entry = self._saved[s].setdefault(ptr, [0, nbytes])
        entry[0] += 1
        self._sample(s)
        return _Held(t.detach(), s, ptr, self)

    def _release(self, s: int, ptr: int) -> None:
        entry = self._saved[s][ptr]
        entry[0] -= 1
        if entry[0] == 0:
            del self._saved[s][ptr]

    def _sample(self, s: int) -> None:
        storages = {ptr: n for ptr, (_, n) in self._saved[s].items()}
        records = [*self.stages[s]._in_flight.values(), self._recomputing[s]]
        held = tree_flatten([self._recomputed[s]])[0]
        for record in records:
            if record is not None:
                held += [*record.inputs, *(record.outputs or ()), record.loss, record.rng and record.rng[0]]
        for t in held:
            if isinstance(t, Tensor) and t.untyped_storage().nbytes():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.peak[s] = max(self.peak[s], sum(storages.values()))


class _Held:
    __slots__ = ("meter", "ptr", "stage", "tensor")

    def __init__(self, tensor: Tensor, stage: int, ptr: int, meter: StageMeter) -> None:
        self.tensor, self.stage, self.ptr, self.meter = tensor, stage, ptr, meter

    def __del__(self) -> None:
        self.meter._release(self.stage, self.ptr)


def _unpack(held: Any) -> Tensor:
    return held.tensor if isinstance(held, _Held) else held


def measure_run(
    module: Any,
    sizes: Sequence[int],
    batches: Sequence[Any],
    schedule: str,
    accumulate: int,
    recompute: bool = False,
    precision: str = "32-true",
    checkpointing: Any = None,
) -> list[dict[str, int]]:
    """Run ``batches`` through the real pipeline (every stage in this process) and measure each stage.

    Returns per stage: ``activations`` (the `StageMeter` peak), ``weights``, ``gradients``, ``optimizer``
    and ``max_in_flight``. The module's weights train (take a copy to keep them).
    """
    context = MixedPrecision("bf16-mixed", "cpu").forward_context if precision == "bf16-mixed" else nullcontext
    layers = list(module.pipeline_layers())
    if checkpointing is not None:
        checkpointing.wrap(module)
    with _stand_in_trainer(module, 1000, accumulate):
        make = optimizer_factory(module, foreach=False)
    stages = []
    for s, (first, last) in enumerate(stage_bounds(sizes)):
        own = list(layers[first:last])
        params = list(dict.fromkeys(p for layer in own for p in layer.parameters()))
        stages.append(PipelineStage(
            own, s, len(sizes), make([p for p in params if p.requires_grad]), loss_fn=module.pipeline_loss,
            recompute=recompute, forward_context=context, first_layer=first,
        ))  # fmt: skip
    pipeline = local_pipeline(stages, schedule, accumulate, module.pipeline_input)  # type: ignore[arg-type]
    meter = StageMeter(stages)
    token = ac._ACTIVE_METER.set(meter)  # type: ignore[arg-type] - selective checkpointing reports its cache here
    try:
        with meter:
            for index, batch in enumerate(batches):
                pipeline.feed(batch, index)
            pipeline.drain()
    finally:
        ac._ACTIVE_METER.reset(token)
        if checkpointing is not None:
            checkpointing.unwrap()
    out = []
    for st in stages:
        tensors = [t for layer in st.layers for t in (*layer.parameters(), *layer.buffers())]
        state = [t for p in st.parameters() for t in st.optimizer.state.get(p, {}).values() if isinstance(t, Tensor)]
        out.append({
            "activations": meter.peak[st.stage], "weights": _storage_bytes(tensors),
            "gradients": meter.gradients[st.stage], "optimizer": _storage_bytes(state),
            "max_in_flight": st.stats.max_in_flight,
        })  # fmt: skip
    return out


def _storage_bytes(tensors: Sequence[Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def agreement(result: MemoryPlan, measured: Sequence[dict[str, int]]) -> list[dict[str, float]]:
    """Per stage: planned and measured activation and state bytes, and plan / measured."""
    rows = []
    for s, m in zip(result.stages, measured, strict=True):
        state = m["weights"] + m["gradients"] + m["optimizer"]
        planned_state = s.weights + s.gradients + s.optimizer
        rows.append({
            "stage": s.stage, "in_flight_plan": s.in_flight, "in_flight_run": m["max_in_flight"],
            "activations_plan": s.activations, "activations_run": m["activations"],
            "activations_ratio": s.activations / m["activations"], "state_plan": planned_state,
            "state_run": state, "state_ratio": planned_state / state,
        })  # fmt: skip
    return rows


# -- the models --------------------------------------------------------------------------------------


def gpt(n_layer: int = 4, n_embd: int = 64, n_head: int = 4, block: int = 32, dropout: float = 0.0) -> Any:
    """A small GPT (the package's)."""
    from lit_efficient.models import GPT

    return GPT(vocab_size=256, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=dropout)


def llama(layers: int = 4, hidden: int = 64, intermediate: int = 172, heads: int = 4, kv_heads: int = 2) -> Any:
    """A small Hugging Face Llama through HFCausalLM, untied (a tied weight is one parameter in one process)."""
    from lit_efficient.models import HFCausalLM

    config = {
        "model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": 256,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0,
    }  # fmt: skip
    return HFCausalLM(config, attn_implementation="sdpa")


def batches(count: int, batch_size: int, block: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """Random byte-token micro-batches ``(x, y)``."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, 256, (batch_size, block), generator=g) for _ in range(2)) for _ in range(count)]


def compare(
    build: Any, stages: int, accumulate: int, schedule: str, recompute: bool, precision: str, batch_size: int,
    block: int, windows: int = 3, checkpointing: Any = None,
) -> dict[str, Any]:  # fmt: skip
    """Plan and run one configuration (a fresh model for each, the same seed); returns both and the agreement."""
    strategy = PACIStrategy(pipeline_stages=stages, schedule=schedule, recompute=recompute, balance="uniform")
    data = batches(windows * accumulate, batch_size, block)
    start = time.perf_counter()
    torch.manual_seed(0)
    result = plan(build(), data[0], strategy, accumulate, precision, checkpointing, accelerator="cpu")
    plan_seconds = time.perf_counter() - start
    torch.manual_seed(0)
    measured = measure_run(build(), result.context["sizes"], data, schedule, accumulate, recompute, precision,
                           checkpointing)  # fmt: skip
    return {"plan": result, "measured": measured, "rows": agreement(result, measured), "plan_seconds": plan_seconds}


def agreement_grid(quick: bool) -> list[dict[str, Any]]:
    """The agreement table: models x schedules x recompute, ActivationCheckpointing on GPT, and bf16-mixed.

    The larger models run in fp32: CPU autocast's bf16 matmuls are ~12x slower than fp32 here, so bf16-mixed
    (where Linear saves bf16 casts of its input and weight) gets a smaller micro-batch.
    """
    from lit_efficient import ActivationCheckpointing

    every = [(s, r, None) for s, r in itertools.product(("paci", "1f1b_flush"), (False, True))]
    checkpointed = [("paci", False, "full"), ("paci", False, "selective")]
    if quick:
        models = [
            ("GPT 4x64, T=32", lambda: gpt(), 3, 4, 32, "bf16-mixed", every),
            ("Llama 4x64, T=32", lambda: llama(), 3, 4, 32, "bf16-mixed", every),
        ]
    else:
        models = [
            ("GPT 8x256, T=256", lambda: gpt(8, 256, 4, 256), 4, 4, 256, "32-true", every + checkpointed),
            ("Llama 8x256, T=256", lambda: llama(8, 256, 688, 8, 2), 4, 4, 256, "32-true", every),
            ("GPT 8x256, T=128", lambda: gpt(8, 256, 4, 128), 4, 2, 128, "bf16-mixed", every[:2]),
            ("Llama 8x256, T=128", lambda: llama(8, 256, 688, 8, 2), 4, 2, 128, "bf16-mixed", every[:2]),
        ]
    rows = []
    for name, build, stages, batch_size, block, precision, configs in models:
        for schedule, recompute, mode in configs:
            checkpointing = ActivationCheckpointing(mode=mode) if mode else None
            out = compare(build, stages, 2, schedule, recompute, precision, batch_size, block,
                          checkpointing=checkpointing)  # fmt: skip
            rows.append({
                "model": name, "precision": precision, "schedule": schedule, "recompute": recompute,
                "checkpointing": mode, "plan_seconds": out["plan_seconds"], "stages": out["rows"],
            })  # fmt: skip
            worst = max(abs(r["activations_ratio"] - 1) for r in out["rows"])
            print(f"{name} {precision} {schedule} recompute={recompute} ckpt={mode}: activations within {worst:.2%}",
                  flush=True)  # fmt: skip
    return rows


def layout_plans(argv: list[str], layouts: Sequence[tuple[int, int]], shard_options: bool) -> list[dict[str, Any]]:
    """The config's plans for each (S, R) layout, paci and flush, recompute off and on, and with R > 1 the
    optimizer state whole and sharded: one measurement per layout (the schedule, recompute, the replicas
    and sharding only change the arithmetic), checked against `plan_config` for the config as written."""
    rows = []
    for stages, replicas in layouts:
        arguments = load_config([*argv, f"--trainer.strategy.init_args.pipeline_stages={stages}"])
        start = time.perf_counter()
        measures, context = measure(
            arguments["module"], arguments["batch"], arguments["strategy"], arguments["accumulate"],
            arguments["precision"], arguments["activation_checkpointing"], "80GiB", arguments["accelerator"],
            arguments["max_steps"],
        )  # fmt: skip
        seconds = time.perf_counter() - start
        strategy = arguments["strategy"]
        for schedule, recompute in itertools.product(("paci", "1f1b_flush"), (False, True)):
            for shard in (False, True) if shard_options and replicas > 1 else (False,):
                result = plan_memory(
                    measures, schedule, arguments["accumulate"], recompute, replicas, shard,
                    strategy.staleness_correction, strategy.local_sgd_steps, strategy.outer_optimizer,
                    device_memory=80 * 2**30, context=context,
                )  # fmt: skip
                rows.append({"argv": argv, "measure_seconds": seconds, **result.to_dict()})
                print(f"S={stages} R={replicas} {schedule} recompute={recompute} shard={shard}: {result.summary()}")
        print(f"  measured S={stages} in {seconds:.1f} s", flush=True)
    return rows


def config_plans() -> dict[str, Any]:
    """docs/memory-plan.md's plans: GPT-2 Medium's two configs as written (and on 2 nodes, sharded), the
    Llama-3-8B-shaped config on 8 GPUs as 8 x 1, 4 x 2 and 2 x 4 (stages x replicas), and the wall time
    of `lit-efficient plan` for each GPT-2 Medium config (the speed check)."""
    out: dict[str, Any] = {"speed": []}
    for config in GPT2_MEDIUM.values():
        start = time.perf_counter()
        result = plan_config(["--config", str(config)], device_memory="80GiB")
        seconds = time.perf_counter() - start
        out["speed"].append({"config": config.name, "seconds": seconds, "peak": result.peak})
        print(f"{config.name}: planned in {seconds:.1f} s\n{describe(result)}", flush=True)
    gpt2 = ["--config", str(GPT2_MEDIUM["paci"])]
    out["gpt2_medium"] = layout_plans(gpt2, [(8, 1)], False)
    out["gpt2_medium_2_nodes"] = layout_plans([*gpt2, "--trainer.num_nodes=2"], [(8, 2)], True)
    out["llama3_8b"] = layout_plans(["--config", str(LLAMA_8B)], [(8, 1), (4, 2), (2, 4)], True)
    return out


def agreement_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per configuration and stage, planned and measured bytes and their ratio."""
    lines = [
        "| model | precision | schedule | recompute | checkpointing | stage | in flight "
        "| activations plan / run | state plan / run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for r in row["stages"]:
            lines.append(
                f"| {row['model']} | {row['precision']} | {row['schedule']} | {row['recompute']} | "
                f"{row['checkpointing'] or '-'} | "
                f"{r['stage']} | {r['in_flight_plan']} | {format_bytes(r['activations_plan'])} / "
                f"{format_bytes(r['activations_run'])} ({r['activations_ratio']:.3f}) | "
                f"{format_bytes(r['state_plan'])} / {format_bytes(r['state_run'])} ({r['state_ratio']:.3f}) |"
            )
    return "\n".join(lines)


def plans_table(plans: list[dict[str, Any]]) -> str:
    """Markdown: one row per planned variant: layout, options, peak per stage, verdict."""
    lines = [
        "| schedule | S x R | recompute | optimizer state | peak per stage, GiB (stage 0 ... S-1) | worst | 80 GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        peaks = " / ".join(f"{s['peak'] / 2**30:.1f}" for s in p["stages"])
        shard = "sharded" if p["shard_optimizer_state"] else "whole"
        verdict = p["verdict"]
        if verdict == "does not fit":
            verdict += f" (short {format_bytes(-p['headroom'])})"
        lines.append(f"| {p['schedule']} | {len(p['stages'])} x {p['replicas']} | {p['recompute']} | {shard} | {peaks} "
                     f"| {format_bytes(p['peak'])} | {verdict} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="agreement on small models only, no config plans")
    p.add_argument("--out", default="memory_plan.json", help="file name under benchmarks/results/")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    start, before = time.perf_counter(), machine()
    rows = agreement_grid(args.quick)
    plans = {} if args.quick else config_plans()
    out = args.out if not args.quick or args.out != "memory_plan.json" else "memory_plan_quick.json"
    payload = envelope("memory_plan", args.quick, before, vars(args), start, agreement=rows, plans=plans)
    path = write_json(out, payload)
    print(agreement_table(rows))
    for name, runs in plans.items():
        if name != "speed":
            print(f"\n{name}\n{plans_table(runs)}")
    print(f"wrote {path} in {payload['wall_seconds']:.0f} s")
    return payload


if __name__ == "__main__":
    main()
