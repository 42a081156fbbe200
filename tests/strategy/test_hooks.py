"""Which Lightning hooks PACIStrategy never calls, and the one warning that says so (pure, no processes)."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LambdaCallback, LearningRateMonitor

from lit_efficient import GradientAccumulation
from lit_efficient.models import GPT
from lit_efficient.strategy.module_hooks import (
    epoch_ends_where_the_steps_ran,
    training_step_logs,
    uncalled_hooks,
    undo_epoch_ends,
    warn_uncalled_hooks,
)


class _GradNormLogger(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        pass


class _Custom(GPT):
    def training_step(self, batch, batch_idx):
        loss, _ = self.pipeline_loss(self(batch[0]), batch)
        self.log("train_loss", loss)
        self.log("train_acc", loss * 0)
        self.log_dict({"a": loss})
        return loss

    def on_after_backward(self) -> None:
        pass


def test_gpt_and_the_package_callbacks_lose_nothing():
    callbacks = [GradientAccumulation(steps=2), LearningRateMonitor()]
    assert uncalled_hooks(GPT(n_layer=1), callbacks) == []
    assert training_step_logs(GPT(n_layer=1)) == []  # it logs train_loss, which the strategy logs itself


def test_overrides_that_never_run_are_named():
    module = _Custom(n_layer=1)
    assert uncalled_hooks(module, [_GradNormLogger()]) == [
        "_Custom.on_after_backward",
        "_GradNormLogger.on_before_optimizer_step",
    ]
    assert training_step_logs(module) == ["train_acc", "log_dict(...)"]
    with pytest.warns(UserWarning, match=r"on_after_backward.*train_acc, log_dict\(\.\.\.\).*pipeline_loss"):
        warn_uncalled_hooks(module, [_GradNormLogger()])
    # A gradient-norm logger's replacement is named where on_before_optimizer_step is overridden.
    with pytest.warns(UserWarning, match=r"PipelineMonitor\(grad_norm=True\) logs the gradient norm"):
        warn_uncalled_hooks(module, [_GradNormLogger()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_uncalled_hooks(module, [])
    assert caught and not [w for w in caught if "grad_norm=True" in str(w.message)]


def test_a_lambda_callbacks_hooks_that_never_run_are_named():
    """LambdaCallback sets the hooks it is given on the instance: its class overrides none, and a gradient-norm
    logger given as ``on_before_optimizer_step`` never ran, unannounced. Those it runs are not named."""
    logger = LambdaCallback(on_before_optimizer_step=lambda *args: None, on_train_batch_end=lambda *args: None)
    assert uncalled_hooks(GPT(n_layer=1), [logger]) == ["LambdaCallback.on_before_optimizer_step"]


class _TrainLossPerEpoch(GPT):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss


def test_a_train_loss_logged_per_epoch_in_training_step_is_named_with_the_fix():
    """The strategy logs train_loss itself, per step: a training_step logging it per epoch (Lightning's docs'
    pattern) lost its ``train_loss_epoch`` with no word, and a ModelCheckpoint monitoring train_loss scored the last
    micro-batch's loss instead of the epoch's mean."""
    assert training_step_logs(_TrainLossPerEpoch(n_layer=1)) == [
        "train_loss per epoch (the strategy logs it per step; log it from pipeline_loss instead)"
    ]
    with pytest.warns(UserWarning, match=r"train_loss per epoch .*log it from pipeline_loss instead"):
        warn_uncalled_hooks(_TrainLossPerEpoch(n_layer=1), [])


class _AggregatesAtEpochEnds(GPT):
    """Lightning's documented epoch-end pattern, unguarded: what the steps collected, stacked."""

    def on_train_epoch_end(self) -> None:
        torch.stack(self.losses)

    def on_validation_epoch_end(self) -> None:
        torch.stack(self.losses)


