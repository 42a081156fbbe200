"""GradientAccumulation: N micro-batches equal one batch of N x size, on one device, DDP and the pipeline.

The equivalence runs use a tiny GPT with SGD (fp32, dropout 0) on a token dataset whose targets are
partly masked with -1, so micro-batches hold different numbers of tokens, and whose epoch is not a
multiple of N, so the last window is partial. Each trained model is compared with a reference
computed by hand in this process on the same micro-batches:

- ``tokens``: per window, one backward of the cross-entropy of the concatenated window (literally one
  batch of N x size, all replicas' micro-batches included);
- ``mean``: per window, one backward of the mean of the micro-batch mean losses (the same as one big
  batch when token counts are equal; here they are not, which is what tells the two modes apart).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lit_efficient import GradientAccumulation, PACIStrategy
from lit_efficient.models import GPT
from tests.support.multiproc import SpawnedDDP

VOCAB, BLOCK, BATCH, N, LR = 32, 8, 2, 3, 0.5
MICRO_BATCHES = 7  # per replica and epoch: windows of 3, 3 and a partial 1


class SGDGPT(GPT):
    """The example GPT with plain SGD: Adam would hide a wrong gradient scale."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _model() -> SGDGPT:
    L.seed_everything(0)
    return SGDGPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=16, max_steps=10)


def _dataset(num_samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (num_samples, BLOCK), generator=g)
    y = torch.randint(0, VOCAB, (num_samples, BLOCK), generator=g)
    for i in range(num_samples):
        y[i, : (3 * i) % BLOCK] = -1  # 1 to 8 counted targets per sample: micro-batches of 4 to 13 tokens
    return TensorDataset(x, y)


