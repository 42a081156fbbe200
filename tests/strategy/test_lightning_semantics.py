"""What Lightning does between two training batches, under PACIStrategy, with the arguments a user has.

Each test runs the real Trainer with its defaults (the default sampler, validation inside fit) and
compares the pipeline with a reference: the same run with a Lightning hook turned off, a one-process
emulation of PACI's documented rule, or one device.
"""

from __future__ import annotations

import json
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_efficient import PACIStrategy
from lit_efficient.models import GPT
from lit_efficient.runtime.partition import partition_uniform, stage_bounds
from lit_efficient.tools.demo import build_layers, lm_loss
from tests.support.gpt_runs import gpt_model as _model
from tests.support.gpt_runs import max_diff as _max_diff
from tests.support.gpt_runs import text_data as _text_data
from tests.support.runtime_runs import MODEL, correction_emulation, runtime_optimizer
from tests.support.runtime_runs import paci_emulation as _paci_emulation
from tests.support.runtime_runs import runtime_batches as _data

pytestmark = pytest.mark.multiproc


class TinyPipelined(L.LightningModule):
    """The runtime tests' demo model as a pipelineable LightningModule, trained on a fixed list of
    micro-batches in order (no shuffling), so a one-process emulation can replay exactly its data."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(build_layers(**MODEL))
        self.batches = batches

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_input(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return lm_loss(output, batch)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)[0]

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.pipeline_loss(self(batch[0]), batch)[0])

    def configure_optimizers(self):
        return _sgd(self.parameters())

    def train_dataloader(self):
        xs, ys = (torch.cat(t) for t in zip(*self.batches, strict=True))
        return DataLoader(TensorDataset(xs, ys), batch_size=self.batches[0][0].shape[0])

    def val_dataloader(self):
        return self.train_dataloader()


def _sgd(params):
    # Not AdamW: its first steps move every weight by ~lr * sign(grad), so the float reassociation of a
    # near-zero gradient (another thread count in the spawned ranks) would show as a 1e-2 difference.
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _fit(module, strategy, devices, accumulate, max_steps, datamodule=None, **kw):
    """A fit with the Trainer's defaults besides quiet output; returns the module (whole after fit)."""
    kw = {"enable_checkpointing": False, **kw}
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps,
        accumulate_grad_batches=accumulate, logger=False, enable_progress_bar=False, enable_model_summary=False, **kw,
    )  # fmt: skip
    trainer.fit(module, datamodule=datamodule)
    return module


def _drained_emulation(data, stages, accumulate, drains):
    """PACI (recompute) from its definition, with the pipeline drained before each micro-batch in
    ``drains``: a drain finishes every backward first, so forwards after it count those steps."""
    layers = _paci_emulation(data, stages, accumulate, _bounds(stages), drains=drains, optimizer=_sgd)
    return [p for mine in layers for layer in mine for p in layer.parameters()]


def _bounds(stages):
    return stage_bounds(partition_uniform(len(build_layers(**MODEL)), stages))


@pytest.mark.parametrize(("every", "devices"), [(4, 2), (3, 1)], ids=["window end, processes", "mid-window, one"])
def test_paci_validation_loses_no_gradient(every, devices):
    """Validation every 2 windows (val_check_interval = 2N micro-batches): Lightning's zero-grad hook
    runs there on every stage while stage 0 still has that window's last micro-batch in flight.
    Validation inside a window (every 3 micro-batches, N=2) drains at the validation's start, inside
    the validation loop's no_grad (inference mode is off inside fit): there the recomputed forwards of the
    micro-batches in flight built no graph, and their backwards added nothing (1e-2 in the weights, flush
    too). PACI must equal its definition with a drain at each validation: a lost gradient shows as a
    difference of order 1e-2."""
    stages, accumulate, windows = 2, 2, 6
    data = _data(accumulate * windows)
    strategy = PACIStrategy(pipeline_stages=stages, schedule="paci", recompute=True, start_method="forkserver")
    piped = _fit(
        TinyPipelined(data), strategy, devices, accumulate, windows, val_check_interval=every, limit_val_batches=1
    )
    got = list(piped.parameters())
    drains = set(range(every, len(data), every))
    want = _drained_emulation(data, stages, accumulate, drains)
    undrained = _drained_emulation(data, stages, accumulate, set())
    assert max((a - b).abs().max().item() for a, b in zip(got, undrained, strict=True)) > 1e-4, (
        "the drains must change the trajectory, or this test cannot tell a drained run from an undrained one"
    )
    assert max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)) <= 1e-5


