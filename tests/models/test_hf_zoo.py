"""HFCausalLM over many architectures: tiny random models built from their own Config classes (nothing
downloaded; `benchmarks.hf_zoo` builds them and runs the whole list of the installed transformers).

The chain of pipeline layers gives the model's own logits at its weights and at enlarged ones (nested
decoders, final norms without weights or none, a `base_model_prefix` naming no attribute, soft-capped and
scaled logits, complex rotary tables); flush trains exactly as one device, in one process for many
architectures and on two processes for a few (one spawned run trains them all); what it cannot
reproduce is refused with the reason.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_efficient import PACIStrategy
from lit_efficient.models import HFCausalLM
from lit_efficient.runtime.stage import run_layers
from tests.support.multiproc import spawn, values

transformers = pytest.importorskip("transformers")
from benchmarks.hf_zoo import batches, build, fit, flush_in_one_process, max_diff, sgd_module, skip_reason  # noqa: E402
from tests.support.hf_runs import AUX  # noqa: E402
from tests.support.hf_runs import padded_batches as _padded_batches  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one thread here and in every rank


def _chain_and_model(module: HFCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return run_layers(module.pipeline_layers(), (ids,))[0], module.model(input_ids=ids, use_cache=False).logits


def _scale_head(model: nn.Module, factor: float) -> None:
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)


# What each architecture exercises in the split.
STRUCTURES = {
    "opt": "decoder layers at model.decoder.layers, a tied head",
    "olmo": "a final LayerNorm without weights",
    "nanochat": "one norm without weights before and after the layers",
    "openai-gpt": "no final norm, blocks returning lists",
    "llama4_text": "base_model_prefix ('language_model') names no attribute",
    "deepseek_v2": "complex64 rotary tables (freqs_cis) as side inputs",
}


@pytest.mark.parametrize("model_type", list(STRUCTURES))
def test_the_chain_gives_the_models_logits_at_its_weights_and_enlarged(model_type):
    module = HFCausalLM(build(model_type).eval())
    ids = batches(1)[0][0]
    got, want = _chain_and_model(module, ids)
    assert torch.equal(got, want), STRUCTURES[model_type]
    _scale_head(module.model, 1000.0)
    got, want = _chain_and_model(module, ids)
    assert want.abs().max() > 10 and torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    if model_type == "deepseek_v2":
        side = run_layers(module.pipeline_layers()[:1], (ids,))[1:]
        assert any(t is not None and t.is_complex() for t in side)  # what the wire must carry


def test_gemma2_softcapping_and_logit_scales_are_applied_by_the_head():
    """At enlarged head weights the soft-cap bounds the logits (|logit| < cap) and the head's chain keeps it; a
    head of norm + LM head only would not (at random init both are within the old dry run's tolerance)."""
    module = HFCausalLM(build("gemma2", final_logit_softcapping=5.0).eval())
    _scale_head(module.model, 1000.0)
    ids = batches(1)[0][0]
    got, want = _chain_and_model(module, ids)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4) and want.abs().max() <= 5.0
    with torch.no_grad():
        hidden = module.model.model(input_ids=ids, use_cache=False).last_hidden_state
        uncapped = module.model.lm_head(hidden)
    assert uncapped.abs().max() > 50  # what the pipeline would have trained without the cap
    for model_type, attr, scale in [("cohere", "logit_scale", 0.25), ("granite", "logits_scaling", 0.25)]:
        module = HFCausalLM(build(model_type).eval())  # OVERRIDES set the scales to something not 1
        assert getattr(module.model.config, attr) in (scale, 1 / scale)
        got, want = _chain_and_model(module, ids)
        assert torch.equal(got, want), model_type


