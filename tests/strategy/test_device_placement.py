"""GPU readiness without a GPU (issue 25): device placement and host syncs, checked on CPU.

``meta`` tensors under `tests.support.devices.SameDeviceMode` stand for an accelerator's (an op mixing devices
fails as on CUDA); `tests.support.devices.OnDevice` counts the host reads a CUDA tensor would pay for.
"""

from __future__ import annotations

import contextlib
import csv
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lit_efficient import PACIStrategy
from lit_efficient.models import GPT
from lit_efficient.nested import tensors_in
from lit_efficient.replicas import averaging
from lit_efficient.replicas.averaging import ReplicaAverager
from tests.support.devices import OnDevice, SameDeviceMode

# -- LocalSGD / DiLoCo -------------------------------------------------------------------------------


def _meta_module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to("meta")


class _NoOpMean:
    alone = False

    def __call__(self, tensors) -> int:
        return 0


@pytest.mark.parametrize("outer_optimizer", ["average", "nesterov"])
def test_averager_sync_keeps_every_tensor_on_the_parameters_device(monkeypatch, outer_optimizer):
    """A sync of two replicas on the stand-in device: the divergence sums are made there too (CPU
    accumulators `+=` device scalars is an error on CUDA), and reach the host once, for the metric."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a world of one: "nothing to average"
        averager = ReplicaAverager(_meta_module(), None, sync_every=1, outer_optimizer=outer_optimizer)
    # Two replicas whose mean is a no-op: the sync runs its whole arithmetic, communication aside.
    monkeypatch.setattr(averager, "_mean", _NoOpMean())
    seen: list[torch.device] = []

    def relative(diff_sq, avg_sq):
        seen.extend([diff_sq.device, avg_sq.device])
        return 0.0

    monkeypatch.setattr(averaging, "_relative", relative)
    with SameDeviceMode():
        averager.sync()
    assert seen == [torch.device("meta")] * 2
    assert averager.last_divergence == 0.0


def test_divergence_reaches_the_host_in_one_read():
    diff_sq = OnDevice.of(torch.tensor(4.0, dtype=torch.float64))
    avg_sq = OnDevice.of(torch.tensor(16.0, dtype=torch.float64))
    with OnDevice.counting() as counter:
        assert averaging._relative(diff_sq, avg_sq) == 0.5
    assert counter.reads == 1  # the one host sync per sync the metric costs


# -- checkpoints -------------------------------------------------------------------------------------


def _on_device(obj):
    """``obj`` with every tensor an `OnDevice` (a device tensor, as a GPU rank's state holds them)."""
    if isinstance(obj, torch.Tensor):
        return OnDevice.of(obj)
    if isinstance(obj, dict):
        return {k: _on_device(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_device(v) for v in obj)
    return obj


def _pipeline_extras(stage, averager) -> dict:
    """What `PipelineCheckpointing.pipeline_state` hands `rank_share` on a rank mid-window, DiLoCo on."""
    accumulation = stage.accumulation_state()
    accumulation["grads"] = {f"p{i}": g for i, g in enumerate(accumulation["grads"])}  # by name, as there
    return {
        "stage": 0, "replica": 1, "accumulation": accumulation,
        "rng": {"cpu": torch.get_rng_state()}, "averager": averager.state_dict(),
    }  # fmt: skip


def _mid_window_stage_and_averager():
    from lit_efficient.runtime.stage import PipelineStage

    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Linear(4, 2)]
    params = [p for layer in layers for p in layer.parameters()]
    stage = PipelineStage(layers, 0, 2, torch.optim.SGD(params, lr=0.1))
    for p in params:
        p.grad = torch.randn_like(p)  # an unfinished window's accumulated gradients
    stage._window = torch.tensor([2.0, 0.0, -1.0], dtype=torch.float64)
    module = nn.Sequential(*layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        averager = ReplicaAverager(module, None, sync_every=4, outer_optimizer="nesterov")
    for p in params:
        p.data.add_(0.5)
    averager.sync()  # an outer step: anchor and momentum buffers exist
    return stage, averager, module


def test_rank_share_holds_only_host_tensors():
    """The share goes through `gather_object` (pickled to rank 0): a device tensor in it would be
    reopened on rank 0 at the sender's device index. Weights, optimizer state and every extra (an
    unfinished window's gradients and counters, the DiLoCo anchor and momentum) are host copies."""
    from lit_efficient.checkpoint.merge import names_of_groups, rank_share

    stage, averager, module = _mid_window_stage_and_averager()
    optimizer = stage.optimizer
    checkpoint = {
        "state_dict": _on_device(module.state_dict()),
        "optimizer_states": [_on_device(optimizer.state_dict())],
        "lr_schedulers": [],
    }
    extras = _on_device(_pipeline_extras(stage, averager))
    share = rank_share(checkpoint, names_of_groups(module, optimizer), extras, keep_weights=True)
    tensors = list(tensors_in(share))
    assert len(tensors) >= 10  # weights, grads, window, RNG, anchor, momentum
    on_device = [type(t).__name__ for t in tensors if isinstance(t, OnDevice)]
    assert not on_device, f"{len(on_device)} device tensors in the share"
    assert all(t.device.type == "cpu" for t in tensors)


def test_pipeline_state_loads_back_onto_the_ranks_device():
    """A checkpoint is read on the CPU (`load_file`); each rank's accumulated gradients, window counters
    and DiLoCo state go back onto its own device (here the stand-in device, `meta`)."""
    from lit_efficient.runtime.stage import PipelineStage

    stage, averager, _ = _mid_window_stage_and_averager()
    saved_stage = {**stage.accumulation_state(), "grads": [p.grad.clone() for p in stage.parameters()]}
    saved_averager = averager.state_dict()

    layers = [nn.Linear(4, 4, device="meta"), nn.Linear(4, 2, device="meta")]
    params = [p for layer in layers for p in layer.parameters()]
    target = PipelineStage(layers, 0, 2, torch.optim.SGD(params, lr=0.1), device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        meta_averager = ReplicaAverager(nn.Sequential(*layers), None, sync_every=4, outer_optimizer="nesterov")
    with SameDeviceMode():
        target.load_accumulation_state(saved_stage)
        meta_averager.load_state_dict(saved_averager)
    assert target._window.device.type == "meta"
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in params)
    assert all(a.device.type == "meta" for a in meta_averager._anchor)
    buffers = [s["momentum_buffer"] for s in meta_averager._outer.state.values()]
    assert len(buffers) == len(params) and all(b.device.type == "meta" for b in buffers)


# -- balance="profile" -------------------------------------------------------------------------------


def _token_loader(seed: int = 3) -> torch.utils.data.DataLoader:
    # The user's own loader, shuffled by the process's random stream (no generator): the case where
    # whatever draws from that stream before training changes the batches every stage reads.
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (48, 33), generator=g)
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True)