def test_a_rank_without_the_last_stage_skips_evaluation_epoch_ends_and_explains_a_training_one(caplog):
    module = _AggregatesAtEpochEnds(n_layer=1)
    module.losses = []
    shared = []
    epoch_ends_where_the_steps_ran(module, False, "stage 0 (rank 1)", lambda: shared.append(True))
    module.on_validation_epoch_end()  # not called: the evaluation steps never ran on this rank
    explained = (
        r"on_train_epoch_end raised on stage 0 \(rank 1\), which hosts no last stage .*stack expects a non-empty "
        r"TensorList.*if self.trainer.strategy.is_last_stage:"
    )
    with pytest.raises(RuntimeError, match=explained):
        module.on_train_epoch_end()
    undo_epoch_ends(module)
    with pytest.raises(RuntimeError, match="stack expects a non-empty TensorList"):
        module.on_validation_epoch_end()  # its own hook again
    # On the last stage's ranks the hooks run as they are, and the metrics are shared after on_train_epoch_end.
    module.losses = [torch.ones(())]
    with caplog.at_level("INFO"):
        epoch_ends_where_the_steps_ran(module, True, "stage 1 (rank 0)", lambda: shared.append(True))
    assert "_AggregatesAtEpochEnds.on_validation_epoch_end run only on the ranks hosting the last stage" in caplog.text
    module.on_validation_epoch_end()
    module.on_train_epoch_end()
    assert shared == [True]
    undo_epoch_ends(module)
    assert "on_train_epoch_end" not in module.__dict__


class _SamplesAtEpochEnd(GPT):
    def on_train_epoch_end(self) -> None:
        self.generate(torch.zeros(1, 1, dtype=torch.long), 2)


def test_a_layer_of_another_stage_called_at_an_epoch_end_says_where_the_whole_model_is():
    """Sampling at an epoch's end on processes: stage 0's rank was told that pipeline_loss collected nothing (the
    wrapper's guess for any error there) and stage 1's that evaluation steps must call self(...), neither the cause.
    Both now get the layer's own message: where the whole model is, and where to sample."""
    from lit_efficient.runtime.split import LayerNotHereError, LayerOnOtherStage

    module = _SamplesAtEpochEnd(n_layer=1, n_head=2, n_embd=8, block_size=4, vocab_size=16)
    module.blocks[0] = LayerOnOtherStage(1, 1, module.blocks[0])  # stage 0's rank: the block lives on stage 1
    epoch_ends_where_the_steps_ran(module, False, "stage 0 (rank 1)", None)
    said = r"pipeline layer 1 lives on stage 1, not on this rank.*after fit under `if trainer.is_global_zero:`"
    with pytest.raises(LayerNotHereError, match=said):
        module.on_train_epoch_end()
    undo_epoch_ends(module)


class _SamplesInPredict(GPT):
    def predict_step(self, batch, batch_idx):
        return self.generate(self.pipeline_input(batch)[:, :5], 1, temperature=0)


@pytest.mark.usefixtures("one_thread")
def test_a_prompt_cut_short_in_an_evaluation_step_is_refused_by_its_shapes():
    """A predict_step sampling after the first 5 tokens of each row got the token after all 8 (the pipeline's
    answer to any self(...) is its output for pipeline_input(batch)), silently: the first call's shapes are now
    checked. Through the Trainer in one process, with the shapes named."""
    from torch.utils.data import DataLoader, TensorDataset

    from lit_efficient import PACIStrategy

    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.roll(-1, 1)), batch_size=2)
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = _SamplesInPredict(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64)
    said = r"_SamplesInPredict.predict_step called self\(...\) with tensors of shapes \(2, 5\), but the pipeline ran "
    said += r"self.pipeline_input\(batch\), of shapes \(2, 8\).*The whole model"
    with pytest.raises(RuntimeError, match=said):
        L.Trainer(strategy=PACIStrategy(pipeline_stages=2), **kw).predict(model, loader)


