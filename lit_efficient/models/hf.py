"""`HFCausalLM`: any decoder-only Hugging Face causal LM as a pipelineable LightningModule, no glue code.

This file owns the adapter between a `transformers` model and the pipeline protocol: finding the
model's parts, passing its side inputs between stages, its loss on both batch formats, its optimizer.

The model is split as ``[input embeddings, decoder layer 0, ..., decoder layer L-1, final norm + LM
head]``, found from the model's own structure: ``model.base_model`` holds one ``nn.ModuleList`` of
``config.num_hidden_layers`` decoder layers and, after it, one module with weights (the final norm);
``model.get_output_embeddings()`` is the head. GPT-2 and every Llama-layout model (Llama, Mistral,
Qwen2, ...) have that shape, with no per-model code here.

Side inputs (position ids, rotary cos/sin, causal and padding masks) are the model's own: the first
stage runs the base model's forward with every decoder layer replaced by a recorder, so HF's code
computes them exactly as it would unsplit; the first recorder call gives the hidden states, each call
the arguments of that layer. They travel with the hidden states (as tensors, never requiring grad, so
no gradient is computed or sent back for them), and each decoder-layer adapter replays its layer's
call with them. Which arguments are tensors and which ones are shared by several layers is learned
once, from a dry run on a tiny padded batch, which also checks that the chain of parts reproduces the
model's logits (so an architecture whose forward does more, e.g. logit soft-capping, is refused
instead of trained wrong).

The adapters are not registered in this module's tree (they hold the model's own submodules), so
``module.model`` stays the real HF model: ``state_dict`` keys are ``model.<HF key>`` and
``module.model.save_pretrained(dir)`` works before and after ``fit``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
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


# ----------------------------------------------------------------------------- structure


@dataclass
class _Structure:
    """Where the parts of a causal LM are, by attribute name."""

    base: nn.Module  # model.base_model: the decoder stack
    embed: list[str]  # children of base that the embedding stage runs (embeddings, dropout, rotary)
    layers: str  # the ModuleList of decoder layers in base
    norm: str  # the final norm in base
    head: str  # the LM head in model


def find_structure(model: nn.Module) -> _Structure:
    """The parts of ``model``, or a ValueError saying what was looked for and not found."""
    arch = type(model).__name__
    config = getattr(model, "config", None)
    want = (
        f"HFCausalLM splits a decoder-only causal LM as [input embeddings, decoder layers, final norm, LM head] and "
        f"could not find that shape in {arch}"
    )
    if config is None or getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{want}: it is not a decoder-only transformers model (is_encoder_decoder or no config).")
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise ValueError(f"{want}: model.base_model (the decoder stack) is missing; pass an ...ForCausalLM model.")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = next((n for n, m in model.named_children() if m is head), None)
    if head is None or head_name is None:
        raise ValueError(f"{want}: model.get_output_embeddings() (the LM head) is not a direct child of the model.")
    n_layers = getattr(config, "num_hidden_layers", None)
    children = list(base.named_children())
    lists = [n for n, m in children if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if len(lists) != 1:
        raise ValueError(
            f"{want}: looked for one nn.ModuleList of config.num_hidden_layers={n_layers} decoder layers in "
            f"model.{model.base_model_prefix}, found {lists or 'none'} among its children {[n for n, _ in children]}."
        )
    at = [n for n, _ in children].index(lists[0])
    weighted_after = [n for n, m in children[at + 1 :] if any(True for _ in m.parameters())]
    if len(weighted_after) != 1:
        raise ValueError(
            f"{want}: looked for one module with weights (the final norm) after model.{model.base_model_prefix}."
            f"{lists[0]}, found {weighted_after or 'none'}."
        )
    others = [n for n, m in model.named_children() if m is not base and m is not head and any(m.parameters())]
    if others:
        raise ValueError(f"{want}: {others} hold weights outside the decoder stack and the LM head.")
    embed = [n for n, _ in children if n not in (lists[0], weighted_after[0])]
    return _Structure(base, embed, lists[0], weighted_after[0], head_name)


# ----------------------------------------------------------------------------- side inputs


class _Recorded(Exception):
    """Raised by the last recorder: the base model's forward has produced every layer's arguments."""


class _Recorder(nn.Module):
    """Stands in for decoder layer ``index`` during the first stage's run of the base forward."""

    def __init__(self, index: int, last: int, like: nn.Module, log: list) -> None:
        super().__init__()
        self.index, self.last = index, last
        self.__dict__["log"] = log
        # Plain attributes some base forwards read from their layers (e.g. attention_type).
        for key, value in vars(getattr(like, "structure", like)).items():
            if not key.startswith("_") and key != "training" and isinstance(value, (str, int, float, bool)):
                self.__dict__.setdefault(key, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.log.append((args, kwargs))
        if self.index == self.last:
            raise _Recorded
        return args[0] if args else kwargs["hidden_states"]


def _record_calls(s: _Structure, input_ids: Tensor, attention_mask: Tensor | None) -> list[tuple[tuple, dict]]:
    """Each decoder layer's call ``(args, kwargs)`` as the base forward would make it, without running any layer."""
    original = s.base._modules[s.layers]
    log: list[tuple[tuple, dict]] = []
    n = len(original)  # type: ignore[arg-type]
    s.base._modules[s.layers] = nn.ModuleList(_Recorder(i, n - 1, original[i], log) for i in range(n))  # type: ignore[index]
    try:
        s.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _Recorded:
        pass
    finally:
        s.base._modules[s.layers] = original
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
        return out[0] if isinstance(out, tuple) else out


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


class HFHead(nn.Module):
    """Last pipeline layer: final norm and LM head, ``(hidden, *side)`` -> logits ``(B, T, V)``."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    @override
    def forward(self, hidden: Tensor, *side: Tensor | None) -> Tensor:
        return self.lm_head(self.norm(hidden))


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
        template = self._template
        layers = s.base._modules[s.layers]
        return [
            HFEmbedding(s, template),
            *(HFDecoderLayer(i, layer, template) for i, layer in enumerate(layers)),  # type: ignore[arg-type]
            HFHead(s.base._modules[s.norm], self.model._modules[s.head]),  # type: ignore[arg-type]
        ]

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
        """Learn the layers' call template on a tiny right-padded batch, and check that the parts in a chain
        give the model's own logits. Eval mode and no grad: no dropout, no RNG drawn, nothing trained."""
        model = self.model
        device = next(model.parameters()).device
        ids = torch.arange(8, device=device).remainder(model.config.vocab_size).view(2, 4)
        mask = torch.ones_like(ids)
        mask[1, -1] = 0
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                template = _Template.learn(_record_calls(s, ids, mask))
                want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                x: Any = (ids, mask)
                layers = [
                    HFEmbedding(s, template),
                    *(HFDecoderLayer(i, m, template) for i, m in enumerate(s.base._modules[s.layers])),
                ]  # type: ignore[arg-type]
                for layer in layers:
                    x = layer(*x)
                got = HFHead(s.base._modules[s.norm], model._modules[s.head])(*x)  # type: ignore[arg-type]
        finally:
            model.train(was_training)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            diff = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
            raise ValueError(
                f"HFCausalLM cannot reproduce {type(model).__name__}'s logits from [embeddings, decoder layers, "
                f"model.{model.base_model_prefix}.{s.norm}, {s.head}] (max difference {diff:.3g}): its forward does "
                "more than that chain (e.g. logit scaling or soft-capping), so it cannot be split this way."
            )
        return template

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
