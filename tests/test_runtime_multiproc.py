"""The pipeline runtime on real processes (gloo, CPU), checked against an unsplit copy of the model."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from lit_efficient.runtime.interpreter import PipelineRuntime
from lit_efficient.runtime.partition import partition_uniform, stage_bounds
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.topology import Topology
from lit_efficient.tools.corpus import embedded_corpus
from lit_efficient.tools.demo import batches, build_layers, lm_loss
from lit_efficient.transport.process import PointToPoint
from tests.emulation import backward_from_inputs, run
from tests.multiproc import spawn, values

pytestmark = pytest.mark.multiproc

MODEL = dict(n_layer=2, dim=32, heads=2, block=16)
BATCH = 4
LR = 1e-2


def _data(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(batches(embedded_corpus(200_000), MODEL["block"], BATCH, seed), n))


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _reference(data, accumulate: int, dropout: float = 0.0) -> list[torch.nn.Module]:
    """Unsplit model trained on the same micro-batches: loss / N per micro-batch, step per window."""
    layers = build_layers(**MODEL, dropout=dropout)
    opt = _optimizer([p for layer in layers for p in layer.parameters()])
    for j, batch in enumerate(data):
        x = batch[0]
        for layer in layers:
            x = layer(x)
        (lm_loss(x, batch)[0] / accumulate).backward()
        if (j + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    return layers


def _pipeline(rank, world, schedule, accumulate, stages, *, dropout=0.0, recompute=False, timeout=60.0):
    topo = Topology.for_world(world, stages)
    s = topo.stage_of(rank)
    layers = build_layers(**MODEL, dropout=dropout)
    lo, hi = stage_bounds(partition_uniform(len(layers), stages))[s]
    mine = layers[lo:hi]
    stage = PipelineStage(
        mine, s, stages, _optimizer([p for layer in mine for p in layer.parameters()]), lm_loss, recompute=recompute
    )
    comm = PointToPoint(s, topo.stage_of, torch.device("cpu"), timeout)
    prev_rank, next_rank = topo.neighbours(rank)
    runtime = PipelineRuntime(stage, schedule, accumulate, lambda b: b[0], comm, prev_rank, next_rank)
    return runtime, (lo, hi)


def _train_and_compare(rank, world, schedule, accumulate, steps):
    data = _data(accumulate * steps)
    runtime, (lo, hi) = _pipeline(rank, world, schedule, accumulate, world)
    for j, batch in enumerate(data):
        runtime.feed(batch, j)
    runtime.drain()
    ref = _reference(data, accumulate)[lo:hi]
    got = [p for layer in runtime.stage.layers for p in layer.parameters()]
    want = [p for layer in ref for p in layer.parameters()]
    init = [p for layer in build_layers(**MODEL)[lo:hi] for p in layer.parameters()]
    diff = max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))
    moved = max((a - b).abs().max().item() for a, b in zip(got, init, strict=True))
    return {"diff": diff, "moved": moved, "stats": runtime.stats()}


@pytest.mark.parametrize("stages", [2, 4])
def test_flush_equals_unsplit_model(stages):
    results = values(spawn(_train_and_compare, stages, "1f1b_flush", 4, 3))
    for r in results:
        assert r["moved"] > 1e-3, "training did not change the parameters: the comparison would be vacuous"
        assert r["diff"] <= 1e-5, r
        assert r["stats"]["steps"] == 3 and r["stats"]["drift_max"] == 0


# (batch, sequence length) per micro-batch: the shapes crossing each stage boundary change, so every
# transfer protocol path runs (payload receives posted ahead with the last shapes, placeholders when
# they change), in both directions, around a drain and an evaluation in the middle of a window.
VARYING = [(4, 16), (4, 16), (3, 12), (3, 12), (4, 8), (4, 16), (2, 16), (4, 16), (4, 16), (4, 12), (1, 16), (4, 16)]
EVAL_SHAPE = (2, 10)


def _cut(batch, shape):
    b, t = shape
    return batch[0][:b, :t], batch[1][:b, :t]


def _train_varying_shapes(rank, world):
    data = [_cut(batch, shape) for batch, shape in zip(_data(len(VARYING)), VARYING, strict=True)]
    probe = _cut(_data(1, seed=7)[0], EVAL_SHAPE)
    runtime, (lo, hi) = _pipeline(rank, world, "1f1b_flush", 4, world)
    for j, batch in enumerate(data[:6]):
        runtime.feed(batch, j)
    runtime.drain()  # mid-window: micro-batches 4 and 5 stay accumulated
    logits = runtime.evaluate(probe, 0)
    for j, batch in enumerate(data[6:], start=6):
        runtime.feed(batch, j)
    runtime.drain()

    layers = build_layers(**MODEL)
    opt = _optimizer([p for layer in layers for p in layer.parameters()])
    want_logits = None
    for j, batch in enumerate(data):
        if j == 6:
            with torch.no_grad():
                x = probe[0]
                for layer in layers:
                    x = layer(x)
                want_logits = x
        x = batch[0]
        for layer in layers:
            x = layer(x)
        (lm_loss(x, batch)[0] / 4).backward()
        if (j + 1) % 4 == 0:
            opt.step()
            opt.zero_grad()
    got = [p for layer in runtime.stage.layers for p in layer.parameters()]
    want = [p for layer in layers[lo:hi] for p in layer.parameters()]
    diff = max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))
    logits_diff = None if logits is None else (logits[0] - want_logits).abs().max().item()
    return {"diff": diff, "logits_diff": logits_diff, "steps": runtime.stats()["steps"]}


def test_flush_equals_unsplit_model_when_shapes_change():
    results = values(spawn(_train_varying_shapes, 3))
    for r in results:
        assert r["diff"] <= 1e-5, r
        assert r["steps"] == 3, r
    logits = [r["logits_diff"] for r in results if r["logits_diff"] is not None]
    assert len(logits) == 1 and logits[0] <= 1e-5, results  # the last stage returns the evaluation's output


def _paci_drift(rank, world, accumulate):
    data = _data(accumulate * 4)
    runtime, _ = _pipeline(rank, world, "paci", accumulate, world)
    for j, batch in enumerate(data):
        runtime.feed(batch, j)
    runtime.drain()
    return runtime.stats()


@pytest.mark.parametrize("accumulate", [1, 2, 4])
def test_paci_measured_drift_equals_bound(accumulate):
    stats = values(spawn(_paci_drift, 4, accumulate))
    for st in stats:
        bound = math.ceil((4 - 1 - st["stage"]) / accumulate)
        assert st["drift_max"] == bound, st
        assert st["max_in_flight"] <= 4 - st["stage"]
        assert st["steps"] == 4


def _forward_version(stage: int, stages: int, j: int, accumulate: int, segment_start: int = 0) -> int:
    """Optimizer steps stage ``stage`` has taken when it runs micro-batch ``j``'s forward (docs/DESIGN.md):
    1F1B with at most S-s in flight puts F(j) right after B(j-(S-s)) and that backward's step, if any.
    A drain before micro-batch ``segment_start`` finished every backward before it."""
    done = segment_start + max(0, j - segment_start - (stages - stage) + 1)  # backwards finished before F(j)
    return done // accumulate


def _paci_emulation(
    data, stages: int, accumulate: int, bounds, drains=frozenset(), optimizer=_optimizer
) -> list[list[torch.nn.Module]]:
    """PACI with recompute=True, emulated in one process from its definition, not from the runtime: each
    stage forwards micro-batch j on the weights of `_forward_version`; its backward recomputes the stage
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
                x = run(versions[s][_forward_version(s, stages, j, accumulate, segment_start)], x)
        backward_from_inputs(stage_layers, inputs, batch, accumulate)
        if (j + 1) % accumulate == 0:
            for s in range(stages):
                opts[s].step()
                opts[s].zero_grad()
                versions[s].append(copy.deepcopy(stage_layers[s]))
    return stage_layers