class _TinyAdamW(TinyPipelined):
    """With the runtime tests' AdamW (lr 1e-2): PACI's defaults switch on for it."""

    def configure_optimizers(self):
        return runtime_optimizer(self.parameters())


def _fit_as_a_user(root, module, strategy, devices, accumulate, max_steps):
    """The Trainer with every default (logger, checkpoints, progress bar, validation at the epoch's end)."""
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps,
        accumulate_grad_batches=accumulate, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(module)
    return [p.detach() for p in module.parameters()]


def _emulated(data, stages, accumulate, correction):
    """The parameters after `correction_emulation` with the default synchronous start (40 steps with AdamW)."""
    layers = correction_emulation(data, stages, accumulate, correction, sync_steps=40)
    return [p for mine in layers for layer in mine for p in layer.parameters()]


def _params_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.usefixtures("one_thread")  # the spawned ranks and the emulation reduce in one thread
@pytest.mark.parametrize("devices", [1, 4])
def test_paci_defaults_equal_their_rule_through_the_trainer(tmp_path, devices):
    """``PACIStrategy(schedule="paci")`` with AdamW and nothing else set (``recompute=True``, the emulated rule): 40
    synchronous steps in flush order, then PACI with the first-step weight prediction whose second moment takes the
    window's mean squared for the share of the window accumulated (docs/DESIGN.md, "PACI's defaults"), through the
    Trainer with its defaults, in one process and on 4. Stage 0 is two steps stale after the start, so windows
    41-45 forward on predicted weights. The rule's stashed form equals the emulation to float rounding: the
    delays, the window's micro-batch count and the switch from the synchronous start reach the prediction as the
    rule says. The default's in-place form undoes each prediction by its inverse, whose rounding AdamW amplifies
    over steps (equal to the stashed form forward by forward: test_staleness.py), so it is held to a tenth of the
    distance from plain PACI and to half its distance from the previous rule (the whole window's square folded),
    which a prediction built without N would run."""
    stages, accumulate, steps = 4, 2, 46
    data = _data(accumulate * steps)
    want, plain, whole = (
        _emulated(data, stages, accumulate, correction) for correction in ("auto", None, "weight_prediction_first_step")
    )
    distance = _params_diff(want, plain)
    assert distance > 1e-2, "the prediction must move the trajectory, or the comparisons below are vacuous"
    stashed = PACIStrategy(
        pipeline_stages=stages, schedule="paci", recompute=True, start_method="forkserver",
        staleness_correction="weight_prediction_first_step_square_shrunk",
    )  # fmt: skip
    got = _fit_as_a_user(tmp_path / "stashed", _TinyAdamW(data), stashed, devices, accumulate, steps)
    assert _params_diff(got, want) <= 1e-5
    default = PACIStrategy(pipeline_stages=stages, schedule="paci", recompute=True, start_method="forkserver")
    got = _fit_as_a_user(tmp_path / "default", _TinyAdamW(data), default, devices, accumulate, steps)
    off, rule = _params_diff(got, want), _params_diff(got, whole)
    assert off <= 0.1 * distance and off < 0.5 * rule, (off, distance, rule)


class _NoValidationZeroGrad(GPT):
    def on_validation_model_zero_grad(self) -> None:
        pass


def test_paci_validation_zero_grad_hook_changes_nothing():
    """The package's own GPT in keep-graph mode (the default): the run with Lightning's zero-grad
    hook equals, bit for bit, the run with the hook turned off."""
    kw = dict(val_check_interval=8, limit_val_batches=2)
    runs = []
    for cls in (GPT, _NoValidationZeroGrad):
        module = _model()
        module.__class__ = cls
        strategy = PACIStrategy(pipeline_stages=2, schedule="paci", start_method="forkserver")
        runs.append(_fit_with_data(module, strategy, 2, 4, 6, **kw))
    assert _max_diff(runs[0], runs[1]) == 0.0


def _fit_with_data(module, strategy, devices, accumulate, max_steps, **kw):
    return _fit(module, strategy, devices, accumulate, max_steps, datamodule=_text_data(), **kw)


