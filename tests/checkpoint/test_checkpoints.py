"""A PACIStrategy checkpoint is one ordinary Lightning file: it loads anywhere and resumes on another layout.

The reference is one device: 6 optimizer steps (2 epochs of 3 windows of N=4) without interruption.
Checkpoints are taken at step 3, an epoch's end, so a resumed run reads the same batches as the
uninterrupted one (Lightning restarts a plain dataloader at its epoch's start), and 1F1B-flush is
exactly large-batch SGD, so every layout must continue to the same weights.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_efficient import GradientAccumulation, PACIStrategy, consolidate_checkpoint
from lit_efficient.models import GPT
from tests.support.gpt_runs import gpt_model as _model
from tests.support.gpt_runs import gpt_trainer as _trainer
from tests.support.gpt_runs import max_diff as _max_diff
from tests.support.gpt_runs import ordered_data as _ordered
from tests.support.multiproc import SpawnedDDP

pytestmark = pytest.mark.multiproc


def _flush(stages: int = 2) -> PACIStrategy:
    return PACIStrategy(pipeline_stages=stages, schedule="1f1b_flush", start_method="forkserver")


class _WeightsOnly(ModelCheckpoint):
    """A second ModelCheckpoint beside the first needs a state key of its own."""

    @property
    def state_key(self) -> str:
        return "weights-only"


def _checkpoint_at_step_3(strategy, devices, directory) -> tuple[GPT, str]:
    model = _model()
    ckpt = ModelCheckpoint(dirpath=directory, every_n_train_steps=3, filename="{step}")
    weights = _WeightsOnly(dirpath=directory, every_n_train_steps=3, filename="weights", save_weights_only=True)
    trainer = _trainer(strategy, devices, 3, callbacks=[ckpt, weights], enable_checkpointing=True)
    trainer.fit(model, datamodule=_ordered())
    return model, str(directory / "step=3.ckpt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted one-device run, and step-3 checkpoints written by S=2 and by one device."""
    root = tmp_path_factory.mktemp("checkpoints")
    full = _model()
    _trainer("auto", 1, 6).fit(full, datamodule=_ordered())
    piped, piped_path = _checkpoint_at_step_3(_flush(), 2, root / "piped")
    single, single_path = _checkpoint_at_step_3("auto", 1, root / "single")
    return {"full": full, "piped": piped, "path": piped_path, "single": single, "single_path": single_path}


def _resume(strategy, devices: int, path: str, **kw) -> GPT:
    model = _model()
    _trainer(strategy, devices, 6, **kw).fit(model, datamodule=_ordered(), ckpt_path=path)
    return model


def test_the_checkpoint_is_one_file_that_one_device_loads(saved):
    path = saved["path"]
    loaded = GPT.load_from_checkpoint(path)  # no strategy, no processes: Lightning's own loader
    assert _max_diff(loaded, saved["piped"]) == 0.0 and loaded.hparams.n_layer == saved["piped"].hparams.n_layer
    assert _max_diff(loaded, saved["full"]) > 1e-3, "step 3 must differ from step 6 for the comparisons to mean much"
    plain = _model()
    plain.load_state_dict(consolidate_checkpoint(path))
    assert _max_diff(plain, saved["piped"]) == 0.0
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["global_step"] == 3 and checkpoint["pipeline"]["layout"]["num_stages"] == 2
    weights = Path(path).with_name("weights.ckpt")  # ModelCheckpoint(save_weights_only=True)
    assert "optimizer_states" not in torch.load(weights, weights_only=True)
    assert _max_diff(GPT.load_from_checkpoint(weights), saved["piped"]) == 0.0
    validator = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, limit_val_batches=2,
                          enable_model_summary=False)  # fmt: skip
    want = validator.validate(copy.deepcopy(saved["piped"]), datamodule=_ordered(), verbose=False)[0]
    got = validator.validate(_model(), datamodule=_ordered(), ckpt_path=path, verbose=False)[0]
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)


@pytest.mark.parametrize(
    ("name", "strategy", "devices"),
    [("one device", "auto", 1), ("4 stages", lambda: _flush(4), 4), ("2 stages", _flush, 2)],
)
def test_a_two_stage_checkpoint_resumes_on_another_layout(saved, name, strategy, devices):
    resumed = _resume(strategy() if callable(strategy) else strategy, devices, saved["path"])
    assert _max_diff(resumed, saved["piped"]) > 1e-3, name
    assert _max_diff(resumed, saved["full"]) <= 1e-5, name


def test_another_models_checkpoint_is_refused_as_one_device_refuses_it_unless_loading_is_not_strict(saved):
    """A 2-block GPT's checkpoint into a 1-block one: one device raises torch's "Unexpected key(s)"; the pipeline
    loaded only the keys the model has and resumed silently. ``strict_loading = False`` drops them, as there."""
    for strategy in ("auto", _flush()):
        with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "blocks\.1\.'):
            _trainer(strategy, 1, 4).fit(_model(n_layer=1), datamodule=_ordered(), ckpt_path=saved["path"])
    losses = []
    for strategy in ("auto", _flush()):
        model = _model(n_layer=1)
        model.strict_loading = False
        trainer = _trainer(strategy, 1, 4, limit_val_batches=2)
        losses.append(trainer.validate(model, datamodule=_ordered(), ckpt_path=saved["path"], verbose=False)[0])
    assert losses[1]["val_loss"] == pytest.approx(losses[0]["val_loss"], rel=1e-6)