class _ClampedLlamaModel(transformers.LlamaModel):
    """A decoder stack whose forward clamps its output after the final norm (not a module call): invisible at
    random init, where the normed values are far below the bound, and plain once the norm's weights grow."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.last_hidden_state = out.last_hidden_state.clamp(-8.0, 8.0)
        return out


class _InputDependentHead(transformers.LlamaForCausalLM):
    """A causal LM adding a function of the input ids to its logits: the last stage has no input ids."""

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        out.logits = out.logits + input_ids.unsqueeze(-1).float()
        return out


def test_what_the_chain_cannot_reproduce_is_refused_with_the_reason():
    model = build("llama")
    model.model.__class__ = _ClampedLlamaModel
    with torch.no_grad():
        hidden = model.model(input_ids=batches(1)[0][0]).last_hidden_state
    assert hidden.abs().max() < 8.0  # at its weights the clamp does nothing: a check there alone would pass
    with pytest.raises(ValueError, match="logits with enlarged final-module and LM-head weights"):
        HFCausalLM(model).pipeline_layers()
    model = build("llama")
    model.__class__ = _InputDependentHead
    with pytest.raises(ValueError, match="failed in HFHead: .*needs more than that chain gives it"):
        HFCausalLM(model).pipeline_layers()
    model = build("llama")
    inner = model.model
    calls = inner.layers[1].register_forward_pre_hook(lambda m, args: (inner.norm(args[0]), *args[1:]))
    with pytest.raises(ValueError, match=r"calls \['norm'\] between its decoder layers"):
        HFCausalLM(model)
    calls.remove()
    config = transformers.AutoConfig.for_model("t5", d_model=16, d_ff=32, num_layers=1, num_heads=2, vocab_size=64)
    with pytest.raises(ValueError, match="not a decoder-only"):
        HFCausalLM(transformers.T5ForConditionalGeneration(config))


def test_key_value_states_shared_across_layers_are_refused_naming_them():
    # Gemma 4 with a layer reusing an earlier layer's keys and values through the dict the stack hands every layer:
    # that state is not in the hidden states, so no stage boundary can carry it.
    types = ["sliding_attention", "full_attention", "full_attention"]
    model = build("gemma4_text", num_hidden_layers=3, layer_types=types, num_kv_shared_layers=1)
    assert model.config.kv_sharing_modes == ["store", "store", "reuse"]
    with pytest.raises(ValueError, match=r"layer 2 looked up .full_attention. in its argument shared_kv_states"):
        HFCausalLM(model).pipeline_layers()
    HFCausalLM(build("gemma4_text", num_hidden_layers=3, layer_types=types)).pipeline_layers()  # none reused: taken


def test_weights_of_the_decoder_stack_itself_are_refused_naming_them():
    # ZAYA scales and shifts the embeddings by parameters of its stack module, which holds every decoder layer too.
    with pytest.raises(ValueError, match=r"model\.model holds weights of its own.*'input_hidden_states_scale'"):
        HFCausalLM(build("zaya"))


def test_a_stacks_module_list_called_after_the_layers_is_refused_naming_it():
    # Gemma-3n mixes its altup streams back into one by indexing a ModuleList inside its own forward, whose hook
    # never fires: the chain once ran only the final norm, on the stacked streams, and compared NaN logits.
    with pytest.raises(ValueError, match=r"calls the modules of \['altup_unembed_projections'\].*after its decoder"):
        HFCausalLM(build("gemma3n_text"))


def test_lists_of_num_hidden_layers_inside_one_layer_are_named_not_taken_for_the_stack():
    """LongCat-Flash's num_hidden_layers counts two attention sublayers per decoder layer: the only lists of that
    length are one layer's parts (the message named weights outside a stack found inside layer 0)."""
    with pytest.raises(ValueError, match=r"only nn\.ModuleLists of config\.num_hidden_layers=2 modules \(model\.model"
                       r"\.layers\.0\.self_attn, .*inside an element of another nn\.ModuleList \(model\.model\.layers"
                       r"\.0, one of the 1 modules"):  # fmt: skip
        HFCausalLM(build("longcat_flash"))