class _LogsFromPipelineLoss(GPT):
    """Logs a per-micro-batch metric where PACIStrategy runs it: in pipeline_loss, on the last stage; in validation,
    what ``self.all_gather`` gives (only the last stage runs the evaluation step); and at the epochs' ends what
    Lightning's documented patterns aggregate: a list of the steps' outputs and a torchmetrics metric (the
    training one guarded by ``is_last_stage``, where pipeline_loss ran)."""

    def pipeline_loss(self, output, batch):
        loss, items = super().pipeline_loss(output, batch)
        if self.trainer.training:
            self.log("train_items", items.float(), on_step=True, batch_size=batch[0].shape[0])
            self.log("train_loss", loss, on_step=True, on_epoch=True, batch_size=batch[0].shape[0])  # the module's own
            self.items_mean.update(items.float())
        return loss, items

    def on_fit_start(self):  # a metric made after the strategy's setup
        import torchmetrics

        self.val_late = torchmetrics.MeanMetric()

    def on_validation_epoch_start(self):  # made anew at each validation, synced at each step
        import torchmetrics

        self.val_each_step = torchmetrics.MeanMetric(dist_sync_on_step=True)

    def validation_step(self, batch, batch_idx):
        gathered = self.all_gather(torch.tensor([float(batch_idx) + 1.0]))
        self.log("gathered_sum", gathered.sum(), batch_size=batch[0].shape[0])
        self.log("gathered_count", float(gathered.numel()), batch_size=batch[0].shape[0])
        self.log("gathered_dim", float(gathered.dim()), batch_size=batch[0].shape[0])  # stacked: (replicas, 1)
        loss = super().validation_step(batch, batch_idx)
        self.val_losses.append(loss)
        self.val_mean.update(loss)
        self.val_late.update(loss)
        self.log("val_each_step", self.val_each_step(loss), batch_size=batch[0].shape[0])
        return loss

    def on_validation_epoch_end(self):
        self.log("val_stacked", torch.stack(self.val_losses).mean(), sync_dist=True)  # raised on stage 0's ranks
        self.val_losses.clear()
        self.log("val_mean", self.val_mean.compute())  # gathered over a group stage 0's ranks are not in
        self.val_mean.reset()
        self.log("val_late", self.val_late.compute())  # gathered over the world: stage 0's ranks never came
        self.val_late.reset()

    def on_train_epoch_end(self):
        if self.trainer.strategy.is_last_stage:
            self.log("items_epoch", self.items_mean.compute())
            self.items_mean.reset()


