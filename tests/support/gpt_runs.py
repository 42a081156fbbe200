"""The package's GPT on the embedded text, the Trainer arguments most strategy tests share, and comparisons."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT

BLOCK = 32


def gpt_model(**kw) -> GPT:
    L.seed_everything(0)
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, warmup_steps=2, max_steps=20, learning_rate=3e-3)
    args.update(kw)
    return GPT(**args)


def text_data(batch_size: int = 4) -> TextDataModule:
    return TextDataModule(block_size=BLOCK, batch_size=batch_size, max_bytes=60_000, seed=1)


class OrderedData(TextDataModule):
    """Epochs of exactly 12 micro-batches in a fixed order, so a run resumed at an epoch boundary sees the
    same data as an uninterrupted one (Lightning cannot resume a plain dataloader mid-epoch)."""

    def train_dataloader(self):
        subset = torch.utils.data.Subset(self.train_set, range(12 * self.batch_size))
        return torch.utils.data.DataLoader(subset, batch_size=self.batch_size, shuffle=False)


def ordered_data() -> OrderedData:
    return OrderedData(block_size=BLOCK, batch_size=4, max_bytes=60_000)


def gpt_trainer(strategy, devices: int, max_steps: int, tmp_path: Path | None = None, **kw) -> L.Trainer:
    args = dict(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, accumulate_grad_batches=4,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    args.update(kw)
    return L.Trainer(**args)


def max_diff(a: GPT, b: GPT) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


class ValHistory(Callback):
    def on_validation_end(self, trainer, pl_module) -> None:  # epoch metrics are final only here
        if "val_loss" in trainer.callback_metrics:
            pl_module.__dict__.setdefault("_val_history", []).append(trainer.callback_metrics["val_loss"].item())