def test_the_first_forward_check_takes_fewer_tensors_in_any_order_and_refuses_more_or_other_shapes():
    """Each tensor of the call needs one of pipeline_input's of its shape: a bare input_ids of an (input_ids,
    attention_mask) input is taken (a Hugging Face module's forward accepts it), keyword arguments in another order,
    a dict, a dataclass; another shape or an extra tensor (one the pipeline never saw) is refused."""
    import dataclasses

    from lit_efficient.strategy.evaluation import _check_shapes, shapes_of

    @dataclasses.dataclass
    class Inputs:
        ids: torch.Tensor
        mask: torch.Tensor

    ids, mask, pixels = torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8), torch.ones(2, 3, 4, 4)
    expected = shapes_of({"input_ids": ids, "attention_mask": mask, "pixel_values": pixels})
    assert expected == shapes_of(Inputs(ids, mask)) + [(2, 3, 4, 4)]
    taken = [
        (((ids, mask, pixels),), {}), ((ids,), {}), ((), {"pixel_values": pixels, "input_ids": ids}),
        ((ids,), {"mask": None}), (({"pixel_values": pixels, "input_ids": ids},), {}), ((Inputs(ids, mask),), {}),
        ((ids.float(), mask.bool()), {}),
    ]  # fmt: skip
    for given in taken:
        _check_shapes(GPT, "validation_step", given, expected)
    _check_shapes(GPT, "validation_step", ((ids[:, :3],), {}), [])  # nothing to compare with
    refused = [((ids[:, :5],), {}), ((ids, mask, mask), {}), ((mask.T,), {}), ((ids,), {"extra": pixels[:, 0]})]
    for given in refused:
        with pytest.raises(RuntimeError, match=r"called self\(...\) with tensors of shapes"):
            _check_shapes(GPT, "validation_step", given, expected)


class _CutsItsBatch(GPT):
    def predict_step(self, batch, batch_idx):
        batch[0] = batch[0][:, :5]  # the batch changed before the call: still not what the pipeline ran
        return self(self.pipeline_input(batch))


class _TakesItsInput(GPT):
    def pipeline_input(self, batch):
        return batch["x"]

    def predict_step(self, batch, batch_idx):
        return self(batch.pop("x"))  # the input taken out of the batch: what the pipeline ran


@pytest.mark.usefixtures("one_thread")
def test_the_first_forward_check_reads_the_batch_before_the_step_changes_it():
    """The check computed pipeline_input(batch) at the step's first call: a batch cut in place before it passed, and
    an input popped out of the batch raised a bare KeyError. Taken before the step runs."""
    from torch.utils.data import DataLoader, TensorDataset

    from lit_efficient import PACIStrategy

    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    sizes = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64)
    pairs, rows = DataLoader(TensorDataset(x, x), batch_size=2), DataLoader([{"x": row} for row in x], batch_size=2)
    with pytest.raises(RuntimeError, match=r"tensors of shapes \(2, 5\), but the pipeline ran"):
        L.Trainer(strategy=PACIStrategy(pipeline_stages=2), **kw).predict(_CutsItsBatch(**sizes), pairs)
    out = L.Trainer(strategy=PACIStrategy(pipeline_stages=2), **kw).predict(_TakesItsInput(**sizes), rows)
    assert [tuple(o.shape) for o in out] == [(2, 8, 64), (2, 8, 64)]


class _RandomlyMasked(GPT):
    """A random masking of the input tokens, drawn from the process's streams, in training and evaluation alike."""

    def pipeline_input(self, batch):
        x = batch[0]
        return x.masked_fill(torch.rand(x.shape) < 0.25, 0)

    def validation_step(self, batch, batch_idx):
        loss, _ = self.pipeline_loss(self(self.pipeline_input(batch)), batch)
        self.log("val_loss", loss)


@pytest.mark.usefixtures("one_thread")
def test_a_random_pipeline_input_validates_in_one_process_as_on_one_device():
    """Stage 0 computed pipeline_input, the shape check computed it again and the validation step called it: a random
    masking was drawn three times per batch where one device draws it once, so the losses and every later draw (the
    next epoch's shuffle) differed. Stage 0 and the check now draw with the streams put back: the step's own call
    draws the masking one device draws, once."""
    from torch.utils.data import DataLoader, TensorDataset

    from lit_efficient import PACIStrategy

    x = torch.randint(1, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.roll(-1, 1)), batch_size=2)
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    results, after = {}, {}
    for name, strategy in (("one device", "auto"), ("pipeline", PACIStrategy(pipeline_stages=2))):
        torch.manual_seed(1)
        model = _RandomlyMasked(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64)
        results[name] = L.Trainer(strategy=strategy, **kw).validate(model, loader, verbose=False)
        after[name] = torch.rand(3)
    assert results["pipeline"] == results["one device"]
    assert torch.equal(after["pipeline"], after["one device"])


