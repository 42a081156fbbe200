"""`HFCausalLM`: any decoder-only Hugging Face causal LM as a pipelineable LightningModule, no glue code.

This file owns the adapter between a `transformers` model and the pipeline protocol: loading the model,
the pipeline layers that hold the model's parts, its loss on both batch formats, its optimizer. Finding the
parts, recording each decoder layer's call and the dry run's checks are `lit_efficient.models.hf_structure`'s;
which loss terms the model's own loss adds (a router's auxiliary loss) and where its router is are
`lit_efficient.models.hf_router`'s.

The model is split as ``[input embeddings, decoder layer 0, ..., decoder layer L-1, head]``, found from the
model's own structure and behaviour, with no per-model code (`find_structure`). Side inputs (position ids,
rotary cos/sin, causal and padding masks) are the model's own: the first stage runs the decoder stack's
forward with every decoder layer replaced by a recorder, so HF's code computes them exactly as it would
unsplit. They travel with the hidden states (as tensors, never requiring grad, so no gradient is computed or
sent back for them), and each decoder-layer adapter replays its layer's call with them. The last stage runs
the modules called after the layers, then the causal LM's own forward with the decoder stack replaced by a
stub returning those hidden states: the LM head and whatever the model does to its logits (soft-capping,
logit scales) are the model's code, not a copy. With a mixture-of-experts router's auxiliary loss on (`RouterAux`), each
decoder layer's router logits travel too, and the head's run of the causal LM's forward computes the
model's own ``aux_loss`` from them. Which arguments are tensors and which ones are shared by
several layers is learned once, from a dry run on a tiny padded batch, which also checks that the chain of
parts reproduces the model's logits at its weights and at enlarged ones (so the check does not pass or fail
with the weights' scale), and refuses, naming what failed, an architecture it cannot reproduce instead of
training it wrong.

The adapters are not registered in this module's tree (they hold the model's own submodules), so
``module.model`` stays the real HF model: ``state_dict`` keys are ``model.<HF key>`` and
``module.model.save_pretrained(dir)`` works before and after ``fit``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override

from lit_efficient.checks import is_count
from lit_efficient.models.gpt import adamw_with_warmup_cosine, check_recipe, counted_cross_entropy
from lit_efficient.models.hf_router import (
    RouterAux,
    reinstall_output_capture_hooks,
    remove_output_capture_hooks,
    router_aux_loss_coef,
    router_recorder,
)
from lit_efficient.models.hf_structure import (
    Structure,
    Template,
    check_logits,
    enlarged,
    find_structure,
    probe_ids,
    record_calls,
    run_chain,
    swapped,
)

HF_IGNORE_INDEX = -100  # labels equal to this are ignored (Hugging Face's convention)


def _check_has_a_head(model: nn.Module) -> None:
    """A base model (``Qwen2Model``) has no LM head: refuse it naming the causal LM class to use instead."""
    if model.get_output_embeddings() is not None:
        return
    name = type(model).__name__
    causal = " or ".join(sorted(_causal_lm_classes(model.config))) or "its ...ForCausalLM class"
    raise ValueError(
        f"HFCausalLM({name}) is a base model without a language-model head (get_output_embeddings() is None): it "
        f"has no logits to train next-token prediction with. Use {causal}: HFCausalLM({causal}(config)), or "
        "pass the config dict or the save_pretrained folder, from which HFCausalLM builds the causal LM class "
        "(AutoModelForCausalLM)."
    )


# Keys every config takes besides its class's fields: what PretrainedConfig's __post_init__ reads from its keyword
# arguments (legacy names, implementation choices), and what a saved config.json (``to_diff_dict``) holds.
_GENERIC_CONFIG_KEYS = frozenset({
    "model_type", "transformers_version", "torch_dtype", "num_labels", "name_or_path", "_name_or_path",
    "_commit_hash", "output_attentions", "attn_implementation", "experts_implementation", "per_layer_config",
})  # fmt: skip
# Legacy rotary keys, folded into rope_parameters by the configs that have it (and meaningless to those that do not).
_ROPE_KEYS = frozenset({"rope_theta", "rope_scaling", "partial_rotary_factor"})
# The dtype names HFCausalLM(dtype=...) takes, besides "auto".
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@functools.cache
def config_fields(config_class: type) -> frozenset[str]:
    """The keys ``config_class(**values)`` uses: its fields and ``__init__`` parameters, the aliases of its
    ``attribute_map``, the attributes its defaults set, and the keys any config takes (`_GENERIC_CONFIG_KEYS`,
    generation defaults, legacy rotary keys where it has ``rope_parameters``)."""
    from transformers import GenerationConfig

    keys = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    params = inspect.signature(config_class.__init__).parameters.values()
    keys |= {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}
    keys |= set(getattr(config_class, "attribute_map", {}))
    # Defaults its own validator rejects (Gemma-4 assistant's): its fields stand.
    with contextlib.suppress(Exception):
        keys |= set(config_class().to_dict())
    keys |= _GENERIC_CONFIG_KEYS | set(GenerationConfig._get_default_generation_params())
    return frozenset((keys | _ROPE_KEYS) if "rope_parameters" in keys else keys)


def _check_config_keys(values: Mapping[str, Any]) -> None:
    """Refuse a config dict's keys that look like a misspelling of one of its class's fields: transformers keeps a
    misspelt key as an unused attribute and builds the class's default instead (``num_hidden_layer: 4`` gives
    Llama's 32 layers), silently. Other keys its class does not define (a downloaded config.json's ``n_ctx``,
    ``task_specific_params``, ``auto_map``...) transformers accepts as they are: a warning names them."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = values["model_type"]
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise ValueError(
            f"HFCausalLM(model={{'model_type': {model_type!r}, ...}}): transformers has no model type "
            f"{model_type!r}{hint}; use a config.json's model_type, e.g. 'llama', 'gpt2' or 'qwen2'."
        )
    config_class = CONFIG_MAPPING[model_type]
    allowed = config_fields(config_class)
    unknown = [key for key in values if key not in allowed]
    close = {key: difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.85) for key in unknown}
    named = [f"{key!r} (did you mean {close[key][0]!r}?)" for key in unknown if close[key]]
    if named:
        raise ValueError(
            f"HFCausalLM(model={{'model_type': {model_type!r}, ...}}): {', '.join(named)} "
            f"{'is not a field' if len(named) == 1 else 'are not fields'} of {config_class.__name__}: transformers "
            f"would keep {'it' if len(named) == 1 else 'them'} as an unused attribute and leave the field meant at "
            f"its default. Use {config_class.__name__}'s field names (its documentation lists them)."
        )
    if unknown:
        warnings.warn(
            f"HFCausalLM(model={{'model_type': {model_type!r}, ...}}): {', '.join(map(repr, unknown))} "
            f"{'is not a field' if len(unknown) == 1 else 'are not fields'} of {config_class.__name__}; transformers "
            "keeps them as attributes, which its model does not read (a config.json's extras do this).",
            stacklevel=3,
        )


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """``dtype`` as a floating-point torch.dtype, or "auto"; a ValueError naming the choices otherwise."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and (dtype == "auto" or dtype.removeprefix("torch.") in _DTYPES):
        return "auto" if dtype == "auto" else _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(
        f"HFCausalLM(dtype={dtype!r}) is not a dtype to train in: use 'float32' (the default: float32 weights, "
        f"gradients and AdamW state), {', '.join(map(repr, list(_DTYPES)[1:]))}, 'auto' (the folder's own dtype, "
        "as from_pretrained reads it) or a floating-point torch.dtype."
    )


def load_hf_model(
    model: Any,
    vocab_size: int | None = None,
    attn_implementation: str | None = None,
    dtype: str | torch.dtype | None = None,
) -> nn.Module:
    """A `PreTrainedModel` from an instance (returned as is), a config dict with ``model_type`` (random
    init), or a local folder written by ``save_pretrained``. Never downloads.

    A model built or loaded here has ``dtype`` parameters: float32 by default (None), whatever the folder's weights
    are stored in (most downloaded checkpoints are bfloat16, which ``from_pretrained`` would keep); "auto" keeps
    them. An instance keeps its own dtype: a ``dtype`` given with one is refused, not ignored."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
    except ImportError as err:  # pragma: no cover - the hf extra
        raise ImportError("HFCausalLM needs transformers: pip install 'lit-efficient[hf]'") from err
    if attn_implementation is not None and not isinstance(attn_implementation, (str, Mapping)):
        # transformers read it with str methods: an AttributeError from inside it, naming no argument
        raise ValueError(
            f"HFCausalLM(attn_implementation={attn_implementation!r}) must be a transformers attention name such as "
            "'sdpa' or 'eager' (or a dict of them per sub-config), or None for the model type's default."
        )
    resolved = _resolve_dtype("float32" if dtype is None else dtype)
    kwargs: dict[str, Any] = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    # from_config builds in the config's own dtype (a folder's config.json says bfloat16) unless told; "auto" is that.
    built = kwargs if resolved == "auto" else {**kwargs, "dtype": resolved}
    if isinstance(model, PreTrainedModel):
        if dtype is not None:
            raise ValueError(
                f"HFCausalLM(dtype={dtype!r}) applies to a model built or loaded here (a config dict or a folder); "
                f"the {type(model).__name__} instance given keeps its own ({next(model.parameters()).dtype}). "
                "Convert it first (model.to(torch.float32)) and drop dtype."
            )
        if attn_implementation is not None:  # it was ignored: the instance ran its own
            raise ValueError(
                f"HFCausalLM(attn_implementation={attn_implementation!r}) applies to a model built or loaded here (a "
                f"config dict or a folder); the {type(model).__name__} instance given keeps its own "
                f"({getattr(model.config, '_attn_implementation', None)!r}). Set it on the instance first "
                f"(model.set_attn_implementation({attn_implementation!r})) and drop attn_implementation."
            )
        return model
    if isinstance(model, Mapping):
        values = dict(model)
        if "model_type" not in values:
            raise ValueError(
                f"HFCausalLM(model={values}) needs a 'model_type' key (e.g. 'llama', 'gpt2', 'qwen2') to pick the "
                "config class"
            )
        _check_config_keys(values)
        if vocab_size is not None:
            values.setdefault("vocab_size", vocab_size)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        _check_has_a_causal_lm_class(config, f"HFCausalLM(model={{'model_type': {config.model_type!r}, ...}})")
        return AutoModelForCausalLM.from_config(config, **built)
    if isinstance(model, (str, Path)):
        folder = Path(model)
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"HFCausalLM(model={str(model)!r}) is not a local folder with a config.json. HFCausalLM never "
                "downloads: save the model with save_pretrained(folder) (or download it yourself) and pass the folder, "
                "or pass a config dict with model_type."
            )
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        where = f"HFCausalLM(model={str(model)!r})"
        _check_has_a_causal_lm_class(config, where)
        _check_saved_from_a_causal_lm(config, where)
        if torch.get_default_device().type == "meta":  # the memory plan: the architecture, no weights to read
            return AutoModelForCausalLM.from_config(config, **built)
        loaded, info = AutoModelForCausalLM.from_pretrained(
            folder, config=config, local_files_only=True, dtype=resolved, output_loading_info=True, **kwargs
        )
        # transformers only logs the weights a folder lacks, and initializes them at random: a folder saved from
        # another class (an encoder-decoder's, a bare base model without a tied head) trained from noise, silently.
        parameters = dict(loaded.named_parameters())
        missing = sorted(k for k in info.get("missing_keys", ()) if k in parameters)
        if missing:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            raise ValueError(
                f"{where}: the folder's weights do not hold {len(missing)} of {type(loaded).__name__}'s parameters "
                f"({shown}), which would train from random values. Save the causal LM itself (its ...ForCausalLM "
                "class) with save_pretrained, or pass the model instance you built."
            )
        # from_pretrained returns the model in eval mode (for inference); a model built here is to train, and
        # Lightning keeps each submodule's mode as it finds it: left so, dropout would stay off, silently.
        return loaded.train()
    raise TypeError(
        f"HFCausalLM(model=...) takes a transformers PreTrainedModel, a config dict or a local folder; got "
        f"{type(model).__name__}"
    )


