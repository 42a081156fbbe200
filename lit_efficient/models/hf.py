"""`HFCausalLM`: any decoder-only Hugging Face causal LM as a pipelineable LightningModule, no glue code.

This file owns the adapter between a `transformers` model and the pipeline protocol: finding the
model's parts, passing its side inputs between stages, its loss on both batch formats, its optimizer.

The model is split as ``[input embeddings, decoder layer 0, ..., decoder layer L-1, head]``, found
from the model's own structure and behaviour, with no per-model code here (`find_structure`): the
decoder layers are the one ``nn.ModuleList`` of ``config.num_hidden_layers`` modules wherever it sits
(``model.model.layers``, ``model.transformer.h``, OPT's ``model.model.decoder.layers``); the module
holding it is the decoder stack, whose other children are sorted by one hooked run of its forward into
those it calls before the layers (embeddings, rotary tables) and after them (the final norm, with or
without weights, a projection, or nothing).

Side inputs (position ids, rotary cos/sin, causal and padding masks) are the model's own: the first
stage runs the decoder stack's forward with every decoder layer replaced by a recorder, so HF's code
computes them exactly as it would unsplit; the first recorder call gives the hidden states, each call
the arguments of that layer. They travel with the hidden states (as tensors, never requiring grad, so
no gradient is computed or sent back for them), and each decoder-layer adapter replays its layer's
call with them. The last stage runs the modules called after the layers, then the causal LM's own
forward with the decoder stack replaced by a stub returning those hidden states: the LM head and
whatever the model does to its logits (soft-capping, logit scales) are the model's code, not a copy.
Which arguments are tensors and which ones are shared by several layers is learned once, from a dry
run on a tiny padded batch, which also checks that the chain of parts reproduces the model's logits at
its weights and at enlarged ones (so the check does not pass or fail with the weights' scale), and
refuses, naming what failed, an architecture it cannot reproduce instead of training it wrong.

The adapters are not registered in this module's tree (they hold the model's own submodules), so
``module.model`` stays the real HF model: ``state_dict`` keys are ``model.<HF key>`` and
``module.model.save_pretrained(dir)`` works before and after ``fit``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from typing_extensions import override

from lit_efficient.models.gpt import adamw_with_warmup_cosine

HF_IGNORE_INDEX = -100  # labels equal to this are ignored (Hugging Face's convention)


def load_hf_model(model: Any, vocab_size: int | None = None, attn_implementation: str | None = None) -> nn.Module:
    """A `PreTrainedModel` from an instance (returned as is), a config dict with ``model_type`` (random
    init), or a local folder written by ``save_pretrained``. Never downloads."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
    except ImportError as err:  # pragma: no cover - the hf extra
        raise ImportError("HFCausalLM needs transformers: pip install 'lit-efficient[hf]'") from err
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if isinstance(model, PreTrainedModel):
        return model
    if isinstance(model, Mapping):
        values = dict(model)
        if "model_type" not in values:
            raise ValueError(
                f"HFCausalLM(model={values}) needs a 'model_type' key (e.g. 'llama', 'gpt2', 'qwen2') to pick the "
                "config class"
            )
        if vocab_size is not None:
            values.setdefault("vocab_size", vocab_size)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        return AutoModelForCausalLM.from_config(config, **kwargs)
    if isinstance(model, (str, Path)):
        folder = Path(model)
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"HFCausalLM(model={str(model)!r}) is not a local folder with a config.json. HFCausalLM never "
                "downloads: save the model with save_pretrained(folder) (or download it yourself) and pass the folder, "
                "or pass a config dict with model_type."
            )
        return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **kwargs)
    raise TypeError(
        f"HFCausalLM(model=...) takes a transformers PreTrainedModel, a config dict or a local folder; got "
        f"{type(model).__name__}"
    )