class _Shards(L.LightningDataModule):
    """Replica r reads samples r, r + 2, ... in order (Lightning's own distributed sampler would shuffle)."""

    def __init__(self, ds: TensorDataset) -> None:
        super().__init__()
        self.ds = ds

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(self.ds, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(self.ds, batch_size=BATCH, sampler=sampler)


def _trainer(strategy="auto", devices: int = 1, **kw) -> L.Trainer:
    args = dict(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    args.update(kw)
    return L.Trainer(**args)


def _windows(ds: TensorDataset, replicas: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The micro-batches of every optimizer step, all replicas together (replica r reads samples r,
    r + replicas, ...)."""
    per_replica = []
    for r in range(replicas):
        idx = list(range(r, len(ds), replicas))
        per_replica.append([ds[idx[k : k + BATCH]] for k in range(0, len(idx), BATCH)])
    count = len(per_replica[0])
    return [[mb for rep in per_replica for mb in rep[s : s + N]] for s in range(0, count, N)]


def _reference(model: GPT, windows: Sequence[Sequence[tuple]], normalize: str, naive: bool = False) -> GPT:
    """Train a copy of ``model`` on ``windows`` by hand. ``naive``: Lightning's own arithmetic instead
    (every micro-batch loss divided by N, also in a partial window): must differ, or the test is blind."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for window in windows:
        opt.zero_grad()
        if naive:
            loss = sum(model.pipeline_loss(model(x), (x, y))[0] for x, y in window) / N
        elif normalize == "tokens":
            x, y = torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window])
            loss = model.pipeline_loss(model(x), (x, y))[0]  # one batch of the whole window
        else:
            loss = sum(model.pipeline_loss(model(x), (x, y))[0] for x, y in window) / len(window)
        loss.backward()
        opt.step()
    return model


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


# ---------------------------------------------------------------- equivalence: one device (in-process)


@pytest.mark.parametrize("normalize", ["mean", "tokens"])
def test_single_device_equals_one_big_batch(normalize):
    ds = _dataset(BATCH * MICRO_BATCHES)
    model = _model()
    start = copy.deepcopy(model)
    trainer = _trainer(callbacks=[GradientAccumulation(N, normalize=normalize)])
    trainer.fit(model, DataLoader(ds, batch_size=BATCH))
    assert trainer.fit_loop.epoch_loop.automatic_optimization.output_result_cls is ClosureResult  # restored
    windows = _windows(ds, replicas=1)
    assert [len(w) for w in windows] == [3, 3, 1]
    want = _reference(start, windows, normalize)
    assert _max_diff(want, start) > 1e-2, "training must move the weights for the comparison to mean anything"
    assert _max_diff(model, want) <= 1e-5
    # Lightning alone (mean of micro-batch means, the partial window divided by N) is measurably different.
    assert _max_diff(model, _reference(start, windows, normalize, naive=True)) > 1e-4
    other = "mean" if normalize == "tokens" else "tokens"
    assert _max_diff(model, _reference(start, windows, other)) > 1e-4


# ---------------------------------------------------------------- equivalence: spawned DDP and pipeline


@pytest.mark.multiproc
@pytest.mark.parametrize("normalize", ["mean", "tokens"])
def test_ddp_equals_one_big_batch_over_replicas(normalize):
    ds = _dataset(2 * BATCH * MICRO_BATCHES)
    model = _model()
    start = copy.deepcopy(model)
    strategy = SpawnedDDP()
    callbacks = [GradientAccumulation(N, normalize=normalize)]
    trainer = _trainer(strategy, 2, callbacks=callbacks)
    trainer.fit(model, datamodule=_Shards(ds))
    windows = _windows(ds, replicas=2)
    assert [len(w) for w in windows] == [6, 6, 2]
    assert _max_diff(model, _reference(start, windows, normalize)) <= 1e-5


@pytest.mark.multiproc
@pytest.mark.parametrize("normalize", ["mean", "tokens"])
def test_flush_pipeline_equals_one_big_batch(normalize):
    # The strategy normalizes inside the stages; it reads N and the mode from the callback.
    ds = _dataset(BATCH * MICRO_BATCHES)
    model = _model()
    start = copy.deepcopy(model)
    strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", start_method="forkserver")
    # Every stage of the one pipeline reads the same stream: no distributed sampler.
    callbacks = [GradientAccumulation(N, normalize=normalize)]
    trainer = _trainer(strategy, 2, callbacks=callbacks)
    trainer.fit(model, DataLoader(ds, batch_size=BATCH))
    assert _max_diff(model, _reference(start, _windows(ds, replicas=1), normalize)) <= 1e-5


# ---------------------------------------------------------------- configuration (in-process, quick)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(steps=0), "steps=0 must be an integer >= 1"),
        (dict(steps=2.5), "steps=2.5 must be an integer >= 1"),
        (dict(steps=True), "steps=True must be an integer >= 1"),
        (dict(steps={}), "give N"),
        (dict(steps={-1: 2}), "epochs [-1] must be integers >= 0"),
        (dict(steps={0: 2, 3: 0}), "{3: 0} must map epochs to integers >= 1"),
        (dict(normalize="sum"), "normalize='sum' is not one of 'mean', 'tokens'"),
    ],
)
def test_arguments_are_checked_with_value_and_fix(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        GradientAccumulation(**kwargs)
    assert fragment in str(err.value)


def test_schedule_query_is_pure():
    cb = GradientAccumulation({2: 4, 5: 8})
    assert [cb.get_accumulate_grad_batches(e) for e in (0, 1, 2, 4, 5, 99)] == [1, 1, 4, 4, 8, 8]
    assert cb.max_accumulate_grad_batches == 8
    assert GradientAccumulation(3).get_accumulate_grad_batches(7) == 3


def test_sets_trainer_value_and_trainer_spelling_agrees():
    model = _model()
    trainer = _trainer(callbacks=[GradientAccumulation({0: 2, 3: 5})])
    trainer.callbacks[0].setup(trainer, model, "fit")
    assert trainer.accumulate_grad_batches == 2
    trainer.callbacks[0]._apply(trainer, 3)
    assert trainer.accumulate_grad_batches == 5
    same = _trainer(accumulate_grad_batches=3, callbacks=[GradientAccumulation(3)])
    same.callbacks[0].setup(same, model, "fit")  # the equivalent spelling is accepted
    assert same.accumulate_grad_batches == 3


def test_conflicting_trainer_value_is_an_error():
    trainer = _trainer(accumulate_grad_batches=4, callbacks=[GradientAccumulation(2)])
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=4\) and GradientAccumulation\(steps=2\)") as err:
        trainer.fit(_model(), DataLoader(_dataset(4), batch_size=BATCH))
    assert "Set N in one place" in str(err.value)
    both = _trainer(callbacks=[GradientAccumulation(2), GradientAccumulationScheduler({0: 2})])
    with pytest.raises(ValueError, match="GradientAccumulationScheduler both set"):
        both.fit(_model(), DataLoader(_dataset(4), batch_size=BATCH))


