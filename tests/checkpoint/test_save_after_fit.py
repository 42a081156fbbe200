"""``trainer.save_checkpoint(path)`` after ``trainer.fit(...)``, the common way to write the final model.

On every rank that keeps its stage after fit (``start_method="popen"``: torchrun, SLURM; here the harness
of tests/support/multiproc.py with torchrun's environment) and in one process (``devices=1``), in both formats, the
checkpoint holds exactly what a `ModelCheckpoint` at the last step of the same run wrote (weights, optimizer,
schedulers, pipeline section), loads on one device to the trained weights, and training resumed from it
continues as from one device's own checkpoint after fit (1F1B-flush, 1e-6). That is the reference because
Lightning itself does not continue an after-fit checkpoint as the uninterrupted run: it resumes "after"
the finished epoch's last batch, runs one more micro-batch there and steps it as a partial window, which
the pipeline normalizes by its real size (docs/DESIGN.md section 7) and Lightning by N unless
`GradientAccumulation` says otherwise; the resumed runs use it. After a spawned fit the parent holds the
weights only (as under Lightning's DDP) and writes those, saying so.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_efficient import GradientAccumulation, PACIStrategy
from lit_efficient.models import GPT
from tests.support.checkpoints import FORMATS, SaveBothFormatsAt
from tests.support.checkpoints import one_file as _one_file
from tests.support.compare import assert_equal as _assert_equal
from tests.support.gpt_runs import gpt_model as _model
from tests.support.gpt_runs import gpt_trainer as _trainer
from tests.support.gpt_runs import max_diff as _max_diff
from tests.support.gpt_runs import ordered_data as _ordered
from tests.support.multiproc import spawn, values

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("one_thread")]


def _flush(**kw) -> PACIStrategy:
    return PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", **kw)


@pytest.fixture(scope="module")
def one_device_resumed(tmp_path_factory):
    """One device: 3 steps, ``save_checkpoint`` after fit, resumed to step 6: where the pipeline's must arrive."""
    path = tmp_path_factory.mktemp("one-device") / "end.ckpt"
    model = _model()
    trainer = _trainer("auto", 1, 3)
    trainer.fit(model, datamodule=_ordered())
    trainer.save_checkpoint(path)
    return _resume("auto", path)


def _resume(strategy, path: Path) -> GPT:
    resumed = _model()
    trainer = _trainer(strategy, 1, 6, callbacks=[GradientAccumulation()])
    trainer.fit(resumed, datamodule=_ordered(), ckpt_path=str(path))
    return resumed


def _assert_same_content(path: Path, reference: Path, what: str) -> None:
    """Every tensor and number of the two files' weights, optimizer, schedulers and pipeline section equal."""
    got, want = (torch.load(p, weights_only=True) for p in (path, reference))
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "global_step"):  # not the loops: fit ended
        _assert_equal(got[key], want[key], f"{what}: {key}")
    for key in ("layout", "param_names", "optimizer_by_name", "ranks", "hyper", "tied_state", "replicas"):
        if key in want["pipeline"]:
            _assert_equal(got["pipeline"][key], want["pipeline"][key], f"{what}: pipeline.{key}")


def _resumes_to(path: Path, reference: GPT) -> float:
    """Plain one-device Lightning from ``path`` (written at step 3) to step 6: its distance from ``reference``."""
    return _max_diff(_resume("auto", path), reference)