class _RecordMetrics(L.Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            self.path.write_text(json.dumps(metrics))


class _ComputesTheModulesMetric(L.Callback):
    """A callback computing the module's metric, unguarded: as under DDP, on every rank."""

    def __init__(self, path) -> None:
        self.path = path

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        try:
            value: float | str = float(pl_module.val_mean.compute())
        except RuntimeError as err:
            value = str(err)
        (self.path / f"computed{trainer.global_rank}.json").write_text(json.dumps(value))


class _SeesEpochEndMetrics(Checkpoint):
    """Where Lightning runs ModelCheckpoint and EarlyStopping, after the module's ``on_train_epoch_end``: what each
    rank reads there (a save is collective: every rank must decide alike)."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        seen = trainer.callback_metrics.get("items_epoch")
        (self.path / f"seen{trainer.global_rank}.json").write_text(json.dumps(None if seen is None else float(seen)))


@pytest.mark.parametrize("replicas", [1, 2])
def test_metrics_logged_in_pipeline_loss_reach_the_logger(tmp_path, replicas):
    """And ``self.all_gather`` in validation_step gathers over the last stage's replicas (one: as on one device;
    two: each replica's share, as under DDP): over the world it waited forever for stage 0, which never runs the
    evaluation step. Lightning's epoch-end patterns work as on one device: stage 0's ranks, which never ran the
    evaluation steps, raised in on_validation_epoch_end (an empty outputs list; a metric gathered over the last
    stage's group), and a monitoring callback after on_train_epoch_end read what the last stage logged there on
    every rank. A metric the module makes after setup (in on_fit_start, or anew at each validation's start, synced
    at each step) syncs over the last stage's replicas too (over the world it waited forever for stage 0), and a
    callback computing the module's metric on a rank without
    the last stage is told to guard it (a gather over a group the rank is not in: "stack expects a non-empty
    TensorList")."""
    import torchmetrics

    module = _model()
    module.__class__ = _LogsFromPipelineLoss
    module.val_losses, module.val_mean, module.items_mean = [], torchmetrics.MeanMetric(), torchmetrics.MeanMetric()
    out = tmp_path / "metrics.json"
    strategy = PACIStrategy(pipeline_stages=2, schedule="paci", start_method="forkserver")
    _fit_with_data(
        module, strategy, 2 * replicas, 2, 3, limit_val_batches=1, val_check_interval=2, limit_train_batches=4,
        callbacks=[_RecordMetrics(out), _SeesEpochEndMetrics(tmp_path), _ComputesTheModulesMetric(tmp_path)],
        enable_checkpointing=True,
    )  # fmt: skip
    metrics = json.loads(out.read_text())
    assert metrics["train_items"] == 4 * 32  # batch_size x block tokens, every micro-batch
    assert "train_loss" in metrics and "train_loss_epoch" in metrics  # the module's own, per epoch too
    # Each replica's first validation batch (batch_idx 0, so 1.0), one row per replica of the last stage.
    assert metrics["gathered_count"] == replicas and metrics["gathered_sum"] == replicas, metrics
    assert metrics["gathered_dim"] == 2.0
    # Over every replica's batch, as val_loss (sync_dist) is: the same batch size on each.
    assert metrics["val_stacked"] == pytest.approx(metrics["val_loss"], rel=1e-6)
    assert metrics["val_mean"] == pytest.approx(metrics["val_loss"], rel=1e-6)
    assert metrics["val_late"] == pytest.approx(metrics["val_loss"], rel=1e-6)
    assert metrics["val_each_step"] == pytest.approx(metrics["val_loss"], rel=1e-6)  # one batch per replica
    computed = [json.loads((tmp_path / f"computed{rank}.json").read_text()) for rank in range(2 * replicas)]
    stage = [0 if rank % 2 else 1 for rank in range(2 * replicas)]  # global rank 0 hosts the last stage
    for rank, value in enumerate(computed):
        if stage[rank] == 1:
            assert value == pytest.approx(metrics["val_loss"], rel=1e-6), (rank, value)
        else:
            assert "hosts no last stage" in value and "trainer.strategy.is_last_stage" in value, (rank, value)
    seen = [json.loads((tmp_path / f"seen{rank}.json").read_text()) for rank in range(2 * replicas)]
    assert seen == [4 * 32] * (2 * replicas), seen


class _LogsInItsInput(GPT):
    """Logs what its input holds where one device's training_step reads it: in pipeline_input, which runs on stage
    0 (on processes, not on global rank 0, which hosts the last stage)."""

    def pipeline_input(self, batch):
        if self.trainer.training:
            self.log("input_tokens", float(batch[0].numel()), on_step=False, on_epoch=True, reduce_fx="sum")
        return super().pipeline_input(batch)


class _RecordWarnings(L.Callback):
    """Global rank 0's warnings during the fit, written to ``path`` at its end (a spawned rank's stderr is not the
    test's: the forkserver keeps the descriptor of the test that started it)."""

    def __init__(self, path) -> None:
        self.path = path

    def setup(self, trainer, pl_module, stage) -> None:
        self._catching = warnings.catch_warnings(record=True)
        self.caught = self._catching.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer, pl_module) -> None:
        self._catching.__exit__(None, None, None)
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps([str(w.message) for w in self.caught]))


def test_a_metric_logged_in_pipeline_input_reaches_a_checkpoint_that_monitors_it(tmp_path):
    """On processes the key was on stage 0's rank only: its ModelCheckpoint saved (a collective) while rank 0's
    found no key and skipped, and the fit hung; without a monitor the value was lost silently. Every rank now sees
    it, the checkpoint kept is one device's, and rank 0 says that its logger does not show the key."""
    kept, said = {}, {}
    pipeline = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", start_method="forkserver")
    for devices, strategy in [(1, "auto"), (2, pipeline)]:
        module = _model()
        module.__class__ = _LogsInItsInput
        out, caught = tmp_path / f"metrics{devices}.json", tmp_path / f"warnings{devices}.json"
        checkpoint = ModelCheckpoint(dirpath=tmp_path / f"kept{devices}", monitor="input_tokens", mode="max")
        _fit_with_data(
            module, strategy, devices, 2, 4, limit_val_batches=1, enable_checkpointing=True,
            callbacks=[checkpoint, _RecordMetrics(out), _RecordWarnings(caught)],
        )  # fmt: skip
        kept[devices] = sorted(p.name for p in (tmp_path / f"kept{devices}").iterdir())
        assert json.loads(out.read_text())["input_tokens"] == 8 * 4 * 32  # micro-batches x batch x block
        said[devices] = [w for w in json.loads(caught.read_text()) if "'input_tokens'" in w]
    assert kept[1] == kept[2] == ["epoch=0-step=4.ckpt"], kept
    assert not said[1] and said[2] and "ran on a rank without the last stage" in said[2][0], said


class _LogsItsFirstToken(GPT):
    """Logs a per-micro-batch value of its input where one device's training_step reads it: in pipeline_input."""

    def pipeline_input(self, batch):
        if self.trainer.training:
            self.log("first_token", batch[0][:, 0].float().mean(), on_step=True, on_epoch=False)
        return super().pipeline_input(batch)


class _SeenAtValidations(L.Callback):
    def __init__(self, path, key) -> None:
        self.path, self.key, self.seen = path, key, []

    def on_validation_end(self, trainer, pl_module) -> None:
        value = trainer.callback_metrics.get(self.key)
        self.seen.append(None if value is None else float(value))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps(self.seen))


