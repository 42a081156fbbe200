"""The pipeline runtime on real processes (gloo, CPU), checked against an unsplit copy of the model."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from lit_efficient.runtime.partition import partition_uniform, stage_bounds
from lit_efficient.tools.demo import build_layers, lm_loss
from tests.support.multiproc import spawn, values
from tests.support.runtime_runs import MODEL, train_unsplit
from tests.support.runtime_runs import paci_emulation as _paci_emulation
from tests.support.runtime_runs import pipeline_on_ranks as _pipeline
from tests.support.runtime_runs import runtime_batches as _data
from tests.support.runtime_runs import runtime_optimizer as _optimizer

pytestmark = pytest.mark.multiproc


def _reference(data, accumulate: int, dropout: float = 0.0) -> list[torch.nn.Module]:
    """Unsplit model trained on the same micro-batches: loss / N per micro-batch, step per window."""
    layers = build_layers(**MODEL, dropout=dropout)
    train_unsplit(layers, _optimizer([p for layer in layers for p in layer.parameters()]), data, accumulate)
    return layers


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


def _raises_on_stage_0(rank, world, stamp):
    data = _data(12)
    runtime, _ = _pipeline(rank, world, "paci", 2, world, timeout=30.0)

    def boom(batch):
        if runtime._fed > 5:
            Path(stamp).write_text(repr(time.time()))
            raise ValueError("injected failure in forward")
        return batch[0]

    runtime.input_fn = boom
    for j, batch in enumerate(data):
        runtime.feed(batch, j)
    runtime.drain()


def test_failed_stage_stops_every_rank_with_its_name(tmp_path):
    stamp = tmp_path / "raised_at"
    results = spawn(_raises_on_stage_0, 2, str(stamp), timeout=60)
    assert "injected failure" in results[1]["error"]  # rank 1 runs stage 0
    assert "stage 0 (rank 1)" in results[0]["error"], results[0]["error"]
    noticed = results[0]["finished_at"] - float(stamp.read_text())  # from the raise: set-up is not detection
    assert noticed < 15, f"the peer noticed the failed stage {noticed:.0f} s after it, near the 30 s timeout"