def test_a_throughput_monitor_multiplies_by_the_replicas_not_the_world_size():
    """Lightning's ThroughputMonitor makes a rank's rates job-wide by the world size; a pipeline's S stages read the
    same samples, so on 2 stages of one replica ``train/samples_per_sec`` was twice ``train/device/samples_per_sec``
    (a user audit: 1498 against 749). The strategy's setup sets its factor to the replicas."""
    from types import SimpleNamespace

    from lightning.fabric.utilities.throughput import Throughput
    from lightning.pytorch.callbacks import ThroughputMonitor

    from lit_efficient.strategy.trainer_glue import throughput_counts_replicas

    monitor = ThroughputMonitor(batch_size_fn=len)
    monitor._throughputs = {s: Throughput(world_size=4, window_size=2) for s in ("train", "validate")}  # 2 x 2
    throughput_counts_replicas(SimpleNamespace(callbacks=[monitor]), replicas=2)
    for throughput in monitor._throughputs.values():
        throughput.update(time=1.0, batches=1, samples=8)
        throughput.update(time=2.0, batches=2, samples=16)
        rates = throughput.compute()
        assert rates["device/samples_per_sec"] == 8.0 and rates["samples_per_sec"] == 16.0, rates


class _TwoForwards(GPT):
    """A validation step calling self(...) twice: on the same input again, or on a test-time augmentation."""

    augment = False

    def validation_step(self, batch, batch_idx):
        x = self.pipeline_input(batch)
        logits = self(x)
        again = self(x.flip(1) if self.augment else x.clone())
        loss, _ = self.pipeline_loss((logits + again) / 2, batch)
        self.log("val_loss", loss)
        return loss


@pytest.mark.usefixtures("one_thread")
def test_a_second_forward_of_another_input_in_an_evaluation_step_is_refused():
    """The last stage answers self(...) with the pipeline's output for pipeline_input(batch): a test-time
    augmentation's forward got that same output, silently (its metric was the unaugmented one's)."""
    from torch.utils.data import DataLoader, TensorDataset

    from lit_efficient import PACIStrategy

    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.roll(-1, 1)), batch_size=2)
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    results = {}
    for strategy in ("auto", PACIStrategy(pipeline_stages=2)):
        L.seed_everything(0)
        model = _TwoForwards(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64)
        results[str(strategy)] = L.Trainer(strategy=strategy, **kw).validate(model, loader, verbose=False)
    assert results["auto"] == results[str(strategy)]  # the same input twice: one device's result
    model = _TwoForwards(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64)
    model.augment = True
    with pytest.raises(RuntimeError, match=r"_TwoForwards.validation_step called self\(...\) a second time with other"):
        L.Trainer(strategy=PACIStrategy(pipeline_stages=2), **kw).validate(model, loader, verbose=False)


class _GradientInValidation(GPT):
    """A validation step that needs a gradient (a gradient norm, a saliency map) under torch.enable_grad()."""

    def validation_step(self, batch, batch_idx):
        with torch.enable_grad():
            loss, _ = self.pipeline_loss(self(self.pipeline_input(batch)), batch)
            (grad,) = torch.autograd.grad(loss, self.head.lm_head.weight)
        self.log("grad_norm", grad.norm())


@pytest.mark.usefixtures("one_thread")
def test_an_evaluation_step_needing_a_gradient_is_told_why_there_is_none():
    """The pipeline's output in an evaluation step carries no graph (the stages evaluate forward only): a validation
    step computing a gradient failed with autograd's 'element 0 of tensors does not require grad'."""
    from torch.utils.data import DataLoader, TensorDataset

    from lit_efficient import PACIStrategy

    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.roll(-1, 1)), batch_size=2)
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = _GradientInValidation(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64)
    assert L.Trainer(inference_mode=False, **kw).validate(model, loader, verbose=False)[0]["grad_norm"] > 0
    with pytest.raises(RuntimeError, match=r"validation_step called self\(...\) with gradients enabled.*after fit"):
        strategy = PACIStrategy(pipeline_stages=2)
        L.Trainer(strategy=strategy, inference_mode=False, **kw).validate(model, loader, verbose=False)