def test_a_per_step_metric_of_pipeline_input_ranks_checkpoints_at_every_step_as_on_one_device(tmp_path):
    """ModelCheckpoint(every_n_train_steps=1) on a key pipeline_input logs at every micro-batch, with validations
    inside the fit, in one process and on 2. Two defects on processes: rank 0 (the last stage) found the key
    missing at the first window's batch ends, before any share, and deferred a save to the first validation where
    stage 0's rank did not: at that validation it saved alone, a hang; and the copy rank 0 took at the first share
    won every later share, so every validation and the checkpoints ranked the key's first value. Kept checkpoints
    and the values seen at each validation are one device's."""
    kept, seen = {}, {}
    pipeline = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", start_method="forkserver")
    in_process = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush")
    for where, devices, strategy in [("one", 1, "auto"), ("in", 1, in_process), ("on", 2, pipeline)]:
        module = _model()
        module.__class__ = _LogsItsFirstToken
        out = tmp_path / f"seen-{where}.json"
        folder = tmp_path / f"kept-{where}"
        checkpoint = ModelCheckpoint(folder, monitor="first_token", mode="max", every_n_train_steps=1, save_top_k=2)
        _fit_with_data(
            module, strategy, devices, 2, 6, limit_val_batches=1, val_check_interval=4, enable_checkpointing=True,
            callbacks=[checkpoint, _SeenAtValidations(out, "first_token")],
        )  # fmt: skip
        kept[where] = sorted(p.name for p in folder.iterdir())
        seen[where] = json.loads(out.read_text())
    assert seen["one"][0] is None and len(set(seen["one"][1:])) == 3, seen  # the sanity check's, then three that move
    assert seen["in"] == seen["on"] == seen["one"] and kept["in"] == kept["on"] == kept["one"], (seen, kept)


class _RecordSteps(L.Callback):
    """What a user's end-of-training callback sees: each stage's optimizer steps against global_step."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        runtime = trainer.strategy.runtime
        record = {
            "global_step": trainer.global_step,
            "steps": runtime.stage.stats.steps,
            "in_flight": runtime.stage.in_flight,
        }
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def test_callbacks_at_the_end_of_training_see_every_stage_stepped(tmp_path):
    """max_steps ends the run mid-epoch: Lightning calls the callbacks' on_train_end before the strategy's,
    so without a drain first stage 0 would still hold its last micro-batch and one step less."""
    strategy = PACIStrategy(pipeline_stages=2, schedule="paci", start_method="forkserver")
    _fit_with_data(_model(), strategy, 2, 4, 3, limit_val_batches=0, callbacks=[_RecordSteps(tmp_path)])
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record == {"global_step": 3, "steps": 3, "in_flight": 0}, (rank, record)


class _SkipsRestOfEpoch(TinyPipelined):
    """Returns -1 from on_train_batch_start (Lightning: skip the rest of this epoch) at the (epoch, batch) pairs
    given, with an epoch-interval scheduler; records the learning rate at each epoch's end."""

    def __init__(self, batches, skips, record) -> None:
        super().__init__(batches)
        self.skips, self.record = skips, record
        self.lrs: list[float] = []

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if (self.current_epoch, batch_idx) in self.skips else None

    def on_train_epoch_end(self):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_end(self):
        if self.trainer.global_rank == 0:  # on processes the ranks are not the test's process
            self.record.write_text(json.dumps({"lrs": self.lrs, "steps": self.trainer.global_step}))

    def configure_optimizers(self):
        optimizer = _sgd(self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}


