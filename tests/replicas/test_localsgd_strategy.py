"""LocalSGD and DiLoCo through PACIStrategy in the real Trainer (gloo on CPU).

Spawned ranks cannot return values: the parent's module gets rank 0's full weights after fit, and
everything else is written to per-rank files by callbacks and asserted here. The averaging math
itself (DiLoCo's formula, ``outer_lr=1, outer_momentum=0`` equal to plain averaging, bytes and
divergence per sync) is tested at the averager level in ``test_averaging.py``; these tests check
that the strategy wires it in per stage, logs it, checkpoints it and matches DDP.
"""

from __future__ import annotations

import copy
import hashlib
import json
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_efficient import PACIStrategy
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT
from lit_efficient.runtime.topology import Topology
from lit_efficient.strategy.config import _warn_single_replica
from tests.support.gpt_runs import gpt_trainer as _trainer
from tests.support.gpt_runs import max_diff as _max_diff
from tests.support.multiproc import SpawnedDDP, spawn, values

BLOCK = 32


class SGDGPT(GPT):
    """The test GPT with plain SGD (no momentum, decay or schedule): averaging weights after every
    step then equals averaging gradients, i.e. synchronous data parallelism."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)


class _PositionsLeftOut(GPT):
    """The fine-tuner's optimizer over what it trains: a weight of stage 0 (``requires_grad`` still True) left out.
    An averager's sync writes every weight of the stage, this one too, while PACI keeps micro-batches in flight."""

    def configure_optimizers(self):
        trained = [p for name, p in self.named_parameters() if name != "blocks.0.mlp.c_fc.weight"]
        return torch.optim.AdamW(trained, lr=self.hparams.learning_rate)


def _model(cls: type[GPT] = GPT, **kw) -> GPT:
    L.seed_everything(0)
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, warmup_steps=2, max_steps=20, learning_rate=3e-3)
    args.update(kw)
    return cls(**args)


def _data() -> TextDataModule:
    return TextDataModule(block_size=BLOCK, batch_size=4, max_bytes=60_000, seed=1)


class _OrderedData(TextDataModule):
    """Epochs of exactly 12 micro-batches per replica (2 replicas) in a fixed order, so a run resumed at
    an epoch boundary sees the same data as an uninterrupted one (Lightning cannot resume a plain
    dataloader mid-epoch)."""

    def train_dataloader(self):
        subset = torch.utils.data.Subset(self.train_set, range(2 * 12 * self.batch_size))
        return torch.utils.data.DataLoader(subset, batch_size=self.batch_size, shuffle=False)


def _digest(params) -> str:
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _read(path: Path, world: int) -> list[dict]:
    return [json.loads(Path(path, f"rank{r}.json").read_text()) for r in range(world)]


class RecordSteps(Callback):
    """After every local optimizer step of this rank's stage (averaging included), records the step
    and a hash of the stage's parameters; rank 0 also records the validation losses and the logged
    LocalSGD metrics. One JSON file per rank, rewritten as it goes (stages finish at different times)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.record: dict = {"steps": [], "val_loss": []}

    def _write(self, trainer) -> None:
        Path(self.path, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))

    def on_train_start(self, trainer, pl_module) -> None:
        s = trainer.strategy
        stage, averager = s.runtime.stage, s.averager
        params = list(stage.parameters())
        self.record.update(
            stage=s.stage, replica=s.replica, sync_bytes=sum(p.numel() * p.element_size() for p in params)
        )
        inner = stage.after_step

        def after_step() -> None:
            inner()
            self.record["steps"].append([averager.step, _digest(params)])
            self._write(trainer)

        stage.after_step = after_step

    def on_validation_end(self, trainer, pl_module) -> None:
        # Not on_validation_epoch_end: Lightning puts this evaluation's epoch metrics into
        # callback_metrics only after that hook, so it would read the previous evaluation's.
        if trainer.global_rank == 0 and "val_loss" in trainer.callback_metrics:
            self.record["val_loss"].append(trainer.callback_metrics["val_loss"].item())

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:  # the last stage: all its steps are done (others finish in the drain)
            m = trainer.callback_metrics
            self.record["logged"] = {k: m[k].item() for k in ("localsgd/divergence", "localsgd/bytes_per_step")}
            self.record["averager"] = {
                "divergence": trainer.strategy.averager.last_divergence,
                "steps": trainer.strategy.averager.step,
            }
        self._write(trainer)


class FinalDigest(Callback):
    """Writes each rank's parameter hash at the end of training (single-stage pipelines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        params = list(trainer.strategy.runtime.stage.parameters())
        Path(self.path, f"rank{trainer.global_rank}.json").write_text(json.dumps({"digest": _digest(params)}))