def test_schedule_changes_n_at_epoch_starts():
    # 7 micro-batches per epoch: N=2 -> 4 steps (last window partial), then N=3 -> 3 steps.
    trainer = _trainer(max_epochs=2, callbacks=[GradientAccumulation({0: 2, 1: 3})])
    trainer.fit(_model(), DataLoader(_dataset(BATCH * MICRO_BATCHES), batch_size=BATCH))
    assert trainer.global_step == 7 and trainer.accumulate_grad_batches == 3


class _BatchNormModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def test_batchnorm_warns_once():
    cb = GradientAccumulation(4)
    trainer = _trainer(callbacks=[cb])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cb.setup(trainer, _BatchNormModel(), "fit")
        cb.setup(trainer, _BatchNormModel(), "fit")
    messages = [str(w.message) for w in caught if "BatchNorm" in str(w.message)]
    assert len(messages) == 1 and "net.1" in messages[0] and "GroupNorm or LayerNorm" in messages[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GradientAccumulation(1).setup(_trainer(), _BatchNormModel(), "fit")  # no accumulation, no warning
    assert not [w for w in caught if "BatchNorm" in str(w.message)]


class _ManualGPT(SGDGPT):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False


def test_manual_optimization_is_refused():
    L.seed_everything(0)
    model = _ManualGPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=1, n_head=2, n_embd=8)
    with pytest.raises(RuntimeError, match="automatic_optimization=False \\(strategy SingleDeviceStrategy\\)"):
        _trainer(callbacks=[GradientAccumulation(2)]).fit(model, DataLoader(_dataset(4), batch_size=BATCH))


class _NoItemsGPT(SGDGPT):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx)["loss"]


def test_tokens_mode_needs_num_items():
    L.seed_everything(0)
    model = _NoItemsGPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=1, n_head=2, n_embd=8)
    with pytest.raises(ValueError, match="needs training_step to return .*it returned Tensor"):
        _trainer(callbacks=[GradientAccumulation(2, "tokens")]).fit(model, DataLoader(_dataset(4), batch_size=BATCH))


def test_state_dict_round_trip():
    cb = GradientAccumulation({0: 2, 4: 8}, normalize="tokens")
    state = cb.state_dict()
    assert state == {"steps": {0: 2, 4: 8}, "normalize": "tokens"}
    same = GradientAccumulation({0: 2, 4: 8}, normalize="tokens")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # identical configuration: silent
        same.load_state_dict(state)
    assert same.state_dict() == state
    other = GradientAccumulation(3)
    with pytest.warns(UserWarning, match="continues with steps=3"):
        other.load_state_dict(state)
    assert other.state_dict() == {"steps": 3, "normalize": "mean"}  # this run's arguments win