def _causal_lm_classes(config: Any) -> set[str]:
    """The names of the classes AutoModelForCausalLM builds for ``config`` (classes registered with it included);
    empty where it builds none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        found = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return set()
    return {c.__name__ for c in (found if isinstance(found, (list, tuple)) else (found,))}


def _check_has_a_causal_lm_class(config: Any, where: str) -> None:
    """Refuse a config whose model_type transformers has no causal LM class for (T5, an encoder), naming that,
    instead of AutoModelForCausalLM's list of two hundred config classes."""
    if not _causal_lm_classes(config):
        raise ValueError(
            f"{where}: model_type {config.model_type!r} ({type(config).__name__}) has no causal LM class in "
            "transformers, and HFCausalLM trains decoder-only causal LMs (next-token prediction), not encoder-decoder "
            "(T5, BART) or encoder-only models. docs/hf-models.md lists the architectures that train and why the "
            "others are refused."
        )


def _check_saved_from_a_causal_lm(config: Any, where: str) -> None:
    """Refuse a folder that config.json says was saved from a transformers class other than a causal LM (a
    BertForMaskedLM, a BartForConditionalGeneration, a bare Qwen2Model): AutoModelForCausalLM would load the
    weights the two classes share and leave the rest random. Names transformers does not know (remote code) pass."""
    import transformers

    saved = [a for a in getattr(config, "architectures", None) or () if hasattr(transformers, a)]
    causal = _causal_lm_classes(config)
    if saved and not causal.intersection(saved):
        raise ValueError(
            f"{where}: the folder was saved from {', '.join(saved)} (its config.json's architectures), not a causal "
            f"LM; AutoModelForCausalLM would load it as {' or '.join(sorted(causal))} and start whatever the two "
            "classes do not share from random values. Pass a folder saved from the causal LM class (the "
            "...ForCausalLM one), or build that model from this one's weights and pass the instance."
        )


