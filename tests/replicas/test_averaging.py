"""Tests for `lit_efficient.replicas.averaging`: the sync schedule and arguments in-process, the averaging
math on 2 gloo processes. Children only compute and save tensors; the parent asserts."""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lit_efficient.replicas.averaging import ReplicaAverager
from tests.support.multiproc import START_METHOD

WORLD = 2


# ---------------------------------------------------------------------------------------------
# Helpers shared by parent and children


def _model(seed: int = 0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(4, 8)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(8))
    layers += [nn.Tanh(), nn.Linear(8, 2)]
    return nn.Sequential(*layers)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Different data per replica, deterministic per (rank, step) so reruns see the same stream.
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _local_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    # Test-side reference only; the code under test talks through comm.
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t)
    return out


def _child(rank: int, scenario: str, init_file: str, out_dir: str, kwargs: dict[str, Any]) -> None:
    torch.set_num_threads(1)  # two cores shared with other test runs
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        result = _SCENARIOS[scenario](rank, **kwargs)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path: Path, scenario: str, **kwargs: Any) -> list[Any]:
    args = (scenario, str(tmp_path / "pg_init"), str(tmp_path), kwargs)
    mp.start_processes(_child, args=args, nprocs=WORLD, start_method=START_METHOD)  # fast ranks: tests/conftest.py
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


# ---------------------------------------------------------------------------------------------
# Scenarios (run in each child; return what the parent checks)


def _dp_equivalence(rank: int) -> dict[str, Any]:
    local, ref = _model(), _model()
    avg = ReplicaAverager(local, None, sync_every=1)
    opt_local = torch.optim.SGD(local.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(1, 6):
        _local_step(local, opt_local, rank, step)
        assert avg.after_step()
        # Reference: synchronous data parallel, mean gradient then SGD.
        x, y = _batch(rank, step)
        opt_ref.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ref(x), y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(WORLD)
        opt_ref.step()
    return {"local": _flat(local), "ref": _flat(ref)}


def _trace(rank: int, outer_optimizer: str) -> dict[str, Any]:
    model = _model(seed=rank, batchnorm=True)  # different inits: construction must broadcast
    bn = model[1]
    avg = ReplicaAverager(model, None, sync_every=3, outer_optimizer=outer_optimizer)
    init = _flat(model)
    bn.num_batches_tracked.fill_(100 * rank)  # integer buffers must stay local
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    synced, params, running_means, counts = [], [], [], []
    for step in range(1, 8):
        _local_step(model, opt, rank, step)
        synced.append(avg.after_step())
        params.append(_flat(model))
        running_means.append(bn.running_mean.clone())
        counts.append(int(bn.num_batches_tracked))
    return {"init": init, "synced": synced, "params": params, "running_means": running_means, "counts": counts}


def _nesterov_vs_average(rank: int) -> dict[str, Any]:
    models = {name: _model() for name in ("average", "unit_nesterov", "diloco")}
    avgs = {
        "average": ReplicaAverager(models["average"], None, sync_every=2),
        "unit_nesterov": ReplicaAverager(
            models["unit_nesterov"], None, sync_every=2, outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0
        ),
        "diloco": ReplicaAverager(
            models["diloco"], None, sync_every=2, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9
        ),
    }
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in models.items()}
    # Hand-written DiLoCo reference for the "diloco" replica, from gathered local weights.
    anchor = _flat(models["diloco"])
    buf = torch.zeros_like(anchor)
    expected, got = [], []
    for step in range(1, 7):
        for name in models:
            _local_step(models[name], opts[name], rank, step)
        if step % 2 == 0:
            pseudo = torch.stack([anchor - w for w in _gather(_flat(models["diloco"]))]).mean(0)
            buf = 0.9 * buf + pseudo
            anchor = anchor - 0.7 * (pseudo + 0.9 * buf)
        for a in avgs.values():
            assert a.after_step() == (step % 2 == 0)
        if step % 2 == 0:
            expected.append(anchor.clone())
            got.append(_flat(models["diloco"]))
    return {
        "average": _flat(models["average"]),
        "unit_nesterov": _flat(models["unit_nesterov"]),
        "diloco_expected": expected,
        "diloco_got": got,
        **_diloco_after_a_warmup(rank),
    }


