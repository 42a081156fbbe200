"""Checkpoint helpers shared by the checkpoint tests: finding a file, saving both formats at a step."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.fabric.utilities.load import _load_distributed_checkpoint
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
