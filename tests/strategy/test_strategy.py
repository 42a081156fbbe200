"""PACIStrategy inside the real Lightning Trainer, against single-device and DDP runs on the same data."""

from __future__ import annotations

import contextlib
import copy
import json
import math
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, Callback, ModelCheckpoint

from lit_efficient import GradientAccumulation, PACIStrategy, consolidate_checkpoint
from lit_efficient.models import GPT
from tests.support.gpt_runs import ValHistory
from tests.support.gpt_runs import gpt_model as _model
from tests.support.gpt_runs import gpt_trainer as _trainer
from tests.support.gpt_runs import max_diff as _max_diff
from tests.support.gpt_runs import ordered_data as _ordered
from tests.support.gpt_runs import text_data as _data
from tests.support.multiproc import SpawnedDDP

pytestmark = pytest.mark.multiproc


class RecordStats(Callback):
    """Writes every rank's pipeline stats to a file at the end of training (spawned ranks cannot return)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        s = trainer.strategy
        stats = s.runtime.stats() if getattr(s, "runtime", None) else {}
        stats.update(global_step=trainer.global_step, rank=trainer.global_rank)
        stats["val_loss"] = [float(x) for x in getattr(pl_module, "_val_history", [])]
        Path(self.path, f"rank{trainer.global_rank}.json").write_text(json.dumps(stats))


def test_flush_in_trainer_equals_single_device():
    """The Trainer's default arguments (use_distributed_sampler=True, a shuffled training loader): a
    2-stage flush pipeline with one replica reads the batches one device reads, so it trains alike."""
    steps = 3
    single, piped = _model(), _model()
    start = copy.deepcopy(single)
    _trainer("auto", 1, steps).fit(single, datamodule=_data())
    strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", start_method="forkserver")
    _trainer(strategy, 2, steps).fit(piped, datamodule=_data())
    assert _max_diff(single, start) > 1e-3, "training must move the weights for the comparison to mean anything"
    assert _max_diff(piped, single) <= 1e-5


@pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one device and one process at the same thread count
def test_default_schedule_leaves_one_device_batches_and_steps():
    """GPT's default schedule (max_steps=None) reads trainer.estimated_stepping_batches in configure_optimizers,
    which loads the training loader inside the strategy's setup. The pipeline must still read the user's loader,
    as one device does: it read a DistributedSampler's order when the loader was loaded before the strategy
    turned Lightning's sampler off (1.5e-2 apart here; 5.8e-5 at GPT's default learning rate). Epochs end in a
    partial window; both estimate 2 x ceil(3 / 2) = 4 steps and take them, so the schedules are alike."""
    estimates = []

    class Estimate(Callback):
        def on_train_start(self, trainer, pl_module):
            estimates.append(trainer.estimated_stepping_batches)

    def fit(strategy) -> tuple[GPT, int]:
        model = _model(max_steps=None)
        trainer = _trainer(
            strategy, 1, -1, max_epochs=2, limit_train_batches=3, accumulate_grad_batches=2,
            callbacks=[GradientAccumulation(steps=2), Estimate()],
        )  # fmt: skip
        trainer.fit(model, datamodule=_data())
        return model, trainer.global_step

    single, single_steps = fit("auto")
    piped, piped_steps = fit(PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"))
    assert estimates == [4, 4] and single_steps == piped_steps == 4
    assert _max_diff(single, _model()) > 1e-3  # the run moved the weights
    assert _max_diff(piped, single) == 0.0


def test_pipeline_times_data_parallel_equals_ddp():
    steps = 2
    ddp, piped = _model(), _model()
    _trainer(SpawnedDDP(), 2, steps).fit(ddp, datamodule=_data())
    strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", start_method="forkserver")
    _trainer(strategy, 4, steps).fit(piped, datamodule=_data())
    assert _max_diff(piped, ddp) <= 1e-5


def test_paci_trains_on_real_text_with_drift_in_bound(tmp_path):
    model = _model()
    # balance="profile" times every layer on rank 0 and broadcasts the split: exercised here too.
    # A synchronous start of 4 of the 24 steps (the default's 40 would cover them all): flush's order, then PACI's.
    strategy = PACIStrategy(
        pipeline_stages=2, schedule="paci", balance="profile", sync_start_steps=4, start_method="forkserver"
    )
    trainer = _trainer(
        strategy, 2, 24, callbacks=[ValHistory(), RecordStats(tmp_path)], limit_val_batches=4, val_check_interval=32
    )
    trainer.fit(model, datamodule=_data())
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    for st in ranks:
        assert st["global_step"] == 24
        assert st["drift_max"] <= math.ceil((2 - 1 - st["stage"]) / 4)
        assert st["steps"] == 24
    stage0 = next(st for st in ranks if st["stage"] == 0)
    assert stage0["drift_max"] == 1 and 0 < stage0["drift_mean"] <= 0.25 + 1e-9
    history = ranks[0]["val_loss"]  # rank 0 holds the last stage and its metrics
    assert len(history) >= 3 and history[-1] < history[0] - 0.3, history


def test_checkpoint_resume_follows_uninterrupted_run(tmp_path):
    # Epochs of 12 micro-batches (3 windows); the checkpoint is taken after the last batch of epoch 0,
    # so the resumed run sees the same micro-batches as the uninterrupted one.
    def trainer(max_steps, **kw):
        strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", start_method="forkserver")
        return _trainer(strategy, 2, max_steps, **kw)

    full = _model()
    trainer(6).fit(full, datamodule=_ordered())
    first = _model()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, filename="{step}")
    trainer(3, callbacks=[ckpt], enable_checkpointing=True).fit(first, datamodule=_ordered())
    path = tmp_path / "step=3.ckpt"
    assert path.is_file()  # one ordinary Lightning file (tests/checkpoint/test_checkpoints.py: it loads anywhere)
    resumed = _model()
    trainer(6).fit(resumed, datamodule=_ordered(), ckpt_path=str(path))
    assert _max_diff(resumed, first) > 1e-3
    assert _max_diff(resumed, full) <= 1e-5
    # The consolidated checkpoint is the unsplit module's state_dict at step 3.
    plain = _model()
    plain.load_state_dict(consolidate_checkpoint(path))
    assert _max_diff(plain, first) == 0.0


class _CountsClockBroadcasts(PACIStrategy):
    """Counts the broadcasts of ModelCheckpoint's time decision (a bool from rank 0's clock)."""

    clock_reads = 0

    def broadcast(self, obj, src=0):
        type(self).clock_reads += isinstance(obj, bool)
        return super().broadcast(obj, src)


def test_a_time_based_checkpoint_reads_rank_zeros_clock_once_per_optimizer_step(tmp_path):
    """Lightning broadcasts rank 0's clock at every call of the hook: on processes a barrier, which at every
    micro-batch would hold the pipeline's stages together. It runs at the first batch end of each step (4 steps of
    N=4: 5 reads with step 0's, not 16), and saves at each step as one device does (the feature matrix)."""
    strategy = _CountsClockBroadcasts(pipeline_stages=2)
    timed = ModelCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(0), save_top_k=-1, filename="{step}")
    trainer = _trainer(strategy, 1, 4, callbacks=[timed], enable_checkpointing=True)
    trainer.fit(_model(), datamodule=_data())
    assert _CountsClockBroadcasts.clock_reads == 5
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == [f"step={s}.ckpt" for s in (1, 2, 3, 4)]
    assert "on_train_batch_end" not in vars(timed)  # its own hook again after fit (teardown gives it back)