def check_loss_is_cross_entropy(model: nn.Module) -> None:
    """Refuse, naming the config values and the fix, a model whose Hugging Face loss adds a term to the
    cross-entropy of the logits, which is all `HFCausalLM` trains (on one device and pipelined alike).

    Read from the config and its sub-configs by the names transformers 5.24 uses, not from a list of models:
    a mixture-of-experts router's auxiliary (load-balancing) loss is added when ``output_router_logits`` is
    on and its weight is nonzero (``router_aux_loss_coef``: Mixtral, Qwen2-MoE, OLMoE, Jamba, GraniteMoE, ...,
    a composite's in its ``text_config``; JetMoE's ``aux_loss_coef``; DBRX's ``ffn_config.moe_loss_weight``),
    a z-loss on the logits whenever its weight is nonzero (Bamba's ``z_loss_coefficient``). A model whose
    forward ignores the flag (Llama-4) is refused too: turning the flag off costs it nothing."""
    weights: dict[str, float] = {}
    router = False

    def walk(values: Mapping[str, Any], prefix: str) -> None:
        nonlocal router
        for key, value in ((str(k), v) for k, v in values.items()):  # id2label's keys are ints
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
            elif key == "output_router_logits":
                router = router or bool(value)
            elif (
                "loss" in key
                and ("coef" in key or "weight" in key)
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and value != 0
            ):
                weights[f"{prefix}{key}"] = value

    walk(model.config.to_dict(), "")
    z_loss = {k: v for k, v in weights.items() if "z_loss" in k}
    aux = {k: v for k, v in weights.items() if k not in z_loss} if router else {}
    arch = type(model).__name__
    if aux:
        found = ", ".join(f"{k}={v}" for k, v in {"output_router_logits": True, **aux}.items())
        raise ValueError(
            f"HFCausalLM({arch}): its config has {found}, so Hugging Face's own loss adds the router's auxiliary "
            "(load-balancing) loss to the cross-entropy. HFCausalLM adds it on no path (one device, DDP or "
            "pipelined: its loss is the cross-entropy of the logits), so it would train a different objective. "
            "Build the model with output_router_logits=False (the config's default) to train the cross-entropy "
            "alone, or train it with its auxiliary loss elsewhere."
        )
    if z_loss:
        found = ", ".join(f"{k}={v}" for k, v in z_loss.items())
        raise ValueError(
            f"HFCausalLM({arch}): its config has {found}, so Hugging Face's own loss adds a z-loss on the logits to "
            "the cross-entropy. HFCausalLM adds it on no path, so it would train a different objective. Build the "
            f"model with {' and '.join(f'{k}=0' for k in z_loss)} (the config's default), or train it elsewhere."
        )


# ----------------------------------------------------------------------------- structure


@dataclass
class _Structure:
    """Where the parts of a causal LM are. ``base`` is the module whose forward runs the decoder layers
    (``model.model``, ``model.transformer``, OPT's ``model.model.decoder``), found by its layers, not by name."""

    base: nn.Module  # the decoder stack: its forward computes the side inputs and calls every decoder layer
    parent: nn.Module  # the module holding ``base`` as its child ``base_name`` (where the head stage stubs it)
    base_name: str
    path: str  # ``base``'s qualified name in the model, for messages
    embed: list[str]  # children of base the first stage holds (embeddings, dropout, rotary, unused ones)
    layers: str  # the ModuleList of decoder layers in base
    finals: list[str]  # children of base its forward calls after the last layer, in call order (final norm, ...)
    head: list[str]  # children of the model outside the decoder stack (the LM head, ...): the last stage's
    output_type: type  # what base's forward returns (a ModelOutput class), for the head stage's stub
    layer_returns: int | None  # how many values a decoder layer returns (RWKV's 3), None for a bare tensor


def _probe_ids(model: nn.Module) -> tuple[Tensor, Tensor]:
    """A tiny batch of two rows of four tokens, the second right-padded: what the structure probe and the dry
    run feed (ids below the vocabulary, so any model takes them)."""
    device = next(model.parameters()).device
    ids = torch.arange(8, device=device).remainder(model.config.vocab_size).view(2, 4)
    mask = torch.ones_like(ids)
    mask[1, -1] = 0
    return ids, mask


