"""The GPT example model: a nanoGPT-class decoder-only transformer as a LightningModule.

This file owns the model (embedding, pre-LayerNorm blocks, head), its optimizer and LR schedule,
its Lightning steps and sampling. It implements the pipeline protocol (`pipeline_layers`,
`pipeline_input`, `pipeline_loss`) so `PACIStrategy` can split it into stages, and it trains
unchanged under single-device or DDP through `training_step`.

`forward` is literally "run the pipeline layers in order", so a split model and an unsplit one
compute the same function and share `state_dict` keys (`embed.*`, `blocks.<i>.*`, `head.*`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics.text import Perplexity
from typing_extensions import override

from lit_efficient.checks import check_flags, is_count, is_real

# Targets equal to this are ignored by the loss and the perplexity (padding); nanoGPT's convention.
IGNORE_INDEX = -1


def counted_cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy of ``logits`` ``(..., V)`` over the targets not equal to ``ignore_index``, and their number
    (a tensor: no host sync). With none counted (a micro-batch of padding only) the loss is 0 with no gradient, not
    torch's 0/0 NaN, which the pipeline's non-finite check refuses and an epoch's mean loss would carry."""
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=ignore_index)
    count = (targets != ignore_index).sum()
    return torch.where(count > 0, loss, torch.zeros((), dtype=loss.dtype, device=loss.device)), count


class GPTEmbedding(nn.Module):
    """Pipeline layer 0: token + learned position embeddings, then dropout.

    Args:
        vocab_size: Number of token ids.
        block_size: Longest sequence the position table covers.
        n_embd: Embedding width.
        dropout: Dropout probability applied to the summed embeddings.
    """

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    @override
    def forward(self, idx: Tensor) -> Tensor:
        t = idx.size(1)
        if t > self.block_size:
            raise ValueError(
                f"Sequence length {t} exceeds block_size={self.block_size}; crop the input or build the "
                f"model with a larger block_size."
            )
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through `F.scaled_dot_product_attention(is_causal=True)`.

    Args:
        n_embd: Model width.
        n_head: Number of heads (divides `n_embd`).
        dropout: Attention-probability and residual dropout.
        bias: Whether the projections have biases.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    @override
    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        # SDPA picks the fused kernel (flash / memory-efficient) when one fits; is_causal avoids a mask tensor.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(4x) -> GELU -> Linear -> dropout.

    Args:
        n_embd: Model width.
        dropout: Output dropout.
        bias: Whether the projections have biases.
    """

    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    Args:
        n_embd: Model width.
        n_head: Number of attention heads.
        dropout: Dropout probability.
        bias: Whether Linear and LayerNorm layers have biases.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    @override
    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTHead(nn.Module):
    """Last pipeline layer: final LayerNorm and the LM head, hidden states -> logits (B, T, V).

    Args:
        n_embd: Model width.
        vocab_size: Number of token ids (logit width).
        bias: Whether the LayerNorm has a bias (the LM head never has one).
    """

    def __init__(self, n_embd: int, vocab_size: int, bias: bool) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


def cosine_with_warmup(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step `step`: linear warmup, then cosine decay to `min_lr_ratio`.

    Warmup goes (step + 1) / (warmup_steps + 1), so step 0 already moves (nanoGPT's choice); from
    `warmup_steps` on the multiplier follows half a cosine from 1 down to `min_lr_ratio`, reached at
    `max_steps` and held afterwards.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - min_lr_ratio)


def check_finite(owner: str, **values: Any) -> None:
    """Refuse a rate that is not a finite number: NaN passes every range comparison, and inf trains to NaN weights."""
    for name, value in values.items():
        if not is_real(value):
            raise ValueError(f"{owner}({name}={value!r}) must be a finite number.")


def check_betas(owner: str, betas: Any) -> None:
    """Refuse AdamW betas that are not two values in [0, 1) now, rather than in every rank's first step."""
    try:
        values = tuple(float(b) for b in betas)
    except (TypeError, ValueError):
        values = ()
    if len(values) != 2 or not all(0.0 <= b < 1.0 for b in values):
        shown = tuple(betas) if isinstance(betas, Sequence) and not isinstance(betas, str) else betas
        raise ValueError(f"{owner}(betas={shown!r}) must be two values in [0, 1), e.g. (0.9, 0.95).")


