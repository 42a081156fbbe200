"""``PACIStrategy(shard_optimizer_state=True)`` (ZeRO-1): each stage's optimizer state split over its replicas.

One spawned run of 4 ranks (2 stages x 2 replicas, the real Trainer on each rank as under torchrun, AdamW
with two parameter groups, gradient-norm clipping on) trains sharded and unsharded side by side and saves
after fit; the parent then checks that the sharded runs end where the unsharded ones do (1F1B-flush and
PACI, 1e-6), that each rank holds half the optimizer state, that both checkpoint formats of a sharded run
hold what the unsharded run's hold, and that they resume unsharded, sharded, on one device and on another
layout (2 stages in one process), and that the memory plan counts what each rank holds; the ranks also check
that a NaN in one replica's gradient makes every replica refuse the update. The refusals are checked without
processes.
"""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lit_efficient import GradientAccumulation, PACIStrategy
from lit_efficient.cli.plan import plan
from lit_efficient.replicas.sharded_optimizer import ShardedOptimizer, check_elementwise, optimizer_state_bytes
from lit_efficient.runtime.topology import Topology
from lit_efficient.strategy.config import _sharding_applies
from tests.support.checkpoints import one_file as _one_file
from tests.support.gpt_runs import gpt_model as _model
from tests.support.gpt_runs import gpt_trainer as _trainer
from tests.support.gpt_runs import max_diff as _max_diff
from tests.support.gpt_runs import ordered_data as _ordered
from tests.support.multiproc import spawn, values

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("one_thread")]  # one thread in every rank

CLIP = 0.05  # below the tiny GPT's gradient norms: every step clips


def _fit(root: str, name: str, steps: int, ckpt: str | None = None, formats: tuple[str, ...] = (), **kw) -> int:
    """One 4-rank fit (every rank runs it); saves after fit in ``formats`` as ``{name}-{format}.ckpt``. Returns
    this rank's optimizer-state bytes; rank 0 also keeps the trained weights in ``{name}.pt``."""
    model = _model()
    strategy = PACIStrategy(pipeline_stages=2, **{"schedule": "1f1b_flush", **kw})
    trainer = _trainer(strategy, 4, steps, gradient_clip_val=CLIP)
    trainer.fit(model, datamodule=_ordered(), ckpt_path=ckpt)
    for fmt in formats:  # collective; the sharded optimizer consolidated at the end of fit (shares.py)
        strategy.checkpoint_format = fmt
        trainer.save_checkpoint(Path(root, f"{name}-{fmt}.ckpt"))
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), Path(root, f"{name}.pt"))
    optimizer = strategy.optimizers[0]
    assert isinstance(optimizer, ShardedOptimizer) == kw.get("shard_optimizer_state", False)
    return optimizer_state_bytes(optimizer)


def _nonfinite_chunk_poisons_every_replica(rank: int) -> bool:
    """A NaN in one replica's gradient lands in one replica's chunk of the sum; every replica must then see a
    non-finite gradient (and refuse the update), or the others would wait for it in the all-gather."""
    layer = torch.nn.Linear(3, 2)
    optimizer = ShardedOptimizer(torch.optim.AdamW(layer.parameters()), dist.group.WORLD, range(dist.get_world_size()))
    for p in layer.parameters():
        p.grad = torch.ones_like(p)
    if rank == 1:
        layer.bias.grad[1] = float("nan")  # the last elements: the last replica's chunk
    totals = optimizer.reduce_gradients([p.grad for p in layer.parameters()], torch.tensor([1.0, 0.0, -1.0]))
    finite = all(torch.isfinite(p.grad).all() for p in layer.parameters())
    return not finite and totals[0].item() == dist.get_world_size()


def _step_sharded(optimizer: ShardedOptimizer, params: torch.nn.ParameterList) -> None:
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, 0.5 + i)
    optimizer.reduce_gradients([p.grad for p in params], torch.tensor([1.0, 0.0, -1.0]))
    optimizer.step()