def test_the_second_forward_check_takes_equal_values_as_the_same_input():
    """The same input again in another form is not refused: the same tensor holding a NaN, an equal numpy copy, a
    dataclass holding a clone, ids of another integer dtype, a keyword given as None; other values are refused."""
    import dataclasses

    import numpy as np

    from lit_efficient.strategy.evaluation import _same

    @dataclasses.dataclass
    class Inputs:
        ids: torch.Tensor

    x, ids = torch.tensor([[1.0, float("nan")]]), torch.arange(4)
    same = [
        (x, x), (x, x.clone()), (np.arange(4.0), np.arange(4.0)), (Inputs(ids), Inputs(ids.clone())), (ids, ids.int()),
        (((ids,), {}), ((ids,), {"mask": None})), ({"input_ids": ids}, {"input_ids": ids.clone()}),
    ]  # fmt: skip
    for a, b in same:
        assert _same(a, b), (a, b)
    other = [
        (ids, ids.flip(0)), (ids, ids[:3]), (x, x * 2), (np.arange(4), np.arange(1, 5)), (Inputs(ids), Inputs(ids + 1)),
        (((ids,), {}), ((ids,), {"mask": ids})), ((ids,), [ids, ids]), (ids, ids.tolist()),
    ]  # fmt: skip
    for a, b in other:
        assert not _same(a, b), (a, b)


def test_on_train_batch_ends_outputs_off_the_last_stage_say_why_a_key_is_missing():
    """A callback reading ``outputs["loss"]`` on stage 0's rank got a bare ``KeyError: 'loss'``: the outputs there are
    empty, as documented, and now a missing key says why. Through Lightning's own conversion of the step's output."""
    from lightning.pytorch.loops.optimization.manual import ManualResult

    from lit_efficient.strategy.paci import _NoLossHere

    outputs = ManualResult.from_training_step_output(_NoLossHere("stage 0 (rank 1)")).asdict()
    assert outputs == {} and not outputs and outputs.get("loss") is None and "loss" not in outputs
    said = r"outputs\['loss'\] on stage 0 \(rank 1\), which hosts no last stage.*is_last_stage"
    with pytest.raises(KeyError, match=said):
        outputs["loss"]


def test_metrics_are_pointed_once_and_given_back_when_the_module_lets_them_go():
    """The last stage's group for every metric the module holds, once; a metric the module replaced (made anew each
    epoch) gets its own sync function back and is not kept alive; on a rank without the last stage a compute says
    what to guard; a copy of the module (a metric's clone in on_fit_start) and a pickle of it work, which a process
    group in the metric refused ("cannot pickle ProcessGroup"); `give_metrics_back` restores the sync function."""
    import copy
    import pickle

    import torchmetrics

    from lit_efficient.strategy.trainer_glue import LastStageSync, give_metrics_back, point_metrics_at

    class _Group:  # stands for the last stage's process group, which neither copies nor pickles
        def __deepcopy__(self, memo):
            raise TypeError("cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object")

        def __reduce__(self):
            raise TypeError("cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object")

    module = L.LightningModule()
    module.first = torchmetrics.MeanMetric()
    pointed: list[tuple] = []
    group = _Group()
    point_metrics_at(module, group, False, "stage 0 (rank 1)", pointed)
    first = module.first
    assert isinstance(first.dist_sync_fn, LastStageSync) and first.dist_sync_fn.group is group and len(pointed) == 1
    with pytest.raises(RuntimeError, match=r"stage 0 \(rank 1\), which hosts no last stage.*is_last_stage"):
        first.dist_sync_fn(torch.zeros(1))
    assert copy.deepcopy(first).dist_sync_fn is first.dist_sync_fn  # a clone syncs as the original
    assert pickle.loads(pickle.dumps(first)).dist_sync_fn is None  # torchmetrics' own gather
    point_metrics_at(module, group, False, "stage 0 (rank 1)", pointed)
    assert len(pointed) == 1  # pointed once
    module.first = torchmetrics.MeanMetric()  # replaced
    point_metrics_at(module, group, True, "stage 1 (rank 0)", pointed)
    assert first.dist_sync_fn is None and first.process_group is None
    assert [m for m, _ in pointed] == [module.first] and module.first.dist_sync_fn.here is None
    give_metrics_back(pointed)
    assert module.first.dist_sync_fn is None