# Configs whose Hugging Face loss adds a term to the cross-entropy HFCausalLM does not train (refused: the value or
# the reason, the fix), when (at construction or at the dry run), and the same families with the term's weight at 0
# (accepted). JetMoE: two routers per layer; DBRX: a router output that is not what its loss reads; Llama-4: a
# forward that ignores the flag; Bamba: a z-loss on the logits.
REFUSED_LOSS = {
    "jetmoe": (dict(output_router_logits=True), "construction", r"2 JetMoeTopKGating router modules, not one"),
    "dbrx": (dict(output_router_logits=True), "dry run", r"router loss is not the one HFCausalLM carries"),
    "llama4_text": (dict(output_router_logits=True, router_aux_loss_coef=0.02), "dry run", "returns no aux_loss"),
    "qwen2_moe": (
        dict(output_router_logits=True, router_aux_loss_coef=0.02, z_loss_coefficient=0.1),
        "construction",
        r"z_loss_coefficient=0\.1.*adds it on no path.*z_loss_coefficient=0",
    ),
    "bamba": (dict(z_loss_coefficient=0.1), "construction", r"z_loss_coefficient=0\.1.*adds it on no path"),
}
NO_ADDED_LOSS = {
    "mixtral": dict(output_router_logits=True, router_aux_loss_coef=0.0),
    "jetmoe": dict(output_router_logits=True, aux_loss_coef=0.0),
    "bamba": {},
}


def _hf_loss_and_ours(model: nn.Module) -> tuple[float, float]:
    """Hugging Face's own training loss and HFCausalLM's (the cross-entropy of the logits) on one batch."""
    ids = batches(1)[0][0]
    model.train()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, use_cache=False)
        # Any HFCausalLM's pipeline_loss: it reads the logits and the batch only.
        ours, _ = HFCausalLM(build("llama")).pipeline_loss(out.logits, {"input_ids": ids})
    return out.loss.item(), ours.item()


@pytest.mark.parametrize("model_type", list(REFUSED_LOSS))
def test_a_loss_term_hfcausallm_cannot_train_exactly_is_refused_naming_the_reason(model_type):
    overrides, when, reason = REFUSED_LOSS[model_type]
    model = build(model_type, **overrides)
    hf, ours = _hf_loss_and_ours(model)
    if model_type != "llama4_text":  # Llama-4's forward ignores the flag: no term, and nothing to train
        assert abs(hf - ours) > 1e-4 * abs(ours)  # the term is there: training the cross-entropy alone would differ
    if when == "construction":
        with pytest.raises(ValueError, match=reason):
            HFCausalLM(model)
    else:
        with pytest.raises(ValueError, match=rf"{reason}.*output_router_logits=False"):
            HFCausalLM(model).pipeline_layers()


@pytest.mark.parametrize("model_type", list(NO_ADDED_LOSS))
def test_the_same_families_without_the_term_are_accepted_and_hfs_loss_is_ours(model_type):
    model = build(model_type, **NO_ADDED_LOSS[model_type])
    hf, ours = _hf_loss_and_ours(model)
    assert hf == pytest.approx(ours, rel=1e-6)
    HFCausalLM(model)


AUX_FAMILIES = ["mixtral", "qwen2_moe"]


@pytest.mark.parametrize("model_type", AUX_FAMILIES)
def test_the_router_aux_loss_is_hfs_on_one_device_and_through_the_chain(model_type):
    model = build(model_type, **AUX)
    module = HFCausalLM(model)
    batch = _padded_batches(1)[0]
    model.train()
    out = model(**batch, use_cache=False)
    assert out.aux_loss * 0.02 > 1e-3  # the term weighs: a loss without it fails the comparisons below
    one_device, items = module.pipeline_loss(module(module.pipeline_input(batch)), batch)
    chained, _ = module.pipeline_loss(run_layers(module.pipeline_layers(), module.pipeline_input(batch)), batch)
    assert abs(one_device.item() - out.loss.item()) <= 1e-6 and abs(chained.item() - out.loss.item()) <= 1e-6
    assert items == (batch["labels"][:, 1:] != -100).sum()
    module.eval()
    model.eval()
    with torch.no_grad():  # Hugging Face adds the term in evaluation too, and so does validation_step
        want = model(**batch, use_cache=False).loss
        assert abs(module.validation_step(batch, 0).item() - want.item()) <= 1e-6