def find_structure(model: nn.Module) -> _Structure:
    """The parts of ``model``, or a ValueError saying what was looked for and not found.

    The decoder layers are the one ``nn.ModuleList`` of ``config.num_hidden_layers`` modules (the one with
    the most weights if several have that length), wherever it sits: ``base`` is its parent. Which other
    children of ``base`` come before the layers and which after them (the final norm, with or without
    weights, or none at all) is read from one run of ``base``'s forward on a tiny batch (eval mode, no grad)
    with a hook on each child, so no attribute name is assumed."""
    arch = type(model).__name__
    config = getattr(model, "config", None)
    want = (
        f"HFCausalLM splits a decoder-only causal LM as [input embeddings, decoder layers, final modules + LM head] "
        f"and could not find that shape in {arch}"
    )
    if config is None or getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{want}: it is not a decoder-only transformers model (is_encoder_decoder or no config).")
    # A composite config (Fuyu's: text + vision) keeps the decoder's depth in its text part.
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = getattr(text_config, "num_hidden_layers", None)
    lists = [
        (name, m)
        for name, m in model.named_modules()
        if name and isinstance(m, nn.ModuleList) and len(m) == n_layers and any(True for _ in m.parameters())
    ]
    if not lists:
        raise ValueError(
            f"{want}: looked for an nn.ModuleList of config.num_hidden_layers={n_layers} decoder layers and found none."
        )
    layers_path, _ = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    path, _, layers = layers_path.rpartition(".")
    if not path:
        raise ValueError(f"{want}: its decoder layers are a direct child of the model, with no decoder stack around")
    base = model.get_submodule(path)
    parent_path, _, base_name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    top = path.split(".")[0]
    head = [n for n, _ in model.named_children() if n != top]
    held = {id(p) for p in base.parameters()}
    held |= {id(p) for n in head for p in model.get_submodule(n).parameters()}
    stray = sorted({n.rpartition(".")[0] for n, p in model.named_parameters() if id(p) not in held})
    if stray:  # e.g. a vision tower beside the text decoder, or weights on the way down to it
        raise ValueError(f"{want}: {stray} hold weights outside the decoder stack model.{path} and the model's head.")
    order, output_type, layer_returns = _call_order(model, base, layers)
    children = [n for n, _ in base.named_children() if n != layers]
    first_layer, last_layer = order.index(f"{layers}.0"), order.index(f"{layers}.end")
    between = sorted({c for c in order[first_layer:last_layer] if c in children})
    if between:
        raise ValueError(
            f"{want}: model.{path}'s forward calls {between} between its decoder layers, which a split between layers "
            "cannot reproduce."
        )
    before = {c for c in order[:first_layer] if c in children}
    finals = list(dict.fromkeys(c for c in order[last_layer:] if c in children))
    # A module without weights may run on both ends (nanochat's norm after the embedding and after the layers).
    shared = sorted(c for c in before & set(finals) if any(True for _ in base._modules[c].parameters()))  # type: ignore[union-attr]
    if shared:
        raise ValueError(
            f"{want}: model.{path}'s forward calls {shared} both before and after its decoder layers; they hold "
            "weights, so they belong to no single stage."
        )
    embed = [c for c in children if c not in finals or c in before]
    return _Structure(base, parent, base_name, path, embed, layers, finals, head, output_type, layer_returns)