def _fit_and_save_on_every_rank(rank: int, world: int, root: str) -> dict[str, torch.Tensor] | None:
    """What a torchrun script does: fit, then save on every rank (Lightning's save is collective)."""
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    model = _model()
    strategy = _flush()
    last = SaveBothFormatsAt(root, batch_idx=11, prefix="last")  # the last micro-batch: step 3, drained
    trainer = _trainer(strategy, world, 3, callbacks=[last])
    trainer.fit(model, datamodule=_ordered())
    for fmt in FORMATS:  # the format is read when saving: one fit serves both
        strategy.checkpoint_format = fmt
        trainer.save_checkpoint(Path(root, f"{fmt}.ckpt"))
    _validate(trainer, model)
    for fmt in FORMATS:
        strategy.checkpoint_format = fmt
        trainer.save_checkpoint(Path(root, f"after-validate-{fmt}.ckpt"))
    return {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else None


def test_every_rank_saves_after_fit_in_both_formats(tmp_path, one_device_resumed):
    trained = values(spawn(_fit_and_save_on_every_rank, 2, str(tmp_path), timeout=240, torchrun_env=True))[0]
    model = _model()
    model.load_state_dict(trained)  # rank 0 holds the whole trained model after fit
    for fmt in FORMATS:
        path = _one_file(tmp_path / f"{fmt}.ckpt")
        assert _max_diff(GPT.load_from_checkpoint(path), model) == 0.0, fmt
        saved = torch.load(path, weights_only=True)
        assert saved["global_step"] == 3 and saved["pipeline"]["layout"]["num_stages"] == 2, fmt
        _assert_same_content(path, _one_file(tmp_path / f"last-{fmt}.ckpt"), fmt)
        assert _resumes_to(path, one_device_resumed) <= 1e-6, fmt
    assert (tmp_path / "sharded.ckpt" / "__1_0.distcp").is_file()  # rank 1 wrote its own share
    for fmt in FORMATS:
        after_validate = _one_file(tmp_path / f"after-validate-{fmt}.ckpt")
        _assert_same_content(after_validate, _one_file(tmp_path / f"{fmt}.ckpt"), f"validate, {fmt}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_process_saves_after_fit(tmp_path, one_device_resumed, fmt):
    model = _model()
    last = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, filename="last")
    trainer = _trainer(_flush(checkpoint_format=fmt), 1, 3, callbacks=[last], enable_checkpointing=True)
    trainer.fit(model, datamodule=_ordered())
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    path = _one_file(tmp_path / "end.ckpt")
    _assert_same_content(path, _one_file(tmp_path / "last.ckpt"), fmt)
    assert _max_diff(GPT.load_from_checkpoint(path), model) == 0.0
    assert _resumes_to(path, one_device_resumed) <= 1e-6
    # And the pipeline resumes it, in one process, as it left it.
    assert _max_diff(_resume(_flush(), tmp_path / "end.ckpt"), one_device_resumed) <= 1e-6
    _validate(trainer, model)
    trainer.save_checkpoint(tmp_path / "after-validate.ckpt")
    _assert_same_content(_one_file(tmp_path / "after-validate.ckpt"), path, "validate")
    trainer.callbacks.append(SaveAtValidationEnd(tmp_path / "in-validate.ckpt"))  # during one: its stages are live
    _validate(trainer, model)
    _assert_same_content(_one_file(tmp_path / "in-validate.ckpt"), path, "inside validate")


def _without_rng(path: Path) -> Path:
    """The file without its per-rank random states: they moved since the restore (the fit's loaders drew their
    seeds), as in any resumed run."""
    saved = torch.load(path, weights_only=True)
    for record in saved["pipeline"]["ranks"].values():
        del record["rng"]
    torch.save(saved, path.with_suffix(".without-rng"))
    return path.with_suffix(".without-rng")


def test_a_fit_resumed_at_its_last_step_saves_what_it_restored(tmp_path):
    """A fit whose restored loop is already done (resumed from its own end, or a fault-tolerant group that healed
    at max_steps) trains nothing: Lightning calls neither on_train_start nor on_train_end. Its save after fit
    raised "no fit's stages are left to save", under torchrun a failure that restarted the group to retrain alone.
    PACI with a tied weight: the delay line restored is the one saved again. On a Trainer whose previous fit ended
    elsewhere, and after a learning-rate finder's run (whose end is not the fit's), the restored state is saved."""
    from lightning.pytorch.callbacks import LearningRateFinder

    def fit(ckpt_path=None, callbacks=(), trainer=None, **model_kw):
        trainer = trainer or _trainer(PACIStrategy(pipeline_stages=3), 1, 3, callbacks=list(callbacks))
        model = _model(tie_weights=True, **model_kw)
        trainer.fit(model, datamodule=_ordered(), ckpt_path=ckpt_path)
        assert trainer.global_step == 3
        return trainer, model

    trainer, model = fit()
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    other_trainer, other = fit(learning_rate=1e-3)  # another run's end: what the first Trainer restores next
    other_trainer.save_checkpoint(tmp_path / "other.ckpt")
    finder = LearningRateFinder(num_training_steps=5, early_stop_threshold=None, update_attr=False)
    for name, source, kw in (("new", "end", {}), ("reused", "other", {"trainer": trainer}),
                             ("finder", "end", {"callbacks": [finder]})):  # fmt: skip
        resumed_trainer, resumed = fit(tmp_path / f"{source}.ckpt", **kw)
        assert _max_diff(resumed, model if source == "end" else other) == 0.0, name
        resumed_trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
        got, want = _without_rng(tmp_path / f"{name}.ckpt"), _without_rng(tmp_path / f"{source}.ckpt")
        _assert_same_content(got, want, f"resumed at its end, {name}")
    # A fit that fails (here in its data's setup, before the strategy's) leaves nothing to save: the previous
    # fit's end was saved under it, silently.
    broken = _ordered()
    broken.setup = lambda stage: (_ for _ in ()).throw(OSError("the data's disk is gone"))
    with pytest.raises(OSError, match="disk is gone"):
        trainer.fit(_model(tie_weights=True), datamodule=broken)
    with pytest.raises(RuntimeError, match="no fit's stages are left to save"):
        trainer.save_checkpoint(tmp_path / "after-failure.ckpt")


class SaveAtValidationEnd(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_validation_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)


def _validate(trainer, model) -> None:
    """Lightning's fit-then-evaluate on the same Trainer: the evaluation's stages have no optimizer, and a save after
    it wrote none for them (a crash in one process; on processes a file holding the last stage's state only)."""
    trainer.limit_val_batches = 2
    trainer.validate(model, datamodule=_ordered(), verbose=False)


def test_the_parent_of_spawned_ranks_saves_the_trained_weights(tmp_path):
    model = _model()
    strategy = _flush(start_method="forkserver")
    trainer = _trainer(strategy, 2, 3)
    trainer.fit(model, datamodule=_ordered())  # the parent's model now holds the trained weights
    for fmt in FORMATS:
        strategy.checkpoint_format = fmt
        with pytest.warns(UserWarning, match="holds only the trained weights"):
            trainer.save_checkpoint(tmp_path / f"{fmt}.ckpt")
        path = _one_file(tmp_path / f"{fmt}.ckpt")
        assert _max_diff(GPT.load_from_checkpoint(path), model) == 0.0, fmt
        assert "optimizer_states" not in torch.load(path, weights_only=True), fmt
        # It does not resume, and says why and what does (Lightning blamed ModelCheckpoint.save_weights_only).
        with pytest.raises(ValueError, match=r"holds weights only .*load_from_checkpoint.*start_method='popen'"):
            _trainer(_flush(), 1, 6).fit(_model(), datamodule=_ordered(), ckpt_path=str(tmp_path / f"{fmt}.ckpt"))


def _local_sgd_fit_evaluate_save(rank: int, world: int, root: str) -> tuple[float, float]:
    """Fit two LocalSGD replicas to between two syncs, save, validate, save again, validate the first save."""
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    model = _model()
    trainer = _trainer(PACIStrategy(pipeline_stages=1, local_sgd_steps=2), world, 3)
    trainer.fit(model, datamodule=_ordered())  # step 3: the replicas synced at step 2 and stepped apart since
    trainer.save_checkpoint(Path(root, "fit.ckpt"))
    trainer.limit_val_batches = 2
    after_fit = trainer.validate(model, datamodule=_ordered(), verbose=False)[0]["val_loss"]
    trainer.save_checkpoint(Path(root, "after-validate.ckpt"))
    of_file = trainer.validate(model, datamodule=_ordered(), ckpt_path=str(Path(root, "fit.ckpt")), verbose=False)
    return after_fit, of_file[0]["val_loss"]


def test_an_evaluation_between_local_sgd_syncs_scores_the_first_replica_and_keeps_each_replicas_own(tmp_path):
    """Between LocalSGD syncs the replicas' weights differ; a checkpoint keeps each one's beside the first's (its
    model). An evaluation scores that model, on the fit's Trainer and from the file alike: from the file each replica
    scored its own, a loss of two models. And the evaluation leaves each replica its own: it took the first's for
    good, so a save after it wrote replica 1's record with replica 0's weights (and its own optimizer state)."""
    after_fit, of_file = values(spawn(_local_sgd_fit_evaluate_save, 2, str(tmp_path), timeout=240, torchrun_env=True))[
        0
    ]
    saved = torch.load(tmp_path / "fit.ckpt", weights_only=True)
    own = saved["pipeline"]["replicas"]["stage0-replica1"]["state_dict"]
    assert max((own[k] - saved["state_dict"][k]).abs().max().item() for k in own) > 1e-4  # apart: the test means it
    assert of_file == after_fit
    _assert_same_content(tmp_path / "after-validate.ckpt", tmp_path / "fit.ckpt", "validate between syncs")
