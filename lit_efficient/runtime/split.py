"""Splitting a module into pipeline stages in place, and putting it back together.

A process keeps the layers of the stages it hosts (its own stage on a rank; every stage when the whole
pipeline runs in one process, where nothing moves). Every other layer is swapped, at its place in the
module tree, for a `LayerOnOtherStage` placeholder without parameters, so ``module.parameters()``,
``configure_optimizers`` and ``state_dict`` see exactly the hosted stages, under the unsplit module's
key names. The placeholder remembers the layer's structure on the meta device (no memory), which
is what lets `unsplit` rebuild the whole model on one rank from the stages' state dicts.

A pipeline layer is either a registered submodule, or an *adapter*: a module kept out of the module
tree (e.g. in a plain list) whose children are registered submodules, such as the decoder layers of
a Hugging Face model wrapped to pass side inputs along (`lit_efficient.models.HFCausalLM`). The
parts that move between stages are then the adapter's children, at their own places in the tree, so
the module's ``state_dict`` keys stay the wrapped model's own.

`only_stage` shows one hosted stage alone for the duration of a block (to build its optimizer, or read
its share of a checkpoint): it swaps the other stages' parts out and puts the very same objects back; on
a rank hosting one stage there is nothing to swap. A process hosting both the first and the last stage
gives the last its own copy of a tied weight, the copy that stage's own rank would hold
(`separate_tied_copies`).

This file also checks what sharing a split can honour: a module registered at two places is refused
(moving one copy to another stage would leave the other on the meta device), and a parameter may be
shared across stages only by the first and the last layer (a tied embedding, see
`lit_efficient.runtime.tied`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


class LayerNotHereError(RuntimeError):
    """A layer of another stage was called: code ran the model's layers itself where this rank holds only its own."""


class LayerOnOtherStage(nn.Module):
    """Stands in for a pipeline layer that lives on another stage.

    Args:
        index: The layer's position in ``pipeline_layers()``.
        stage: The stage that holds it.
        structure: The layer on the meta device (kept out of the module tree).
    """

    def __init__(self, index: int, stage: int, structure: nn.Module) -> None:
        super().__init__()
        self.index = index
        self.stage = stage
        self.__dict__["structure"] = structure  # not a submodule: no keys, no parameters

    def forward(self, *args: object, **kwargs: object) -> None:
        raise LayerNotHereError(
            f"pipeline layer {self.index} lives on stage {self.stage}, not on this rank: under PACIStrategy on "
            "processes each rank holds only its own stages' layers while a fit, validate, test or predict runs (when "
            "it returns, global rank 0 holds the whole model again). Code that runs the layers itself (a generation "
            "loop, a Hugging Face generate(), a sample at an epoch's end) runs after fit under `if "
            "trainer.is_global_zero:`, or on one device from a checkpoint; an evaluation step gets its output from "
            'the pipeline with self(self.pipeline_input(batch)), called once (docs/python-api.md, "The whole '
            'model").'
        )

    def extra_repr(self) -> str:
        return f"layer={self.index}, stage={self.stage}"


@dataclass(frozen=True)
class Tie:
    """A parameter shared by the first and the last pipeline layer (a tied input embedding and LM head).

    Attributes:
        name: The parameter's name in the module where the first layer holds it.
        alias: Its name where the last layer holds it.
        first: (part index, name inside the part) of the first layer's copy.
        last: (part index, name inside the part) of the last layer's copy.
    """

    name: str
    alias: str
    first: tuple[int, str]
    last: tuple[int, str]


@dataclass
class Split:
    """Where each layer went: ``sizes[s]`` layers on stage s, the stages this process hosts, and the slots
    of every layer's parts."""

    sizes: list[int]
    hosted: list[int]
    # (layer index, parent, attribute name) of every part, in layer order: a registered layer is one
    # part; an adapter layer has one part per child.
    slots: list[tuple[int, nn.Module, str]]
    ties: list[Tie] = field(default_factory=list)

    def bounds_of(self, stage: int) -> tuple[int, int]:
        """``[first, last)`` layer indices of ``stage``."""
        first = sum(self.sizes[:stage])
        return first, first + self.sizes[stage]

    def hosts(self, index: int) -> bool:
        """Whether this process holds layer ``index``."""
        return self.stage_of_layer(index) in self.hosted

    @property
    def whole(self) -> bool:
        """Whether this process hosts every stage (nothing was moved out)."""
        return len(self.hosted) == len(self.sizes)

    def stage_of_layer(self, index: int) -> int:
        """The stage that holds layer ``index``."""
        total = 0
        for stage, size in enumerate(self.sizes):
            total += size
            if index < total:
                return stage
        raise IndexError(index)