def _diloco_after_a_warmup(rank: int) -> dict[str, Any]:
    """DiLoCo with 2 warm-up steps, then a sync every 2: each warm-up step ends with the replicas' plain average
    (an outer Nesterov step there moved the weights by up to 7x the inner step), and the outer steps start from the
    last one with an empty momentum. The weights after each sync (steps 1, 2, 4, 6) against a hand-written
    reference from the gathered local weights."""
    model = _model()
    avg = ReplicaAverager(model, None, sync_every=2, warmup_steps=2, outer_optimizer="nesterov")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    anchor, buf = _flat(model), torch.zeros_like(_flat(model))
    expected, got = [], []
    for step in range(1, 7):
        _local_step(model, opt, rank, step)
        local = _gather(_flat(model))
        if step <= 2:
            anchor = torch.stack(local).mean(0)
        elif step % 2 == 0:
            pseudo = torch.stack([anchor - w for w in local]).mean(0)
            buf = 0.9 * buf + pseudo
            anchor = anchor - 0.7 * (pseudo + 0.9 * buf)
        assert avg.after_step() == (step <= 2 or step % 2 == 0)
        if step <= 2 or step % 2 == 0:
            expected.append(anchor.clone())
            got.append(_flat(model))
    return {"warm_expected": expected, "warm_got": got}


def _run_resumable(rank: int, ckpt_dir: str, stop_at: int | None, resume: bool) -> torch.Tensor:
    """Steps 1..7 of DiLoCo with Adam inside; optionally save after `stop_at`, or resume from it."""
    model = _model(seed=123 if resume else 0)  # a resumed run must not depend on its fresh init
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    avg = ReplicaAverager(model, None, sync_every=3, warmup_steps=1, outer_optimizer="nesterov")
    path = os.path.join(ckpt_dir, f"ckpt{rank}.pt")
    first = 1
    if resume:
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        avg.load_state_dict(state["averager"])
        first = avg.step + 1
    for step in range(first, 8):
        _local_step(model, opt, rank, step)
        avg.after_step()
        if step == stop_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "averager": avg.state_dict()}, path)
            return _flat(model)
    return _flat(model)


def _state_dict_round_trip(rank: int, ckpt_dir: str) -> dict[str, Any]:
    full = _run_resumable(rank, ckpt_dir, stop_at=None, resume=False)
    _run_resumable(rank, ckpt_dir, stop_at=5, resume=False)  # syncs at 1, 4, 7: 5 is mid-window
    resumed = _run_resumable(rank, ckpt_dir, stop_at=None, resume=True)
    return {"full": full, "resumed": resumed}


def _traffic(rank: int, outer_optimizer: str) -> dict[str, Any]:
    model = _model(batchnorm=True)
    avg = ReplicaAverager(model, None, sync_every=2, outer_optimizer=outer_optimizer)
    after_init = avg.bytes_communicated
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bytes_at, divergence, expected_divergence = [], [], []
    for step in range(1, 5):
        _local_step(model, opt, rank, step)
        if step % 2 == 0:
            local = _flat(model)
            mean = torch.stack(_gather(local)).mean(0)
            expected_divergence.append(float((local - mean).norm() / mean.norm()))
        if avg.after_step():
            bytes_at.append(avg.bytes_communicated)
            divergence.append(avg.last_divergence)
    avg.sync()  # again, with identical replicas
    bytes_at.append(avg.bytes_communicated)
    divergence.append(avg.last_divergence)
    return {
        "after_init": after_init,
        "bytes_at": bytes_at,
        "divergence": divergence,
        "expected_divergence": expected_divergence,
    }


_SCENARIOS = {
    "dp_equivalence": _dp_equivalence,
    "trace": _trace,
    "nesterov_vs_average": _nesterov_vs_average,
    "state_dict_round_trip": _state_dict_round_trip,
    "traffic": _traffic,
}


# ---------------------------------------------------------------------------------------------
# Multi-process tests


@pytest.mark.multiproc
def test_sync_every_step_matches_synchronous_data_parallel(tmp_path: Path) -> None:
    for r in _spawn(tmp_path, "dp_equivalence"):
        torch.testing.assert_close(r["local"], r["ref"], atol=1e-5, rtol=0)