@pytest.mark.parametrize("strategy", ["auto", "pipeline", pytest.param("processes", marks=pytest.mark.multiproc)])
def test_a_schedule_resumed_mid_epoch_uses_that_epochs_n(tmp_path, strategy):
    """{0: 1, 1: 2}, resumed from step 10 (two windows into epoch 1): setup saw epoch 0 (Lightning restores the loops
    after it) and Lightning skips on_train_epoch_start for the epoch it restarts in, so the rest of epoch 1 ran with
    N=1. One device, and the pipeline in one process; the resumed run equals the uninterrupted one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.support.gpt_runs import gpt_model, gpt_trainer, max_diff, text_data

    def fit(ckpt_path=None, **kw):
        model = gpt_model()
        place = "auto" if strategy == "auto" else PACIStrategy(pipeline_stages=2, schedule="1f1b_flush",
                                                               start_method="forkserver")  # fmt: skip
        devices = 2 if strategy == "processes" else 1
        callbacks = [GradientAccumulation(steps={0: 1, 1: 2}), *kw.pop("callbacks", [])]
        trainer = gpt_trainer(place, devices, 12, tmp_path, accumulate_grad_batches=1, limit_train_batches=8,
                              max_epochs=-1, callbacks=callbacks, **kw)  # fmt: skip
        trainer.fit(model, datamodule=text_data(), ckpt_path=ckpt_path)
        return model, trainer

    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, filename="{step}", save_top_k=-1)
    whole, trainer = fit(callbacks=[save], enable_checkpointing=True)  # epoch 0: 8 steps of 1; epoch 1: 4 of 2
    if strategy != "processes":  # spawned ranks: the launching process's Trainer keeps no loop state
        assert trainer.current_epoch == 2 and trainer.global_step == 12
    resumed, _ = fit(str(tmp_path / "ckpt" / "step=10.ckpt"))
    assert max_diff(resumed, whole) == 0.0


def test_a_schedule_that_changes_n_under_paci_rebuilds_the_staleness_correction():
    """PACI's default correction shrinks a young window's square by the share of the window accumulated, counted in
    N: built at setup with epoch 0's N, it kept counting in it after {0: 2, 1: 4} moved to N=4."""
    from lightning.pytorch.callbacks import Callback

    from tests.support.gpt_runs import gpt_model, gpt_trainer, text_data

    class Seen(Callback):
        def __init__(self) -> None:
            self.windows: dict[int, set] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            corrections = [h.stage.correction for h in trainer.strategy.hosted if h.stage.correction is not None]
            self.windows.setdefault(trainer.current_epoch, set()).update(c.accumulate for c in corrections)

    seen = Seen()
    strategy = PACIStrategy(pipeline_stages=2, schedule="paci", sync_start_steps=0)
    trainer = gpt_trainer(strategy, 1, 6, None, accumulate_grad_batches=1, limit_train_batches=8, max_epochs=2,
                          callbacks=[GradientAccumulation(steps={0: 2, 1: 4}), seen])  # fmt: skip
    trainer.fit(gpt_model(), datamodule=text_data())
    assert seen.windows == {0: {2}, 1: {4}}


