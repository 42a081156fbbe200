"""Where a Hugging Face causal LM's parts are and how its decoder layers are called: `HFCausalLM`'s structure
discovery and dry run, with no per-model code.

This file owns reading a model's shape from the model itself (`find_structure`): the decoder layers are the
one ``nn.ModuleList`` of ``config.num_hidden_layers`` modules wherever it sits (``model.model.layers``,
``model.transformer.h``, OPT's ``model.model.decoder.layers``); the module holding it is the decoder stack,
whose other children are sorted by one hooked run of its forward into those it calls before the layers
(embeddings, rotary tables) and after them (the final norm, with or without weights, a projection, or
nothing). It also owns each decoder layer's recorded call (`record_calls`: the stack's forward with every
layer replaced by a recorder, so Hugging Face's code computes the side inputs, position ids, rotary cos/sin
and masks, exactly as unsplit) and the `Template` that replays it from the hidden states and a flat tuple of
side inputs, and the dry run's checks that a chain of parts gives the model's own logits at its weights and
at enlarged ones (`run_chain`, `enlarged`, `check_logits`). What it cannot reproduce is refused with a
ValueError naming what was looked for or what differs. The adapters that hold the parts, and the
LightningModule, are `lit_efficient.models.hf`'s.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

# ----------------------------------------------------------------------------- structure


@dataclass
class Structure:
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


def probe_ids(model: nn.Module) -> tuple[Tensor, Tensor]:
    """A tiny batch of two rows of four tokens, the second right-padded: what the structure probe and the dry
    run feed (ids below the vocabulary, so any model takes them)."""
    device = next(model.parameters()).device
    ids = torch.arange(8, device=device).remainder(model.config.vocab_size).view(2, 4)
    mask = torch.ones_like(ids)
    mask[1, -1] = 0
    return ids, mask


def find_structure(model: nn.Module) -> Structure:
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
    elements = {name: _element_of_a_list(model, name) for name, _ in lists}
    if all(elements.values()):
        # LongCat-Flash: num_hidden_layers counts the two attention sublayers of each decoder layer, so the only
        # lists of that length are a layer's parts; taking one would split one layer's forward, not the stack.
        outer, _, index = next(iter(elements.values())).rpartition(".")  # type: ignore[union-attr]
        raise ValueError(
            f"{want}: the only nn.ModuleLists of config.num_hidden_layers={n_layers} modules "
            f"({', '.join(f'model.{name}' for name in elements)}) sit inside an element of another nn.ModuleList "
            f"(model.{outer}.{index}, one of the {len(model.get_submodule(outer))} modules of model.{outer}): they "
            f"are parts of one layer, not the decoder layers, and a split between them would cut that layer's "
            f"forward in two. config.num_hidden_layers does not count model.{outer}'s layers here, so HFCausalLM "
            "cannot tell which list holds the decoder layers."
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
        raise ValueError(
            f"{want}: {stray} hold weights outside the decoder stack model.{path} and the model's head. "
            "docs/hf-models.md lists the architectures that train and why the others are refused."
        )
    own = [n for n, _ in base.named_parameters(recurse=False)]
    if own:  # ZAYA's input scale and bias: a stage holds whole modules, and this one holds every decoder layer too
        raise ValueError(
            f"{want}: model.{path} holds weights of its own, outside its child modules ({own}), which no single "
            "pipeline stage can hold: a stage holds whole modules, and that module holds every decoder layer."
        )
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
    indexed = [c for c in finals if _container(base._modules[c])]  # type: ignore[arg-type]
    if indexed:
        raise ValueError(
            f"{want}: model.{path}'s forward calls the modules of {indexed} (an nn.ModuleList or ModuleDict) after its "
            "decoder layers, with code of its own around them, which the last stage cannot replay by calling modules."
        )
    embed = [c for c in children if c not in finals or c in before]
    return Structure(base, parent, base_name, path, embed, layers, finals, head, output_type, layer_returns)


def _container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _element_of_a_list(model: nn.Module, name: str) -> str | None:
    """The element of another ``nn.ModuleList`` that module ``name`` sits inside (``layers.0`` for
    ``layers.0.self_attn``), or None."""
    parts = name.split(".")
    for i in range(1, len(parts) - 1):
        holder = ".".join(parts[:i])
        if parts[i].isdigit() and isinstance(model.get_submodule(holder), nn.ModuleList):
            return f"{holder}.{parts[i]}"
    return None


def _call_order(model: nn.Module, base: nn.Module, layers: str) -> tuple[list[str], type, int | None]:
    """The order in which ``base``'s forward calls its children (each decoder layer as ``layers.i``) on the probe
    batch, the type of what it returns, and how many values a decoder layer returns (None: a bare tensor)."""
    order: list[str] = []
    returns: list[int | None] = []
    handles = []
    for name, child in base.named_children():
        # A container's own forward is never called: its elements are (Gemma-3n's altup projections), under its name.
        subs = list(child.named_children()) if name == layers or _container(child) else [("", child)]
        for i, m in subs:
            label = f"{name}.{i}" if i and name == layers else name
            handles.append(m.register_forward_pre_hook(lambda *_, label=label: order.append(label)))
    last = base._modules[layers][-1]  # type: ignore[index]
    handles.append(last.register_forward_hook(lambda *_: order.append(f"{layers}.end")))
    handles.append(
        last.register_forward_hook(lambda _m, _a, out: returns.append(len(out) if isinstance(out, tuple) else None))
    )
    # On the meta device (a model planned, never materialized: lit_efficient.cli.plan) the probe runs on fake
    # tensors: transformers reads values (a padding mask's `.all()`) that meta tensors do not have, and takes
    # its tracing paths for fake ones. The order of the calls is the same.
    on_meta = next(model.parameters()).is_meta
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True) if on_meta else contextlib.nullcontext():
            ids, mask = probe_ids(model)
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


def record_calls(s: Structure, input_ids: Tensor, attention_mask: Tensor | None) -> list[tuple[tuple, dict]]:
    """Each decoder layer's call ``(args, kwargs)`` as the base forward would make it, without running any layer."""
    original = s.base._modules[s.layers]
    log: list[tuple[tuple, dict]] = []
    n = len(original)  # type: ignore[arg-type]
    recorders = nn.ModuleList(_Recorder(i, n - 1, original[i], log, s.layer_returns) for i in range(n))  # type: ignore[index]
    with swapped(s.base, s.layers, recorders), contextlib.suppress(_Recorded):
        s.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    if len(log) != n:
        raise ValueError(f"the base model's forward called {len(log)} of its {n} decoder layers; HFCausalLM needs all")
    return log


