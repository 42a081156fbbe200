"""The bare runtime on a tiny transformer (no Lightning): stages, ranks and the emulation of PACI's rule."""

from __future__ import annotations

import copy
import itertools
import math

import torch

from lit_efficient.runtime.interpreter import PipelineRuntime
from lit_efficient.runtime.partition import partition_uniform, stage_bounds
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.topology import Topology
from lit_efficient.tools.corpus import embedded_corpus
from lit_efficient.tools.demo import batches, build_layers, lm_loss
from lit_efficient.transport.process import PointToPoint
from tests.support.emulation import backward_from_inputs, run

MODEL = dict(n_layer=2, dim=32, heads=2, block=16)
BATCH = 4
LR, WD, BETAS, EPS = 1e-2, 0.01, (0.9, 0.999), 1e-8  # runtime_optimizer's AdamW


def demo_stage(stages: int, s: int, recompute: bool, normalize: str) -> PipelineStage:
    torch.manual_seed(0)
    layers = build_layers(**MODEL, dropout=0.1)
    lo, hi = stage_bounds(partition_uniform(len(layers), stages))[s]
    torch.manual_seed(1234)  # the dropout stream every stage forks from
    mine = layers[lo:hi]
    opt = runtime_optimizer([p for layer in mine for p in layer.parameters()])
    return PipelineStage(mine, s, stages, opt, lm_loss, recompute=recompute, normalize=normalize)  # type: ignore[arg-type]


def runtime_batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(batches(embedded_corpus(200_000), MODEL["block"], BATCH, seed), n))


def runtime_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, betas=BETAS, eps=EPS)