def _call_order(model: nn.Module, base: nn.Module, layers: str) -> tuple[list[str], type, int | None]:
    """The order in which ``base``'s forward calls its children (each decoder layer as ``layers.i``) on the probe
    batch, the type of what it returns, and how many values a decoder layer returns (None: a bare tensor)."""
    order: list[str] = []
    returns: list[int | None] = []
    handles = []
    for name, child in base.named_children():
        subs = list(child.named_children()) if name == layers else [("", child)]
        for i, m in subs:
            label = f"{name}.{i}" if i else name
            handles.append(m.register_forward_pre_hook(lambda *_, label=label: order.append(label)))
    last = base._modules[layers][-1]  # type: ignore[index]
    handles.append(last.register_forward_hook(lambda *_: order.append(f"{layers}.end")))
    handles.append(
        last.register_forward_hook(lambda _m, _a, out: returns.append(len(out) if isinstance(out, tuple) else None))
    )
    # On the meta device (a model planned, never materialized: lit_efficient.plan) the probe runs on fake
    # tensors: transformers reads values (a padding mask's `.all()`) that meta tensors do not have, and takes
    # its tracing paths for fake ones. The order of the calls is the same.
    on_meta = next(model.parameters()).is_meta
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True) if on_meta else contextlib.nullcontext():
            ids, mask = _probe_ids(model)
            out = base(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    n = len(base._modules[layers])  # type: ignore[arg-type]
    if [o for o in order if o.startswith(f"{layers}.")] != [*(f"{layers}.{i}" for i in range(n)), f"{layers}.end"]:
        raise ValueError(
            f"HFCausalLM needs {type(model).__name__}'s decoder stack to call each of its {n} decoder layers once, in "
            "order; it did not."
        )
    return order, type(out), returns[0]


# ----------------------------------------------------------------------------- side inputs


class _Recorded(Exception):
    """Raised by the last recorder: the base model's forward has produced every layer's arguments."""


class _Recorder(nn.Module):
    """Stands in for decoder layer ``index`` during the first stage's run of the base forward."""

    def __init__(self, index: int, last: int, like: nn.Module, log: list, returns: int | None = None) -> None:
        super().__init__()
        self.index, self.last, self.returns = index, last, returns
        self.__dict__["log"] = log
        # Plain attributes some base forwards read from their layers (e.g. attention_type).
        for key, value in vars(getattr(like, "structure", like)).items():
            if not key.startswith("_") and key != "training" and isinstance(value, (str, int, float, bool)):
                self.__dict__.setdefault(key, value)
        self.__dict__["like_"] = like

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # A class attribute of the layer (Inkling's attention_type), or one of its submodules: RWKV's base
            # forward rescales its blocks' weights in place when the model switches between eval and training, and
            # must reach the real weights. Nothing that computes: a base forward calling a layer's submodule would
            # change the hidden states, which the dry run's logits check catches.
            value = getattr(self.__dict__["like_"], name)
            if isinstance(value, (str, int, float, bool, nn.Module)):
                return value
            raise

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.log.append((args, kwargs))
        if self.index == self.last:
            raise _Recorded
        hidden = args[0] if args else kwargs["hidden_states"]
        # A base forward that unpacks its layers' tuples (RWKV's `hidden, state, attentions = block(...)`) gets a
        # tuple as long; the other values are None, what they are without a cache or attention outputs. A base that
        # used them would feed the next layer something else, which the dry run's logits check catches.
        return hidden if self.returns is None else (hidden, *(None,) * (self.returns - 1))


def _record_calls(s: _Structure, input_ids: Tensor, attention_mask: Tensor | None) -> list[tuple[tuple, dict]]:
    """Each decoder layer's call ``(args, kwargs)`` as the base forward would make it, without running any layer."""
    original = s.base._modules[s.layers]
    log: list[tuple[tuple, dict]] = []
    n = len(original)  # type: ignore[arg-type]
    recorders = nn.ModuleList(_Recorder(i, n - 1, original[i], log, s.layer_returns) for i in range(n))  # type: ignore[index]
    with _swapped(s.base, s.layers, recorders), contextlib.suppress(_Recorded):
        s.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    if len(log) != n:
        raise ValueError(f"the base model's forward called {len(log)} of its {n} decoder layers; HFCausalLM needs all")
    return log


# A template entry: ("hidden",) the incoming hidden states, ("side", g) side input g, ("tuple", (g, ...)) a
# tuple of side inputs, ("const", value) a value that is not a tensor (use_cache=False, cache=None, ...).
_Entry = tuple


@dataclass
class _Template:
    """How to replay every decoder layer's call from the hidden states and a flat tuple of side inputs."""

    args: list[list[_Entry]]
    kwargs: list[dict[str, _Entry]]
    num_side: int

    @classmethod
    def learn(cls, calls: list[tuple[tuple, dict]]) -> _Template:
        groups: dict[int, int] = {}  # id(tensor) -> side index: one slot per distinct tensor (a mask shared by layers)

        def entry(value: Any) -> _Entry:
            if isinstance(value, Tensor):
                return ("side", groups.setdefault(id(value), len(groups)))
            if isinstance(value, tuple) and value and all(isinstance(v, Tensor) for v in value):
                return ("tuple", tuple(entry(v)[1] for v in value))
            return ("const", value)

        args, kwargs = [], []
        for i, (a, kw) in enumerate(calls):
            if not a or "hidden_states" in kw:
                raise ValueError(f"decoder layer {i} was not called with the hidden states as its first argument")
            args.append([("hidden",), *(entry(v) for v in a[1:])])
            kwargs.append({k: entry(v) for k, v in kw.items()})
        return cls(args, kwargs, len(groups))

    def side_inputs(self, calls: list[tuple[tuple, dict]]) -> list[Tensor | None]:
        """This micro-batch's side inputs in template order, checking that the calls have the learned shape."""
        side: list[Tensor | None] = [None] * self.num_side
        seen = [False] * self.num_side

        def put(e: _Entry, value: Any, where: str) -> None:
            kind = e[0]
            if kind == "side":
                if value is not None and not isinstance(value, Tensor):
                    raise ValueError(f"{where}: expected a tensor or None, got {type(value).__name__}")
                if seen[e[1]] and side[e[1]] is not value:
                    raise ValueError(f"{where}: a side input the dry run saw shared by several layers differs now")
                side[e[1]], seen[e[1]] = value, True
            elif kind == "tuple":
                if not isinstance(value, tuple) or len(value) != len(e[1]):
                    raise ValueError(f"{where}: expected a tuple of {len(e[1])} tensors")
                for g, v in zip(e[1], value, strict=True):
                    put(("side", g), v, where)
            elif kind == "const" and value is not e[1] and value != e[1]:
                raise ValueError(f"{where}: {value!r} differs from the dry run's {e[1]!r}")

        for i, (a, kw) in enumerate(calls):
            for j, (e, v) in enumerate(zip(self.args[i][1:], a[1:], strict=True)):
                put(e, v, f"decoder layer {i} argument {j + 1}")
            for k, e in self.kwargs[i].items():
                put(e, kw.get(k), f"decoder layer {i} argument {k}")
        return side

    def call(self, i: int, layer: nn.Module, hidden: Tensor, side: Sequence[Tensor | None]) -> Tensor:
        """Run decoder layer ``i`` as the base forward would."""

        def value(e: _Entry) -> Any:
            if e[0] == "hidden":
                return hidden
            if e[0] == "side":
                return side[e[1]]
            if e[0] == "tuple":
                return tuple(side[g] for g in e[1])
            return e[1]

        out = layer(*(value(e) for e in self.args[i]), **{k: value(e) for k, e in self.kwargs[i].items()})
        return out[0] if isinstance(out, (tuple, list)) else out  # openai-gpt's blocks return lists


# ----------------------------------------------------------------------------- pipeline layers


class HFEmbedding(nn.Module):
    """Pipeline layer 0: ``(input_ids[, attention_mask])`` -> ``(hidden, *side inputs)``, by the base forward."""

    def __init__(self, s: _Structure, template: _Template) -> None:
        super().__init__()
        for name in s.embed:
            self.add_module(name, s.base._modules[name])
        self.__dict__.update(structure_=s, template=template)

    @override
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor | None, ...]:
        calls = _record_calls(self.structure_, input_ids, attention_mask)
        return (calls[0][0][0], *self.template.side_inputs(calls))