@pytest.mark.parametrize("normalize", ["mean", "tokens"])
def test_one_device_resumed_inside_a_window_keeps_the_windows_micro_batches(tmp_path, normalize):
    """A checkpoint written inside a window (a validation every 6 micro-batches with N=4: ModelCheckpoint saves 2
    micro-batches into the second window) lost those micro-batches on one device: Lightning's checkpoint holds no
    partial gradients, the resumed step averaged the window's other two, and the one warning said they were kept
    (an audit). The callback keeps them: the resumed run equals the uninterrupted one bit for bit; with another N
    they are dropped and said."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.support.gpt_runs import gpt_model, gpt_trainer, max_diff, text_data

    def fit(steps=4, ckpt_path=None, callbacks=(), normalize=normalize, **kw):
        model = gpt_model()
        callbacks = [GradientAccumulation(steps, normalize), *callbacks]
        trainer = gpt_trainer("auto", 1, 5, tmp_path, accumulate_grad_batches=1, val_check_interval=6,
                              limit_val_batches=2, callbacks=callbacks, **kw)  # fmt: skip
        trainer.fit(model, datamodule=text_data(), ckpt_path=ckpt_path)
        return model

    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", save_top_k=-1)
    whole = fit(callbacks=[save], enable_checkpointing=True)
    inside = tmp_path / "ckpt" / "step=1.ckpt"  # batches 4 and 5 of the window [4, 8) done
    window = torch.load(inside)["callbacks"]["GradientAccumulation"]["window"]
    assert window["micro_batches"] == 2 and {g.device.type for g in window["grads"].values()} == {"cpu"}
    assert max_diff(fit(ckpt_path=str(inside)), whole) == 0.0
    # Another N, or another normalization (a window of item-weighted sums is no window of 1/N means): dropped, said.
    other, said = ((2, "mean"), "4 micro-batches per step with normalize='mean', and this run 2 with normalize='mean'")
    if normalize == "tokens":
        other, said = ((4, "mean"), "with normalize='tokens', and this run 4 with normalize='mean'")
    with pytest.warns(UserWarning, match=rf"written 2 micro-batch\(es\) into a window; it accumulated .*{said}, so "
                      r"those micro-batches are dropped"):  # fmt: skip
        fit(steps=other[0], normalize=other[1], ckpt_path=str(inside))


class _Classifier(L.LightningModule):
    """A user's classifier whose loss is torch's mean cross-entropy: NaN for a micro-batch with every label -100."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 5)])

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_input(self, batch):
        return batch[0]

    def pipeline_loss(self, out, batch):
        y = batch[1]
        return nn.functional.cross_entropy(out, y, ignore_index=-100), (y != -100).sum()

    def training_step(self, batch, batch_idx):
        loss, items = self.pipeline_loss(self.layers[1](self.layers[0](batch[0])), batch)
        return {"loss": loss, "num_items": items}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_micro_batches_of_no_items_count_for_nothing_under_tokens_as_on_one_device():
    """normalize="tokens": a micro-batch whose labels are all -100 has a NaN mean loss and, on one device, a zero
    gradient; the pipeline raised on it (or skipped its whole window), and a window of such micro-batches only
    divided 0 by 0 into NaN gradients (a numerics audit). Flush now equals one device."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 8, generator=g), torch.randint(0, 5, (48,), generator=g)
    for b in (2, 3, 5):  # the whole second window (N=2), and one micro-batch of the third
        y[b * 4 : (b + 1) * 4] = -100

    def fit(strategy):
        model = _Classifier()
        _trainer(strategy, max_steps=6, callbacks=[GradientAccumulation(2, "tokens")]).fit(
            model, DataLoader(TensorDataset(x, y), batch_size=4)
        )
        return model

    one = fit("auto")
    flush = fit(PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"))
    assert all(torch.isfinite(p).all() for p in one.parameters())
    assert _max_diff(flush, one) < 1e-6
    paci = fit(PACIStrategy(pipeline_stages=2))  # the default schedule: trains on, finite (the re-read)
    assert all(torch.isfinite(p).all() for p in paci.parameters()) and _max_diff(paci, one) > 0


def test_a_bf16_models_token_count_is_not_rounded_on_one_device():
    """normalize="tokens" on one device divided a bf16 model's gradients by the window's token count cast to bf16
    (507 as 508: a scale off by up to 2^-9, 2.4e-4 in the weights after one SGD step), and scaled the loss by the
    count cast likewise, where the pipeline divides by the exact count (a precision audit). Flush = one device."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (32, 17), generator=g)
    y = x[:, 1:].clone()
    y[0, :5] = -1  # GPT's ignored label: 507 counted tokens in the window of 4 x 8 x 16
    data = lambda: DataLoader(TensorDataset(x[:, :-1].contiguous(), y), batch_size=8)  # noqa: E731

    def fit(strategy):
        torch.manual_seed(0)
        model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32).to(torch.bfloat16)
        model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=1.0)  # the scale reaches w
        _trainer(strategy, max_steps=1, callbacks=[GradientAccumulation(4, "tokens")]).fit(model, data())
        return model

    one, flush = fit("auto"), fit(PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"))
    torch.manual_seed(0)
    start = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32).to(torch.bfloat16)
    assert _max_diff(one, start) > 1e-3  # it stepped
    assert _max_diff(flush, one) == 0.0