def _paci_against_emulation(rank, world, accumulate, windows):
    data = _data(accumulate * windows)
    runtime, (lo, hi) = _pipeline(rank, world, "paci", accumulate, world, recompute=True)
    for j, batch in enumerate(data):
        runtime.feed(batch, j)
    runtime.drain()
    bounds = stage_bounds(partition_uniform(len(build_layers(**MODEL)), world))
    s = runtime.stage.stage
    emulated = _paci_emulation(data, world, accumulate, bounds)[s]
    flush = _reference(data, accumulate)[lo:hi]
    got = [p for layer in runtime.stage.layers for p in layer.parameters()]
    want = [p for layer in emulated for p in layer.parameters()]
    sync = [p for layer in flush for p in layer.parameters()]
    return {
        "stage": s,
        "diff": max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)),
        "from_flush": max((a - b).abs().max().item() for a, b in zip(got, sync, strict=True)),
        "drift_max": runtime.stats()["drift_max"],
    }


@pytest.mark.parametrize(("stages", "accumulate"), [(2, 2), (2, 8), (4, 2)])
def test_paci_equals_its_definition(stages, accumulate):
    """Multi-process PACI (recompute) against a one-process emulation of its semantics, to float rounding.

    Stage 0 of every configuration trains on stale inputs (drift >= 1), so its weights leave flush's."""
    results = values(spawn(_paci_against_emulation, stages, accumulate, 3))
    for r in results:
        assert r["diff"] <= 1e-5, r
    first = next(r for r in results if r["stage"] == 0)
    assert first["drift_max"] >= 1 and first["from_flush"] > 1e-4, results  # staleness happened and mattered