# ----------------------------------------------------------------------------- pipeline layers


_READ_KEYS = frozenset({"input_ids", "attention_mask", "labels"})  # what HFCausalLM reads from a dict batch


def _forward_inputs(model: nn.Module) -> frozenset[str]:
    """The named inputs of ``model.forward``; through its ``**kwargs`` also transformers' own keyword inputs
    (``TransformersKwargs``: a flattening collator's ``cu_seq_lens_q``, ``max_length_q``, ...)."""
    kinds = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    parameters = inspect.signature(model.forward).parameters.values()
    names = {p.name for p in parameters if p.kind not in kinds}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        try:
            from transformers.utils.generic import TransformersKwargs
        except ImportError:  # an older transformers: its keyword inputs are not listed
            TransformersKwargs = None  # noqa: N806
        for cls in getattr(TransformersKwargs, "__mro__", ()):
            names.update(getattr(cls, "__annotations__", {}))
    return frozenset(names)


class HFEmbedding(nn.Module):
    """Pipeline layer 0: ``(input_ids[, attention_mask])`` -> ``(hidden, *side inputs)``, by the base forward
    (then ``attention_mask, None`` for the router logits to come, under `RouterAux`)."""

    def __init__(self, s: Structure, template: Template, aux: RouterAux | None = None) -> None:
        super().__init__()
        for name in s.embed:
            self.add_module(name, s.base._modules[name])
        self.__dict__.update(structure_=s, template=template, aux=aux)

    @override
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor | None, ...]:
        calls = record_calls(self.structure_, input_ids, attention_mask)
        out = (calls[0][0][0], *self.template.side_inputs(calls))
        return out if self.aux is None else (*out, attention_mask, None)