class _Sizes(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.__dict__["_sizes"] = list(trainer.strategy._split.sizes)


def _fit_in_one_process(balance, steps: int = 3):
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=2, balance=balance), max_steps=steps,
        accumulate_grad_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[_Sizes()],
    )  # fmt: skip
    torch.manual_seed(1)  # the stream the loader shuffles with and the stages fork their dropout from
    trainer.fit(model, _token_loader())
    assert trainer.global_step == steps
    return model, model.__dict__["_sizes"]


def test_profile_balance_in_one_process_fits_and_leaves_no_trace():
    """``devices=1``: no process group, so nothing to broadcast the split over; and profiling (a forward
    and backward of every layer on the first batch) must not change what training does afterwards: the
    same run as with the split it chose given explicitly, bit for bit. On S processes only rank 0
    profiles, so a random number it drew (dropout, the loader's shuffle) would part its stream from the
    others': the last stage would read other batches than the first."""
    profiled, sizes = _fit_in_one_process("profile")
    explicit, same = _fit_in_one_process(sizes)
    assert same == sizes
    a, b = profiled.state_dict(), explicit.state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


def test_profile_balance_takes_a_named_tuple_batch_as_training_does():
    """A loader yielding named tuples trains under PACIStrategy; profiling moved the first batch with its own walk,
    which rebuilt a named tuple from one generator argument (TypeError before any layer was timed)."""
    from collections import namedtuple

    Batch = namedtuple("Batch", ["x", "y"])
    tokens = torch.randint(0, 256, (16, 33), generator=torch.Generator().manual_seed(0))
    pairs = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = torch.utils.data.DataLoader(pairs, batch_size=4, collate_fn=lambda items: Batch(
        torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])))  # fmt: skip
    model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=2, balance="profile"), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, loader)
    assert trainer.global_step == 2


def test_profile_layers_restores_buffers_random_streams_and_placement():
    from lit_efficient.runtime.profile import profile_layers

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2)])

        def pipeline_input(self, batch):
            return batch[0]

    torch.manual_seed(0)
    net = Net().train()
    buffers = {k: v.clone() for k, v in net.state_dict().items()}
    batch = (torch.randn(6, 4),)
    rng = torch.get_rng_state()
    result = profile_layers(net, list(net.layers), batch, torch.device("cpu"), contextlib.nullcontext)
    assert len(result.times) == 4
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in net.state_dict().items():
        assert torch.equal(v, buffers[k]), k  # BatchNorm's running statistics and counter untouched
    assert all(p.grad is None for p in net.parameters())


# -- train_loss: one logger row and one host read per optimizer step ----------------------------------

N = 4  # micro-batches per optimizer step


