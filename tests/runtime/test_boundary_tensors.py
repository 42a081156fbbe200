"""What crosses a stage boundary, through the real Trainer in one process and on processes against plain Lightning:
a complex activation carries its gradient back, a buffer handed on crosses as a copy, an input kept for a recompute
may not change, a buffer two stages register may not change."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.multiprocessing.spawn import ProcessRaisedException
from torch.utils.data import DataLoader, TensorDataset

from lit_efficient import PACIStrategy

pytestmark = pytest.mark.usefixtures("one_thread")


class _ToComplex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x):
        h = self.lin(x)
        return torch.complex(h[:, :4], h[:, 4:])


class _Magnitude(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, z):
        return self.lin(z.abs())


class _PassesItsBuffer(nn.Module):
    """Hands the next layer its own buffer along with the hidden state (a table the next layer reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x):
        return self.lin(x), self.scale


class _ScalesInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, h, scale):
        scale.mul_(1.5)  # the received tensor, changed in place: in one process the sender's buffer
        return self.lin(h) * scale


class _TwoLayers(LightningModule):
    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([first, second])

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_input(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return nn.functional.mse_loss(output, batch[1])

    def training_step(self, batch, batch_idx):
        x = self.pipeline_input(batch)
        for layer in self.layers:
            x = layer(*x) if isinstance(x, tuple) else layer(x)
        return self.pipeline_loss(x, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(model: LightningModule, devices: int | None, **strategy) -> Trainer:
    """Four steps of two micro-batches (the pipeline's N from accumulate_grad_batches): plain Lightning (devices
    None) or the pipeline of 2 stages."""
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    setup = (
        dict(devices=1)
        if devices is None
        else dict(devices=devices, strategy=PACIStrategy(pipeline_stages=2, start_method="forkserver", **strategy))
    )
    trainer = Trainer(
        accelerator="cpu", max_steps=4, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **setup,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=4))
    return trainer


def _complex_model() -> _TwoLayers:
    torch.manual_seed(0)
    return _TwoLayers(_ToComplex(), _Magnitude())


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.multiproc)])
def test_a_complex_activation_trains_the_stages_before_it(devices, recompute):
    """A complex tensor at the boundary was taken for one that gets no gradient (only floats did): stage 0 never
    trained, silently. Under flush both stages end as plain Lightning's."""
    plain = _complex_model()
    _fit(plain, None)
    piped = _complex_model()
    initial = piped.layers[0].lin.weight.detach().clone()
    _fit(piped, devices, schedule="1f1b_flush", recompute=recompute)
    assert (piped.layers[0].lin.weight - initial).abs().max() > 1e-3  # stage 0 trained
    for (name, want), got in zip(plain.state_dict().items(), piped.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


@pytest.mark.multiproc
def test_a_buffer_handed_to_the_next_stage_crosses_as_a_copy_in_one_process_too():
    """In one process the next stage received the sending stage's buffer itself, and its in-place change changed the
    buffer there, on processes a copy: the weights differed by orders of magnitude. Now a copy in both, alike."""
    runs = []
    for devices in (1, 2):
        torch.manual_seed(0)
        runs.append(_TwoLayers(_PassesItsBuffer(), _ScalesInPlace()))
        _fit(runs[-1], devices)
        assert runs[-1].layers[0].scale.item() == 1.0
    for (name, want), got in zip(runs[1].state_dict().items(), runs[0].state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


class _DoublesInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x.mul_(2))  # its input, changed in place


@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.multiproc)])
def test_an_input_changed_in_place_under_recompute_is_refused(devices):
    """recompute=True reruns a stage's forward on the input it kept: an in-place change made the rerun start from the
    changed values (wrong gradients, silently)."""
    torch.manual_seed(0)
    model = _TwoLayers(_DoublesInPlace(), _Magnitude())
    said = r"pipeline layer 0 \(stage 0\) changed input 0 in place \(Tensor\(4, 4\), pipeline_input's output\) "
    said += r"under PACIStrategy\(recompute=True\).*x.clone\(\)"
    # On processes the rank's ValueError reaches the launching process inside torch's ProcessRaisedException.
    with pytest.raises(ValueError if devices == 1 else ProcessRaisedException, match=said):
        _fit(model, devices, recompute=True)