def _a_scalar_parameter_resumes() -> float:
    """A 0-dim parameter (a learnable temperature, a ReZero gate): its saved moments are 0-dim as its step count
    is, and loading sliced only tensors with a dimension, so each replica's 1-D piece took a 0-dim moment and its
    next step failed ("output with shape [] doesn't match the broadcast shape [1]"). How far the weights stepped
    after a save and load end from the same step without them (every optimizer of the list)."""
    far = 0.0
    for make in (torch.optim.AdamW, torch.optim.NAdam, torch.optim.Adagrad, torch.optim.RMSprop):
        params = torch.nn.ParameterList([torch.nn.Parameter(torch.tensor(1.5)), torch.nn.Parameter(torch.ones(3))])
        world = range(dist.get_world_size())
        first = ShardedOptimizer(make(params.parameters(), lr=0.1), dist.group.WORLD, world)
        _step_sharded(first, params)
        saved = [first.state_dict()]  # collective: rank 0's holds the whole stage's state
        dist.broadcast_object_list(saved, src=0)
        before = [p.detach().clone() for p in params]
        _step_sharded(first, params)
        want = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, value in zip(params, before, strict=True):
                p.copy_(value)
        again = ShardedOptimizer(make(params.parameters(), lr=0.1), dist.group.WORLD, world)
        again.load_state_dict(saved[0])
        _step_sharded(again, params)
        far = max(far, *((p - w).abs().max().item() for p, w in zip(params, want, strict=True)))
    return far