class HFDecoderLayer(nn.Module):
    """Pipeline layer 1 + i: decoder layer i on ``(hidden, *side)``; the side inputs pass through unchanged."""

    def __init__(self, index: int, layer: nn.Module, template: _Template) -> None:
        super().__init__()
        self.index = index
        self.layer = layer
        self.__dict__["template"] = template

    @override
    def forward(self, hidden: Tensor, *side: Tensor | None) -> tuple[Tensor | None, ...]:
        return (self.template.call(self.index, self.layer, hidden, side), *side)


class _Stub(nn.Module):
    """Stands in for the decoder stack during the head stage's run of the causal LM's forward: returns the
    hidden states the stage received, as the stack's own output type, whatever it is called with."""

    def __init__(self, hidden: Tensor, output_type: type, like: nn.Module) -> None:
        super().__init__()
        # Plain attributes the causal LM's forward may read from its decoder stack (Falcon-H1's multipliers).
        for key, value in vars(like).items():
            if not key.startswith("_") and key != "training" and isinstance(value, (str, int, float, bool)):
                self.__dict__[key] = value
        self.__dict__.update(hidden=hidden, output_type=output_type)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if dataclasses.is_dataclass(self.output_type):
            return self.output_type(last_hidden_state=self.hidden)
        return (self.hidden,)


