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
from tests.support.gpt_runs import gpt_model, gpt_trainer, max_diff, ordered_data, text_data
from tests.support.multiproc import spawn, values

pytestmark = pytest.mark.usefixtures("one_thread")


def _fit(tmp_path, callbacks: list[Callback], **kw):
    """Six steps of PACI with a tied weight and a synchronous start of two steps, in one process."""
    model = gpt_model(tie_weights=True)
    strategy = PACIStrategy(pipeline_stages=2, sync_start_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gpt_trainer(strategy, 1, 6, tmp_path, callbacks=callbacks, **kw).fit(model, datamodule=text_data())
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


class _AtEpochStart(LearningRateFinder):
    """Lightning's documented pattern for finding the rate again while fine-tuning (`LearningRateFinder`'s
    docstring): the finder at an epoch's start, inside the fit's training run, not before it."""

    def __init__(self, *args, epoch: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = epoch

    def on_fit_start(self, trainer, pl_module) -> None:
        return

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            self.lr_find(trainer, pl_module)


class _TiedCopies(Callback):
    """How far apart the two stages' copies of the tied weight are at the end of training: the rule gives both the
    same gradient at every update; stage 0's in-place weight prediction leaves its copy a rounding residue."""

    def on_train_end(self, trainer, pl_module) -> None:
        first, last = (h.tied[0].param for h in (trainer.strategy.hosted[0], trainer.strategy.hosted[-1]))
        self.diff = (first - last).abs().max().item()


def test_a_finder_inside_the_fits_run_leaves_it_as_without_it(tmp_path):
    """The finder's run ends inside the fit's: the rest of the fit starts again from the restored checkpoint at its
    next batch (the synchronous start, the tied weight's delay line: else a deadlock), as a fit after it does."""
    finder = _AtEpochStart(num_training_steps=8, min_lr=1e-4, max_lr=1e-2, early_stop_threshold=None, update_attr=False)
    found, _ = _fit(tmp_path / "found", [finder])
    plain, _ = _fit(tmp_path / "plain", [])
    assert len(finder.optimal_lr.results["lr"]) == 8
    assert max_diff(found, plain) == 0.0


def test_a_finder_at_a_later_epoch_keeps_the_tied_copies_equal(tmp_path):
    """At a later epoch (epochs of two steps) the run's last tied-weight gradients are still in flight when the
    finder's run starts: its last stage took them as its own, the restore left the finder's last ones in flight, and
    the two copies of the tied weight parted for the rest of the fit. (Lightning's own run after a finder at a later
    epoch is not the run without it, on one device too: the copies' agreement is what is asserted.)"""
    finder = _AtEpochStart(
        num_training_steps=8, min_lr=1e-4, max_lr=1e-2, early_stop_threshold=None, update_attr=False, epoch=1
    )
    copies = _TiedCopies()
    _fit(tmp_path, [finder, copies], limit_train_batches=8)
    assert copies.diff <= 1e-6  # parted: 1.1e-2


@pytest.mark.parametrize("via", ["tuner", "callback"])
def test_the_finders_run_trains_with_activation_checkpointing(tmp_path, monkeypatch, via):
    """Lightning moves the finder to the front of the callbacks, so its run came before ActivationCheckpointing's
    on_fit_start wrapped the blocks: 0 of 2 blocks wrapped, a model that fits only with it could not find its
    rate. Every block is wrapped when the finder's run starts; the finder is itself again after fit."""
    import lightning.pytorch.tuner.lr_finder as lr_finder

    from lit_efficient import ActivationCheckpointing
    from lit_efficient.callbacks.activation_checkpointing import is_wrapped

    wrapped, exchange = [], lr_finder._LRFinder._exchange_scheduler

    def counted(self, trainer):  # the finder swaps the schedulers right before its run
        wrapped.append(sum(is_wrapped(m) for m in trainer.lightning_module.modules()))
        exchange(self, trainer)

    monkeypatch.setattr(lr_finder._LRFinder, "_exchange_scheduler", counted)
    finder = LearningRateFinder(num_training_steps=4, early_stop_threshold=None, update_attr=False)
    callbacks = [ActivationCheckpointing()] + ([finder] if via == "callback" else [])
    trainer = gpt_trainer(PACIStrategy(pipeline_stages=2), 1, 2, tmp_path, callbacks=callbacks)
    if via == "tuner":
        Tuner(trainer).lr_find(gpt_model(), datamodule=text_data(), num_training=4, early_stop_threshold=None)
    else:
        trainer.fit(gpt_model(), datamodule=text_data())
    assert wrapped == [2]  # the GPT's two blocks
    assert "lr_find" not in finder.__dict__


def test_a_hugging_face_model_after_the_tuner_fits_as_without_it(tmp_path):
    """A foreign model (a Hugging Face GPT-2 config, its embedding tied to its LM head, split by adapter layers):
    Lightning's tuner, then fit on the same Trainer, equals the fit without the tuner (PACI, one process)."""
    from lit_efficient.models import HFCausalLM

    config = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 32,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # fmt: skip
    weights = []
    for tuned in (True, False):
        torch.manual_seed(0)
        model = HFCausalLM(config, warmup_steps=2, max_steps=20)
        trainer = gpt_trainer(PACIStrategy(pipeline_stages=2, sync_start_steps=2), 1, 4, tmp_path / str(tuned))
        if tuned:
            kw = dict(num_training=14, min_lr=1e-5, max_lr=1.0, update_attr=False)
            assert Tuner(trainer).lr_find(model, datamodule=text_data(), **kw).suggestion() is not None
        trainer.fit(model, datamodule=text_data())
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    assert_same(weights[0], weights[1], "after the tuner against without it")


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
    """Lightning's tuner, then fit on the same Trainer and module (PACI, a tied weight); then the finder as a
    callback at fit start, whose run ends in an epoch's partial window (epochs of 12 micro-batches in windows of
    5, 5 and 2: N > S), and the rest of that fit. What global rank 0 has."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    model = gpt_model(tie_weights=True)
    trainer = gpt_trainer(PACIStrategy(pipeline_stages=2, sync_start_steps=2), devices, 4, root)
    finder = Tuner(trainer).lr_find(model, datamodule=text_data(), num_training=14, min_lr=1e-5, max_lr=1.0)
    trainer.fit(model, datamodule=text_data())
    in_fit = LearningRateFinder(num_training_steps=3, early_stop_threshold=None, update_attr=False)
    other = gpt_model()
    strategy = PACIStrategy(pipeline_stages=2, sync_start_steps=0)
    gpt_trainer(strategy, devices, 8, root, accumulate_grad_batches=5, callbacks=[in_fit]).fit(other, ordered_data())
    if trainer.global_rank:
        return None
    seen = {"lr": finder.results["lr"], "loss": finder.results["loss"], "suggestion": finder.suggestion()}
    weights = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in (model, other)]
    return {**seen, "weights": weights, "in fit": in_fit.optimal_lr.results}


def _on_ranks(rank: int, world: int, root: str) -> dict | None:
    warnings.filterwarnings("ignore")
    return _tuned_then_fit(world, root)


@pytest.mark.multiproc
def test_the_finder_then_fit_on_processes_is_one_process(tmp_path):
    """The user's day on two processes: the tuner's fit, then fit on the same Trainer and module with a tied
    embedding. After a fit every rank but 0 keeps only its stage's layers, so the second fit's rank 1 could not
    see the tie any more and the ranks disagreed on the process groups to make: a hang, which a second fit without
    the tuner met as well. Then the finder inside a fit: the lagged SIGTERM broadcasts of its run are finished
    with their batch counts before the fit's run (the counts were left behind once: an IndexError on every rank
    at the fit's second batch). Bit for bit the same as in one process."""
    got = values(spawn(_on_ranks, 2, str(tmp_path / "processes"), timeout=240, torchrun_env=True))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _tuned_then_fit(1, str(tmp_path / "one"))
    assert want is not None and want["suggestion"] is not None
    assert_same(got, want, "processes against one process")