class _Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.lin.requires_grad_(False)

    def forward(self, x):
        return self.lin(x)


def _in_place_relu_model() -> _TwoLayers:
    torch.manual_seed(0)
    return _TwoLayers(_Frozen(), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 1)))


def test_an_in_place_relu_at_a_stages_start_trains_and_evaluates_as_one_device():
    """A stage that starts with nn.ReLU(inplace=True) on an activation needing no gradient (the stage before it
    frozen, or any evaluation): as harmless as on one device, and not refused."""
    plain = _in_place_relu_model()
    _fit(plain, None)
    piped = _in_place_relu_model()
    trainer = _fit(piped, 1, schedule="1f1b_flush")
    for (name, want), got in zip(plain.state_dict().items(), piped.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    piped.validation_step = lambda batch, *_: piped.log("val_loss", piped.pipeline_loss(piped(batch[0]), batch))
    assert trainer.validate(piped, data, verbose=False)[0]["val_loss"] > 0


class _Counts(nn.Module):
    """A layer that reads (and, ``counting``, increments) a buffer it shares with another layer."""

    def __init__(self, count: torch.Tensor, counting: bool) -> None:
        super().__init__()
        self.lin, self.counting = nn.Linear(4, 4), counting
        self.register_buffer("count", count)

    def forward(self, x):
        if self.training and self.counting:
            self.count += 1
        return torch.tanh(self.lin(x)) * (1 + 0.01 * self.count)


def _sharing(counting: bool) -> _TwoLayers:
    torch.manual_seed(0)
    count = torch.zeros(())
    model = _TwoLayers(_Counts(count, counting), _Counts(count, counting))
    model.layers.append(nn.Linear(4, 1))
    return model


@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.multiproc)])
def test_a_buffer_two_stages_register_may_be_read_not_changed(devices):
    """One tensor registered as a buffer by layers on two stages: each process keeps its own copy, so a running count
    one stage changed reached the other in one process only (8 in the count and 2.5e-2 in the validation loss on
    processes, silently). Refused on both; a constant one (a shared table) trains as plain Lightning."""
    plain = _sharing(counting=False)
    _fit(plain, None)
    piped = _sharing(counting=False)
    _fit(piped, devices, schedule="1f1b_flush", balance=[1, 2])
    for (name, want), got in zip(plain.state_dict().items(), piped.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
    said = r"buffer 'layers.0.count' is registered by pipeline layers on stages \[0, 1\], and stage 0's forward"
    with pytest.raises(ValueError if devices == 1 else ProcessRaisedException, match=said):
        _fit(_sharing(counting=True), devices, balance=[1, 2])


def test_a_move_that_gives_each_owner_its_own_copy_leaves_nothing_to_watch(monkeypatch):
    """A move to a GPU replaces every owner's buffer with its own copy, plain Lightning's model's too: nothing shared
    remains to diverge, and the watch held the tensors from before the move (never changed, kept alive)."""
    moved = PACIStrategy.model_to_device

    def to_device_replacing_buffers(self):  # what .to("cuda") does to buffers, on the CPU
        moved(self)
        self.model._apply(lambda t: t.clone())

    monkeypatch.setattr(PACIStrategy, "model_to_device", to_device_replacing_buffers)
    model = _sharing(counting=True)
    trainer = _fit(model, 1, balance=[1, 2])  # not refused: each owner counts on its own, as plain Lightning's would
    assert [h.stage.shared_buffers for h in trainer.strategy.hosted] == [[], []]
    assert model.layers[0].count.item() == model.layers[1].count.item() == 8.0