class HFHead(nn.Module):
    """Last pipeline layer, ``(hidden, *side)`` -> logits ``(B, T, V)``: the modules the decoder stack calls after
    its last layer (the final norm, a projection; none for some models), then the causal LM's own forward with the
    decoder stack replaced by a stub returning those hidden states. So the LM head and whatever the model does to
    its logits (Gemma-2's soft-capping, Cohere's and Granite's logit scales, ...) are the model's own code, not a
    copy of it here."""

    def __init__(self, s: _Structure, model: nn.Module) -> None:
        super().__init__()
        # Children, not a ModuleList: every part of an adapter is a module registered in the model (split.py).
        finals = [s.base._modules[n] for n in s.finals]
        for name, module in zip(s.finals, finals, strict=True):
            self.add_module(f"final_{name}", module)
        for name in s.head:
            self.add_module(name, model._modules[name])
        self.__dict__.update(structure_=s, causal_lm=model, finals=finals)

    @override
    def forward(self, hidden: Tensor, *side: Tensor | None) -> Tensor:
        for module in self.finals:
            hidden = module(hidden)
        s = self.structure_
        with _swapped(s.parent, s.base_name, _Stub(hidden, s.output_type, s.base)):
            return self.causal_lm(use_cache=False).logits


@contextlib.contextmanager
def _swapped(parent: nn.Module, name: str, replacement: nn.Module) -> Iterator[None]:
    """``parent.<name>`` is ``replacement`` inside the block (the model's own forward then runs around it)."""
    original = parent._modules[name]
    parent._modules[name] = replacement
    try:
        yield
    finally:
        parent._modules[name] = original


def _run_chain(model: nn.Module, s: _Structure, chain: Sequence[nn.Module], ids: Tensor, mask: Tensor) -> Tensor:
    x: Any = (ids, mask)
    try:
        for layer in chain:
            x = layer(*x) if isinstance(x, tuple) else layer(x)
    except Exception as err:
        raise ValueError(
            f"HFCausalLM's dry run of {type(model).__name__} split as [model.{s.path} up to its decoder layers, each "
            f"decoder layer, {[f'model.{s.path}.{n}' for n in s.finals]} + the causal LM's forward from there] failed "
            f"in {type(layer).__name__}: {type(err).__name__}: {err}. Its forward needs more than that chain gives it "
            "(e.g. the input ids on the last stage), so it cannot be split this way."
        ) from err
    return x


@contextlib.contextmanager
def _enlarged(model: nn.Module, s: _Structure) -> Iterator[None]:
    """Inside the block, the final modules' floating weights are 10x and the LM head's weight is scaled so that the
    logits are about 100 in size; restored bit for bit afterwards."""
    finals = [p for n in s.finals for p in s.base._modules[n].parameters() if p.is_floating_point()]  # type: ignore[union-attr]
    head = getattr(model.get_output_embeddings(), "weight", None)
    params = list({id(p): p for p in [*finals, *([head] if isinstance(head, Tensor) else [])]}.values())
    saved = [p.detach().clone() for p in params]
    try:
        for p in finals:
            p.mul_(10.0)
        if isinstance(head, Tensor):
            size = model(input_ids=_probe_ids(model)[0], use_cache=False).logits.abs().max().item()
            if size > 0:
                head.mul_(100.0 / size)
        yield
    finally:
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)