def test_a_one_device_checkpoint_resumes_as_a_pipeline(saved):
    resumed = _resume(_flush(), 2, saved["single_path"])
    assert _max_diff(resumed, saved["full"]) <= 1e-5


def test_a_single_replica_checkpoint_resumes_on_two_replicas(saved):
    """S=2 x dp=2 continues like DDP on 2 devices from the same step (the same data, split alike). Each
    replica's epoch is 6 micro-batches, so every second window is partial: GradientAccumulation (N from
    the Trainer) makes DDP normalize it by its real size, as the pipeline does."""
    want = _resume(SpawnedDDP(), 2, saved["single_path"], callbacks=[GradientAccumulation()])
    got = _resume(_flush(), 4, saved["path"], callbacks=[GradientAccumulation()])
    assert _max_diff(want, saved["single"]) > 1e-3
    assert _max_diff(got, want) <= 1e-5


class _AveragersAtStart(Callback):
    """Each rank, once the checkpoint is restored (training starts): its DiLoCo averagers' step count, the largest
    distance of their anchor from the weights, and the outer momentum buffers they hold."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        record = []
        for averager in trainer.strategy.averagers:
            state = averager.state_dict()
            weights = [p.detach().float() for p in averager.module.parameters()]
            gap = max((a - w).abs().max().item() for a, w in zip(state["anchor"], weights, strict=True))
            momentum = sum(m is not None for m in state["outer_momentum_buffers"])
            record.append({"step": state["step"], "anchor_gap": gap, "momentum": momentum})
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.parametrize("source", ["path", "single_path"], ids=["pipeline, one replica", "one device"])
def test_diloco_resumed_from_a_checkpoint_without_its_state_anchors_at_the_loaded_weights(saved, source, tmp_path):
    """DiLoCo's averagers are built at setup, from the initial weights, before Lightning restores the checkpoint. A
    checkpoint with no averager state (another layout's, one device's) used to leave the anchor at those initial
    weights, the step count at 0: the first sync's pseudo-gradient was everything trained before the checkpoint,
    and the outer step (lr 0.7, Nesterov 0.9) threw the weights back a third of the way past their start."""
    strategy = PACIStrategy(
        pipeline_stages=2, local_sgd_steps=2, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9,
        start_method="forkserver",
    )  # fmt: skip
    _resume(strategy, 4, saved[source], callbacks=[_AveragersAtStart(tmp_path)])
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(len(r) == 1 for r in records)  # one hosted stage per rank, one averager each
    for (averager,) in records:
        assert averager == {"step": 3, "anchor_gap": 0.0, "momentum": 0}  # from the checkpoint's step and weights


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_linked_last_checkpoint_resumes_a_restart(tmp_path, fmt):
    """``ModelCheckpoint(save_last="link")`` (the GPT-2 Medium configs': last.ckpt a link to the latest save, not a
    second save of several GB): a restart's ``ckpt_path="last"`` follows the link, in either format."""

    def fit(max_steps, ckpt_path=None):
        saver = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=3, save_top_k=1, save_last="link")
        strategy = PACIStrategy(pipeline_stages=2, checkpoint_format=fmt)
        trainer = _trainer(strategy, 1, max_steps, tmp_path, callbacks=[saver], enable_checkpointing=True)
        model = _model()
        trainer.fit(model, datamodule=_ordered(), ckpt_path=ckpt_path)
        return trainer, model

    fit(3)  # an epoch's end (the module's docstring)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and last.resolve().name == "epoch=0-step=3.ckpt"
    resumed_trainer, resumed = fit(6, "last")
    assert resumed_trainer.ckpt_path == str(last)  # restored from it, not started over
    assert last.resolve().name == "epoch=1-step=6.ckpt"  # the link follows the latest save
    _, whole = fit(6)  # saves at step 3 too: PACI drains there, the same trajectory
    assert _max_diff(resumed, whole) == 0.0


def _resume_where_only_rank_zero_finds_it(rank: int, world: int, root: str) -> str:
    """A fit that saves (the file: global rank 0 writes it), then a fit whose ranks resolved ``ckpt_path`` apart: rank
    0 the file, rank 1 nothing, as ``"last"`` resolves on node-local disks where only rank 0's node has it."""
    from datetime import timedelta

    saved = Path(root, "saved.ckpt")
    strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush")
    trainer = _trainer(strategy, 2, 2, accumulate_grad_batches=2)
    trainer.fit(_model(), datamodule=_ordered())
    trainer.save_checkpoint(saved)
    strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", p2p_timeout=20, timeout=timedelta(seconds=20))
    trainer = _trainer(strategy, 2, 4, accumulate_grad_batches=2)
    try:
        trainer.fit(_model(), datamodule=_ordered(), ckpt_path=saved if rank == 0 else None)
    except Exception as err:  # noqa: BLE001 - what each rank says is the point
        return f"{type(err).__name__}: {err}"
    return "fit ended"


