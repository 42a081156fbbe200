"""Per-layer costs of the project's GPT (F, full B, and torch's I/W split) and the simulator's predictions from them.

`measure_layers` times one micro-batch through each kind of layer (embedding, block, head + loss)
on this process's thread: forward; a full backward (`torch.autograd.backward`); and the split that
torch.distributed.pipelining's zero-bubble schedules run, through torch's own functions
(`stage_backward_input`: gradient w.r.t. the layer's input, keeping what the weight gradient needs;
then `stage_backward_weight`). It also counts the bytes autograd saves for backward in one forward
(`DetachedMeter`, parameters excluded), the unit of the activation-memory predictions.

`predict` builds GPT layouts of 2, 4 and 8 ranks from those costs (two blocks per rank; embedding
on the first model stage, head on the last; two-chunk schedules get one block per chunk, so the
embedding and the head sit on rank 0 in a V) and runs every plan of `lit_efficient.tools.schedule_plans`
through the simulator for many windows: steady utilization, throughput against PACI, peak
activation bytes per rank and activation transfers per micro-batch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from benchmarks.runtime_throughput import SavedTensorMeter, _Held
from lit_efficient.tools.schedule_plans import PLANS, build_plan
from lit_efficient.tools.simulate import simulate_plan

KINDS = ("embed", "block", "head")


class DetachedMeter(SavedTensorMeter):
    """`SavedTensorMeter` whose holders keep a saved tensor without its autograd graph.

    A holder of the tensor itself closes a cycle node -> saved variable -> holder -> tensor ->
    grad_fn -> node when a node saves its own output (attention does), a cycle that Python's
    collector cannot see through C++. A full backward frees saved variables and breaks it; torch's
    split backward never releases the nodes it runs only in the input-gradient pass, so the plain
    meter would count their tensors forever (1.5 MiB per block and micro-batch here) although the
    process frees them. Holding ``tensor.detach()`` (same storage, no graph) measures what is held.
    """

    def _pack(self, t: Tensor) -> Any:
        held = super()._pack(t)
        if isinstance(held, _Held):
            held.tensor = t.detach()
        return held


WINDOWS = 6  # simulated windows: the steady period is the makespan of the last one


def measure_layers(
    layers: dict[str, nn.Module], first_input: Tensor, target: Tensor, loss_fn: Callable, reps: int
) -> dict[str, dict[str, float]]:
    """Median seconds of forward / backward / input_grad / weight_grad, and saved bytes, per layer kind.

    ``layers`` maps each of `KINDS` to one module, in pipeline order; each gets the (detached,
    grad-requiring after the first) output of the one before, as a pipeline stage would.
    """
    out: dict[str, dict[str, float]] = {}
    x = first_input
    for kind in KINDS:
        layer = layers[kind]
        params = list(layer.parameters())
        inp = x if kind == "embed" else x.detach().requires_grad_(True)
        inputs = [inp] if inp.requires_grad else []  # token ids have no gradient
        times: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "input_grad", "weight_grad")}
        for _ in range(reps + 1):  # the first repetition warms the allocator and is dropped
            clock = [time.perf_counter()]
            y = _forward(layer, inp, kind, target, loss_fn)
            clock.append(time.perf_counter())
            grad = None if kind == "head" else [torch.ones_like(y)]
            torch.autograd.backward(y, grad)
            clock.append(time.perf_counter())
            y = _forward(layer, inp, kind, target, loss_fn)
            clock.append(time.perf_counter())
            _, groups = stage_backward_input([y], grad, inputs, iter(params))
            clock.append(time.perf_counter())
            stage_backward_weight(iter(params), groups)
            clock.append(time.perf_counter())
            for key, (t0, t1) in zip(times, [clock[0:2], clock[1:3], clock[3:5], clock[4:6]], strict=True):
                times[key].append(t1 - t0)
            for p in params:
                p.grad = None
        with DetachedMeter(params) as meter:
            y = _forward(layer, inp, kind, target, loss_fn)
        out[kind] = {k: statistics.median(v[1:]) for k, v in times.items()}
        out[kind]["saved_bytes"] = float(meter.peak)
        x = y.detach() if kind != "head" else x
    return out


def _forward(layer: nn.Module, inp: Tensor, kind: str, target: Tensor, loss_fn: Callable) -> Tensor:
    y = layer(inp)
    return loss_fn(y, target) if kind == "head" else y


def gpt_stages(costs: dict[str, dict[str, float]], num_ranks: int, chunks: int) -> list[dict[str, float]]:
    """Per model stage, summed layer costs of a GPT with 2 blocks per rank cut into ``chunks`` per rank."""
    blocks = 2 * num_ranks
    num_stages = num_ranks * chunks
    per = blocks // num_stages
    stages = []
    for s in range(num_stages):  # 2 ranks: [embed, b0, b1] | [b2, b3, head], or [embed, b0] [b1] [b2] [b3, head]
        kinds = ["block"] * per + (["embed"] if s == 0 else []) + (["head"] if s == num_stages - 1 else [])
        stages.append({k: sum(costs[kind][k] for kind in kinds) for k in costs["block"]})
    return stages


def predict(
    costs: dict[str, dict[str, float]],
    ranks: Sequence[int],
    accumulate: Sequence[int],
    comm: float,
    step: float,
) -> list[dict[str, Any]]:
    """One row per (ranks, N, plan, split costs): the simulator's steady state and memory for GPT costs.

    At 2 ranks the layouts are the measured ones (`benchmarks.zero_bubble`). ``comm`` is the
    one-way latency of a transfer between ranks; ``step`` one rank's optimizer step, split over
    its chunks. ``paci_speedup`` is the steady window period of the plan over PACI's; ``of_bound``
    the bubble-free bound's over the plan's; ``utilization`` busy (its own F, B, I, W) over period.
    Plans with a split backward also get a row with ``split_costs="as_fused"``: I and W scaled
    (in their measured proportion) to add up to the fused B, the zero-bubble paper's assumption.
    """
    fused = {kind: {**c, **_as_fused(c)} for kind, c in costs.items()}
    rows = []
    for p in ranks:
        one = gpt_stages(costs, p, 1)
        for n in accumulate:
            # Bubble-free bound of the unsplit work: the busiest rank's N forwards and full backwards and
            # its step, with no wait. A split backward (I + W) that costs more than B shows up against it.
            bound = max(n * (c["forward"] + c["backward"]) + step for c in one)
            block = []
            for name in PLANS:
                for split, layer_costs in (("measured", costs), ("as_fused", fused)):
                    if split == "as_fused" and name not in SPLIT:
                        continue
                    row: dict[str, Any] = {"S": p, "N": n, "schedule": name, "split_costs": split, "error": None}
                    try:
                        row.update(_steady(name, p, n, layer_costs, comm, step), error=None)
                        row["of_bound"] = bound / row["period_s"]
                    except ValueError as err:
                        row.update(dict.fromkeys(_PREDICTED), error=str(err))
                    block.append(row)
            paci = next(r["period_s"] for r in block if r["schedule"] == "paci")
            for row in block:
                row["paci_speedup"] = row["period_s"] / paci if row["period_s"] else None
            rows += block
    return rows


SPLIT = ("zb1p", "zbv", "dualpipev")  # the plans that run I and W


def _as_fused(c: dict[str, float]) -> dict[str, float]:
    scale = c["backward"] / (c["input_grad"] + c["weight_grad"])
    return {"input_grad": c["input_grad"] * scale, "weight_grad": c["weight_grad"] * scale}


def _steady(name: str, p: int, n: int, costs: dict[str, dict[str, float]], comm: float, step: float) -> dict[str, Any]:
    """Simulate `WINDOWS` windows of ``name``; the last window's period, busy fractions and memory."""
    plan = build_plan(name, p, n, windows=WINDOWS)  # type: ignore[arg-type]
    chunks = plan.num_stages // p
    st = gpt_stages(costs, p, chunks)
    result = simulate_plan(
        plan,
        forward=[c["forward"] for c in st],
        backward=[c["backward"] for c in st],
        input_grad=[c["input_grad"] for c in st],
        weight_grad=[c["weight_grad"] for c in st],
        comm=comm,
        step=step / chunks,
        activation=[c["saved_bytes"] for c in st],
    )
    ends = [max(s.end for s in result.timeline if s.action.kind == "STEP" and s.action.index == k)
            for k in (WINDOWS - 2, WINDOWS - 1)]  # fmt: skip
    period = ends[1] - ends[0]  # the last window, once the earlier ones have filled the pipe
    busy = [b / WINDOWS / period for b in result.busy]
    return {
        "period_s": period, "utilization": sum(busy) / len(busy), "utilization_per_rank": busy,
        "peak_activation_bytes_per_rank": list(result.peak_activations),
        "transfers_per_microbatch": sum(plan.rank_of[s] != plan.rank_of[s + 1] for s in range(plan.num_stages - 1)),
    }  # fmt: skip


_PREDICTED = (
    "period_s",
    "of_bound",
    "utilization",
    "utilization_per_rank",
    "peak_activation_bytes_per_rank",
    "transfers_per_microbatch",
    "paci_speedup",
)