class HFDecoderLayer(nn.Module):
    """Pipeline layer 1 + i: decoder layer i on ``(hidden, *side)``; the side inputs pass through unchanged (under
    `RouterAux`, the last one, the stacked router logits, gains this layer's)."""

    def __init__(self, index: int, layer: nn.Module, template: Template, aux: RouterAux | None = None) -> None:
        super().__init__()
        self.index = index
        self.layer = layer
        self.__dict__.update(template=template, aux=aux, router=None if aux is None else aux.find(layer, index))

    @override
    def forward(self, hidden: Tensor, *side: Tensor | None) -> tuple[Tensor | None, ...]:
        if self.aux is None:
            return (self.template.call(self.index, self.layer, hidden, side), *side)
        if self.router is None:  # a dense layer: no router logits to add, as in the model's own forward
            return (self.template.call(self.index, self.layer, hidden, side[:-2]), *side)
        # A hook for this call only: the adapters are rebuilt on every pipeline_layers() and must leave nothing on
        # the model's modules. Under recompute the layer runs again and the hook records the same logits again.
        seen: list[Tensor] = []
        index = self.aux.index
        handle = self.router.register_forward_hook(lambda _m, _a, out: seen.append(out[index]))
        try:
            out = self.template.call(self.index, self.layer, hidden, side[:-2])
        finally:
            handle.remove()
        if len(seen) != 1:
            raise ValueError(f"HFCausalLM: decoder layer {self.index} called its router {len(seen)} times, not once")
        # One growing tensor rather than one entry per layer: the boundary's arity stays fixed, and it requires
        # grad, so the runtime sends its gradient back like the hidden states'. Its copies cost O(layers^2) router
        # logits, a few KB per token at most.
        logits = seen[0].unsqueeze(0)
        stacked = logits if side[-1] is None else torch.cat([side[-1], logits])
        return (out, *side[:-1], stacked)


class _Stub(nn.Module):
    """Stands in for the decoder stack during the head stage's run of the causal LM's forward: returns the
    hidden states the stage received (and the router logits, under `RouterAux`), as the stack's own output type,
    whatever it is called with."""

    def __init__(self, hidden: Tensor, output_type: type, like: nn.Module, router_logits: tuple | None = None) -> None:
        super().__init__()
        # Plain attributes the causal LM's forward may read from its decoder stack (Falcon-H1's multipliers).
        for key, value in vars(like).items():
            if not key.startswith("_") and key != "training" and isinstance(value, (str, int, float, bool)):
                self.__dict__[key] = value
        self.__dict__.update(hidden=hidden, output_type=output_type, router_logits=router_logits)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if dataclasses.is_dataclass(self.output_type):
            extra = {} if self.router_logits is None else {"router_logits": self.router_logits}
            return self.output_type(last_hidden_state=self.hidden, **extra)
        return (self.hidden,)