@pytest.mark.usefixtures("one_thread")
def test_an_epoch_cut_short_by_on_train_batch_start_drops_its_window_as_one_device(tmp_path):
    """Epochs of 8 micro-batches, N=2: epoch 0 skips from batch 5, in the middle of its third window; epoch 1 from
    its first batch. One device steps no optimizer for the interrupted window (its next epoch's first batch zeroes
    the gradients) and steps its epoch-interval schedulers at both ends. The pipeline carried the window's batch
    into the next epoch's first window (divided by 3) and skipped the schedulers (0.022 in the weights); now it
    does what one device does, in one process and on processes."""
    data = _data(8)
    skips = {(0, 5), (1, 0)}

    def run(strategy, devices):
        module = _SkipsRestOfEpoch(data, skips, tmp_path / "record.json")
        _fit(module, strategy, devices, 2, 100, max_epochs=3, limit_val_batches=0)
        return module, json.loads((tmp_path / "record.json").read_text())

    one, seen = run("auto", 1)
    assert seen["steps"] == 2 + 0 + 4  # the schedulers step at the skips from Lightning 2.6 on, not before
    for devices in (1, 2):
        piped, piped_seen = run(
            PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", start_method="forkserver"), devices
        )
        assert piped_seen == seen, devices
        diff = max((a - b).abs().max().item() for a, b in zip(piped.parameters(), one.parameters(), strict=True))
        assert diff <= 1e-6, (devices, diff)


class _TimmStyleSchedule:
    """A scheduler that does not follow torch's API (timm's: ``step_update(num_updates)`` per optimizer step),
    which Lightning steps through the module's ``lr_scheduler_step`` only."""

    def __init__(self, optimizer, total: int) -> None:
        self.optimizer, self.total = optimizer, total
        self.base = [group["lr"] for group in optimizer.param_groups]

    def step_update(self, num_updates: int) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base, strict=True):
            group["lr"] = base * max(0.0, 1 - num_updates / self.total)

    def step(self, epoch: int) -> None:  # timm's per-epoch call: nothing here
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class _StepsItsOwnSchedulers(GPT):
    """``lr_scheduler_step`` overridden, as Lightning's docs show for timm, reading ``trainer.global_step``; and a
    torch scheduler the same override steps every second step only."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        timm = {"scheduler": _TimmStyleSchedule(optimizer, total=8), "interval": "step"}
        halving = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), "interval": "step"}
        return [optimizer], [timm, halving]

    def lr_scheduler_step(self, scheduler, metric) -> None:
        if isinstance(scheduler, _TimmStyleSchedule):
            scheduler.step_update(num_updates=self.trainer.global_step)
        elif self.trainer.global_step % 2 == 0:
            scheduler.step()


@pytest.mark.usefixtures("one_thread")
def test_a_modules_own_lr_scheduler_step_steps_its_schedulers_as_on_one_device(tmp_path):
    """The override was never called (a setup warning said so): a timm-style scheduler crashed at the first step
    (``step()`` needs its epoch) and a torch one stepped at every step (weights 4.9e-3 from one device's after 3
    steps). Each stage calls it at its own steps, reading one device's ``global_step`` there: 1F1B-flush in one
    process equals one device; under PACI every stage ends at one device's rate."""

    def fit(strategy):
        L.seed_everything(0)
        model = _StepsItsOwnSchedulers(n_layer=2, n_head=2, n_embd=32, block_size=32)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, accumulate_grad_batches=2,
                            limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
        trainer.fit(model, datamodule=_text_data())
        return model, trainer

    one_device, plain = fit("auto")
    rate = [group["lr"] for group in plain.optimizers[0].param_groups]
    # timm's at update 3 (it sets the rate; the halving at step 2 set step 3's rate, which the weights show)
    assert rate == pytest.approx([3e-3 * (1 - 3 / 8)])
    flush, _ = fit(PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"))
    assert _max_diff(flush, one_device) == 0.0
    _, paci = fit(PACIStrategy(pipeline_stages=2))
    for hosted in paci.strategy.hosted:
        assert [group["lr"] for group in hosted.optimizer.param_groups] == pytest.approx(rate)


class _LogsTrainLossPerEpoch(GPT):
    """``train_loss`` per step and per epoch, as Lightning's docs log it, from pipeline_loss (which one device's
    training_step calls here, and the pipeline's last stage runs)."""

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(self.pipeline_input(batch)), batch)[0]

    def pipeline_loss(self, output, batch):
        loss, items = super().pipeline_loss(output, batch)
        if self.trainer.training:
            self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=batch[0].shape[0])
        return loss, items