@pytest.mark.multiproc
@pytest.mark.parametrize("outer_optimizer", ["average", "nesterov"])
def test_replicas_identical_right_after_sync_and_apart_between(tmp_path: Path, outer_optimizer: str) -> None:
    r0, r1 = _spawn(tmp_path, "trace", outer_optimizer=outer_optimizer)
    assert torch.equal(r0["init"], r1["init"])  # broadcast at construction
    assert r0["synced"] == r1["synced"] == [False, False, True, False, False, True, False]
    for i, synced in enumerate(r0["synced"]):
        assert torch.equal(r0["params"][i], r1["params"][i]) == synced, f"step {i + 1}"
        assert torch.equal(r0["running_means"][i], r1["running_means"][i]) == synced, f"step {i + 1}"
    # num_batches_tracked: never averaged (would be 100*rank/2-ish otherwise).
    assert r0["counts"] == list(range(1, 8))
    assert r1["counts"] == list(range(101, 108))


@pytest.mark.multiproc
def test_nesterov_unit_lr_zero_momentum_equals_average_and_diloco_matches_formula(tmp_path: Path) -> None:
    for r in _spawn(tmp_path, "nesterov_vs_average"):
        torch.testing.assert_close(r["unit_nesterov"], r["average"], atol=1e-6, rtol=0)
        assert len(r["diloco_got"]) == 3
        for got, expected in zip(r["diloco_got"], r["diloco_expected"], strict=True):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
        assert len(r["warm_got"]) == 4
        for got, expected in zip(r["warm_got"], r["warm_expected"], strict=True):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.multiproc
def test_state_dict_round_trip_mid_window_continues_exactly(tmp_path: Path) -> None:
    results = _spawn(tmp_path, "state_dict_round_trip", ckpt_dir=str(tmp_path))
    for r in results:
        assert torch.equal(r["full"], r["resumed"])
    assert torch.equal(results[0]["full"], results[1]["full"])  # step 7 is a sync


@pytest.mark.multiproc
@pytest.mark.parametrize("outer_optimizer", ["average", "nesterov"])
def test_bytes_and_divergence_per_sync(tmp_path: Path, outer_optimizer: str) -> None:
    model = _model(batchnorm=True)
    n_params = sum(p.numel() for p in model.parameters())
    n_float_buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    per_sync = 4 * (n_params + n_float_buffers)  # all fp32; the pseudo-gradient is fp32 too
    for r in _spawn(tmp_path, "traffic", outer_optimizer=outer_optimizer):
        assert r["after_init"] == per_sync  # the construction broadcast
        assert r["bytes_at"] == [per_sync * k for k in (2, 3, 4)]
        scheduled, again = r["divergence"][:2], r["divergence"][2]
        assert all(d > 0 for d in scheduled)
        assert scheduled == pytest.approx(r["expected_divergence"], rel=1e-4)
        assert again == 0.0


# ---------------------------------------------------------------------------------------------
# In-process tests


def _single(model: nn.Module | None = None, **kwargs: Any) -> ReplicaAverager:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the single-replica warning has its own test
        return ReplicaAverager(model if model is not None else _model(), None, **kwargs)


def test_warmup_then_every_h() -> None:
    avg = _single(sync_every=4, warmup_steps=3)
    synced = [step for step in range(1, 16) if avg.after_step()]
    assert synced == [1, 2, 3, 7, 11, 15]
    assert [avg.is_sync_step(s) for s in range(1, 16)] == [s in synced for s in range(1, 16)]
    assert avg.step == 15


def test_a_diloco_warmup_averages_and_its_outer_steps_start_after_it() -> None:
    """A warm-up sync under DiLoCo took an outer Nesterov step (lr 0.7, momentum 0.9) at every step: up to 7x the
    inner step, a warm-up at several times the learning rate asked for, its momentum carried on after it. It
    averages now (one replica here: the weights stay the inner optimizer's), and the first outer step after it
    starts from the warm-up's last weights with an empty momentum."""
    model = _model()
    avg = _single(model, sync_every=2, warmup_steps=3, outer_optimizer="nesterov")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 4):
        _local_step(model, opt, 0, step)
        inner = _flat(model)
        assert avg.after_step()
        assert torch.equal(_flat(model), inner), step
    warmed = _flat(model)
    for step in (4, 5):
        _local_step(model, opt, 0, step)
    pseudo = warmed - _flat(model)
    assert avg.after_step() is False and avg.after_step() is True
    # Nesterov's first step: the momentum is the pseudo-gradient, the update (1 + 0.9) times it.
    torch.testing.assert_close(_flat(model), warmed - 0.7 * 1.9 * pseudo, atol=1e-6, rtol=0)
    # A checkpoint of the warm-up's last step from before the change carried the warm-up's outer momentum: dropped.
    saved = {**avg.state_dict(), "step": 3, "outer_momentum_buffers": [torch.ones_like(a) for a in avg._anchor]}
    again = _single(_model(), sync_every=2, warmup_steps=3, outer_optimizer="nesterov")
    again.load_state_dict(saved)
    assert again._outer is not None and not again._outer.state
    again.load_state_dict({**saved, "step": 4})  # after the warm-up: the momentum is DiLoCo's own
    assert len(again._outer.state) == len(saved["anchor"])


