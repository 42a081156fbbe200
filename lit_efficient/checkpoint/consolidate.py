"""The unsplit module's weights from any pipeline checkpoint (a single file or a sharded folder)."""

from __future__ import annotations

import os
from pathlib import Path

from torch import Tensor

from lit_efficient.checkpoint.sharded_read import consolidated_state_dict
from lit_efficient.checkpoint.sharded_write import INDEX, not_a_checkpoint_folder
from lit_efficient.checkpoint.single_file import load_file


def consolidate_checkpoint(path: str | os.PathLike) -> dict[str, Tensor]:
    """The unsplit module's ``state_dict`` from a pipeline checkpoint, a file or a sharded folder. For a file this
    is its ``state_dict``; ``Module.load_from_checkpoint(path)`` reads the same file directly:
    ``GPT(...).load_state_dict(consolidate_checkpoint("last.ckpt"))``."""
    path = Path(path)
    if (path / INDEX).is_file():  # a sharded folder (torch.distributed.checkpoint's index)
        return consolidated_state_dict(path)
    if path.is_dir():
        raise ValueError(f"{not_a_checkpoint_folder(path)}: give a checkpoint file or a sharded checkpoint's folder")
    return load_file(path)["state_dict"]