class _MetricsAtEvaluationEnd(Callback):
    """Writes what each rank's callbacks see in ``callback_metrics`` at a validation's and a test's end."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _write(self, trainer, stage: str) -> None:
        seen = {k: float(v) for k, v in trainer.callback_metrics.items()}
        Path(self.root, f"{stage}-{trainer.global_rank}.json").write_text(json.dumps(seen))

    def on_validation_end(self, trainer, pl_module) -> None:
        self._write(trainer, "validate")

    def on_test_end(self, trainer, pl_module) -> None:
        self._write(trainer, "test")


class _Writer(BasePredictionWriter):
    """Lightning's documented writer: the epoch's predictions concatenated, one file per rank."""

    def __init__(self, root: Path) -> None:
        super().__init__(write_interval="epoch")
        self.root = root

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        torch.save(torch.cat(predictions), Path(self.root, f"predictions-{trainer.global_rank}.pt"))


def test_validate_test_and_predict_equal_unsplit_model_on_every_rank(tmp_path):
    """The results, what every rank's callbacks see at a validation's and a test's end (rank 1 saw no test metric),
    and a prediction writer, which writes where the last stage is (on stage 0's rank every prediction was None: the
    writer raised and ended the job)."""
    model = _model()
    dm = _data()
    single = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, limit_test_batches=5,
                       limit_val_batches=5, limit_predict_batches=3, enable_model_summary=False,
                       callbacks=[_Writer(tmp_path / "one")])  # fmt: skip
    (tmp_path / "one").mkdir()
    want_val = single.validate(model, datamodule=dm, verbose=False)[0]
    want_test = single.test(model, datamodule=dm, verbose=False)[0]
    single.predict(model, datamodule=dm, return_predictions=False)
    seen_by = [_MetricsAtEvaluationEnd(tmp_path), _Writer(tmp_path)]
    piped = L.Trainer(accelerator="cpu", devices=2, strategy=PACIStrategy(start_method="forkserver"), logger=False,
                      enable_progress_bar=False, limit_val_batches=5, limit_test_batches=5, limit_predict_batches=3,
                      enable_model_summary=False, callbacks=seen_by)  # fmt: skip
    got_val = piped.validate(model, datamodule=_data(), verbose=False)[0]
    got_test = piped.test(model, datamodule=_data(), verbose=False)[0]
    piped.predict(model, datamodule=_data(), return_predictions=False)
    for stage, want, got in (("validate", want_val, got_val), ("test", want_test, got_test)):
        assert want.keys() == got.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
        seen = [json.loads((tmp_path / f"{stage}-{rank}.json").read_text()) for rank in (0, 1)]
        assert seen[0] == seen[1] and seen[0].keys() == want.keys(), stage
    assert sorted(p.name for p in tmp_path.glob("predictions-*.pt")) == ["predictions-0.pt"]
    predictions = torch.load(tmp_path / "predictions-0.pt")
    assert torch.allclose(predictions, torch.load(tmp_path / "one" / "predictions-0.pt"), atol=1e-5)


class _WaitsForEveryRank(_Writer):
    """A DDP pattern: every rank writes its file, then a barrier before rank 0 reads them all; the last stage's
    ranks also gather with the module's all_gather (its stage's replicas), which works."""

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        super().write_on_epoch_end(trainer, pl_module, predictions, batch_indices)
        count = pl_module.all_gather(torch.tensor(len(predictions)))
        Path(self.root, "gathered.json").write_text(json.dumps(count.tolist()))
        trainer.strategy.barrier()


def test_a_writer_waiting_for_every_rank_is_refused_at_once_naming_what_gathers(tmp_path):
    """A user audit: only the last stage's ranks run a writer's hooks, so its barrier waited for the other ranks
    until the group's timeout (30 minutes by default; SIGTERM did not end it), then blamed a lost peer."""
    piped = L.Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, limit_predict_batches=2,
                      strategy=PACIStrategy(start_method="forkserver", timeout=timedelta(seconds=30)),
                      enable_model_summary=False, callbacks=[_WaitsForEveryRank(tmp_path)])  # fmt: skip
    with pytest.raises(Exception, match=r"barrier\(\) inside a BasePredictionWriter's write hook (.|\n)*all_gather"):
        piped.predict(_model(), datamodule=_data(), return_predictions=False)
    assert json.loads((tmp_path / "gathered.json").read_text()) == [2]
    # One stage on two processes (LocalSGD's switch from DDP): every rank is the last and runs the hooks, as DDP's.
    replicas = L.Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, limit_predict_batches=2,
                         strategy=PACIStrategy(pipeline_stages=1, start_method="forkserver"),
                         enable_model_summary=False, callbacks=[_WaitsForEveryRank(tmp_path)])  # fmt: skip
    replicas.predict(_model(), datamodule=_data(), return_predictions=False)
    assert json.loads((tmp_path / "gathered.json").read_text()) == [2, 2]