def _fit_moe_on_every_rank(rank: int, world: int, types: list[str]) -> dict[str, dict[str, torch.Tensor]] | None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out = {}
    for model_type in types:
        strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush")
        out[model_type] = fit(sgd_module(build(model_type, **AUX)), strategy, world, _padded_batches(6))
    return out if rank == 0 else None


def _one_device(model_type: str, **overrides) -> dict[str, torch.Tensor]:
    return fit(sgd_module(build(model_type, **{**AUX, **overrides})), "auto", 1, _padded_batches(6))


@pytest.mark.parametrize("model_type", AUX_FAMILIES)
def test_flush_with_the_router_aux_loss_in_one_process_equals_one_device(model_type):
    single = _one_device(model_type)  # 6 micro-batches, 2 a step: 3 steps
    assert max_diff(single, _one_device(model_type, router_aux_loss_coef=0.0)) > 1e-4  # the term trains the model
    strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush")
    piped = fit(sgd_module(build(model_type, **AUX)), strategy, 1, _padded_batches(6))
    assert max_diff(piped, single) <= 1e-6


@pytest.mark.multiproc
def test_flush_with_the_router_aux_loss_on_two_processes_equals_one_device():
    piped = values(spawn(_fit_moe_on_every_rank, 2, AUX_FAMILIES, timeout=240, torchrun_env=True))[0]
    for model_type in AUX_FAMILIES:
        assert max_diff(piped[model_type], _one_device(model_type)) <= 1e-6, model_type


def test_the_router_aux_loss_with_token_normalization_is_refused():
    import lightning as L

    from lit_efficient.callbacks import GradientAccumulation

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[GradientAccumulation(2, normalize="tokens")],
    )  # fmt: skip
    data = torch.utils.data.DataLoader(_padded_batches(2), batch_size=None)
    refusal = r"router coefficient 0\.02.*normalize='tokens'.*normalize='mean'.*`normalize: mean` in the GradientAccumu"
    with pytest.raises(ValueError, match=refusal):
        trainer.fit(sgd_module(build("mixtral", **AUX)), train_dataloaders=data)


# Flush in one process against one device: tied and untied heads, the structures above and the logit scales;
# rwkv: blocks returning (hidden, state, attentions) tuples the base unpacks, and weights rescaled in place when
# the model switches between eval and training; bamba (a Mamba-2 and an attention layer), dbrx (sub-configs) and
# kimi_linear (a linear-attention and an attention layer): per-type sizes of the zoo; mllama: a composite config;
# mpt: a sub-config (its attention's) with no tiny size to set, which tiny_config once refused;
# gemma4_unified_text (in float64, below): a causal LM reading the inputs' length after the stack, and a dict every
# layer fills (its shared_kv_states); deepseek_v4: a dict of rotary (cos, sin) tuples per layer type as a layer's
# argument.
IN_PROCESS = ["opt", "olmo", "nanochat", "openai-gpt", "gemma2", "cohere", "granite", "llama4_text", "qwen3_moe"]
IN_PROCESS += ["rwkv", "bamba", "dbrx", "kimi_linear", "mllama", "mpt", "deepseek_v4"]


