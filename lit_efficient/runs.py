"""Where a run's files go: one answer for the CLI's config copy and the monitor's timeline."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Trainer


def run_dir(trainer: Trainer) -> Path:
    """The run's own directory, the parent of Lightning's default checkpoint directory:
    ``<save_dir>/<name>/version_<n>`` for CSV and TensorBoard, ``<save_dir>/<project>/<run id>`` for W&B
    (whose ``trainer.log_dir`` is the ``save_dir`` every run shares)."""
    if not trainer.loggers:
        return Path(trainer.default_root_dir)
    logger = trainer.loggers[0]
    save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    return Path(save_dir, str(logger.name), version)
