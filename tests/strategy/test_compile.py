"""torch.compile through the pipeline: `trainer.fit(torch.compile(model))` and `PACIStrategy(compile_layers=...)`
compile each stage's layers and train as the eager pipeline does.

The tests compile with the ``aot_eager`` backend (dynamo and AOTAutograd, eager kernels): the same graphs
and autograd as inductor's, without minutes of C++ compilation on 2 cores; inductor's speed-up is a
benchmark (benchmarks/compile.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_efficient import ActivationCheckpointing, PACIStrategy
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0)


def _fit(model, devices: int = 1, callbacks=(), **strategy) -> tuple[dict[str, torch.Tensor], float]:
    trainer = Trainer(
        accelerator="cpu", devices=devices, max_steps=3, accumulate_grad_batches=2, val_check_interval=3,
        limit_val_batches=2, callbacks=list(callbacks), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", **strategy),
    )  # fmt: skip
    trainer.fit(model, datamodule=TextDataModule(block_size=32, batch_size=4, max_bytes=60_000))
    module = getattr(model, "_orig_mod", model)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, float(trainer.callback_metrics["val_loss"])


def _frames() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _assert_same(got, want) -> None:
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize(
    ("recompute", "checkpointing"),
    [(False, False), (True, False), (False, True)],
    ids=["keep-graph", "recompute", "activation-checkpointing"],
)
def test_fit_of_a_compiled_module_compiles_every_stage_and_trains_as_eager(recompute, checkpointing):
    callbacks = lambda: [ActivationCheckpointing()] if checkpointing else []  # noqa: E731
    eager, eager_val = _fit(_model(), recompute=recompute, callbacks=callbacks())
    assert _frames() == 0
    compiled_model = torch.compile(_model(), backend="aot_eager")
    compiled, compiled_val = _fit(compiled_model, recompute=recompute, callbacks=callbacks())
    assert _frames() >= 2  # each stage's layers, not 0 as before (the stages never called the module)
    _assert_same(compiled, eager)
    assert abs(compiled_val - eager_val) <= 1e-6
    assert compiled_model._orig_mod._compiler_ctx is not None  # the module leaves fit compiled, as it came


def test_a_module_compiled_in_place_compiles_every_stage_with_its_options(caplog):
    """``model.compile()`` (torch's in-place form) compiled only the module's own call, which the stages never make:
    the fit ran eager, silently."""
    eager, eager_val = _fit(_model())
    model = _model()
    model.compile(backend="aot_eager")
    compiled_call = model._compiled_call_impl
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        compiled, compiled_val = _fit(model)
    assert _frames() >= 2  # each stage's layers (0 before)
    assert "GPT was compiled in place (module.compile()) ... with that call's options." in caplog.text.replace(
        ", which compiles its own call; the stages call its layers, so each stage compiles its layers", " ..."
    )
    _assert_same(compiled, eager)
    assert abs(compiled_val - eager_val) <= 1e-6
    assert model._compiled_call_impl is compiled_call  # the module leaves fit compiled, as it came


def test_compile_layers_option_compiles_an_unwrapped_module():
    eager, _ = _fit(_model())
    compiled, _ = _fit(_model(), compile_layers={"backend": "aot_eager"})
    assert _frames() >= 2
    _assert_same(compiled, eager)


class _EveryReading(ActivationCheckpointing):
    """Selective checkpointing that measures every micro-batch and keeps each reading."""

    def __init__(self) -> None:
        super().__init__(mode="selective")
        self.readings: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._measure_next = True
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.readings.append(self.saved_bytes)


def test_selective_checkpointing_under_a_dynamic_compile_trains_as_eager_and_counts_what_runs():
    """Selective checkpointing's meter counted the traced stand-ins while torch.compile traced: a symbolic size under
    compile_layers={"dynamic": True} broke the trace ("mul expected 2 arguments, got 3") and the first reading of a
    static compile was 43% above the later ones."""
    eager, _ = _fit(_model(), callbacks=[ActivationCheckpointing(mode="selective")])
    meter = _EveryReading()
    compiled, _ = _fit(_model(), callbacks=[meter], compile_layers={"backend": "aot_eager", "dynamic": True})
    _assert_same(compiled, eager)
    assert len(meter.readings) == 6 and len(set(meter.readings)) == 1 and meter.readings[0] > 0, meter.readings


def test_compile_layers_refuses_what_it_cannot_use():
    with pytest.raises(ValueError, match="compile_layers='yes'"):
        PACIStrategy(compile_layers="yes")
    # torch.compile's own refusals came only at setup, on every rank, without the option's name
    with pytest.raises(ValueError, match="'modee' is not an argument of torch.compile; did you mean 'mode'"):
        PACIStrategy(compile_layers={"modee": "max-autotune"})
    with pytest.raises(ValueError, match="mode='fastest' is not one of torch.compile's modes 'default'"):
        PACIStrategy(compile_layers={"mode": "fastest"})
    with pytest.raises(ValueError, match="backend='inductr' is not a torch.compile backend; did you mean 'inductor'"):
        PACIStrategy(compile_layers={"backend": "inductr"})  # refused in every rank, after the launch
    PACIStrategy(compile_layers={"backend": "aot_eager", "mode": None, "fullgraph": False})


@pytest.mark.multiproc
def test_compile_layers_on_processes_trains_as_eager():
    eager, _ = _fit(_model(), devices=2, start_method="forkserver")
    compiled, _ = _fit(_model(), devices=2, start_method="forkserver", compile_layers={"backend": "aot_eager"})
    _assert_same(compiled, eager)


def test_a_compiled_module_is_not_sent_to_spawned_ranks():
    with pytest.raises(ValueError, match=r"compile_layers=\{\.\.\.\}"):
        _fit(torch.compile(_model(), backend="aot_eager"), devices=2, start_method="forkserver")
    in_place = _model()
    in_place.compile(backend="aot_eager")  # a pickled copy drops the compiled call: the ranks would train eager
    with pytest.raises(ValueError, match=r"model.compile\(\) cannot start ranks .* arrives eager"):
        _fit(in_place, devices=2, start_method="forkserver")


class _TorchLayers(LightningModule):
    """A user's model of torch.nn layers only (Sequentials, a LayerNorm, Linears), each stage's layers compiled."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        seq = lambda n: nn.Sequential(nn.Linear(n, 16), nn.Tanh())  # noqa: E731
        self.layers = nn.ModuleList([seq(8), seq(16), seq(16), nn.LayerNorm(16), nn.Linear(16, 1)])

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_input(self, batch):
        return batch[0]

    def pipeline_loss(self, out, batch):
        return nn.functional.mse_loss(out, batch[1])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.pipeline_loss(self(batch[0]), batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_layers_of_torch_nn_classes_compile_each_class_apart_and_none_falls_back_to_eager():
    """torch.compile of a torch.nn layer wraps it in one function of torch's whose code every torch.nn layer shares,
    and dynamo keeps 8 graphs per code object: this model's first fit (training, validation, a last partial batch)
    needed 16 and ran the rest eager, warning "hit config.recompile_limit" (a compile audit)."""
    x = torch.randn(30, 8, generator=torch.Generator().manual_seed(1))
    loader = lambda: DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)  # noqa: E731
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=2, accumulate_grad_batches=2, val_check_interval=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=PACIStrategy(pipeline_stages=2, compile_layers={"backend": "eager"}),
    )  # fmt: skip
    trainer.fit(_TorchLayers(), loader(), loader())
    assert _frames() > 8  # 16 on torch 2.13; 8 before: the rest ran eager ("hit config.recompile_limit (8)")