class StartDigest(Callback):
    """Writes each rank's hashes of its stage's weights and optimizer state as training starts (after a restore)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        stage = trainer.strategy.runtime.stage
        moments = [t for state in stage.optimizer.state.values() for t in state.values() if t.dim() > 0]
        record = {"weights": _digest(stage.parameters()), "optimizer": _digest(moments)}
        Path(self.path, f"start{trainer.global_rank}.json").write_text(json.dumps(record))


# ---------------------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_sync_every_step_with_sgd_equals_ddp():
    # pipeline_stages=1: every rank one whole replica, i.e. the one-line switch from DDP.
    steps, lr = 3, 0.5
    ddp, local = _model(SGDGPT, learning_rate=lr), _model(SGDGPT, learning_rate=lr)
    start = copy.deepcopy(ddp)
    _trainer(SpawnedDDP(), 2, steps).fit(ddp, datamodule=_data())
    strategy = PACIStrategy(pipeline_stages=1, local_sgd_steps=1, start_method="forkserver")
    _trainer(strategy, 2, steps).fit(local, datamodule=_data())
    assert _max_diff(ddp, start) > 1e-3, "training must move the weights for the comparison to mean anything"
    assert _max_diff(local, ddp) <= 1e-5


@pytest.mark.multiproc
def test_pipeline_times_localsgd_syncs_each_stage_and_trains(tmp_path):
    # 2 replicas x 2 stages, PACI, H=4, streaming: each stage's replicas are bit-identical right after each of
    # their syncs and apart between, stage by stage: stage 0 at steps 4, 8, ... (the plain schedule), stage 1
    # two steps later (its turn); the logged numbers are the averager's; it learns. A weight left out of the
    # optimizer is synced too: the syncs' in-place writes once failed the in-flight micro-batches' backward
    # (torch's version check), for the step kept only the optimizer's weights' versions.
    steps, h = 24, 4
    strategy = PACIStrategy(
        pipeline_stages=2, schedule="paci", local_sgd_steps=h, streaming_sync=True, start_method="forkserver",
        sync_start_steps=0,
    )  # fmt: skip
    trainer = _trainer(
        strategy, 4, steps, callbacks=[RecordSteps(tmp_path)], limit_val_batches=4, val_check_interval=8 * 4
    )
    trainer.fit(_model(_PositionsLeftOut), datamodule=_data())
    ranks = _read(tmp_path, 4)
    topo = Topology(2, 2)
    for stage in range(2):
        a, b = (ranks[topo.rank_of(stage, r)] for r in range(2))
        assert (a["stage"], a["replica"], b["stage"], b["replica"]) == (stage, 0, stage, 1)
        assert [s for s, _ in a["steps"]] == [s for s, _ in b["steps"]] == list(range(1, steps + 1))
        for (step, da), (_, db) in zip(a["steps"], b["steps"], strict=True):
            assert (da == db) == ((step - stage * h // 2) % h == 0), f"stage {stage} after step {step}"
    rank0 = ranks[0]
    assert rank0["stage"] == 1 and rank0["averager"]["steps"] == steps
    # Logged from rank 0: its stage's numbers; bytes per step = (syncs x one fp32 copy) / steps.
    assert rank0["logged"]["localsgd/divergence"] == pytest.approx(rank0["averager"]["divergence"], rel=1e-6)
    assert rank0["logged"]["localsgd/divergence"] > 0
    assert rank0["logged"]["localsgd/bytes_per_step"] == pytest.approx((steps // h) * rank0["sync_bytes"] / steps)
    history = rank0["val_loss"]  # sanity check, then steps 8, 16, 24: right after syncs
    assert len(history) == 4 and history[-1] < history[1] < history[0] - 0.3, history


@pytest.mark.multiproc
def test_diloco_resume_mid_window_follows_uninterrupted_run(tmp_path):
    # Epochs of 12 micro-batches per replica = 3 optimizer steps; DiLoCo syncs at 2, 4, 6, so the
    # checkpoint after step 3 is mid-window and holds an anchor and outer momentum from sync 2.
    def trainer(max_steps, out, **kw):
        strategy = PACIStrategy(
            pipeline_stages=1, local_sgd_steps=2, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9,
            start_method="forkserver",
        )  # fmt: skip
        return _trainer(strategy, 2, max_steps, callbacks=[FinalDigest(out), *kw.pop("callbacks", [])], **kw)

    def data():
        return _OrderedData(block_size=BLOCK, batch_size=4, max_bytes=60_000)

    dirs = {name: tmp_path / name for name in ("full", "first", "resumed", "ckpt")}
    for d in dirs.values():
        d.mkdir()
    full = _model()
    trainer(6, dirs["full"]).fit(full, datamodule=data())
    first = _model()
    ckpt = ModelCheckpoint(dirpath=dirs["ckpt"], every_n_train_steps=3, filename="{step}")
    trainer(3, dirs["first"], callbacks=[ckpt], enable_checkpointing=True).fit(first, datamodule=data())
    path = dirs["ckpt"] / "step=3.ckpt"
    ranks = torch.load(path, weights_only=False)["pipeline"]["ranks"]  # one file, every rank's share
    for replica in range(2):
        saved = ranks[f"stage0-replica{replica}"]["averager"]
        assert saved["step"] == 3 and saved["outer_optimizer"] == "nesterov"
        assert all(m is not None for m in saved["outer_momentum_buffers"])
    resumed = _model()
    trainer(6, dirs["resumed"]).fit(resumed, datamodule=data(), ckpt_path=str(path))
    assert _max_diff(resumed, first) > 1e-3
    assert _max_diff(resumed, full) <= 1e-6
    # Both replicas, not only rank 0's: identical after the sync at step 6, and to the uninterrupted run.
    want, got = _read(dirs["full"], 2), _read(dirs["resumed"], 2)
    assert want[0] == want[1] == got[0] == got[1]
    first_digests = _read(dirs["first"], 2)
    assert first_digests[0] != first_digests[1], "step 3 is mid-window: replicas must differ there"
    # Resumed with gradients averaged every step (no local_sgd_steps): every replica starts from the first's. Each
    # took its own saved weights, and per-step averaging kept them apart for good.
    (tmp_path / "per-step").mkdir()
    per_step = PACIStrategy(pipeline_stages=1, start_method="forkserver")
    _trainer(per_step, 2, 4, callbacks=[FinalDigest(tmp_path / "per-step")]).fit(
        _model(), datamodule=data(), ckpt_path=str(path)
    )
    averaged = _read(tmp_path / "per-step", 2)
    assert averaged[0] == averaged[1], "replicas resumed apart under per-step averaging"
    # Resumed as LocalSGD (outer_optimizer="average"): the DiLoCo averager's state means nothing to it, so it restarts
    # (a warning says so) where it refused after launch. Both replicas start from the first's weights and optimizer
    # state (replica 1 took the first's weights beside its own moments) and sync at step 4.
    switched = tmp_path / "switched"
    switched.mkdir()
    strategy = PACIStrategy(pipeline_stages=1, local_sgd_steps=2, start_method="forkserver")
    _trainer(strategy, 2, 4, callbacks=[StartDigest(switched), FinalDigest(switched)]).fit(
        _model(), datamodule=data(), ckpt_path=str(path)
    )
    started = [json.loads((switched / f"start{r}.json").read_text()) for r in range(2)]
    assert started[0] == started[1]
    synced = _read(switched, 2)
    assert synced[0] == synced[1]


def _resume_with_another_period(rank: int, world: int, folder: str) -> list[str]:
    def fit(max_steps, period, callbacks=(), ckpt_path=None):
        strategy = PACIStrategy(pipeline_stages=1, local_sgd_steps=period)
        trainer = _trainer(strategy, world, max_steps, callbacks=list(callbacks), enable_checkpointing=bool(callbacks))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(_model(), datamodule=_data(), ckpt_path=ckpt_path)
        return [str(w.message) for w in caught]

    fit(3, 2, callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=3, filename="{step}")])
    return fit(4, 3, ckpt_path=f"{folder}/step=3.ckpt")


@pytest.mark.multiproc
def test_a_resume_with_another_sync_period_says_so(tmp_path):
    """Two replicas synced every 2 steps, resumed syncing every 3: accepted (the step count continues, each replica
    from its own weights), and said, where it was silent."""
    said = values(spawn(_resume_with_another_period, 2, str(tmp_path), timeout=180, torchrun_env=True))[0]
    assert [m for m in said if "synced its replicas every 2 steps; this run syncs every 3" in m], said


def test_bad_local_sgd_arguments_raise():
    with pytest.raises(ValueError, match="local_sgd_steps=0"):
        PACIStrategy(pipeline_stages=1, local_sgd_steps=0)
    with pytest.raises(ValueError, match="outer_optimizer='nesterov'"):
        PACIStrategy(pipeline_stages=1, local_sgd_steps=4, outer_lr=0.5)
    # Without an interval the first message names both settings: it named only the optimizer, whose fix then
    # failed on the interval (a replicas audit).
    with pytest.raises(ValueError, match="set outer_optimizer='nesterov' and local_sgd_steps=H"):
        PACIStrategy(pipeline_stages=1, outer_lr=0.5)
    PACIStrategy(pipeline_stages=1, outer_lr=0.5, outer_optimizer="nesterov", local_sgd_steps=20)  # the fix works
    # DiLoCo's options without an interval: refused, not silently replaced by per-step gradient all-reduce
    with pytest.raises(ValueError, match="outer_optimizer='nesterov' needs local_sgd_steps=H"):
        PACIStrategy(pipeline_stages=1, outer_optimizer="nesterov")
    with pytest.raises(ValueError, match="local_sgd_warmup_steps=5 needs local_sgd_steps=H"):
        PACIStrategy(pipeline_stages=1, local_sgd_warmup_steps=5)


def test_local_sgd_with_one_replica_warns():
    with pytest.warns(UserWarning, match="nothing to average"):
        _warn_single_replica(4, Topology(2, 1))
    # In one process too, where setup_distributed (which said it) never runs: DiLoCo's options went unsaid.
    strategy = PACIStrategy(pipeline_stages=2, local_sgd_steps=4, outer_optimizer="nesterov")
    with pytest.warns(UserWarning, match=r"local_sgd_steps=4\) has no effect: in one process"):
        _trainer(strategy, 1, 1).fit(_model(), datamodule=_data())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_single_replica(None, Topology(2, 1))
        _warn_single_replica(4, Topology(2, 2))


def test_a_fit_ending_between_two_syncs_says_so():
    """max_steps between two syncs leaves the replicas apart, and the fit's model is the first replica's: said once,
    with the nearest synced end; nothing where the end is a sync step, with one replica or under streaming syncs
    (its stages sync in turns)."""
    import types

    from lit_efficient.strategy.step_hooks import Averaging, warn_unsynced_end

    def warned(max_steps, every=4, warmup=0, replicas=2, streaming=False, outer="average"):
        averaging = Averaging(every, warmup, outer, 0.7, 0.9, True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_unsynced_end(types.SimpleNamespace(max_steps=max_steps), averaging, replicas, streaming)
        return [str(w.message) for w in caught]

    (said,) = warned(10)
    assert "max_steps=10 ends the fit 2 optimizer step(s) after the last LocalSGD sync (step 8" in said
    assert "first replica's" in said and "0 + a multiple of 4" in said
    assert "DiLoCo sync (step 11" in warned(13, warmup=3, outer="nesterov")[0]
    assert warned(8) == warned(11, warmup=3) == warned(10, replicas=1) == warned(10, streaming=True) == []
    assert warned(-1) == warned(2, warmup=3) == []  # no step limit; the end inside the warm-up (every step syncs)


def test_a_replica_takes_its_own_weights_only_to_continue_a_fit_on_the_saved_layout():
    """The rule `stage_checkpoints` loads a LocalSGD replica's own record by: on another layout a replica's record
    covers its old stage's parameters (a 2x2 checkpoint on 1x4 gave replica 1 old replica 1's moments for the old
    first stage's parameters and old replica 0's for the rest), and an evaluation scores the checkpoint's model."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    from lit_efficient.strategy.stage_checkpoints import _own_replica_key

    layout = {"num_stages": 2, "num_replicas": 2, "sizes": [2, 2], "schedule": "1f1b_flush"}

    def strategy(fn, local_sgd_steps=2, now=layout):
        trainer = SimpleNamespace(state=SimpleNamespace(fn=fn))
        return SimpleNamespace(
            local_sgd_steps=local_sgd_steps,
            outer_optimizer="average",
            replica=1,
            layout=lambda: now,
            lightning_module=SimpleNamespace(trainer=trainer),
        )

    saved = {"pipeline": {"layout": layout}}
    assert _own_replica_key(strategy(TrainerFn.FITTING), 0, saved) == "stage0-replica1"
    other = {**layout, "num_stages": 1, "num_replicas": 4, "sizes": [4]}
    assert _own_replica_key(strategy(TrainerFn.FITTING, now=other), 0, saved) is None
    for evaluation in (TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING):
        assert _own_replica_key(strategy(evaluation), 0, saved) is None
    assert _own_replica_key(strategy(TrainerFn.FITTING, local_sgd_steps=None), 0, saved) is None
    # Saved by DiLoCo, resumed as LocalSGD: the averager restarts from the first replica's weights, so its state too.
    ranks = {"stage0-replica1": {"averager": {"outer_optimizer": "nesterov"}}}
    assert _own_replica_key(strategy(TrainerFn.FITTING), 0, {"pipeline": {"layout": layout, "ranks": ranks}}) is None