class _LogsItInAParent(GPT):
    """The same through ``log_dict`` in a parent class's pipeline_loss, reached by ``super()``."""

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(self.pipeline_input(batch)), batch)[0]

    def pipeline_loss(self, output, batch):
        loss, items = super().pipeline_loss(output, batch)
        if self.trainer.training:
            self.log_dict({"train_loss": loss}, on_step=True, on_epoch=True, batch_size=batch[0].shape[0])
        return loss, items


class _ItsChild(_LogsItInAParent):
    def pipeline_loss(self, output, batch):
        return super().pipeline_loss(output, batch)


class _OnlySaysSo(GPT):
    def pipeline_loss(self, output, batch):
        # Not here: self.log("train_loss", loss, on_epoch=True)
        return super().pipeline_loss(output, batch)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("module_cls", [_LogsTrainLossPerEpoch, _ItsChild], ids=["log", "log_dict-in-a-parent"])
def test_a_train_loss_the_module_logs_itself_replaces_the_strategys(tmp_path, module_cls):
    """Logged from pipeline_loss (what docs/python-api.md says), ``train_loss`` stopped the fit at the first window's
    end: Lightning refused the key logged twice in one step with other arguments (the strategy's own, per step).
    The strategy now leaves the key to the module when the module logs it while training (seen at run time: through
    log_dict, an inherited pipeline_loss): its per-epoch mean and its rows are one device's. A comment naming the
    call logs nothing, and the strategy's train_loss stays."""

    def fit(strategy, cls=module_cls):
        L.seed_everything(0)
        model = cls(n_layer=2, n_head=2, n_embd=32, block_size=32)
        recorded = tmp_path / f"{type(strategy).__name__}-{cls.__name__}.json"
        _fit_with_data(model, strategy, 1, 2, 6, limit_train_batches=6, max_epochs=-1, limit_val_batches=0,
                       callbacks=[_RecordMetrics(recorded)], default_root_dir=tmp_path)  # fmt: skip
        return json.loads(recorded.read_text())

    one_device = fit("auto")
    assert {"train_loss_step", "train_loss_epoch"} <= set(one_device)
    assert fit(PACIStrategy(pipeline_stages=2, schedule="1f1b_flush")) == one_device
    if module_cls is _LogsTrainLossPerEpoch:
        assert "train_loss" in fit(PACIStrategy(pipeline_stages=2), cls=_OnlySaysSo)


class _ScoresTheFirstLoaderOnly(L.LightningModule):
    """A validation_step that returns early for its second loader, as Lightning lets a step skip a batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 1)])

    def forward(self, x):
        return self.layers[1](self.layers[0](x))

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_input(self, batch):
        return batch[0]

    def pipeline_loss(self, out, batch):
        return nn.functional.mse_loss(out.squeeze(-1), batch[1])

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        if dataloader_idx == 1:
            return None
        self.log("vl", self.pipeline_loss(self(self.pipeline_input(batch)), batch))


@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.multiproc)], ids=["one process", "2 ranks"])
def test_an_evaluation_step_that_skips_a_loader_runs_as_on_one_device(devices):
    """A validation_step that never called self(...) for a batch (it skips a loader) raised "never called
    self(...)", in one process and on every rank (an evaluation audit); Lightning lets a step skip a batch."""
    g = torch.Generator().manual_seed(0)
    loaders = [DataLoader(TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, generator=g)), batch_size=4)
               for _ in range(2)]  # fmt: skip

    def validate(strategy, devices=1):
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                            enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        return trainer.validate(_ScoresTheFirstLoaderOnly(), dataloaders=loaders, verbose=False)

    one = validate("auto")
    pipeline = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", start_method="forkserver")
    assert validate(pipeline, devices) == one
    assert list(one[0]) == ["vl/dataloader_idx_0"] and one[1] == {}