# A template entry: ("hidden",) the incoming hidden states, ("side", g) side input g, ("seq", tuple or list,
# (entry, ...)) and ("map", ((key, entry), ...)) a tuple, list or dict holding tensors at any depth (rotary cos/sin,
# DeepSeek-V4's per-layer-type rotary tables, ZAYA's masks by attention kind), ("const", value) a value holding no
# tensor (use_cache=False, cache=None, ...), ("fresh", empty) an empty container the base forward hands every layer
# to fill (Gemma 4's shared_kv_states).
_Entry = tuple


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensors(v) for v in value)
    return isinstance(value, Mapping) and any(_holds_tensors(v) for v in value.values())


def _is_empty_container(value: Any) -> bool:
    # MutableMapping, not dict: Gemma 4's KVSharingDict is a UserDict (so FSDP's helpers leave it alone).
    return isinstance(value, (MutableMapping, MutableSequence)) and not isinstance(value, Tensor) and len(value) == 0


@dataclass
class Template:
    """How to replay every decoder layer's call from the hidden states and a flat tuple of side inputs."""

    args: list[list[_Entry]]
    kwargs: list[dict[str, _Entry]]
    num_side: int

    @classmethod
    def learn(cls, calls: list[tuple[tuple, dict]]) -> Template:
        groups: dict[int, int] = {}  # id(tensor) -> side index: one slot per distinct tensor (a mask shared by layers)

        def entry(value: Any, where: str) -> _Entry:
            if isinstance(value, Tensor):
                return ("side", groups.setdefault(id(value), len(groups)))
            # Containers are taken apart into their tensors, which travel as side inputs like any other, and
            # rebuilt for each layer: a shared tensor inside them still takes one slot.
            if type(value) in (tuple, list) and _holds_tensors(value):
                return ("seq", type(value), tuple(entry(v, where) for v in value))
            if type(value) is dict and _holds_tensors(value):
                return ("map", tuple((k, entry(v, where)) for k, v in value.items()))
            if _holds_tensors(value):
                raise ValueError(
                    f"{where} is a {type(value).__name__} holding tensors, which HFCausalLM cannot take apart to send "
                    "between stages"
                )
            if _is_empty_container(value):
                # State the layers write for one another (Gemma 4 stores a layer's keys and values there for later
                # layers to reuse). It cannot cross a stage boundary, so every layer call gets an empty one of its
                # own, on any split alike: a layer that needs another's writes fails in the dry run (see `call`).
                return ("fresh", value)
            return ("const", value)

        args, kwargs = [], []
        for i, (a, kw) in enumerate(calls):
            if not a or "hidden_states" in kw:
                raise ValueError(f"decoder layer {i} was not called with the hidden states as its first argument")
            args.append([("hidden",), *(entry(v, f"decoder layer {i} argument {j + 1}") for j, v in enumerate(a[1:]))])
            kwargs.append({k: entry(v, f"decoder layer {i} argument {k}") for k, v in kw.items()})
        return cls(args, kwargs, len(groups))

    def side_inputs(self, calls: list[tuple[tuple, dict]]) -> list[Tensor | None]:
        """This micro-batch's side inputs in template order, checking that the calls have the learned shape."""
        side: list[Tensor | None] = [None] * self.num_side
        seen = [False] * self.num_side

        for i, (a, kw) in enumerate(calls):
            for j, (e, v) in enumerate(zip(self.args[i][1:], a[1:], strict=True)):
                _put(e, v, f"decoder layer {i} argument {j + 1}", side, seen)
            for k, e in self.kwargs[i].items():
                _put(e, kw.get(k), f"decoder layer {i} argument {k}", side, seen)
        return side

    def call(self, i: int, layer: nn.Module, hidden: Tensor, side: Sequence[Tensor | None]) -> Tensor:
        """Run decoder layer ``i`` as the base forward would."""
        fresh = [f"argument {j}" for j, e in enumerate(self.args[i]) if e[0] == "fresh"]
        fresh += [f"argument {k}" for k, e in self.kwargs[i].items() if e[0] == "fresh"]
        args = [_value(e, hidden, side) for e in self.args[i]]
        kwargs = {k: _value(e, hidden, side) for k, e in self.kwargs[i].items()}
        try:
            out = layer(*args, **kwargs)
        except (KeyError, IndexError) as err:
            if not fresh:
                raise
            raise ValueError(
                f"decoder layer {i} looked up {err} in its {', '.join(fresh)}, a container the decoder stack hands "
                "every layer to fill: it reads what an earlier layer wrote there (key/value states shared across "
                "layers), state that is not in the hidden states and cannot cross a stage boundary"
            ) from err
        return out[0] if isinstance(out, (tuple, list)) else out  # openai-gpt's blocks return lists