class _LogsAuxLoss(GPT):
    """Also logs its loss from `pipeline_loss` (where the pipeline runs it) per step and per epoch."""

    def pipeline_loss(self, output, batch):
        loss, items = super().pipeline_loss(output, batch)
        if self.trainer.training:
            self.log("aux_loss", loss, on_step=True, on_epoch=True, batch_size=batch[0].shape[0])
        return loss, items


def _csv_rows(log_dir) -> list[dict[str, str]]:
    with open(Path(log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _logged_run(tmp: Path, name: str, strategy, devices: int) -> list[dict[str, str]]:
    from tests.support.gpt_runs import gpt_model as _model
    from tests.support.gpt_runs import gpt_trainer as _trainer
    from tests.support.gpt_runs import text_data as _data

    model = _model()
    model.__class__ = _LogsAuxLoss
    logger = CSVLogger(tmp, name=name, version=0)
    # Two epochs of 8 micro-batches: two optimizer steps each, and the epoch aggregates.
    trainer = _trainer(
        strategy, devices, -1, tmp, max_epochs=2, limit_train_batches=2 * N, accumulate_grad_batches=N,
        logger=logger, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(model, datamodule=_data())
    return _csv_rows(Path(tmp, name, "version_0"))


@pytest.fixture(scope="module")
def one_device_rows(tmp_path_factory) -> list[dict[str, str]]:
    """Plain Lightning on one device with ``accumulate_grad_batches=N``: what the pipeline must write."""
    return _logged_run(tmp_path_factory.mktemp("one"), "one", "auto", 1)


def _column(rows, key) -> list[tuple[int, int, float]]:
    return [(int(r["epoch"]), int(r["step"]), float(r[key])) for r in rows if r.get(key)]


PIPELINES = [
    pytest.param(1, "1f1b_flush", id="one-process-flush"),
    pytest.param(1, "paci", id="one-process-paci"),
    pytest.param(2, "1f1b_flush", id="two-processes-flush", marks=pytest.mark.multiproc),
]


@pytest.mark.parametrize(("devices", "schedule"), PIPELINES)
def test_train_loss_one_logger_row_per_optimizer_step_as_one_device(tmp_path, one_device_rows, devices, schedule):
    """One device with accumulation writes a row per optimizer step (its last micro-batch's loss), not
    per micro-batch; so does the pipeline, for its own train_loss and for what pipeline_loss logs on
    step. The epoch aggregate still averages every micro-batch."""
    strategy = PACIStrategy(pipeline_stages=2, schedule=schedule, start_method="forkserver")
    rows = _logged_run(tmp_path, "piped", strategy, devices)
    for key in ("train_loss", "aux_loss_step", "aux_loss_epoch"):
        expected, got = _column(one_device_rows, key), _column(rows, key)
        assert [(e, s) for e, s, _ in got] == [(e, s) for e, s, _ in expected], key
        # Flush is one device's math up to float reassociation; PACI's first window (nothing stepped
        # yet) is too, its later losses see stale weights on the first stage.
        compared = expected if schedule == "1f1b_flush" else expected[:1] if key != "aux_loss_epoch" else []
        for (_, _, want), (_, _, value) in zip(compared, got, strict=False):
            assert value == pytest.approx(want, rel=1e-5, abs=1e-6), key
    assert [(e, s) for e, s, _ in _column(one_device_rows, "train_loss")] == [(0, 0), (0, 1), (1, 2), (1, 3)]


class _LossOnDevice(Callback):
    """The pipeline's losses as device tensors would be: every host read of them is counted."""

    def on_train_start(self, trainer, pl_module) -> None:
        runtime = trainer.strategy.runtime
        feed = runtime.feed

        def feed_on_device(batch, index=None):
            loss = feed(batch, index)
            return None if loss is None else OnDevice.of(loss)

        runtime.feed = feed_on_device


def test_train_loss_reaches_the_host_once_per_optimizer_step(tmp_path):
    """Lightning converts progress-bar metrics with ``.item()`` after every batch (stale values too): a
    device loss logged with ``prog_bar=True`` per micro-batch costs a host sync per micro-batch on the
    last stage, which sets the pipeline's pace. One copy per optimizer step, whatever reads it after."""
    from tests.support.gpt_runs import gpt_model as _model
    from tests.support.gpt_runs import gpt_trainer as _trainer
    from tests.support.gpt_runs import text_data as _data

    steps = 3
    strategy = PACIStrategy(pipeline_stages=2, schedule="paci")
    trainer = _trainer(
        strategy, 1, steps, tmp_path, logger=CSVLogger(tmp_path, name="sync"), log_every_n_steps=1,
        enable_progress_bar=True, callbacks=[_LossOnDevice()],
    )  # fmt: skip
    with OnDevice.counting() as counter:
        trainer.fit(_model(), datamodule=_data())
    assert trainer.global_step == steps
    assert counter.reads == steps
    assert len(_column(_csv_rows(Path(tmp_path, "sync", "version_0")), "train_loss")) == steps
