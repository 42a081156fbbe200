"""The bare runtime on a tiny transformer (no Lightning): stages, ranks and the emulation of PACI's rule."""

from __future__ import annotations

import copy
import itertools

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
LR = 1e-2


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
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


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


def forward_version(stage: int, stages: int, j: int, accumulate: int, segment_start: int = 0) -> int:
    """Optimizer steps stage ``stage`` has taken when it runs micro-batch ``j``'s forward (docs/DESIGN.md):
    1F1B with at most S-s in flight puts F(j) right after B(j-(S-s)) and that backward's step, if any.
    A drain before micro-batch ``segment_start`` finished every backward before it."""
    done = segment_start + max(0, j - segment_start - (stages - stage) + 1)  # backwards finished before F(j)
    return done // accumulate


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
