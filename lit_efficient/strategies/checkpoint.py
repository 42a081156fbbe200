"""Sharded pipeline checkpoints: one file per (stage, replica) in a directory, written atomically.

A checkpoint path names a directory. Every rank writes its shard (its stage's weights, optimizer,
scheduler, accumulation, averaging and RNG state, plus Lightning's loop and callback state) into
``<path>.partial``; once all shards are complete, global rank 0 swaps the directory into place
with renames. A crash while saving leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

if TYPE_CHECKING:
    from lit_efficient.strategies.paci import PACIStrategy

META = "pipeline.json"


def shard_name(stage: int, replica: int) -> str:
    """File name of one rank's shard inside a checkpoint directory."""
    return f"stage{stage}-replica{replica}.pt"


class PipelineCheckpointIO(TorchCheckpointIO):
    """Reads and writes the sharded checkpoints of a `PACIStrategy`.

    Args:
        strategy: The strategy whose stage and replica name this rank's shard.
    """

    def __init__(self, strategy: PACIStrategy) -> None:
        super().__init__()
        self.strategy = strategy

    def save_sharded(self, checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
        """Collective: every rank writes its shard; rank 0 publishes the directory atomically."""
        s = self.strategy
        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        if s.is_global_zero:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier(s)
        _write_shard(checkpoint, partial / shard_name(s.stage, s.replica))
        _barrier(s)
        if s.is_global_zero:
            self._publish(partial, path, checkpoint["pipeline"]["sizes"])

    def save_shards(self, checkpoints: list[dict[str, Any]], path: str | os.PathLike) -> None:
        """Write every stage's shard of one replica from this process (a pipeline run in one process), in
        the format `save_sharded` writes from S processes, and publish the directory atomically."""
        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for checkpoint in checkpoints:
            state = checkpoint["pipeline"]
            _write_shard(checkpoint, partial / shard_name(state["stage"], state["replica"]))
        self._publish(partial, path, checkpoints[0]["pipeline"]["sizes"])

    def _publish(self, partial: Path, path: Path, sizes: list[int]) -> None:
        s = self.strategy
        meta = {
            "num_stages": s.pipeline_stages,
            "num_replicas": s.topology.num_replicas,  # type: ignore[union-attr]
            "sizes": sizes,
            "schedule": s.schedule,
        }
        (partial / META).write_text(json.dumps(meta))
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old, ignore_errors=True)

    @override
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(path)
        if not path.is_dir():  # a plain file: the spawn launcher's hand-back of rank 0's weights
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        s = self.strategy
        shard = path / shard_name(s.stage, s.replica)
        if not shard.exists():  # more replicas than when saved: start them from replica 0
            shard = path / shard_name(s.stage, 0)
        if not shard.exists():
            found = sorted(p.name for p in path.glob("*.pt"))
            raise FileNotFoundError(
                f"{path} has no shard for stage {s.stage} (found {found}); it was written with another pipeline "
                "layout: resume with the same pipeline_stages"
            )
        return load_shard(shard, weights_only)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        shutil.rmtree(path, ignore_errors=True)


def consolidate_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The unsplit module's ``state_dict`` from a pipeline checkpoint directory (replica 0's shards).

    Load it into a fresh module for inference or to continue with another strategy:
    ``GPT(...).load_state_dict(consolidate_checkpoint("last.ckpt"))``.
    """
    path = Path(path)
    meta = json.loads((path / META).read_text())
    state: dict[str, torch.Tensor] = {}
    for stage in range(meta["num_stages"]):
        shard = load_shard(path / shard_name(stage, 0))
        state.update(shard["state_dict"])
    return state


def load_shard(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """Load one shard. ``weights_only`` True or False, as the caller asked (``trainer.fit(...,
    weights_only=...)``), is obeyed as is. None (the default): ``weights_only=True`` (no arbitrary code
    on unpickling) when the content allows; a checkpoint holding other Python objects (custom
    hyper-parameter types, say) falls back to a full load, with a warning: only load such checkpoints
    from sources you trust."""
    if weights_only is not None:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        warnings.warn(
            f"{path} holds objects weights_only=True refuses ({str(err).splitlines()[0][:200]}); loading it fully. "
            "Only load checkpoints you trust.",
            stacklevel=2,
        )
        return torch.load(path, map_location="cpu", weights_only=False)


def _write_shard(checkpoint: dict[str, Any], shard: Path) -> None:
    tmp = shard.with_suffix(".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, shard)  # a shard is complete or absent, never half-written


def _barrier(strategy: PACIStrategy) -> None:
    if dist.is_initialized():
        dist.barrier(group=strategy._header_group)