def test_ranks_that_resolved_different_checkpoints_are_told_so_on_every_rank(tmp_path):
    """Lightning resolves ``ckpt_path`` on each rank: with ``"last"`` on node-local disks only global rank 0's node
    found the checkpoint, the other node's rank started afresh, and the collectives of a restore and of a fresh start
    met out of order: the run hung until a timeout. Every rank now raises before the restore, naming each one's."""
    from tests.support.multiproc import spawn, values

    said = values(spawn(_resume_where_only_rank_zero_finds_it, 2, str(tmp_path), timeout=120, torchrun_env=True))
    for text in said:
        assert "the ranks resolved different checkpoints to restore" in text, said
        assert f"rank 0: '{tmp_path / 'saved.ckpt'}', rank 1: None" in text and "file system every node sees" in text


def test_a_url_is_refused_where_a_checkpoint_would_go_and_nothing_lands_on_the_local_disk(tmp_path, monkeypatch):
    """PACIStrategy writes its checkpoints itself, on a file system: ``s3://bucket/run`` (here fsspec's ``memory://``,
    which Lightning accepts alike) became the local folder ``s3:/bucket/run``, and every save went there silently.
    Refused before training, in the ModelCheckpoint's folder (given, or resolved from default_root_dir), in
    ``trainer.save_checkpoint`` and in ``ckpt_path``."""
    monkeypatch.chdir(tmp_path)
    said = r"='memory://bucket/run.*' is a URL: PACIStrategy writes and reads its checkpoints on a local or mounted"
    for setup in (dict(callbacks=[ModelCheckpoint(dirpath="memory://bucket/run")]),
                  dict(default_root_dir="memory://bucket/run")):  # fmt: skip
        trainer = _trainer(PACIStrategy(pipeline_stages=2), 1, 1, enable_checkpointing=True, **setup)
        with pytest.raises(ValueError, match=said):
            trainer.fit(_model(), datamodule=_ordered())
        assert trainer.global_step == 0  # refused before any training
    trainer = _trainer(PACIStrategy(pipeline_stages=2), 1, 1)
    with pytest.raises(ValueError, match=r"ckpt_path='memory://bucket/run/last.ckpt' is a URL"):
        trainer.fit(_model(), datamodule=_ordered(), ckpt_path="memory://bucket/run/last.ckpt")
    trainer.fit(_model(), datamodule=_ordered())
    with pytest.raises(ValueError, match=r"filepath='memory://bucket/run.ckpt' is a URL"):
        trainer.save_checkpoint("memory://bucket/run.ckpt")
    assert list(tmp_path.iterdir()) == []


def test_a_file_url_is_the_local_path_it_names(tmp_path, monkeypatch):
    """``file:///abs/x.ckpt`` is ``/abs/x.ckpt`` to Lightning (fsspec); Path made it the relative folder ``file:``.
    save_checkpoint and ckpt_path read it alike; a ``.partial`` folder a crashed sharded save left under the same
    name does not stop a file save there. (Lightning's ModelCheckpoint makes a ``file://`` folder relative itself.)"""
    monkeypatch.chdir(tmp_path)
    trainer = _trainer(PACIStrategy(pipeline_stages=2), 1, 2)
    trainer.fit(_model(), datamodule=_ordered())
    (tmp_path / "x.ckpt.partial").mkdir()
    trainer.save_checkpoint(f"file://{tmp_path}/x.ckpt")
    assert (tmp_path / "x.ckpt").is_file() and not (tmp_path / "x.ckpt.partial").exists()
    again = _trainer(PACIStrategy(pipeline_stages=2), 1, 3)
    again.fit(_model(), datamodule=_ordered(), ckpt_path=f"file://{tmp_path}/x.ckpt")
    assert again.global_step == 3
    assert not (tmp_path / "file:").exists()


@pytest.mark.usefixtures("one_thread")
def test_a_train_loss_checkpoint_every_few_steps_saves_one_devices_files(tmp_path):
    """ModelCheckpoint(monitor="train_loss", every_n_train_steps=2) with a validation in mid-epoch: at the first batch
    train_loss was not logged yet (the strategy logs it at window ends, one device at every batch), so Lightning
    deferred a save to that validation, an extra epoch=0-step=3.ckpt one device never writes."""
    files = {}
    flush = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush")
    for name, strategy in (("one device", "auto"), ("pipeline", flush)):
        folder = tmp_path / name
        every_two = ModelCheckpoint(dirpath=folder, monitor="train_loss", every_n_train_steps=2, save_top_k=-1)
        trainer = _trainer(strategy, 1, 6, callbacks=[every_two], enable_checkpointing=True, accumulate_grad_batches=2,
                           limit_val_batches=2, val_check_interval=0.5, limit_train_batches=12)  # fmt: skip
        trainer.fit(_model(), datamodule=_ordered())
        files[name] = sorted(p.name for p in folder.iterdir())
    assert files["pipeline"] == files["one device"] == [f"epoch=0-step={k}.ckpt" for k in (2, 4, 6)]
