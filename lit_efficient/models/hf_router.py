"""A mixture-of-experts router's auxiliary (load-balancing) loss in `HFCausalLM`: whether a model's own loss adds
one and with which weight (read from its config), and which module in each decoder layer produces the logits it
takes (read from the model's own ``_can_record_outputs``).

`HFCausalLM`'s adapters (`lit_efficient.models.hf`) use `RouterAux` to carry each layer's router logits to the
head, where the causal LM's own forward computes ``aux_loss`` from them; a loss term it cannot reproduce (a
z-loss, two weights, no declared router) is refused here with the config's values and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import nn

from lit_efficient.models.hf_structure import Structure


def router_aux_loss_coef(model: nn.Module) -> float | None:
    """The weight Hugging Face's own loss gives the router's auxiliary (load-balancing) loss, None when it adds
    none; a ValueError, naming the config values and the fix, for a term `HFCausalLM` does not train.

    Read from the config and its sub-configs by the names transformers 5.24 uses, not from a list of models:
    a mixture-of-experts router's auxiliary loss is added when ``output_router_logits`` is on and its weight is
    nonzero (``router_aux_loss_coef``: Mixtral, Qwen2-MoE, OLMoE, Jamba, GraniteMoE, ..., a composite's in its
    ``text_config``; JetMoE's ``aux_loss_coef``; DBRX's ``ffn_config.moe_loss_weight``). That term is trained
    (the model's own ``aux_loss`` times this weight, on every path; the dry run checks that this is the model's
    ``outputs.loss``). A z-loss on the logits whenever its weight is nonzero (Bamba's ``z_loss_coefficient``)
    is refused, and so are two different auxiliary weights (which one the forward applies is unknown)."""
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
    if z_loss:
        found = ", ".join(f"{k}={v}" for k, v in z_loss.items())
        raise ValueError(
            f"HFCausalLM({arch}): its config has {found}, so Hugging Face's own loss adds a z-loss on the logits to "
            "the cross-entropy. HFCausalLM adds it on no path, so it would train a different objective. Build the "
            f"model with {' and '.join(f'{k}=0' for k in z_loss)} (the config's default), or train it elsewhere."
        )
    if len(set(aux.values())) > 1:
        found = ", ".join(f"{k}={v}" for k, v in {"output_router_logits": True, **aux}.items())
        raise ValueError(
            f"HFCausalLM({arch}): its config has {found}: two different weights for the router's auxiliary loss, and "
            "HFCausalLM cannot tell which one its forward applies, so it would train a different objective. Keep one "
            "nonzero, or build the model with output_router_logits=False to train the cross-entropy alone."
        )
    return float(next(iter(aux.values()))) if aux else None


def router_recorder(model: nn.Module, s: Structure) -> tuple[type | str, int]:
    """The router module's class (or class-name suffix) in each decoder layer and the index of its logits in
    the router's output, from the model's own ``_can_record_outputs["router_logits"]`` (how transformers itself
    collects them), or a ValueError."""
    recorder = None
    for owner in (s.base, model):
        recorder = (getattr(owner, "_can_record_outputs", None) or {}).get("router_logits", recorder)
    if isinstance(recorder, type):
        return recorder, 0
    if recorder is not None and getattr(recorder, "layer_name", None) is None:
        return recorder.class_name or recorder.target_class, recorder.index
    raise ValueError(
        f"HFCausalLM({type(model).__name__}): output_router_logits is on, but the model declares no router module "
        "(its _can_record_outputs has no plain 'router_logits' entry), so HFCausalLM cannot carry the router's "
        "logits across stages for the auxiliary loss. Build the model with output_router_logits=False to train "
        "the cross-entropy alone."
    )


@dataclasses.dataclass(frozen=True)
class RouterAux:
    """How the adapters carry a mixture-of-experts router's logits to the head when the loss includes the router's
    auxiliary loss: ``router`` is the router module's class (or class-name suffix), ``index`` its logits' place in
    the router's output. The payload then ends with two more entries: the 2D attention mask (the loss excludes
    padding; None without one) and every earlier layer's router logits stacked, ``(layers so far, *logits)``,
    None before the first layer."""

    router: type | str
    index: int

    def find(self, layer: nn.Module, i: int) -> nn.Module | None:
        """Decoder layer ``i``'s one router module, or None for a layer without one: a dense layer between expert
        layers (Jamba's ``expert_layer_period``, Qwen2-MoE's ``mlp_only_layers``), which records no logits in the
        model's own forward either, and a placeholder for another stage's layer on a split rank."""
        found = [
            m
            for m in layer.modules()
            if (type(m).__name__.endswith(self.router) if isinstance(self.router, str) else isinstance(m, self.router))
        ]
        if len(found) > 1:
            raise ValueError(
                f"HFCausalLM: decoder layer {i} holds {len(found)} {self.name} router modules, not one, so it cannot "
                "say which logits the auxiliary loss takes. Build the model with output_router_logits=False."
            )
        return found[0] if found else None

    @property
    def name(self) -> str:
        return self.router if isinstance(self.router, str) else self.router.__name__


def remove_output_capture_hooks(model: nn.Module) -> list[str]:
    """Take off the forward hooks transformers installs on the modules the first time a forward is asked to record
    outputs (``output_router_logits=True``), and the marks that say they are there; return the names of the marked
    modules, for `reinstall_output_capture_hooks`.

    They are closures, so a model that carries them cannot be pickled, and `HFCausalLM` runs such forwards before
    any launch (its structure probe at construction): ``PACIStrategy(start_method="spawn" | "forkserver")`` then
    failed to send the module to its ranks. Recognized by the hook's name in transformers' ``output_capturing``
    module."""
    marked = []
    for name, module in model.named_modules():
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__name__", "") == "output_capturing_hook":
                del module._forward_hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
        if module.__dict__.pop("_output_capturing_hooks_installed", False):
            marked.append(name)
    return marked


def reinstall_output_capture_hooks(model: nn.Module, marked: list[str]) -> None:
    """After unpickling: register each Hugging Face model class's recordable outputs again, and install transformers'
    capture hooks on the modules `remove_output_capture_hooks` named, while the model is whole.

    transformers keeps which outputs a class can record in a registry filled by ``PreTrainedModel.__init__``, which
    an unpickled copy in a fresh (spawned) process never runs: its forwards would then record nothing, and a
    Mixtral's auxiliary loss would be the integer 0. Left to the next forward, the hooks would also be installed in
    a pipeline rank after the split, on whichever modules its stage holds then."""
    from transformers import PreTrainedModel

    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, maybe_install_capturing_hooks
    except ImportError:  # a transformers without recorded outputs: nothing to restore
        return

    modules = dict(model.named_modules())
    for module in modules.values():
        if isinstance(module, PreTrainedModel) and not _CAN_RECORD_REGISTRY.get(module):
            _CAN_RECORD_REGISTRY[module] = module._can_record_outputs
    for name in marked:
        maybe_install_capturing_hooks(modules[name])