# Module-level, not closures: a nested function that calls itself by name is a reference cycle (function ->
# cell -> function) holding what it captured, here the hidden states and their autograd graph, until Python's
# cyclic collector runs: every micro-batch's layer inputs stayed alive for a while, the memory plan's measured
# activations depended on when the collector ran (47% above the plan on one stage), and page faults rose.
def _value(e: _Entry, hidden: Tensor, side: Sequence[Tensor | None]) -> Any:
    """The value of template entry ``e`` for this call: the hidden states, a side input, or a structure of them."""
    if e[0] == "hidden":
        return hidden
    if e[0] == "side":
        return side[e[1]]
    if e[0] == "seq":
        return e[1](_value(sub, hidden, side) for sub in e[2])
    if e[0] == "map":
        return {k: _value(sub, hidden, side) for k, sub in e[1]}
    if e[0] == "fresh":
        return copy.copy(e[1])  # empty, of the base forward's own type
    return e[1]


def _put(e: _Entry, value: Any, where: str, side: list[Tensor | None], seen: list[bool]) -> None:
    """Check ``value`` against template entry ``e`` and put the side inputs it holds into ``side``."""
    kind = e[0]
    if kind == "side":
        if value is not None and not isinstance(value, Tensor):
            raise ValueError(f"{where}: expected a tensor or None, got {type(value).__name__}")
        if seen[e[1]] and side[e[1]] is not value:
            raise ValueError(f"{where}: a side input the dry run saw shared by several layers differs now")
        side[e[1]], seen[e[1]] = value, True
    elif kind == "seq":
        if type(value) is not e[1] or len(value) != len(e[2]):
            raise ValueError(f"{where}: expected a {e[1].__name__} of {len(e[2])} values")
        for sub, v in zip(e[2], value, strict=True):
            _put(sub, v, where, side, seen)
    elif kind == "map":
        if type(value) is not dict or value.keys() != {k for k, _ in e[1]}:
            raise ValueError(f"{where}: expected a dict of {[k for k, _ in e[1]]}")
        for k, sub in e[1]:
            _put(sub, value[k], where, side, seen)
    elif kind == "fresh" and not (type(value) is type(e[1]) and _is_empty_container(value)):
        raise ValueError(f"{where}: expected an empty {type(e[1]).__name__}, got {value!r}")
    elif kind == "const" and value is not e[1] and value != e[1]:
        raise ValueError(f"{where}: {value!r} differs from the dry run's {e[1]!r}")


# ----------------------------------------------------------------------------- the dry run's helpers


@contextlib.contextmanager
def swapped(parent: nn.Module, name: str, replacement: nn.Module) -> Iterator[None]:
    """``parent.<name>`` is ``replacement`` inside the block (the model's own forward then runs around it)."""
    original = parent._modules[name]
    parent._modules[name] = replacement
    try:
        yield
    finally:
        parent._modules[name] = original


def run_chain(model: nn.Module, s: Structure, chain: Sequence[nn.Module], ids: Tensor, mask: Tensor) -> Tensor:
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
def enlarged(model: nn.Module, s: Structure) -> Iterator[None]:
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
            size = model(input_ids=probe_ids(model)[0], use_cache=False).logits.abs().max().item()
            if size > 0:
                head.mul_(100.0 / size)
        yield
    finally:
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)


def check_logits(model: nn.Module, s: Structure, got: Tensor, want: Tensor, when: str) -> None:
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