def _schedulers_see_their_optimizer_stepped() -> list[str]:
    """The user's optimizer, which its LR schedulers hold, never steps itself under sharding; torch's scheduler then
    warned "lr_scheduler.step() before optimizer.step()" on every rank at the first step. The warnings it gives."""
    layer = torch.nn.Linear(3, 2)
    user = torch.optim.AdamW(layer.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(user, lambda step: 1.0)
    optimizer = ShardedOptimizer(user, dist.group.WORLD, range(dist.get_world_size()))
    for p in layer.parameters():
        p.grad = torch.ones_like(p)
    optimizer.reduce_gradients([p.grad for p in layer.parameters()], torch.tensor([1.0, 0.0, -1.0]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
        scheduler.step()
    return [str(w.message) for w in caught]


def _runs(rank: int, world: int, root: str) -> dict[str, int]:
    assert _schedulers_see_their_optimizer_stepped() == []
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    both = ("file", "sharded")
    assert _nonfinite_chunk_poisons_every_replica(rank)
    assert _a_scalar_parameter_resumes() == 0.0
    return {
        "plain": _fit(root, "plain", 2, formats=both),
        "sharded": _fit(root, "sharded", 2, formats=both, shard_optimizer_state=True),
        # Each resumes the other's checkpoint: unsharded -> sharded, sharded folder -> unsharded.
        "sharded-from-plain": _fit(root, "from-plain", 4, ckpt=f"{root}/plain-file.ckpt", shard_optimizer_state=True),
        "plain-from-sharded": _fit(root, "from-sharded", 4, ckpt=f"{root}/sharded-sharded.ckpt"),
        "paci-plain": _fit(root, "paci-plain", 2, schedule="paci"),
        "paci-sharded": _fit(root, "paci-sharded", 2, schedule="paci", shard_optimizer_state=True),
    }


def _weights(root: Path, name: str):
    model = _model()
    model.load_state_dict(torch.load(root / f"{name}.pt", weights_only=True))
    return model


def _max_tree_diff(a, b, where: str) -> float:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        return max([_max_tree_diff(a[k], b[k], f"{where}.{k}") for k in a], default=0.0)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        pairs = enumerate(zip(a, b, strict=True))
        return max([_max_tree_diff(x, y, f"{where}[{i}]") for i, (x, y) in pairs], default=0.0)
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape, where
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert a == b, where
    return 0.0


def _resume_here(strategy, path: Path):
    """One more step in this process (without clipping: one process refuses flush's cross-stage norm), the last
    window normalized by its real size on one device too (`GradientAccumulation`, as
    tests/checkpoint/test_save_after_fit.py)."""
    model = _model()
    trainer = _trainer(strategy, 1, 3, callbacks=[GradientAccumulation()])
    trainer.fit(model, datamodule=_ordered(), ckpt_path=str(path))
    return model


def test_sharded_optimizer_state_trains_saves_and_resumes_like_unsharded(tmp_path):
    result = values(spawn(_runs, 4, str(tmp_path), timeout=300, torchrun_env=True))
    # The weights: 1F1B-flush and PACI end where their unsharded runs end, also after resuming each other's.
    assert _max_diff(_weights(tmp_path, "sharded"), _weights(tmp_path, "plain")) <= 1e-6
    assert _max_diff(_weights(tmp_path, "paci-sharded"), _weights(tmp_path, "paci-plain")) <= 1e-6
    assert _max_diff(_weights(tmp_path, "from-plain"), _weights(tmp_path, "from-sharded")) <= 1e-6
    # The memory: every rank holds half its stage's optimizer state (up to the 4-byte step counts of the
    # parameters cut at the chunk boundary).
    for rank, got in enumerate(result):
        assert got["plain"] > 0 and got["plain-from-sharded"] == got["paci-plain"] == got["plain"], (rank, got)
        for sharded in ("sharded", "sharded-from-plain", "paci-sharded"):  # loading a whole state keeps 1/2 too
            assert 0.49 <= got[sharded] / got["plain"] <= 0.52, (rank, sharded, got)
    # The memory plan counts each stage's largest replica's chunk: what the ranks hold, within the 4-byte step
    # counts of the parameters a chunk boundary cuts (each stage has under 16 parameters).
    batch = (torch.zeros(4, 32, dtype=torch.long),) * 2
    sharding = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", shard_optimizer_state=True)
    planned = plan(_model(), batch, sharding, accumulate=4, replicas=2, accelerator="cpu")
    topology = Topology.for_world(4, 2)
    for stage, row in enumerate(planned.stages):
        ranks = topology.replica_ranks(stage)
        assert abs(row.optimizer - max(result[r]["sharded"] for r in ranks)) <= 4 * 16, (stage, row.optimizer)
        assert row.optimizer == math.ceil(result[ranks[0]]["plain"] / 2)
    # The checkpoints: both formats of the sharded run hold the unsharded run's weights and whole optimizer.
    for fmt in ("file", "sharded"):
        plain = torch.load(_one_file(tmp_path / f"plain-{fmt}.ckpt"), weights_only=True)
        saved = torch.load(_one_file(tmp_path / f"sharded-{fmt}.ckpt"), weights_only=True)
        assert _max_tree_diff(saved["optimizer_states"], plain["optimizer_states"], fmt) <= 1e-6
        assert _max_tree_diff(saved["state_dict"], plain["state_dict"], fmt) <= 1e-6
        assert saved["optimizer_states"][0]["state"].keys() == plain["optimizer_states"][0]["state"].keys()
    # One device (plain Lightning) and another layout (2 stages in one process, where sharding splits nothing
    # and says so) resume the sharded run's checkpoints as the unsharded run's.
    reference = _resume_here("auto", tmp_path / "plain-file.ckpt")
    assert _max_diff(_resume_here("auto", tmp_path / "sharded-file.ckpt"), reference) <= 1e-6
    with pytest.warns(UserWarning, match="shard_optimizer_state=True\\) has no effect in one process"):
        one_process = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", shard_optimizer_state=True)
        resumed = _resume_here(one_process, tmp_path / "sharded-sharded.ckpt")
    assert _max_diff(resumed, reference) <= 1e-6


def test_what_sharding_cannot_serve_is_refused_before_training():
    with pytest.raises(ValueError, match="local_sgd_steps=4: under LocalSGD/DiLoCo each replica"):
        PACIStrategy(shard_optimizer_state=True, local_sgd_steps=4)
    with pytest.raises(ValueError, match="weight_prediction.*moments of 1/R"):
        PACIStrategy(shard_optimizer_state=True, staleness_correction="weight_prediction")
    with pytest.raises(ValueError, match=r"shard_optimizer_state='yes'\) must be True or False"):
        PACIStrategy(shard_optimizer_state="yes")
    PACIStrategy(shard_optimizer_state=True, staleness_correction="lr_scale")  # reads only the learning rate
    with pytest.raises(ValueError, match="does not support tied weights"):
        _sharding_applies(Topology.for_world(4, 2), in_process=False, tied=True)
    with pytest.warns(UserWarning, match="has no effect with world size 2"):
        assert not _sharding_applies(Topology.for_world(2, 2), in_process=False, tied=False)
    assert _sharding_applies(Topology.for_world(4, 2), in_process=False, tied=False)
    w = torch.nn.Parameter(torch.zeros(2, 2))
    check_elementwise(torch.optim.AdamW([w]))
    with pytest.raises(ValueError, match="exact only for optimizers that update each element.*returned Adafactor"):
        check_elementwise(torch.optim.Adafactor([w]))
    assert optimizer_state_bytes(torch.optim.AdamW([w])) == 0