def _check_logits(model: nn.Module, s: _Structure, got: Tensor, want: Tensor, when: str) -> None:
    """Raise, naming what differs, unless the chain's logits ``got`` equal the model's ``want`` to float
    reassociation (relative to the logits' size, so the check does not pass or fail with the weights' scale)."""
    scale = max(1.0, want.abs().max().item())
    if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5 * scale):
        return
    diff = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
    raise ValueError(
        f"HFCausalLM cannot reproduce {type(model).__name__}'s logits {when} from the chain [model.{s.path} up to "
        f"its decoder layers, each decoder layer, {[f'model.{s.path}.{n}' for n in s.finals]} + the causal LM's "
        f"forward from there] (max difference {diff:.3g} at logits of size {scale:.3g}): its forward does something "
        "between the layers or on the way to the logits that depends on more than one stage's inputs, so it cannot "
        "be split this way."
    )


# ----------------------------------------------------------------------------- the module


class HFCausalLM(LightningModule):
    """A Hugging Face decoder-only causal LM that trains on one device, under DDP and pipelined, unchanged.

    Batches are either ``(input_ids, targets)`` tuples with ``targets`` already the next tokens
    (`TextDataModule`; negative targets are ignored), or dicts with ``input_ids``, an optional
    ``attention_mask`` and optional ``labels`` (HF's convention: labels are the inputs, shifted inside
    the loss, -100 ignored; without labels, the inputs with padding ignored). The loss is the mean
    over the counted tokens, with their number, so ``GradientAccumulation(normalize="tokens")`` is
    exact with padding. Tied input/output embeddings (GPT-2, Llama 3.2, Qwen2.5, ...) are supported
    across stages (see `lit_efficient.pipeline.tied`).

    Args:
        model: A ``transformers`` ``PreTrainedModel`` (e.g. ``LlamaForCausalLM(config)``), a config dict
            with ``model_type`` (built with random weights; what configs and the CLI use), or a local
            folder written by ``save_pretrained``. Never downloads.
        vocab_size: The data's vocabulary (the CLI links it from the data). A config dict without
            ``vocab_size`` takes it; otherwise the model must have at least this many token ids.
        block_size: The data's context length (linked by the CLI); checked against the model's
            ``max_position_embeddings`` when it has one.
        attn_implementation: ``"sdpa"``, ``"eager"``, ... for a model built here; None keeps HF's default.
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
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if learning_rate <= 0 or weight_decay < 0 or warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(
                f"HFCausalLM(learning_rate={learning_rate}, weight_decay={weight_decay}, warmup_steps={warmup_steps}, "
                f"min_lr_ratio={min_lr_ratio}): need learning_rate > 0, weight_decay >= 0, warmup_steps >= 0 and "
                "min_lr_ratio in [0, 1]"
            )
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"HFCausalLM(max_steps={max_steps}) must be >= 1, or None to use the Trainer's estimate.")
        self.model = load_hf_model(model, vocab_size, attn_implementation)
        self.save_hyperparameters(ignore=["model"])
        # A plain value, so a checkpoint rebuilds the architecture (its weights come from the state dict).
        self.hparams["model"] = model if isinstance(model, (Mapping, str)) else self._config_dict()
        check_loss_is_cross_entropy(self.model)  # before the structure: it is the user's setting to change
        find_structure(self.model)  # fail at construction for an architecture it cannot split
        config = self.model.config
        if vocab_size is not None and config.vocab_size < vocab_size:
            raise ValueError(
                f"the data have vocab_size={vocab_size} but {type(self.model).__name__} has {config.vocab_size} token "
                "ids; build the model with a vocabulary at least that large."
            )
        positions = getattr(config, "max_position_embeddings", None)
        if block_size is not None and isinstance(positions, int) and block_size > positions:
            raise ValueError(
                f"block_size={block_size} exceeds the model's max_position_embeddings={positions}; use shorter blocks."
            )
        # Every name of an embedding table's weight (a tied LM head included): not decayed, on any stage.
        tables = {id(p) for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        self.__dict__["_no_decay"] = frozenset(
            n for n, p in self.named_parameters(remove_duplicate=False) if id(p) in tables or p.ndim < 2
        )
        self.__dict__["_template"] = None

    def _config_dict(self) -> dict[str, Any]:
        return {"model_type": self.model.config.model_type, **self.model.config.to_diff_dict()}

    # ----------------------------------------------------------------- pipeline protocol

    def pipeline_layers(self) -> list[nn.Module]:
        """``[embedding, decoder layer 0, ..., decoder layer L-1, head]`` as adapters around the model's own
        modules (built afresh on every call, so they always hold the model's current parts)."""
        s = find_structure(self.model)
        if self._template is None:
            self.__dict__["_template"] = self._dry_run(s)
        return self._chain(s, self._template)

    def pipeline_input(self, batch: Any) -> tuple[Tensor, ...]:
        """What the embedding layer consumes: ``(input_ids,)`` or ``(input_ids, attention_mask)``."""
        if isinstance(batch, Mapping):
            mask = batch.get("attention_mask")
            return (batch["input_ids"],) if mask is None else (batch["input_ids"], mask)
        return (batch[0],)

    def pipeline_loss(self, output: Tensor, batch: Any) -> tuple[Tensor, Tensor]:
        """Mean next-token cross-entropy over the counted tokens (fp32 softmax), and their number."""
        logits = output.float()
        targets = self._targets(batch)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=HF_IGNORE_INDEX)
        return loss, (targets != HF_IGNORE_INDEX).sum()

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

    def _dry_run(self, s: _Structure) -> _Template:
        """Learn the layers' call template on a tiny right-padded batch, and check that the parts in a chain give
        the model's own logits twice: at the model's weights, and enlarged (the final modules' weights x10, the LM
        head's scaled to logits of about 100), since a soft-cap, a clamp or any saturating step is invisible at
        random init's small values and plain at large ones. Eval mode and no grad: no dropout, no RNG drawn, the
        weights restored exactly afterwards."""
        model = self.model
        ids, mask = _probe_ids(model)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                template = _Template.learn(_record_calls(s, ids, mask))
                chain = self._chain(s, template)
                want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                _check_logits(model, s, _run_chain(model, s, chain, ids, mask), want, "at its weights")
                with _enlarged(model, s):
                    want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                    got = _run_chain(model, s, chain, ids, mask)
                    _check_logits(model, s, got, want, "with enlarged final-module and LM-head weights")
        finally:
            model.train(was_training)
        return template

    def _chain(self, s: _Structure, template: _Template) -> list[nn.Module]:
        layers = s.base._modules[s.layers]
        return [
            HFEmbedding(s, template),
            *(HFDecoderLayer(i, layer, template) for i, layer in enumerate(layers)),  # type: ignore[arg-type]
            HFHead(s, self.model),
        ]

    # ----------------------------------------------------------------- Lightning steps

    @override
    def forward(self, inputs: Tensor | Sequence[Tensor]) -> Tensor:
        """Logits ``(B, T, V)`` for ``pipeline_input(batch)`` (or a bare ``input_ids`` tensor)."""
        ids, mask = (
            (inputs, None) if isinstance(inputs, Tensor) else (inputs[0], inputs[1] if len(inputs) > 1 else None)
        )
        return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    @override
    def setup(self, stage: str) -> None:
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        data_vocab = getattr(datamodule, "vocab_size", None)
        if isinstance(data_vocab, int) and data_vocab > self.model.config.vocab_size:
            raise ValueError(
                f"The data have vocab_size={data_vocab} but the model has vocab_size={self.model.config.vocab_size}; "
                "build the model with a vocabulary at least that large."
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