class HFHead(nn.Module):
    """Last pipeline layer, ``(hidden, *side)`` -> logits ``(B, T, V)``: the modules the decoder stack calls after
    its last layer (the final norm, a projection; none for some models), then the causal LM's own forward with the
    decoder stack replaced by a stub returning those hidden states. So the LM head and whatever the model does to
    its logits (Gemma-2's soft-capping, Cohere's and Granite's logit scales, ...) are the model's own code, not a
    copy of it here. Under `RouterAux` it returns ``(logits, aux_loss)``: the stub also returns the router logits
    that travelled here, and the causal LM's forward computes its auxiliary loss from them with its own code."""

    def __init__(self, s: Structure, model: nn.Module, aux: RouterAux | None = None) -> None:
        super().__init__()
        # Children, not a ModuleList: every part of an adapter is a module registered in the model (split.py).
        finals = [s.base._modules[n] for n in s.finals]
        for name, module in zip(s.finals, finals, strict=True):
            self.add_module(f"final_{name}", module)
        for name in s.head:
            self.add_module(name, model._modules[name])
        takes_embeds = "inputs_embeds" in inspect.signature(model.forward).parameters
        self.__dict__.update(structure_=s, causal_lm=model, finals=finals, aux=aux, takes_embeds=takes_embeds)

    @override
    def forward(self, hidden: Tensor, *side: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
        for module in self.finals:
            hidden = module(hidden)
        s = self.structure_
        # The stub ignores its inputs, but the causal LM's forward may read the batch's shape from them after the
        # stack (Gemma 4 slices the hidden states to logits_to_keep unless their length is the inputs'): it gets the
        # hidden states as its inputs_embeds, which have that shape, where it takes them.
        inputs = {"inputs_embeds": hidden} if self.takes_embeds else {}
        if self.aux is None:
            with swapped(s.parent, s.base_name, _Stub(hidden, s.output_type, s.base)):
                return self.causal_lm(use_cache=False, **inputs).logits
        mask, stacked = side[-2], side[-1]
        assert stacked is not None
        with swapped(s.parent, s.base_name, _Stub(hidden, s.output_type, s.base, tuple(stacked.unbind(0)))):
            out = self.causal_lm(attention_mask=mask, use_cache=False, output_router_logits=True, **inputs)
        return out.logits, out.aux_loss


# ----------------------------------------------------------------------------- the module


class HFCausalLM(LightningModule):
    """A Hugging Face decoder-only causal LM that trains on one device, under DDP and pipelined, unchanged.

    Batches are either ``(input_ids, targets)`` tuples with ``targets`` already the next tokens
    (`TextDataModule`; negative targets are ignored), or dicts with ``input_ids``, an optional
    ``attention_mask`` and optional ``labels`` (HF's convention: labels are the inputs, shifted inside
    the loss, -100 ignored; without labels, the inputs with padding ignored). The loss is the mean
    over the counted tokens, with their number, so ``GradientAccumulation(normalize="tokens")`` is
    exact with padding. A config with ``output_router_logits=True`` and a nonzero router auxiliary
    loss coefficient trains ``cross-entropy + coef * aux_loss``, the model's own ``outputs.loss``, on
    every path (``normalize="tokens"`` is then refused: the term is not a sum over tokens). Tied
    input/output embeddings (GPT-2, Llama 3.2, Qwen2.5, ...) are supported across stages (see
    `lit_efficient.runtime.tied`).

    Args:
        model: A ``transformers`` ``PreTrainedModel`` (e.g. ``LlamaForCausalLM(config)``), a config dict
            with ``model_type`` (built with random weights; what configs and the CLI use), or a local
            folder written by ``save_pretrained``. Never downloads.
        vocab_size: The data's vocabulary (the CLI links it from the data). A config dict without
            ``vocab_size`` takes it; otherwise the model must have at least this many token ids.
        block_size: The data's context length (linked by the CLI); checked against the model's
            ``max_position_embeddings`` when it has one.
        attn_implementation: ``"sdpa"``, ``"eager"``, ... for a model built here; None keeps HF's default.
        dtype: The parameters' dtype of a model built or loaded here (a config dict or a folder); an instance
            keeps its own (a dtype given with one is refused; its hparams record it, so that
            ``load_from_checkpoint`` rebuilds it in that dtype). None (default) is ``"float32"``: a bfloat16
            checkpoint (most downloaded ones) loads in float32, so the master weights, the accumulated gradients
            and the AdamW state are float32; train in bf16
            with ``Trainer(precision="bf16-mixed")``. ``"bfloat16"``, ``"float16"`` or ``"auto"`` (the folder's
            own dtype) train those in that dtype: pure low-precision training, the mode the strategy refuses
            as a Trainer precision; choose it knowingly. ``"float64"`` or a torch.dtype are taken too.
        learning_rate: Peak AdamW learning rate, reached at the end of warmup.
        weight_decay: Decoupled weight decay of matrix weights (not of embeddings, norms or biases).
        betas: AdamW (beta1, beta2).
        warmup_steps: Optimizer steps of linear warmup.
        max_steps: Optimizer step where the cosine decay reaches ``min_lr_ratio * learning_rate``; None
            reads ``trainer.estimated_stepping_batches``.
        min_lr_ratio: Final learning rate as a fraction of ``learning_rate``.
    """

    def __init__(
        self,
        model: dict[str, Any] | str | nn.Module,
        vocab_size: int | None = None,
        block_size: int | None = None,
        attn_implementation: str | None = None,
        dtype: str | torch.dtype | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        check_recipe("HFCausalLM", learning_rate, weight_decay, betas, warmup_steps, max_steps, min_lr_ratio)
        for name, size in (("vocab_size", vocab_size), ("block_size", block_size)):
            if size is not None and not is_count(size):
                raise ValueError(
                    f"HFCausalLM({name}={size!r}) must be an integer >= 1, or None (the CLI links it from the data)."
                )
        self.model = load_hf_model(model, vocab_size, attn_implementation, dtype)
        _check_has_a_head(self.model)
        # The data's sizes only when given (as TextDataModule saves its vocab_size): Lightning refuses a key that the
        # model and the datamodule both log with different values, and None would clash with the data's.
        unset = [name for name, value in (("vocab_size", vocab_size), ("block_size", block_size)) if value is None]
        self.save_hyperparameters(ignore=["model", *unset])
        # A plain value, so a checkpoint rebuilds the architecture (its weights come from the state dict).
        self.hparams["model"] = model if isinstance(model, (Mapping, str)) else self._config_dict()
        if isinstance(model, nn.Module):  # an instance's own dtype, which the checkpoint's rebuild needs too
            dtypes = {p.dtype for p in self.model.parameters() if p.is_floating_point()}
            dtype = dtypes.pop() if len(dtypes) == 1 else None  # mixed: rebuilt in float32, cast up, nothing lost
        if isinstance(dtype, torch.dtype):  # by name: a logger's hparams.yaml cannot hold a torch.dtype
            self.hparams["dtype"] = str(dtype).removeprefix("torch.")
        if isinstance(model, nn.Module):  # and its attention: the config the checkpoint keeps drops it (rebuilt: sdpa)
            attention = getattr(self.model.config, "_attn_implementation", None)
            if isinstance(attention, str):
                self.hparams["attn_implementation"] = attention
        # Before the structure: a refused loss term is the user's setting to change.
        coef = router_aux_loss_coef(self.model)
        s = find_structure(self.model)  # fail at construction for an architecture it cannot split
        self.__dict__["_aux_coef"] = coef
        self.__dict__["_aux"] = None if coef is None else RouterAux(*router_recorder(self.model, s))
        if self._aux is not None:  # at most one router per layer and one at least, refused now, not at the first fit
            routers = [self._aux.find(layer, i) for i, layer in enumerate(s.base._modules[s.layers])]  # type: ignore[arg-type]
            if all(router is None for router in routers):
                raise ValueError(
                    f"HFCausalLM({type(self.model).__name__}): output_router_logits is on, but no decoder layer holds "
                    f"a {self._aux.name} router module, so there are no router logits for the auxiliary loss. Build "
                    "the model with output_router_logits=False to train the cross-entropy alone."
                )
        config = self.model.config
        if vocab_size is not None and config.vocab_size < vocab_size:
            raise ValueError(
                f"the data have vocab_size={vocab_size} but {type(self.model).__name__} has {config.vocab_size} token "
                "ids; build the model with a vocabulary at least that large."
            )
        positions = getattr(config, "max_position_embeddings", None)
        # Read once: pipeline_input checks every micro-batch against it, and a config's attribute map is no plain
        # attribute read (GPT-2 maps it to n_positions).
        self.__dict__["_positions"] = positions if isinstance(positions, int) else None
        if block_size is not None and isinstance(positions, int) and block_size > positions:
            raise ValueError(
                f"block_size={block_size} exceeds the model's max_position_embeddings={positions}; use shorter blocks."
            )
        # Every name of an embedding table's weight (a tied LM head included): not decayed, on any stage.
        tables = {id(p) for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        self.__dict__["_no_decay"] = frozenset(
            n for n, p in self.named_parameters(remove_duplicate=False) if id(p) in tables or p.ndim < 2
        )
        # Discovered once, on the whole model: a pipeline that has split the module (a rank after fit, before a
        # validate or test on the same Trainer) holds other stages' layers only as placeholders, which the probe
        # cannot run. The parts are looked up by name from it at every pipeline_layers().
        self.__dict__["_structure"] = s
        self.__dict__["_template"] = None

    @override
    def __getstate__(self) -> dict[str, Any]:
        # A forward of a model whose config records outputs (output_router_logits=True) leaves transformers' capture
        # hooks, closures, on its modules: the structure probe at construction, the dry run, or training on one device.
        # They are taken off for pickling (spawn/forkserver ranks) and put back on the copy, whole, by __setstate__;
        # this object's next forward installs its own again.
        marked = remove_output_capture_hooks(self.model)
        return {**super().__getstate__(), "_capture_hooks_marked": marked}

    def __setstate__(self, state: dict[str, Any]) -> None:
        marked = state.pop("_capture_hooks_marked", [])
        super().__setstate__(state)
        reinstall_output_capture_hooks(self.model, marked)

    def _config_dict(self) -> dict[str, Any]:
        return {"model_type": self.model.config.model_type, **self.model.config.to_diff_dict()}

    # ----------------------------------------------------------------- pipeline protocol

    def pipeline_layers(self) -> list[nn.Module]:
        """``[embedding, decoder layer 0, ..., decoder layer L-1, head]`` as adapters around the model's own
        modules (built afresh on every call, so they always hold the model's current parts: on a rank of a split
        module, the placeholders of the other stages' layers)."""
        s = self._structure
        if self._template is None:
            self.__dict__["_template"] = self._dry_run(s)
        return self._chain(s, self._template)

    def pipeline_input(self, batch: Any) -> tuple[Tensor, ...]:
        """What the embedding layer consumes: ``(input_ids,)`` or ``(input_ids, attention_mask)``."""
        ids = batch["input_ids"] if isinstance(batch, Mapping) else batch[0]
        positions = self._positions
        if positions is not None and ids.shape[-1] > positions:
            # A learned position table (GPT-2's n_positions) fails with a bare IndexError deep in stage 0 otherwise.
            raise ValueError(
                f"the batch's sequences have {ids.shape[-1]} tokens but {type(self.model).__name__} has "
                f"max_position_embeddings={positions}; use blocks of at most {positions} tokens "
                f"(TextDataModule(block_size={positions}), --data.init_args.block_size {positions})."
            )
        if isinstance(batch, Mapping):
            self._check_batch_keys(batch)
            mask = batch.get("attention_mask")
            return (ids,) if mask is None else (ids, mask)
        return (ids,)

    def _check_batch_keys(self, batch: Mapping) -> None:
        """Refuse a dict batch's key that the model's own forward takes but HFCausalLM does not pass on
        (``position_ids``, ``token_type_ids``, ...): training went on without it, silently unlike
        ``model(**batch).loss`` (token types added nothing, packed sequences' positions were not reset). Keys the
        forward does not take (a dataset's ``length`` or ``id`` column) are the data's own and stay unread."""
        known = self.__dict__.get("_forward_inputs")
        if known is None:
            known = _forward_inputs(self.model) - _READ_KEYS
            self.__dict__["_forward_inputs"] = known
        unread = sorted(k for k in batch if k in known and batch[k] is not None)
        if unread:
            raise ValueError(
                f"the batch holds {', '.join(map(repr, unread))}, an input of {type(self.model).__name__}.forward that "
                f"HFCausalLM does not pass on: it reads {', '.join(sorted(_READ_KEYS))} only (the stages run the "
                "model's parts from input_ids and attention_mask), so training would differ from "
                "model(**batch).loss. Drop the key from the batch (the model computes its default from input_ids "
                "and attention_mask; give one sequence per row, padded with a mask, not packed rows)."
            )

    def pipeline_loss(self, output: Tensor | tuple[Tensor, Tensor], batch: Any) -> tuple[Tensor, Tensor]:
        """Mean next-token cross-entropy over the counted tokens (fp32 softmax), and their number. With a router
        auxiliary loss (``output`` is ``(logits, aux_loss)``), ``cross-entropy + coef * aux_loss``: what the
        model's own ``outputs.loss`` is, in training and evaluation alike."""
        logits = (output[0] if isinstance(output, tuple) else output).float()
        # A micro-batch of padding only: cross-entropy 0, not 0/0 (`counted_cross_entropy`).
        loss, count = counted_cross_entropy(logits, self._targets(batch), HF_IGNORE_INDEX)
        if isinstance(output, tuple):
            assert self._aux_coef is not None
            loss = loss + self._aux_coef * output[1].to(loss.device)  # Hugging Face's order of operations
        return loss, count

    @staticmethod
    def _targets(batch: Any) -> Tensor:
        if not isinstance(batch, Mapping):
            targets = batch[1]
            return targets.masked_fill(targets < 0, HF_IGNORE_INDEX)
        labels = batch.get("labels")
        if labels is None:
            labels = batch["input_ids"]
            mask = batch.get("attention_mask")
            if mask is not None:
                labels = labels.masked_fill(mask == 0, HF_IGNORE_INDEX)
        # HF's shift (ForCausalLMLoss): position t predicts labels[t + 1]; the last position predicts nothing.
        return F.pad(labels, (0, 1), value=HF_IGNORE_INDEX)[..., 1:]

    def _dry_run(self, s: Structure) -> Template:
        """Learn the layers' call template on a tiny right-padded batch, and check that the parts in a chain give
        the model's own logits twice: at the model's weights, and enlarged (the final modules' weights x10, the LM
        head's scaled to logits of about 100), since a soft-cap, a clamp or any saturating step is invisible at
        random init's small values and plain at large ones. Eval mode and no grad: no dropout, no RNG drawn, the
        weights restored exactly afterwards."""
        model = self.model
        ids, mask = probe_ids(model)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                template = Template.learn(record_calls(s, ids, mask))
                chain = self._chain(s, template)
                want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                got = run_chain(model, s, chain, ids, mask)
                check_logits(model, s, got[0] if self._aux else got, want, "at its weights")
                if self._aux:
                    self._check_aux_loss(got[1], ids, mask)
                with enlarged(model, s):
                    want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                    got = run_chain(model, s, chain, ids, mask)
                    check_logits(
                        model, s, got[0] if self._aux else got, want, "with enlarged final-module and LM-head weights"
                    )
        finally:
            model.train(was_training)
        return template

    def _check_aux_loss(self, chained: Tensor, ids: Tensor, mask: Tensor) -> None:
        """Refuse, naming what differs, unless the chain's auxiliary loss is the model's and the model's own
        ``outputs.loss`` is ``pipeline_loss``'s ``cross-entropy + coef * aux_loss`` (the weight read from the
        config is the one its forward applies, and it adds the term in evaluation too)."""
        model, arch = self.model, type(self.model).__name__
        out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False, output_router_logits=True)
        if not isinstance(out.aux_loss, Tensor):
            raise ValueError(
                f"HFCausalLM({arch}): its config has output_router_logits=True and an auxiliary loss weight, but its "
                "forward returns no aux_loss, so there is no auxiliary loss to train. Build the model with "
                "output_router_logits=False."
            )
        # labels=ids: Hugging Face's loss counts the padded positions too, unlike a batch without labels here.
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
        ours, _ = self.pipeline_loss((out.logits, out.aux_loss), batch)
        if not torch.allclose(chained, out.aux_loss, rtol=1e-5, atol=1e-7) or not torch.allclose(
            ours, out.loss, rtol=1e-5, atol=1e-7
        ):
            raise ValueError(
                f"HFCausalLM({arch}): on the dry run's batch the pipelined auxiliary loss is {chained.item():.8g} and "
                f"the cross-entropy + {self._aux_coef} * auxiliary loss is {ours.item():.8g}, but the model gives "
                f"{out.aux_loss.item():.8g} and a loss of {out.loss.item():.8g}: its router loss is not the one "
                "HFCausalLM carries across stages and weighs by the config's coefficient. Build the model with "
                "output_router_logits=False to train the cross-entropy alone."
            )

    def _chain(self, s: Structure, template: Template) -> list[nn.Module]:
        layers = s.base._modules[s.layers]
        aux = self._aux
        return [
            HFEmbedding(s, template, aux),
            *(HFDecoderLayer(i, layer, template, aux) for i, layer in enumerate(layers)),  # type: ignore[arg-type]
            HFHead(s, self.model, aux),
        ]

    # ----------------------------------------------------------------- Lightning steps

    @override
    def forward(self, inputs: Tensor | Sequence[Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        """Logits ``(B, T, V)`` for ``pipeline_input(batch)`` (or a bare ``input_ids`` tensor); with a router
        auxiliary loss, ``(logits, aux_loss)`` from the model's own forward, as the pipeline's head returns."""
        ids, mask = (
            (inputs, None) if isinstance(inputs, Tensor) else (inputs[0], inputs[1] if len(inputs) > 1 else None)
        )
        if self._aux is None:
            return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out = self.model(input_ids=ids, attention_mask=mask, use_cache=False, output_router_logits=True)
        return out.logits, out.aux_loss

    @override
    def setup(self, stage: str) -> None:
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        data_vocab = getattr(datamodule, "vocab_size", None)
        if isinstance(data_vocab, int) and data_vocab > self.model.config.vocab_size:
            raise ValueError(
                f"The data have vocab_size={data_vocab} but the model has vocab_size={self.model.config.vocab_size}; "
                "build the model with a vocabulary at least that large."
            )
        data_block = getattr(datamodule, "block_size", None)
        positions = self._positions
        if isinstance(data_block, int) and positions is not None and data_block > positions:
            raise ValueError(
                f"The data have block_size={data_block} but {type(self.model).__name__} has "
                f"max_position_embeddings={positions}; use blocks of at most {positions} tokens "
                f"(TextDataModule(block_size={positions}), --data.init_args.block_size {positions})."
            )
        tokens = [c for c in getattr(self._trainer, "callbacks", []) if getattr(c, "normalize", None) == "tokens"]
        if self._aux_coef is not None and tokens:
            # A micro-batch's loss is weighed by its token count there; the auxiliary term is a function of the whole
            # micro-batch's routing (a product of means), not a sum over tokens, so no weighing gives HF's loss.
            raise ValueError(
                f"HFCausalLM({type(self.model).__name__}) trains the router's auxiliary loss "
                f"(router coefficient {self._aux_coef}), which is not a per-token sum: "
                f"{type(tokens[0]).__name__}(normalize='tokens') would weigh it by each micro-batch's token count, "
                "an objective Hugging Face's loss is not. Use normalize='mean' (each micro-batch's loss weighs 1, as "
                "Lightning's accumulate_grad_batches; in a config, `normalize: mean` in the GradientAccumulation "
                "callback's init_args), or output_router_logits=False."
            )

    @override
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        loss, num_items = self.pipeline_loss(self(self.pipeline_input(batch)), batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=self.pipeline_input(batch)[0].size(0))
        return {"loss": loss, "num_items": num_items}

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._eval_step(batch, "val")

    @override
    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._eval_step(batch, "test")

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """Greedy next-token predictions ``(B, T)`` int64, as `GPT`'s (the argmax, not the ``(B, T, V)`` logits,
        which would dominate the memory of ``trainer.predict``). Under PACIStrategy on processes the last stage's
        rank returns them; the other ranks return ``None``."""
        out = self(self.pipeline_input(batch))
        return (out[0] if isinstance(out, tuple) else out).argmax(dim=-1)

    def _eval_step(self, batch: Any, prefix: str) -> Tensor:
        # Exactly one self(...) call: under PACIStrategy the last stage gets the pipeline's output here.
        loss, _ = self.pipeline_loss(self(self.pipeline_input(batch)), batch)
        size = self.pipeline_input(batch)[0].size(0)
        self.log(f"{prefix}_loss", loss, prog_bar=prefix == "val", batch_size=size, sync_dist=True)
        return loss

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over two groups (matrix weights decayed; embeddings, a tied head, norms and biases not) with a
        per-step warmup + cosine LambdaLR, as `GPT`'s. Built from ``self.named_parameters()``, so under
        pipelining each stage gets its own parameters; override to change it."""
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            (no_decay if name in self._no_decay else decay).append(param)
        return adamw_with_warmup_cosine(self, decay, no_decay)