def layer_parameter_counts(module: nn.Module, layers: Sequence[nn.Module]) -> list[int]:
    """Parameters per layer, after checking that every parameter belongs to a layer and no part of a
    layer is registered twice. A parameter shared by two layers counts in both (see `check_sharing`); the parts
    of a split module's layers on other stages count as if they were here."""
    _check_registered_once(module, layers)
    owner: set[int] = {id(p) for layer in layers for p in layer.parameters()}
    outside = [name for name, p in module.named_parameters() if id(p) not in owner]
    if outside:
        raise ValueError(
            f"parameters {outside[:5]}{' ...' if len(outside) > 5 else ''} belong to no layer of pipeline_layers(): "
            "every parameter must live in exactly one pipeline layer so that some stage trains it"
        )
    return [_parameters_of(layer) for layer in layers]


def _parameters_of(layer: nn.Module) -> int:
    """A layer's parameter count, its parts on other stages included (a placeholder keeps their structure): every
    rank of a split module counts what the whole one does, so a later setup (a validate or test after fit on the
    same module) partitions as the first did, on every rank alike."""
    own = sum(p.numel() for p in layer.parameters())
    away = (m.structure for m in layer.modules() if isinstance(m, LayerOnOtherStage))
    return own + sum(p.numel() for part in away for p in part.parameters())


def check_sharing(module: nn.Module, layers: Sequence[nn.Module], sizes: Sequence[int]) -> list[Tie]:
    """The parameters shared across stages, each a `Tie` of the first and the last layer; raises for any
    other sharing (between other layers on different stages, or by more than two layers)."""
    names = _parameter_names(module)
    stage_of = [s for s, size in enumerate(sizes) for _ in range(size)]
    users: dict[int, list[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            if i not in users.setdefault(id(p), []):
                users[id(p)].append(i)
            params[id(p)] = p
    ties = []
    last = len(layers) - 1
    for key, idx in users.items():
        if len({stage_of[i] for i in idx}) < 2:
            continue  # shared within one stage: that stage holds the one copy
        where = ", ".join(f"{i} ({type(layers[i]).__name__})" for i in idx)
        pname = names.get(key, ["?"])[0]
        if idx != [0, last]:
            # Where the first and the last layer are among them, no balance puts them on one stage: the others go.
            fix = (
                "untie it from layer(s) " + ", ".join(str(i) for i in idx if i not in (0, last))
                if 0 in idx and last in idx
                else "untie them, or choose balance= so that the layers sharing it sit on one stage"
            )
            raise ValueError(
                f"parameter '{pname}' is shared by pipeline layers {where}, which land on different stages. Only a "
                "weight tied between the first and the last layer (input embedding and LM head) can be shared across "
                f"stages: {fix}."
            )
        ties.append(_tie(module, layers, params[key]))
    return ties


def shared_buffers(module: nn.Module, layers: Sequence[nn.Module], sizes: Sequence[int]) -> dict[int, list[tuple]]:
    """Per stage, where its layers register a buffer that a layer on another stage registers too (one tensor, by
    identity): ``(name, owner, key, buffer, stages)``, ``owner._buffers[key]`` being ``buffer``. On processes each
    stage keeps its own copy; fine for a constant table, not for one a layer changes
    (`PipelineStage.check_shared_buffers`). Owner and key, not the tensor alone: a move to the device replaces it."""
    names: dict[int, str] = {}
    for n, b in module.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), n)
    stage_of = [s for s, size in enumerate(sizes) for _ in range(size)]
    holders: dict[int, list[tuple[int, nn.Module, str, torch.Tensor]]] = {}
    for i, layer in enumerate(layers):
        for owner in layer.modules():
            for key, b in owner._buffers.items():
                if b is not None:
                    holders.setdefault(id(b), []).append((stage_of[i], owner, key, b))
    out: dict[int, list[tuple]] = {}
    for key_id, found in holders.items():
        stages = sorted({s for s, *_ in found})
        if len(stages) > 1:
            for s, owner, key, b in found:
                out.setdefault(s, []).append((names.get(key_id, "?"), owner, key, b, stages))
    return out


_RECORDED_TIES = "_lit_efficient_ties"  # on a module split by a run: the ties that run found (see `find_ties`)


