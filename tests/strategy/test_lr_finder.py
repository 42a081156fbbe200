"""Lightning's learning-rate finder under PACI (lit_efficient/strategy/lr_finder.py): the run after the finder's is
the run without it, and only the finder's schedulers are carried to the stages. Its rates, losses and suggestion
against one device, in one process and on two processes, are rows of tests/strategy/test_feature_matrix.py."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback, LearningRateFinder
from lightning.pytorch.tuner import Tuner

from lit_efficient import PACIStrategy
from tests.support.compare import assert_same
from tests.support.gpt_runs import gpt_model, gpt_trainer, max_diff, text_data
from tests.support.multiproc import spawn, values

pytestmark = pytest.mark.usefixtures("one_thread")


def _fit(tmp_path, callbacks: list[Callback]):
    """Six steps of PACI with a tied weight and a synchronous start of two steps, in one process."""
    model = gpt_model(tie_weights=True)
    strategy = PACIStrategy(pipeline_stages=2, sync_start_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gpt_trainer(strategy, 1, 6, tmp_path, callbacks=callbacks).fit(model, datamodule=text_data())
    return model, [str(w.message) for w in caught]


def test_the_fit_after_the_finder_is_the_fit_without_it(tmp_path):
    """The finder's run raises the rate until the loss blows up, then restores its checkpoint: the fit that follows
    starts from the same weights and optimizer state, runs the synchronous start again (the finder's run had left
    it) and restarts the tied weight's delay line (else its last stage waits for a gradient stage 0 sends later: a
    deadlock), and the finder's blow-up is not reported as PACI diverging."""
    finder = LearningRateFinder(
        num_training_steps=40, min_lr=1e-4, max_lr=10.0, early_stop_threshold=None, update_attr=False
    )
    found, said = _fit(tmp_path / "found", [finder])
    plain, _ = _fit(tmp_path / "plain", [])
    assert len(finder.optimal_lr.results["lr"]) == 40  # no early stop: the loss blows up in its last steps
    assert max_diff(found, plain) == 0.0 and max_diff(plain, gpt_model(tie_weights=True)) > 1e-3
    assert not [m for m in said if "diverging" in m], said


class _OwnScheduler(Callback):
    """Replaces the schedulers Lightning shows by a StepLR of its own when training starts."""

    def on_train_start(self, trainer, pl_module) -> None:
        from lightning.pytorch.utilities.types import LRSchedulerConfig

        scheduler = torch.optim.lr_scheduler.StepLR(trainer.optimizers[0], 1, 0.5)
        trainer.strategy.lr_scheduler_configs = [LRSchedulerConfig(scheduler, interval="step")]


def test_a_scheduler_replaced_after_setup_other_than_the_finders_is_refused(tmp_path):
    """It would step on the stage Lightning shows only: the message says where schedulers go."""
    with pytest.raises(ValueError, match="replaced by StepLR .* Return the schedulers from configure_optimizers"):
        _fit(tmp_path, [_OwnScheduler()])


def _tuned_then_fit(devices: int, root: str) -> dict | None:
    """Lightning's tuner, then fit on the same Trainer and module: PACI, a tied weight; what global rank 0 has."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    model = gpt_model(tie_weights=True)
    trainer = gpt_trainer(PACIStrategy(pipeline_stages=2, sync_start_steps=2), devices, 4, root)
    finder = Tuner(trainer).lr_find(model, datamodule=text_data(), num_training=14, min_lr=1e-5, max_lr=1.0)
    trainer.fit(model, datamodule=text_data())
    if trainer.global_rank:
        return None
    seen = {"lr": finder.results["lr"], "loss": finder.results["loss"], "suggestion": finder.suggestion()}
    return {**seen, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _on_ranks(rank: int, world: int, root: str) -> dict | None:
    warnings.filterwarnings("ignore")
    return _tuned_then_fit(world, root)


@pytest.mark.multiproc
def test_tuner_then_fit_on_processes_is_one_process_with_a_tied_weight(tmp_path):
    """The user's day with a tied embedding on two processes: the tuner's fit, then fit on the same Trainer and
    module. After a fit every rank but 0 keeps only its stage's layers, so the second fit's rank 1 could not see
    the tie any more and the ranks disagreed on the process groups to make: a hang, which a second fit without
    the tuner met as well. Bit for bit the same as in one process."""
    got = values(spawn(_on_ranks, 2, str(tmp_path / "processes"), timeout=240, torchrun_env=True))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _tuned_then_fit(1, str(tmp_path / "one"))
    assert want is not None and want["suggestion"] is not None
    assert_same(got, want, "processes against one process")
