"""Checkpoint helpers shared by the checkpoint tests: finding a file, saving both formats at a step."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

FORMATS = ("file", "sharded")


def one_file(path: Path) -> Path:
    """``path`` itself, or the file Lightning's consolidation makes of a sharded folder (what
    ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` runs)."""
    if path.is_file():
        return path
    out = path.with_name(path.name + ".consolidated")
    torch.save(_format_checkpoint(_load_distributed_checkpoint(path)), out)
    return out


def fit_small_gpt(cls, strategy, steps: int, ckpt=None, save=None, **fit_kw):
    """A seeded two-layer ``cls`` (a GPT subclass) fit for ``steps`` optimizer steps of 2 micro-batches on one
    device or in one process, from ``ckpt`` if given, saved to ``save`` after; the model."""
    from lit_efficient.models import GPT
    from tests.support.gpt_runs import ordered_data

    assert issubclass(cls, GPT)
    torch.manual_seed(0)
    model = cls(n_layer=2, n_head=2, n_embd=32, block_size=32)
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=ordered_data(), ckpt_path=ckpt, **fit_kw)
    if save is not None:
        trainer.save_checkpoint(save)
    return model


class SaveBothFormatsAt(Callback):
    """``trainer.save_checkpoint`` in each format after micro-batch ``batch_idx`` of the first epoch (the
    format is read when saving), as ``{prefix}-{format}.ckpt``: after the last one, what a checkpoint at the
    last step holds; mid-window, accumulated gradients the checkpoint must carry."""

    def __init__(self, directory: Path, batch_idx: int, prefix: str) -> None:
        self.directory, self.batch_idx, self.prefix = directory, batch_idx, prefix

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.batch_idx and trainer.current_epoch == 0:
            before = trainer.strategy.checkpoint_format
            for fmt in FORMATS:
                trainer.strategy.checkpoint_format = fmt
                trainer.save_checkpoint(Path(self.directory, f"{self.prefix}-{fmt}.ckpt"))
            trainer.strategy.checkpoint_format = before