def find_ties(module: nn.Module, layers: Sequence[nn.Module], sizes: Sequence[int]) -> list[Tie]:
    """The weights shared across stages (`check_sharing`). On a module that an earlier run on processes left split
    on this rank (every rank but global rank 0 keeps its stage's layers after fit), another stage's parts are
    placeholders without parameters and a weight tied to one of them cannot be seen: that run's ties, which
    `split_module` recorded on the module, are still its ties (a second fit, or Tuner.lr_find then fit)."""
    recorded = module.__dict__.get(_RECORDED_TIES)
    slots = layer_slots(module, layers)
    left_split = any(isinstance(_get(parent, name), LayerOnOtherStage) for _, parent, name in slots)
    if left_split and recorded is not None:
        return list(recorded)
    return check_sharing(module, layers, sizes)


def split_module(
    module: nn.Module,
    layers: Sequence[nn.Module],
    sizes: Sequence[int],
    hosted: Sequence[int],
    ties: Sequence[Tie] = (),
) -> Split:
    """Replace every part of a layer outside the ``hosted`` stages with a placeholder, in place; returns the
    record. Hosting every stage moves nothing."""
    slots = layer_slots(module, layers)
    split = Split(list(sizes), sorted(hosted), slots, list(ties))
    module.__dict__[_RECORDED_TIES] = list(ties)  # not an attribute torch sees: no state, no submodule
    # A part two layers share (nanochat's weightless norm, before the first layer and after the last) stays where a
    # hosted layer uses it; replaced by the other layer's placeholder, it failed the hosted layer on that rank.
    used_here = {(id(parent), name) for i, parent, name in slots if split.hosts(i)}
    for i, parent, name in slots:
        part = _get(parent, name)
        if (id(parent), name) in used_here and not split.hosts(i):
            continue
        if split.hosts(i):
            if isinstance(part, LayerOnOtherStage):
                raise ValueError(
                    f"layer {i} is needed on stage {split.stage_of_layer(i)} but this process holds no weights for it "
                    "(the module was split by an earlier run with another layout). Load a consolidated checkpoint "
                    "into a fresh module."
                )
            continue
        if not isinstance(part, LayerOnOtherStage):
            part = LayerOnOtherStage(i, split.stage_of_layer(i), _to_meta(part))
        part.stage = split.stage_of_layer(i)
        _set(parent, name, part)
    return split


def unsplit(split: Split, state_dicts: dict[int, dict[str, torch.Tensor]], device: torch.device) -> None:
    """Put every part back, rebuilding moved-out ones from ``state_dicts[part index]`` on ``device``,
    and tie the shared parameters again (the two stages' copies become one parameter)."""
    for k, (_, parent, name) in enumerate(split.slots):
        current = _get(parent, name)
        if not isinstance(current, LayerOnOtherStage):
            continue
        part = current.structure.to_empty(device=device)
        if k in state_dicts:
            state = dict(state_dicts[k])
            modes, trainable = state.pop(_TRAINING, None), state.pop(_REQUIRES_GRAD, None)
            # Non-persistent buffers (e.g. a rotary inv_freq table) travel too: to_empty leaves them garbage.
            unexpected = part.load_state_dict(state, strict=False).unexpected_keys
            for key in unexpected:
                part.get_buffer(key).copy_(state[key])
            # The owner's flags, not the split-time copy's: a dropout or BatchNorm the user put in eval mode, a
            # layer frozen or unfrozen during the run, came back as they were at the split.
            if modes is not None:
                for module, training in zip(part.modules(), modes.tolist(), strict=True):
                    module.training = bool(training)
            if trainable is not None:
                for param, flag in zip(part.parameters(), trainable.tolist(), strict=True):
                    param.requires_grad_(bool(flag))
        _set(parent, name, part)
    tie_again(split)


@contextmanager
def every_part_in_place(split: Split) -> Iterator[None]:
    """Within the block, every part is in its place in the module: the hosted ones as they are, the others as their
    structure on the meta device (no weights), so the module's ``state_dict`` keys are the unsplit module's. Every
    part is back afterwards."""
    parts = [_get(parent, name) for _, parent, name in split.slots]
    try:
        for (_, parent, name), part in zip(split.slots, parts, strict=True):
            if isinstance(part, LayerOnOtherStage):
                _set(parent, name, part.structure)
        yield
    finally:
        for (_, parent, name), part in zip(split.slots, parts, strict=True):
            _set(parent, name, part)


@contextmanager
def every_layer(split: Split) -> Iterator[list[nn.Module] | None]:
    """Within the block, every layer is in its place (`every_part_in_place`); yields them in layer order. None where
    a layer is an adapter (parts of its own, not one module of the tree): there is no one module to give."""
    indices = [i for i, _, _ in split.slots]
    if len(indices) != len(set(indices)):  # an adapter's several parts
        yield None
        return
    with every_part_in_place(split):
        yield [_get(parent, name) for _, parent, name in split.slots]


