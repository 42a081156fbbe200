"""A mixture-of-experts router's auxiliary loss in `HFCausalLM` on the paths tests/models/test_hf_zoo.py leaves out: the
default schedule (PACI) on two processes against the one-process pipeline, bf16 on the wire, activation
checkpointing, and a checkpoint written after fit and loaded on one device.

Tiny Mixtral and Qwen2-MoE (2 layers, width 32, 4 experts, 16 tokens), router coefficient 0.02, padded dict
batches (tests/models/test_hf_zoo.py's helpers). One intra-op thread on every side: one process equals processes bit for
bit only at the same thread count.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_efficient import PACIStrategy
from lit_efficient.callbacks import ActivationCheckpointing
from lit_efficient.models import HFCausalLM
from lit_efficient.transport.wire import WireFormat
from tests.support.multiproc import spawn, values

pytest.importorskip("transformers")
from benchmarks.hf_zoo import build, fit, max_diff  # noqa: E402
from tests.support.hf_runs import (  # noqa: E402
    AUX,
    SGDLM,  # noqa: E402 - a module-level class: the forkserver launcher pickles the module
)
from tests.support.hf_runs import padded_batches as _padded_batches

pytestmark = pytest.mark.usefixtures("one_thread")


def _fit(
    model_type: str, strategy, devices: int, coef: float = 0.02, callbacks=(), router_calls: list | None = None, **kw
) -> dict[str, torch.Tensor]:
    """Weights after 3 optimizer steps (6 padded micro-batches, accumulate_grad_batches=2); in one process, each
    router call appends to ``router_calls``."""
    module = SGDLM(build(model_type, **{**AUX, "router_aux_loss_coef": coef, **kw}))
    if router_calls is not None:
        for m in module.modules():
            if type(m).__name__.endswith("TopKRouter"):
                m.register_forward_hook(lambda *_: router_calls.append(1))
    if not callbacks:
        return fit(module, strategy, devices, _padded_batches(6))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, accumulate_grad_batches=2,
        callbacks=list(callbacks), logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_padded_batches(6), batch_size=None))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _paci(**kwargs) -> PACIStrategy:
    return PACIStrategy(pipeline_stages=2, **kwargs)  # schedule: the default, "paci"


# Qwen2-MoE with a dense layer 0 (``mlp_only_layers``): stage 0 sends no router logits; only layer 1's reach the loss.
MODELS = {"mixtral": {}, "qwen2_moe": {}, "qwen2_moe dense layer 0": {"mlp_only_layers": [0]}}


def _fit_then_validate(model_type: str, strategy, devices: int, **overrides) -> tuple[dict[str, torch.Tensor], float]:
    """`_fit`'s weights, and the validation loss of 2 more padded batches on the same Trainer after fit (a split rank
    builds its adapters over the placeholders of the other stage's layers, which hold no router)."""
    module = SGDLM(build(model_type.split()[0], **{**AUX, **overrides}))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_padded_batches(6), batch_size=None))
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    held_out = torch.utils.data.DataLoader(_padded_batches(8)[6:], batch_size=None)
    (metrics,) = trainer.validate(module, dataloaders=held_out, verbose=False)
    return weights, metrics["val_loss"]


def _fit_on_every_rank(rank: int, world: int, types: list[str], kwargs: dict) -> dict | None:
    """Each rank builds its module, as under the default start_method="popen" (torchrun's environment): the
    module is not pickled."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out = {t: _fit_then_validate(t, _paci(**kwargs), world, **MODELS[t]) for t in types}
    return out if rank == 0 else None  # rank 0 holds the whole trained model after fit


def _on_two_processes(types: list[str], **kwargs) -> dict[str, tuple[dict[str, torch.Tensor], float]]:
    return values(spawn(_fit_on_every_rank, 2, types, kwargs, timeout=240, torchrun_env=True))[0]


@pytest.mark.multiproc
def test_paci_with_the_router_aux_loss_on_two_processes_equals_one_process():
    """Fit, then validate on the same Trainer (a rank holding another stage's placeholders refused to build its
    adapters: "decoder layer 2 holds 0 router modules"), Mixtral and Qwen2-MoE, the latter also with a dense layer
    (refused before: a layer without a router), on two processes as in one."""
    procs = _on_two_processes(list(MODELS))  # one process start for every model
    for model_type, overrides in MODELS.items():
        local, val_loss = _fit_then_validate(model_type, _paci(), 1, **overrides)
        assert max_diff(procs[model_type][0], local) == 0.0, model_type
        assert procs[model_type][1] == val_loss, model_type
        without = _fit(model_type.split()[0], _paci(), 1, coef=0.0, **overrides)
        assert max_diff(local, without) > 1e-4, model_type  # the term is trained


def test_a_module_with_the_router_aux_loss_pickles_for_spawn_and_forkserver():
    """The dry run's forward with output_router_logits=True leaves transformers' capture hooks (closures) on the
    model's modules: without their removal the module could not be sent to spawn/forkserver ranks."""
    import pickle

    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    pickle.dumps(HFCausalLM(build("mixtral")))  # without the term it always did
    sent = pickle.dumps(HFCausalLM(build("mixtral", **AUX)))
    # A spawned rank is a fresh process: no PreTrainedModel.__init__ has registered what its classes can record.
    registered = dict(_CAN_RECORD_REGISTRY)
    _CAN_RECORD_REGISTRY.clear()
    try:
        module = pickle.loads(sent)
        module.pipeline_layers()  # the dry run, as the rank's setup runs it: the chain's aux loss is the model's
        batch = _padded_batches(1)[0]
        logits, aux = module(module.pipeline_input(batch))  # the copy records its router logits
        assert isinstance(aux, torch.Tensor) and aux > 0
    finally:
        _CAN_RECORD_REGISTRY.update(registered)