def test_no_warmup_syncs_every_h() -> None:
    avg = _single(sync_every=3)
    assert [s for s in range(1, 10) if avg.after_step()] == [3, 6, 9]


def test_single_replica_warns_once_and_average_leaves_weights() -> None:
    model = _model(batchnorm=True)
    with pytest.warns(UserWarning, match="nothing to average") as record:
        avg = ReplicaAverager(model, None, sync_every=1)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for _ in range(3):
            assert avg.after_step()
    assert len(record) == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert avg.bytes_communicated == avg.setup_bytes == 0
    assert avg.bytes_per_step == 0.0
    assert avg.last_divergence == 0.0


def test_single_replica_nesterov_unit_lr_is_identity_on_a_world_of_one(tmp_path: Path) -> None:
    # An initialized world of size 1 (not only "no torch.distributed at all").
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = _model()
        with pytest.warns(UserWarning, match="nothing to average"):
            avg = ReplicaAverager(
                model, None, sync_every=2, outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0
            )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(1, 5):
            _local_step(model, opt, 0, step)
            expected = _flat(model)
            if avg.after_step():
                torch.testing.assert_close(_flat(model), expected, atol=1e-6, rtol=0)
        assert avg.bytes_communicated == 0
    finally:
        dist.destroy_process_group()


def test_single_replica_state_dict_round_trip() -> None:
    model = _model()
    avg = _single(model, sync_every=2, outer_optimizer="nesterov")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 4):
        _local_step(model, opt, 0, step)
        avg.after_step()
    state = avg.state_dict()
    assert state["step"] == 3
    assert all(b is not None for b in state["outer_momentum_buffers"])
    fresh = _single(sync_every=2, outer_optimizer="nesterov")
    fresh.load_state_dict(state)
    assert fresh.step == 3
    for a, b in zip(fresh.state_dict()["anchor"], state["anchor"], strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="outer_optimizer='nesterov'"):
        _single(sync_every=2).load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_every": 0}, "sync_every=0"),
        ({"sync_every": 2.5}, "sync_every=2.5 must be an integer"),  # was taken: a sync every 5 steps
        ({"sync_every": True}, "sync_every=True must be an integer"),
        ({"sync_every": 2, "warmup_steps": -1}, "warmup_steps=-1"),
        ({"sync_every": 2, "outer_lr": 0.0}, "outer_lr=0.0"),
        ({"sync_every": 2, "outer_momentum": 1.0}, r"outer_momentum=1.0 must be a number in \[0, 1\)"),
        ({"sync_every": 2, "outer_momentum": -0.1}, "outer_momentum=-0.1"),
        ({"sync_every": 2, "outer_optimizer": "adam"}, "outer_optimizer='adam' is unknown"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReplicaAverager(_model(), None, **kwargs)


def test_streaming_spreads_the_stages_syncs_over_the_interval():
    """Streaming DiLoCo with stages as fragments: each stage syncs every H steps, stage s shifted by s*H//S, so
    every step of the interval carries at most ceil(S/H) stages' shares, and warm-up still syncs every step."""
    from lit_efficient.replicas.averaging import stream_offset, sync_due

    stages, every, warmup = 4, 8, 2
    offsets = [stream_offset(s, stages, every) for s in range(stages)]
    assert offsets == [0, 2, 4, 6]
    turns = {s: [t for t in range(1, 27) if sync_due(t, every, warmup, offsets[s])] for s in range(stages)}
    assert turns[0] == [1, 2, 10, 18, 26] and turns[1] == [1, 2, 4, 12, 20] and turns[3] == [1, 2, 8, 16, 24]
    after_warmup = [t for t in range(3, 27) if sum(t in turns[s] for s in range(stages)) > 1]
    assert after_warmup == []  # one stage at a time
    assert not sync_due(0, every, warmup, 0)
    model = _model()
    averager = ReplicaAverager(model, None, sync_every=every, warmup_steps=warmup, offset=offsets[2])
    assert [t for t in range(1, 27) if averager.is_sync_step(t)] == turns[2]