@contextmanager
def only_stage(split: Split, stage: int | None) -> Iterator[None]:
    """Within the block, the split module holds only ``stage``'s parts (the others are placeholders without
    parameters), as on that stage's rank after `split_module`: ``parameters()``, ``state_dict()`` and
    ``configure_optimizers`` see that stage alone (``None``: no layer, only what the module holds itself). Every
    part is back in its place afterwards, the same object, untouched. On a rank that hosts ``stage`` alone
    nothing changes."""
    parts = [_get(parent, name) for _, parent, name in split.slots]
    used = {(id(parent), name) for i, parent, name in split.slots if split.stage_of_layer(i) == stage}
    try:
        for (i, parent, name), part in zip(split.slots, parts, strict=True):
            if (id(parent), name) in used:
                continue  # the stage's own part, or one it shares with another stage's layer
            if split.stage_of_layer(i) != stage and not isinstance(part, LayerOnOtherStage):
                _set(parent, name, LayerOnOtherStage(i, split.stage_of_layer(i), part))
        yield
    finally:
        for (_, parent, name), part in zip(split.slots, parts, strict=True):
            _set(parent, name, part)


def separate_tied_copies(split: Split) -> None:
    """Give the last layer its own copy of every tied weight: a new parameter equal to the first layer's.

    A process hosting both the first and the last stage holds both layers in one module, where a tied weight
    is one parameter; the two-copy rule (`lit_efficient.runtime.tied`) needs the two copies each stage holds
    on its own rank. `tie_again` makes them one parameter again (the first layer's, with the last's value).
    """
    for tie in split.ties:
        holder, attr = _holder(split, tie.last)
        param = getattr(holder, attr)
        setattr(holder, attr, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))


def tie_again(split: Split) -> None:
    """Make every tie of ``split`` one parameter again, the first layer's, holding the last layer's copy's value.

    The copies differ under PACI between its delayed updates (a checkpoint taken mid-run holds both): the value kept
    is the one ``load_state_dict`` of the whole model keeps (the later key, the last layer's), and so one device's
    ``load_from_checkpoint``; one process (a tie kept one parameter while evaluating) loads it so too. Rebuilding
    rank 0's model after an evaluation on processes kept the embedding's copy: 7e-9 from one process's weights."""
    for tie in split.ties:
        part, name = tie.first
        holder, attr = _holder(split, tie.last)
        first, last = _get(*split.slots[part][1:]).get_parameter(name), getattr(holder, attr)
        if last is not first:
            with torch.no_grad():
                first.copy_(last)
        setattr(holder, attr, first)


def _holder(split: Split, where: tuple[int, str]) -> tuple[nn.Module, str]:
    """The module holding the parameter at ``(part index, name inside the part)``, and its attribute name."""
    part, name = where
    holder_path, _, attr = name.rpartition(".")
    holder = _get(*split.slots[part][1:])
    return (holder.get_submodule(holder_path) if holder_path else holder), attr


def local_layer_state_dicts(split: Split) -> dict[int, dict[str, torch.Tensor]]:
    """This process's parts' state dicts on CPU, keyed by part index (for `unsplit` on another rank)."""
    return {k: _part_state(_get(parent, name)) for k, (i, parent, name) in enumerate(split.slots) if split.hosts(i)}


# Keys no state_dict has, for a part's module flags: each submodule's train/eval mode and each parameter's
# requires_grad, in `modules()` / `parameters()` order (the same on every rank: one structure).
_TRAINING, _REQUIRES_GRAD = "\x00training", "\x00requires_grad"


def _part_state(part: nn.Module) -> dict[str, torch.Tensor]:
    state = {key: v.detach().cpu() for key, v in part.state_dict().items()}
    for key, buf in part.named_buffers():
        state.setdefault(key, buf.detach().cpu())  # non-persistent ones: not in state_dict, needed by unsplit
    state[_TRAINING] = torch.tensor([m.training for m in part.modules()], dtype=torch.bool)
    state[_REQUIRES_GRAD] = torch.tensor([p.requires_grad for p in part.parameters()], dtype=torch.bool)
    return state