def _router_logits_on_a_bf16_wire(model_type: str) -> tuple[float, float]:
    """Largest change of the router logits crossing the stage boundary as bf16 (stage 0: embedding and layer 0),
    and the auxiliary loss's change from it (only the router logits rounded, the hidden states kept exact)."""
    module = HFCausalLM(build(model_type, **AUX))
    batch = _padded_batches(1)[0]
    layers = module.pipeline_layers()
    with torch.no_grad():
        boundary = module.pipeline_input(batch)
        for layer in layers[:2]:
            boundary = layer(*boundary)
        logits = boundary[-1]
        rounded = WireFormat(torch.bfloat16).round_trip(logits)
        aux = []
        for stacked in (logits, rounded):
            out = (*boundary[:-1], stacked)
            for layer in layers[2:]:
                out = layer(*out)
            aux.append(out[1])  # the head's (logits, aux_loss)
    assert logits.dtype == torch.float32 and logits.shape == (1, 2 * 16, 4)  # layer 0's, every token, 4 experts
    return (rounded - logits).abs().max().item(), (aux[1] - aux[0]).abs().item()


@pytest.mark.multiproc
def test_bf16_on_the_wire_with_the_router_aux_loss_one_process_equals_processes():
    local = _fit("mixtral", _paci(wire_dtype="bfloat16"), 1)
    exact = _fit("mixtral", _paci(), 1)
    print(f"\nmixtral, paci, 3 steps: weights, bf16 wire against fp32 wire: {max_diff(local, exact):.3g}")
    logits, aux = _router_logits_on_a_bf16_wire("mixtral")
    print(f"router logits rounded to bf16 at the boundary: max change {logits:.3g}, aux_loss change {aux:.3g}")
    assert 0 < logits < 1e-2 and max_diff(local, exact) > 0  # the wire rounds the router logits too
    assert max_diff(_on_two_processes(["mixtral"], wire_dtype="bfloat16")["mixtral"][0], local) == 0.0


def test_activation_checkpointing_with_the_router_aux_loss_changes_nothing_under_flush():
    # Recompute runs each decoder layer (and its router) again at backward: the logits must be recorded once.
    calls: list[list[int]] = [[], []]
    plain = _fit("mixtral", PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"), 1, router_calls=calls[0])
    flush = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush")
    recomputed = _fit("mixtral", flush, 1, callbacks=[ActivationCheckpointing()], router_calls=calls[1])
    assert len(calls[1]) == len(calls[0]) + 6 * 2  # each of 2 layers recomputed for each of 6 micro-batches
    assert max_diff(recomputed, plain) == 0.0
    assert max_diff(plain, _fit("mixtral", PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"), 1, coef=0.0)) > 1e-4


def _val_loss(module: HFCausalLM, batch: dict[str, torch.Tensor]) -> float:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    (metrics,) = trainer.validate(module, dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    return metrics["val_loss"]


def test_a_checkpoint_saved_after_a_pipelined_fit_loads_on_one_device_with_the_aux_loss(tmp_path):
    module = SGDLM(build("mixtral", **AUX))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=_paci(), max_epochs=1, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_padded_batches(6), batch_size=None))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    loaded = HFCausalLM.load_from_checkpoint(tmp_path / "last.ckpt")
    assert max_diff(loaded.state_dict(), module.state_dict()) == 0.0
    batch = _padded_batches(7)[6]  # a batch it did not train on
    module.model.eval()
    with torch.no_grad():
        out = module.model(**batch, use_cache=False)
    assert out.aux_loss * 0.02 > 1e-3  # a loaded module without the term fails the comparisons below
    trained = _val_loss(module, batch)
    assert _val_loss(loaded, batch) == trained
    assert trained == pytest.approx(out.loss.item(), abs=1e-6)  # Hugging Face's loss, with the term