def warn_long_warmup(owner: str, warmup_steps: int, total: int | float, source: str) -> None:
    """Warn when the linear warmup lasts the whole run: the learning rate then never reaches its peak and the
    cosine never decays it. A warning, not an error: a run that only ever warms up may be what a user wants."""
    if math.isfinite(total) and warmup_steps >= total >= 1:
        total = int(total)
        rank_zero_warn(
            f"{owner}(warmup_steps={warmup_steps}) is not below the run's {total} optimizer steps ({source}): the "
            f"learning rate never reaches its peak and never decays. Set warmup_steps below {total} (e.g. "
            f"{total // 10}, a tenth of the run), or train for more steps."
        )


def adamw_with_warmup_cosine(module: LightningModule, decay: list, no_decay: list) -> dict[str, Any]:
    """AdamW over a decayed and an undecayed group, with a per-step linear warmup + cosine LambdaLR, from
    the module's hparams (``learning_rate``, ``betas``, ``weight_decay``, ``warmup_steps``, ``max_steps``,
    ``min_lr_ratio``): the optimizer of `GPT` and `HFCausalLM`."""
    hp = module.hparams
    # Both groups on every pipeline stage, empty where a stage holds no parameter of one kind (a stage of only the
    # embedding has nothing to decay): the stages then list one device's groups, which a checkpoint merges by position.
    groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas))
    max_steps = hp.max_steps if hp.max_steps is not None else module.trainer.estimated_stepping_batches
    if not math.isfinite(max_steps):
        name = type(module).__name__
        raise ValueError(
            f"{name}(max_steps=None) reads trainer.estimated_stepping_batches, which is infinite here; "
            f"set Trainer(max_steps=...) or max_epochs, or pass {name}(max_steps=...)."
        )
    warmup, floor, total = hp.warmup_steps, hp.min_lr_ratio, int(max_steps)
    if hp.max_steps is None:
        warn_long_warmup(type(module).__name__, warmup, total, f"trainer.estimated_stepping_batches={total}")
    elif module._trainer is not None and 0 < module.trainer.max_steps < total:
        # The schedule's own length was checked at construction; the run may stop before it ends.
        steps = module.trainer.max_steps
        warn_long_warmup(type(module).__name__, warmup, steps, f"Trainer(max_steps={steps})")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_with_warmup(step, warmup, total, floor)
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class GPT(LightningModule):
    """Decoder-only transformer (nanoGPT class) that implements the pipeline protocol.

    The pipeline layers are ``[embed, blocks[0], ..., blocks[n_layer - 1], head]``; every parameter
    lives in exactly one of them (unless `tie_weights`). Batches are ``(x, y)`` int64 ``(B, T)``
    token tensors with ``y`` the next token of ``x``; targets equal to -1 are ignored.

    Args:
        vocab_size: Number of token ids (256 for the byte-level `TextDataModule`).
        block_size: Longest context, in tokens; sets the position-embedding table.
        n_layer: Number of transformer blocks (the pipeline splits between these).
        n_head: Attention heads per block; must divide `n_embd`.
        n_embd: Model width.
        dropout: Dropout probability on embeddings, attention and residual branches (0 disables it).
        bias: Biases in Linear and LayerNorm layers, like GPT-2 (False is slightly faster and as good).
        tie_weights: Share the LM head weight with the token embedding. The two then live in the
            first and the last pipeline layer; under `PACIStrategy` each of those stages holds a copy
            kept equal by the tied-weight rule (exact under 1F1B-flush, the embedding-side gradient
            applied ceil(S/N) steps late under PACI; see `lit_efficient.runtime.tied`).
        learning_rate: Peak AdamW learning rate, reached at the end of warmup.
        weight_decay: Decoupled weight decay of the matrix weights (see `configure_optimizers`).
        betas: AdamW (beta1, beta2).
        warmup_steps: Optimizer steps of linear warmup.
        max_steps: Optimizer step where the cosine decay reaches `min_lr_ratio * learning_rate`;
            None reads `trainer.estimated_stepping_batches`.
        min_lr_ratio: Final learning rate as a fraction of `learning_rate`.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = False,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        check_flags("GPT", bias=bias, tie_weights=tie_weights)
        _check_args(
            vocab_size,
            block_size,
            n_layer,
            n_head,
            n_embd,
            dropout,
            learning_rate,
            weight_decay,
            betas,
            warmup_steps,
            max_steps,
            min_lr_ratio,
        )
        self.save_hyperparameters()
        self.embed = GPTEmbedding(vocab_size, block_size, n_embd, dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.head = GPTHead(n_embd, vocab_size, bias)
        if tie_weights:
            self.head.lm_head.weight = self.embed.wte.weight
        self._init_weights(n_layer)
        # Metric objects, not parameters: they hold only non-persistent state, so state_dict keys stay
        # embed.* / blocks.* / head.* whether or not the model is split.
        self.val_ppl = Perplexity(ignore_index=IGNORE_INDEX)
        self.test_ppl = Perplexity(ignore_index=IGNORE_INDEX)

    def _init_weights(self, n_layer: int) -> None:
        # GPT-2 init: N(0, 0.02) everywhere, and the projections that write into the residual stream
        # scaled by 1/sqrt(2 * n_layer) so the residual variance does not grow with depth.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    # ----------------------------------------------------------------- pipeline protocol

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as an ordered list: ``[embed, *blocks, head]``; layer k consumes layer k-1's output."""
        return [self.embed, *self.blocks, self.head]

    def pipeline_input(self, batch: Sequence[Tensor]) -> Tensor:
        """What layer 0 consumes: the input tokens ``x`` of a ``(x, y)`` batch."""
        return batch[0]

    def pipeline_loss(self, output: Tensor, batch: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """Mean next-token cross-entropy of logits ``(B, T, V)`` and the number of tokens it averaged over.

        The count is a tensor (targets not equal to -1) so token-weighted accumulation needs no host sync; a
        micro-batch with no counted target (your own padded data) has loss 0 (`counted_cross_entropy`).
        """
        # fp32 softmax: under bf16 autocast the logits are bf16 and the loss would lose precision.
        return counted_cross_entropy(output.float(), batch[1], IGNORE_INDEX)

    @override
    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``(B, T, V)`` for tokens ``(B, T)``: the pipeline layers run in order."""
        x = idx
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    # ----------------------------------------------------------------- Lightning steps

    @override
    def setup(self, stage: str) -> None:
        # Fail before training when the data do not fit the model: an out-of-range token id is a
        # device-side assert on GPU, far from its cause.
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        data_vocab = getattr(datamodule, "vocab_size", None)
        if isinstance(data_vocab, int) and data_vocab > self.hparams.vocab_size:
            raise ValueError(
                f"The data have vocab_size={data_vocab} but the model has vocab_size={self.hparams.vocab_size}; "
                f"build GPT(vocab_size={data_vocab}) (or larger)."
            )
        data_block = getattr(datamodule, "block_size", None)
        if isinstance(data_block, int) and data_block > self.hparams.block_size:
            raise ValueError(
                f"The data have block_size={data_block} but the model has block_size={self.hparams.block_size}; "
                f"set both to the same value."
            )

    @override
    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> dict[str, Tensor]:
        logits = self(self.pipeline_input(batch))
        loss, num_items = self.pipeline_loss(logits, batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch[0].size(0))
        return {"loss": loss, "num_items": num_items}

    @override
    def on_fit_start(self) -> None:
        # A Trainer.validate/test before this fit reset the metrics under inference mode, which leaves their
        # states inference tensors; fit validates under no_grad, where updating those in place is an error
        # ("Inplace update to inference tensor outside InferenceMode"), on one device as under the pipeline.
        # Resetting here, outside inference mode, makes them ordinary tensors again; they hold nothing yet.
        self.val_ppl.reset()
        self.test_ppl.reset()

    @override
    def validation_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        return self._eval_step(batch, "val", self.val_ppl)

    @override
    def test_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        return self._eval_step(batch, "test", self.test_ppl)

    def _eval_step(self, batch: Sequence[Tensor], prefix: str, ppl: Perplexity) -> Tensor:
        # Exactly one self(...) call: under PACIStrategy the last stage gets the pipeline's output here.
        logits = self(self.pipeline_input(batch))
        loss, _ = self.pipeline_loss(logits, batch)
        batch_size = batch[0].size(0)
        # sync_dist: with data-parallel replicas each validates its share; the logged loss is their mean.
        self.log(f"{prefix}_loss", loss, prog_bar=prefix == "val", batch_size=batch_size, sync_dist=True)
        ppl.update(logits.float(), batch[1])
        self.log(f"{prefix}_ppl", ppl, batch_size=batch_size)
        return loss

    @override
    def predict_step(self, batch: Sequence[Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """Greedy next-token predictions ``(B, T)`` int64 (the argmax of the logits, not the logits:
        a (B, T, V) float tensor per batch would dominate the memory of `trainer.predict`)."""
        return self(self.pipeline_input(batch)).argmax(dim=-1)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW with two parameter groups and a per-step warmup + cosine LambdaLR.

        Decayed: the matrix weights of Linear layers (attention, MLP, LM head). Not decayed: biases and
        LayerNorm gains/biases (pulling a gain toward 0 is not a useful prior) and the embedding tables
        (a row moves only when its token occurs, so decay would shrink rare tokens' rows between their
        updates; minGPT's choice). A tied LM head weight is the token table and follows it.

        Groups are built from `self.named_parameters()`, so under pipelining each rank sees only its own
        stage's parameters; nothing else is skipped.
        """
        hp = self.hparams
        embedding_params = {id(p) for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            # By name too: on the last pipeline stage the token table is elsewhere, and the tied head's copy
            # must get the same settings as the embedding's, or the two copies would drift apart.
            tied_head = hp.tie_weights and name == "head.lm_head.weight"
            if param.ndim >= 2 and id(param) not in embedding_params and not tied_head:
                decay.append(param)
            else:
                no_decay.append(param)
        return adamw_with_warmup_cosine(self, decay, no_decay)

    # ----------------------------------------------------------------- sampling

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None) -> Tensor:
        """Sample `max_new_tokens` tokens after the prompt `idx` ``(B, T)``; returns ``(B, T + max_new_tokens)``.

        The context is cropped to the last `block_size` tokens. `temperature` 0 picks the argmax;
        `top_k` keeps only the k most likely tokens. Runs in eval mode (no dropout) and restores the
        previous mode. Needs the whole model on this process: under PACIStrategy on processes, after fit on
        global rank 0 (``if trainer.is_global_zero:``), not inside a fit's or an evaluation's hooks
        (docs/python-api.md, "The whole model").
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0.")
        if not temperature >= 0:  # NaN too
            raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy).")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1, or None to sample from every token.")
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(
                f"generate takes a prompt of shape (B, T) with T >= 1, not {tuple(idx.shape)}: start from at least "
                "one token, e.g. GPT.encode('\\n')."
            )
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits = self(idx[:, -self.hparams.block_size :])[:, -1, :].float()
                scaled = logits / temperature if temperature > 0 else None
                # 0, or so small that finite logits overflow: greedy (a diverged model's NaN fails in multinomial).
                if scaled is None or (not torch.isfinite(scaled).all() and torch.isfinite(logits).all()):
                    next_token = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = scaled
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
                idx = torch.cat((idx, next_token), dim=1)
        finally:
            self.train(was_training)
        return idx

    @staticmethod
    def encode(text: str) -> Tensor:
        """UTF-8 bytes of `text` as an int64 ``(1, len)`` prompt for the byte-level model."""
        return torch.tensor([list(text.encode("utf-8"))], dtype=torch.long)

    @staticmethod
    def decode(tokens: Tensor | Sequence[int]) -> str:
        """Byte-level tokens (1D, values 0..255) to text; invalid UTF-8 becomes U+FFFD."""
        values = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
        if any(not 0 <= v < 256 for v in values):
            raise ValueError("decode() handles byte-level tokens (0..255) only; use your tokenizer for others.")
        return bytes(values).decode("utf-8", errors="replace")


def check_recipe(
    owner: str,
    learning_rate: float,
    weight_decay: float,
    betas: Any,
    warmup_steps: int,
    max_steps: int | None,
    min_lr_ratio: float,
) -> None:
    """Refuse a bad argument of `adamw_with_warmup_cosine`'s recipe in ``owner``'s constructor (GPT, HFCausalLM),
    naming it, and warn when ``max_steps`` is given and the warmup lasts all of it."""
    check_finite(owner, learning_rate=learning_rate, weight_decay=weight_decay, min_lr_ratio=min_lr_ratio)
    if learning_rate <= 0:
        raise ValueError(f"{owner}(learning_rate={learning_rate}) must be > 0 (3e-4 is a good start).")
    if weight_decay < 0:
        raise ValueError(f"{owner}(weight_decay={weight_decay}) must be >= 0; 0 disables decay.")
    check_betas(owner, betas)
    if not is_count(warmup_steps, 0):
        raise ValueError(f"{owner}(warmup_steps={warmup_steps!r}) must be an integer >= 0.")
    if max_steps is not None and not is_count(max_steps):
        raise ValueError(
            f"{owner}(max_steps={max_steps!r}) must be an integer >= 1, or None to use the Trainer's estimate."
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"{owner}(min_lr_ratio={min_lr_ratio}) must be in [0, 1] (the final LR / peak LR).")
    if max_steps is not None:
        warn_long_warmup(owner, warmup_steps, max_steps, f"max_steps={max_steps}")


def _check_args(
    vocab_size: int,
    block_size: int,
    n_layer: int,
    n_head: int,
    n_embd: int,
    dropout: float,
    learning_rate: float,
    weight_decay: float,
    betas: Sequence[float],
    warmup_steps: int,
    max_steps: int | None,
    min_lr_ratio: float,
) -> None:
    sizes = dict(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    for name, value in sizes.items():  # a float (n_head=2.0) passed here and failed at the first forward
        if not is_count(value):
            raise ValueError(f"GPT({name}={value!r}) must be a positive integer.")
    check_finite("GPT", dropout=dropout)
    if n_embd % n_head:
        heads = min((h for h in range(1, n_embd + 1) if n_embd % h == 0), key=lambda h: (abs(h - n_head), -h))
        width = n_head * max(1, round(n_embd / n_head))
        raise ValueError(
            f"GPT(n_embd={n_embd}) must be divisible by n_head={n_head}: pick a number of heads that divides it "
            f"(e.g. n_head={heads}) or n_embd a multiple of n_head (e.g. n_embd={width})."
        )
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"GPT(dropout={dropout}) must be in [0, 1); 0 disables dropout.")
    check_recipe("GPT", learning_rate, weight_decay, betas, warmup_steps, max_steps, min_lr_ratio)