def layer_slots(module: nn.Module, layers: Sequence[nn.Module]) -> list[tuple[int, nn.Module, str]]:
    """``(layer index, parent, attribute name)`` of every part of every layer, in layer order: a registered
    layer is one part; an adapter (kept out of the module tree, without parameters of its own) one part per
    child. Raises, naming the layer, for a layer that is neither."""
    where: dict[int, tuple[nn.Module, str]] = {}
    for parent in module.modules():
        for name, child in parent._modules.items():
            if child is not None:
                where.setdefault(id(child), (parent, name))
    slots = []
    for i, layer in enumerate(layers):
        if id(layer) in where:
            slots.append((i, *where[id(layer)]))
            continue
        children = [child for child in layer.children()]
        if not children or any(id(c) not in where for c in children) or next(layer.parameters(False), None) is not None:
            raise ValueError(
                f"pipeline_layers()[{i}] ({type(layer).__name__}) is not a submodule of the module: register every "
                "pipeline layer as an attribute or in an nn.ModuleList so the stage can find and keep it (or, for an "
                "adapter around registered modules, keep the adapter out of the module tree and give it no parameters "
                "of its own)"
            )
        slots += [(i, *where[id(c)]) for c in children]
    return slots


def _check_registered_once(module: nn.Module, layers: Sequence[nn.Module]) -> None:
    """A module reachable at two places would keep a copy on every stage (and the moved-out copy's parameters
    on the meta device: the 'Cannot copy out of meta tensor' error at setup). Refuse it, naming both places.
    A module with no parameters and no buffers (an activation that blocks share, as openai-gpt's do) holds
    nothing to copy or to train: every stage may call the one object."""
    paths: dict[int, list[str]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(name)
    for i, layer in enumerate(layers):
        for m in layer.modules():
            found = paths.get(id(m), [])
            stateless = next(m.parameters(), None) is None and next(m.buffers(), None) is None
            if len(found) > 1 and not stateless:
                raise ValueError(
                    f"pipeline_layers()[{i}] ({type(layer).__name__}) contains a {type(m).__name__} registered twice "
                    f"in {type(module).__name__}, as '{found[0]}' and '{found[1]}' (e.g. the original model kept "
                    "as an attribute next to wrappers around its own layers). Register each layer once: keep "
                    "wrappers out of the module tree (in a plain list) or drop the original model's attribute; for a "
                    "Hugging Face model use lit_efficient.models.HFCausalLM(model). To share weights on purpose, give "
                    "each layer its own module holding the same nn.Parameter (layers on one stage share it; across "
                    "stages only the first and the last layer may, as a tied embedding and head)."
                )


def _parameter_names(module: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _tie(module: nn.Module, layers: Sequence[nn.Module], param: nn.Parameter) -> Tie:
    slots = layer_slots(module, layers)
    last = len(layers) - 1

    def locate(layer_index: int) -> tuple[int, str]:
        for k, (i, parent, name) in enumerate(slots):
            if i != layer_index:
                continue
            for pname, p in _get(parent, name).named_parameters(remove_duplicate=False):
                if p is param:
                    return k, pname
        raise AssertionError("a tied parameter must be found in both layers")

    first_part, last_part = locate(0), locate(last)
    prefix = {id(_get(parent, name)): _qualname(module, _get(parent, name)) for _, parent, name in slots}
    parts = [_get(*slots[k][1:]) for k in (first_part[0], last_part[0])]
    name = f"{prefix[id(parts[0])]}.{first_part[1]}".lstrip(".")
    alias = f"{prefix[id(parts[1])]}.{last_part[1]}".lstrip(".")
    return Tie(name, alias, first_part, last_part)


def _qualname(module: nn.Module, target: nn.Module) -> str:
    for name, m in module.named_modules():
        if m is target:
            return name
    return ""


def _to_meta(part: nn.Module) -> nn.Module:
    """``part`` moved to the meta device with new parameter objects: a parameter it shares with a layer kept on
    this stage (a tied embedding) stays real there. (``Module.to`` would change a shared parameter in place.)"""
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        return part.to("meta")
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)


def _get(parent: nn.Module, name: str) -> nn.Module:
    return parent._modules[name]  # type: ignore[return-value]


def _set(parent: nn.Module, name: str, layer: nn.Module) -> None:
    parent._modules[name] = layer


def check_stage_parameters(counts: Sequence[int], sizes: Sequence[int]) -> None:
    """Refuse, before training, a split that leaves a stage without parameters: it would have nothing to
    optimize (torch refuses an empty optimizer on that rank while its peers hang on it)."""
    first = 0
    for stage, size in enumerate(sizes):
        if sum(counts[first : first + size]) == 0:
            raise ValueError(
                f"stage {stage} would hold pipeline layers {first}..{first + size - 1}, which have no parameters. "
                f"Give every stage a layer with weights: balance='parameters', an explicit balance=[...] (layers per "
                f"stage; sizes {list(sizes)} now), or fewer pipeline_stages; or fold the parameter-free layers into "
                "a neighbouring layer in pipeline_layers()."
            )
        first += size