@pytest.mark.parametrize("model_type", IN_PROCESS)
def test_flush_in_one_process_equals_one_device(model_type):
    assert flush_in_one_process(model_type) <= 1e-5


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma4_unified_text"])
def test_gemma4_flush_in_one_process_equals_one_device_in_float64(model_type):
    # Gemma 4's float32 runs differ by 3.5e-5 (gemma4_text; gemma4_unified_text by 1.4e-5 on an Intel Xeon, under
    # 1e-5 on an AMD EPYC) in the tied embedding (which moves by 1.6 here): its gradient sums the head's, the hidden
    # states' and the per-layer inputs' in another order when split. In float64 that reassociation is 2e-16, so an
    # actual difference in what is trained would show.
    data = batches()
    start = build(model_type).double().state_dict()
    single = fit(sgd_module(build(model_type).double()), "auto", 1, data)
    strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush")
    piped = fit(sgd_module(build(model_type).double()), strategy, 1, data)
    assert max_diff(single, {f"model.{k}": v for k, v in start.items()}) > 1e-2  # it trained
    assert max_diff(piped, single) <= 1e-12


def test_the_zoos_skip_rules_are_read_from_the_class_not_a_list_of_names():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as mapping

    def reason(model_type):
        return skip_reason(model_type, mapping[model_type]) or ""

    for bert_like in ["bert", "electra", "roformer", "big_bird", "xmod"]:  # is_decoder defaults to False
        assert "BERT family" in reason(bert_like), bert_like
    for decoder in ["gpt2", "trocr", "llama", "rwkv", "mllama"]:  # gpt2 can cross-attend, trocr's is_decoder is False
        assert reason(decoder) == "", decoder
    assert "the row of llama4_text" in reason("llama4")  # the same class, built from the composite's text part
    assert "shared_kv_states" in reason("gemma4_assistant")


# Complex side inputs on the wire (untied); soft-capping, tied; one weightless norm used before the first layer and
# after the last (nanochat: its last stage's rank replaced the norm with stage 0's placeholder, issue 33 item 7).
ON_PROCESSES = ["deepseek_v2", "gemma2", "nanochat"]


def _fit_on_every_rank(rank: int, world: int, types: list[str]) -> dict[str, dict[str, torch.Tensor]] | None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out = {}
    for model_type in types:  # one process start for every model
        strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush")
        out[model_type] = fit(sgd_module(build(model_type)), strategy, world, batches())
    return out if rank == 0 else None  # rank 0 holds the whole trained model after fit


@pytest.mark.multiproc
def test_flush_on_two_processes_equals_one_device_for_several_models():
    piped = values(spawn(_fit_on_every_rank, 2, ON_PROCESSES, timeout=240, torchrun_env=True))[0]
    for model_type in ON_PROCESSES:
        tied = build(model_type).config.tie_word_embeddings
        single = fit(sgd_module(build(model_type)), "auto", 1, batches())
        assert max_diff(piped[model_type], single) <= 1e-5, (model_type, tied)
    assert {build(t).config.tie_word_embeddings for t in ON_PROCESSES} == {True, False}


def test_every_zoo_config_passes_the_config_key_check_as_a_dict():
    """HFCausalLM refuses a config dict's keys its class does not define; no config of the zoo is one: neither the
    keys it sets (tiny sizes, OVERRIDES) nor what a module built from the instance saves as its hparams' model dict
    (``to_diff_dict``), from which a checkpoint rebuilds it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as mapping

    from benchmarks.hf_zoo import OVERRIDES, tiny_config
    from lit_efficient.models.hf import _check_config_keys

    checked = 0
    for model_type in mapping:
        try:
            config = tiny_config(model_type, **OVERRIDES.get(model_type, {}))
        except Exception:  # noqa: BLE001 - a config its own validator refuses at tiny sizes: no model, no dict
            continue
        _check_config_keys({"model_type": model_type, **OVERRIDES.get(model_type, {}), **config.to_diff_dict()})
        _check_config_keys({"model_type": model_type, **config.to_dict()})
        checked += 1
    assert checked > 150