def _loss_curve(rank, world, schedule):
    data = _data(4 * 40, seed=1)
    runtime, _ = _pipeline(rank, world, schedule, 4, world)
    losses = [loss.item() for j, b in enumerate(data) if (loss := runtime.feed(b, j)) is not None]
    runtime.drain()
    return losses


def test_paci_loss_decreases_like_flush():
    paci = values(spawn(_loss_curve, 2, "paci"))[0]  # rank 0 holds the last stage and the losses
    flush = values(spawn(_loss_curve, 2, "1f1b_flush"))[0]
    first, last = sum(paci[:16]) / 16, sum(paci[-16:]) / 16
    assert last < first - 0.5, (first, last)
    assert abs(last - sum(flush[-16:]) / 16) < 0.1 * last


def _recompute_grads(rank, world, recompute):
    data = _data(3)
    torch.manual_seed(1234)  # dropout masks come from this stream
    runtime, _ = _pipeline(rank, world, "paci", 8, world, dropout=0.2, recompute=recompute)
    for j, batch in enumerate(data):
        runtime.feed(batch, j)
    runtime.drain()  # 3 < N=8: no step, gradients stay accumulated
    return [p.grad.clone() for p in runtime.stage.parameters()]


def test_recompute_matches_keep_graph_with_dropout():
    keep = values(spawn(_recompute_grads, 2, False))
    again = values(spawn(_recompute_grads, 2, True))
    for a, b in zip(keep, again, strict=True):
        for ga, gb in zip(a, b, strict=True):
            torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in keep[1])


def _raises_on_stage_0(rank, world):
    data = _data(12)
    runtime, _ = _pipeline(rank, world, "paci", 2, world, timeout=30.0)

    def boom(batch):
        if runtime._fed > 5:
            raise ValueError("injected failure in forward")
        return batch[0]

    runtime.input_fn = boom
    for j, batch in enumerate(data):
        runtime.feed(batch, j)
    runtime.drain()


def test_failed_stage_stops_every_rank_with_its_name():
    results = spawn(_raises_on_stage_0, 2, timeout=60)
    assert "injected failure" in results[1]["error"]  # rank 1 runs stage 0
    assert "stage 0 (rank 1)" in results[0]["error"], results[0]["error"]
    assert results[0]["seconds"] < 25, "the peer should notice the dead stage well before the timeout"