def test_validation_metrics_cover_every_replica():
    """2 stages x 2 replicas: each replica validates half of the batches (DistributedSampler), and
    val_loss and val_ppl are the means over all of them, as on one device over the same batches."""
    model = _model()
    single = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, limit_val_batches=6,
                       enable_model_summary=False)  # fmt: skip
    want = single.validate(model, datamodule=_data(), verbose=False)[0]
    strategy = PACIStrategy(pipeline_stages=2, start_method="forkserver")
    piped = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False, enable_progress_bar=False,
                      limit_val_batches=3, enable_model_summary=False)  # fmt: skip
    got = piped.validate(model, datamodule=_data(), verbose=False)[0]
    assert want.keys() == got.keys() == {"val_loss", "val_ppl"}
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5), key


class _EveryOtherStep(GPT):
    """The test GPT with a step-interval scheduler at frequency 2 (it steps at optimizer steps 2, 4, 6)."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)
        halve = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": halve, "interval": "step", "frequency": 2}}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("devices", [1, 2], ids=["one process", "processes"])
def test_a_scheduler_with_a_frequency_resumes_on_the_uninterrupted_runs_steps(tmp_path, devices):
    """A step-interval scheduler at frequency 2 resumed after step 3: its count of the run's steps restarted at 0,
    so it stepped at 5 instead of 4 and 6, and every later learning rate was off (Lightning's own loop counts from
    the checkpoint's steps). One process, 1F1B-flush: the resumed run equals the uninterrupted one."""

    def fit(max_steps: int, ckpt_path: str | None = None, **kw) -> GPT:
        L.seed_everything(0)
        model = _EveryOtherStep(n_layer=2, n_head=2, n_embd=32, block_size=32, learning_rate=0.1)
        strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", start_method="forkserver")
        _trainer(strategy, devices, max_steps, **kw).fit(model, datamodule=_ordered(), ckpt_path=ckpt_path)
        return model

    # It counts the run's steps, not Lightning's micro-batches of the epoch: said (in this process, rank 0's).
    with pytest.warns(UserWarning, match=r"StepLR\(frequency=2\)") if devices == 1 else contextlib.nullcontext():
        full = fit(6)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, filename="{step}")
    fit(3, callbacks=[ckpt], enable_checkpointing=True)
    assert _max_diff(fit(6, str(tmp_path / "step=3.ckpt")), full) <= 1e-6