def train_unsplit(layers, optimizer, data, accumulate: int) -> None:
    """The unsplit reference: every micro-batch through all ``layers``, loss / N, a step per window of N."""
    for j, batch in enumerate(data):
        x = batch[0]
        for layer in layers:
            x = layer(x)
        (lm_loss(x, batch)[0] / accumulate).backward()
        if (j + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()


def pipeline_on_ranks(rank, world, schedule, accumulate, stages, *, dropout=0.0, recompute=False, timeout=60.0):
    topo = Topology.for_world(world, stages)
    s = topo.stage_of(rank)
    layers = build_layers(**MODEL, dropout=dropout)
    lo, hi = stage_bounds(partition_uniform(len(layers), stages))[s]
    mine = layers[lo:hi]
    stage = PipelineStage(
        mine,
        s,
        stages,
        runtime_optimizer([p for layer in mine for p in layer.parameters()]),
        lm_loss,
        recompute=recompute,
    )
    comm = PointToPoint(s, topo.stage_of, torch.device("cpu"), timeout)
    prev_rank, next_rank = topo.neighbours(rank)
    runtime = PipelineRuntime(stage, schedule, accumulate, lambda b: b[0], comm, prev_rank, next_rank)
    return runtime, (lo, hi)


def backwards_before(stage: int, stages: int, j: int, segment_start: int = 0) -> int:
    """Backwards stage ``stage`` has finished when it runs micro-batch ``j``'s forward (docs/DESIGN.md): 1F1B with
    at most S-s in flight puts F(j) right after B(j-(S-s)). A drain before micro-batch ``segment_start`` finished
    every backward before it."""
    return segment_start + max(0, j - segment_start - (stages - stage) + 1)


def forward_version(stage: int, stages: int, j: int, accumulate: int, segment_start: int = 0) -> int:
    """Optimizer steps stage ``stage`` has taken when it runs micro-batch ``j``'s forward: the steps of the
    backwards before it (a stage steps right after a window's N-th backward)."""
    return backwards_before(stage, stages, j, segment_start) // accumulate


def paci_emulation(
    data, stages: int, accumulate: int, bounds, drains=frozenset(), optimizer=runtime_optimizer
) -> list[list[torch.nn.Module]]:
    """PACI with recompute=True, emulated in one process from its definition, not from the runtime: each
    stage forwards micro-batch j on the weights of `forward_version`; its backward recomputes the stage
    on the current weights (window j // N's) from the input it was sent, and stage s steps after its
    N-th backward of a window. ``drains``: micro-batches before which the pipeline was drained."""
    layers = build_layers(**MODEL)
    stage_layers = [layers[lo:hi] for lo, hi in bounds]
    opts = [optimizer([p for layer in mine for p in layer.parameters()]) for mine in stage_layers]
    versions = [[copy.deepcopy(mine)] for mine in stage_layers]  # versions[s][v]: stage s after v steps

    segment_start = 0
    for j, batch in enumerate(data):
        segment_start = j if j in drains else segment_start
        inputs = []  # what each stage received for micro-batch j, computed at forward-time versions
        x = batch[0]
        with torch.no_grad():
            for s in range(stages):
                inputs.append(x)
                x = run(versions[s][forward_version(s, stages, j, accumulate, segment_start)], x)
        backward_from_inputs(stage_layers, inputs, batch, accumulate)
        if (j + 1) % accumulate == 0:
            for s in range(stages):
                opts[s].step()
                opts[s].zero_grad()
                versions[s].append(copy.deepcopy(stage_layers[s]))
    return stage_layers


def adamw_prediction(layers_now, opt_state, delay, partial, first_step=False, share=None):
    """The documented rule for AdamW: w - d * lr * (m'_hat / (sqrt(v'_hat) + eps) + wd * w), per parameter, the
    moments m' and v' (and the step count) advanced by one step on ``partial``, the mean gradient of the window
    accumulated so far (None: the moments as they are). ``first_step``: a parameter without optimizer state yet
    is predicted too, from zero moments at step count 0. ``share``: the square folded into v' is ``share * g^2 +
    (1 - share) * v_hat`` where the parameter has state (the square-shrunk rule)."""
    out = copy.deepcopy(layers_now)
    params = [p for layer in out for p in layer.parameters()]
    state = opt_state["state"]
    decayed = {i for g in opt_state["param_groups"] for i in g["params"] if g["weight_decay"]}
    with torch.no_grad():
        for i, p in enumerate(params):
            square = None
            if i in state:
                t, m, v = float(state[i]["step"]), state[i]["exp_avg"], state[i]["exp_avg_sq"]
                if share is not None and share < 1 and partial is not None and partial[i] is not None:
                    square = share * partial[i] * partial[i] + (1 - share) * v / (1 - BETAS[1] ** t)
            elif first_step and partial is not None and partial[i] is not None:
                t, m, v = 0.0, torch.zeros_like(p), torch.zeros_like(p)
            else:
                continue
            if partial is not None and partial[i] is not None:
                g = partial[i]
                folded = (1 - BETAS[1]) * g * g if square is None else (1 - BETAS[1]) * square
                t, m, v = t + 1, BETAS[0] * m + (1 - BETAS[0]) * g, BETAS[1] * v + folded
            m_hat = m / (1 - BETAS[0] ** t)
            v_hat = v / (1 - BETAS[1] ** t)
            u = m_hat / (v_hat.sqrt() + EPS) + (WD * p if i in decayed else 0)
            p -= delay * LR * u
    return out


# The corrections `correction_emulation` writes out (the others' names also start with "weight_prediction").
EMULATED = frozenset({
    None, "lr_scale", "weight_prediction", "weight_prediction_first_step", "weight_prediction_first_step_square_shrunk"
})  # fmt: skip


def correction_emulation(data, stages, accumulate, correction, anneal: int = 4, sync_steps: int = 0):
    """PACI with recompute from its definition, plus ``correction``'s documented rule (``"auto"``: the default's,
    ``"weight_prediction_first_step_square_shrunk"``; ``anneal``: ``"lr_scale"``'s steps). ``sync_steps``: the
    synchronous start, the first steps in flush order (the pipeline drained before each of those windows and
    after the last)."""
    if correction == "auto":
        correction = "weight_prediction_first_step_square_shrunk"
    if correction not in EMULATED:
        raise ValueError(f"correction={correction!r} has no emulation here; emulated: {sorted(map(str, EMULATED))}")
    layers = build_layers(**MODEL)
    bounds = stage_bounds(partition_uniform(len(layers), stages))
    stage_layers = [layers[lo:hi] for lo, hi in bounds]
    opts = [runtime_optimizer([p for layer in mine for p in layer.parameters()]) for mine in stage_layers]
    versions = [[(copy.deepcopy(mine), copy.deepcopy(opts[s].state_dict()))] for s, mine in enumerate(stage_layers)]
    # partial[s][k]: stage s's mean gradient of its open window right after micro-batch k's backward (None
    # once that backward closed the window). A forward predicts from the stage's last backward before it.
    partial: list[dict[int, list | None]] = [{} for _ in range(stages)]

    for j, batch in enumerate(data):
        inputs, x = [], batch[0]
        with torch.no_grad():
            for s in range(stages):
                inputs.append(x)
                done = backwards_before(s, stages, j, accumulate * min(j // accumulate, sync_steps))
                weights, opt_state = versions[s][done // accumulate]
                delay = j // accumulate - done // accumulate
                if correction and correction.startswith("weight_prediction") and delay > 0:
                    first = correction != "weight_prediction"  # the first_step variants
                    k = done - 1  # the stage's last backward: its window's (k % N + 1)-th micro-batch
                    share = (k % accumulate + 1) / accumulate if correction.endswith("square_shrunk") else None
                    weights = adamw_prediction(weights, opt_state, delay, partial[s].get(k), first, share)
                x = run(weights, x)
        backward_from_inputs(stage_layers, inputs, batch, accumulate)
        window = j % accumulate + 1  # backwards of this window so far; the emulation's grads hold their sum / N
        for s in range(stages):
            grads = [p.grad for layer in stage_layers[s] for p in layer.parameters()]
            partial[s][j] = (
                None if window == accumulate else [None if g is None else g * accumulate / window for g in grads]
            )
        if (j + 1) % accumulate == 0:
            for s in range(stages):
                k = j // accumulate  # this stage's step count before this step
                scale = 1.0
                if correction == "lr_scale":
                    d = math.ceil((stages - 1 - s) / accumulate)
                    scale = (1 + d) ** -(1 - min(1, k / anneal))
                for g in opts[s].param_groups:
                    g["lr"] = LR * scale
                opts[s].step()
                for g in opts[s].param_groups:
                    g["lr"] = LR
                opts[s].zero_grad()
                versions[s].append((copy.deepcopy(stage_layers[s]), copy.deepcopy(opts[s].state_dict())))
    return stage_layers
