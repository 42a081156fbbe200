"""PACIStrategy's checkpoint hooks: every stage's share to one file on save, each stage's share on load.

The file format and the merging are `checkpoint.py`'s; this mixin is the Lightning side: what a rank
contributes (`pipeline_state`), the collective save, and the load hooks Lightning calls after the
module is split, including the layouts' differences (warned, never silent) and the directory
checkpoints of earlier versions. The sharded folder (``checkpoint_format="sharded"``) is `sharded.py`'s,
and saving after ``fit``, when the stages are gone, `shares.py`'s; both load through the same hooks.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_efficient.strategies.checkpoint import (
    assemble,
    from_automatic_loops,
    group_key,
    legacy_shard,
    load_file,
    local_accumulation,
    local_optimizer_state,
    local_state_dict,
    merge_group_names,
    rank_share,
    regroup_schedulers,
    to_automatic_loops,
    write_atomically,
)
from lit_efficient.strategies.sharded import is_sharded
from lit_efficient.strategies.sharded_read import from_consolidated
from lit_efficient.strategies.shares import gather_to_rank_zero, load_sharded, save_from_records


class PipelineCheckpointing:
    """Checkpoint hooks of PACIStrategy (a mixin over the strategy's split, runtime, topology and groups)."""

    runtime: Any
    topology: Any
    optimizers: Any
    lightning_module: Any
    _split: Any

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the module must be split before its stage's weights are loaded

    @override
    def on_train_start(self) -> None:
        self._final_state = None  # what a save after the previous fit used (shares.py) is not this fit's
        super().on_train_start()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.runtime is not None:
            self.runtime.drain()  # a checkpoint holds a consistent model: nothing in flight
        return super().lightning_module_state_dict()

    def pipeline_state(self) -> dict[str, Any]:
        """What this rank adds to a checkpoint besides weights and optimizer (checkpoint.py merges it)."""
        assert self._split is not None and self.runtime is not None and self.lightning_module is not None
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        stage = self.runtime.stage
        accumulation = stage.accumulation_state()
        if "grads" in accumulation:  # by name, so another layout can take its share
            accumulation["grads"] = {
                names[id(p)]: g for p, g in zip(stage.parameters(), accumulation["grads"], strict=True) if g is not None
            }
        state: dict[str, Any] = {
            "stage": self.stage,
            "replica": self.replica,
            "accumulation": accumulation,
            "rng": {"cpu": torch.get_rng_state()},
        }
        if self.root_device.type == "cuda":
            state["rng"]["cuda"] = torch.cuda.get_rng_state(self.root_device)
        if self.averager is not None:
            state["averager"] = self.averager.state_dict()
        return state

    def layout(self) -> dict[str, Any]:
        """The pipeline layout a checkpoint records: what per-rank state (RNG, averaging) depends on."""
        assert self._split is not None and self.topology is not None
        return {
            "num_stages": self.pipeline_stages,
            "num_replicas": self.topology.num_replicas,
            "sizes": self._split.sizes,
            "schedule": self.schedule,
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # Collective: every rank's stage goes to global rank 0, which writes one ordinary file (checkpoint.py).
        if self.checkpoint_format == "sharded" or self.runtime is None:
            return save_from_records(self, checkpoint, filepath)  # the folder; either format after fit (shares.py)
        if self._in_process is not None:
            return self._in_process.save_checkpoint(checkpoint, filepath)
        assert self.lightning_module is not None and self.topology is not None
        diverged = self.local_sgd_steps is not None and self.topology.num_replicas > 1
        optimizer = self.optimizers[0] if self.optimizers else None
        share = rank_share(
            checkpoint, self.lightning_module, optimizer, self.pipeline_state(), self.replica == 0 or diverged,
            tied_copies=self._tied_copy_names()[1],
        )  # fmt: skip
        shares = gather_to_rank_zero(share, self.world_size, self._cpu_group())  # one rank at a time (shares.py)
        if shares is not None:
            write_atomically(to_automatic_loops(assemble(checkpoint, shares, self.layout())), filepath)
        dist.barrier(group=self._cpu_group())  # nobody reads or removes it before it is complete

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if is_sharded(path):  # this rank's part only (sharded.py)
            return from_automatic_loops(load_sharded(self, path, weights_only))
        if path.is_dir() and self._in_process is not None:
            raise ValueError(
                f"{path} is a directory of stage shards (an earlier version's checkpoint); one device resumes only the "
                f"single-file format. Resume it on devices={self.pipeline_stages}, which saves it as one file."
            )
        if path.is_dir():  # an earlier version's directory of shards: its own layout only
            return load_file(legacy_shard(path, self.stage, self.replica), weights_only)
        # Before Lightning restores the loops from it: a one-device file counts steps in the automatic loop.
        return from_automatic_loops(from_consolidated(load_file(path, weights_only)))

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        if _is_legacy(checkpoint):
            _check_checkpoint_layout(checkpoint["pipeline"], self)
            module.load_state_dict(checkpoint["state_dict"], strict=strict)
            return
        module.load_state_dict(local_state_dict(checkpoint, module, self._rank_key()), strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self._in_process is not None:
            return self._in_process.load_optimizer_state_dict(checkpoint)
        if _is_legacy(checkpoint):
            super().load_optimizer_state_dict(checkpoint)
            self._load_rank_state(checkpoint["pipeline"], checkpoint["pipeline"].get("accumulation"))
            return
        module = self.lightning_module
        assert module is not None and self.runtime is not None
        if self.optimizers:
            state, group_map = local_optimizer_state(
                checkpoint, module, self.optimizers[0], self._rank_key(), self._group_names
            )
            self.optimizers[0].load_state_dict(state)
            # Lightning restores the schedulers from the same dict right after this: over this stage's groups.
            saved_groups = len(checkpoint["optimizer_states"][0]["param_groups"])
            checkpoint["lr_schedulers"] = regroup_schedulers(
                checkpoint.get("lr_schedulers", []), group_map, saved_groups
            )
        names = {id(p): n for n, p in module.named_parameters()}
        accumulation = local_accumulation(checkpoint, [names[id(p)] for p in self.runtime.stage.parameters()])
        pipeline = checkpoint.get("pipeline", {})
        same_layout = pipeline.get("layout") == self.layout()
        mine = pipeline.get("ranks", {}).get(self._rank_key(), {}) if same_layout else {}
        dropped = (
            []
            if same_layout
            else [k for k in ("rng", "averager") if any(k in r for r in pipeline.get("ranks", {}).values())]
        )
        if dropped:
            rank_zero_warn(
                f"resuming a checkpoint of layout {pipeline.get('layout')} on {self.layout()}: weights, optimizer, "
                f"schedulers, loops and accumulated gradients carry over by parameter name; the per-rank "
                f"{' and '.join(dropped)} state does not (dropout masks and LocalSGD/DiLoCo state start afresh)."
            )
        self._load_rank_state(mine, accumulation)

    def _load_rank_state(self, state: dict[str, Any], accumulation: dict[str, Any] | None) -> None:
        # The stage's own step count and random stream come from its own record (same layout only):
        # local_accumulation carries only an unfinished window, by name.
        own = {k: v for k, v in state.get("accumulation", {}).items() if k in ("version", "rng")}
        if self.runtime is not None and (accumulation or own):
            self.runtime.stage.load_accumulation_state({**own, **(accumulation or {})})
        if self.averager is not None and "averager" in state:
            self.averager.load_state_dict(state["averager"])
        if "rng" in state:
            torch.set_rng_state(state["rng"]["cpu"])
            if "cuda" in state["rng"] and self.root_device.type == "cuda":
                torch.cuda.set_rng_state(state["rng"]["cuda"], self.root_device)

    def _rank_key(self) -> str:
        return f"stage{self.stage}-replica{self.replica}"

    def _tied_copy_names(self) -> tuple[list[str], list[str]]:
        """This stage's names of tied weights, in tie order: (first copies, second copies); one of them is empty."""
        assert self.lightning_module is not None
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        first = [names[id(t.param)] for t in self._tied if t.is_first]
        return first, [names[id(t.param)] for t in self._tied if not t.is_first]

    def _group_names(self) -> tuple[list[list[str]], dict[str, str]]:
        """The unsplit optimizer's parameter names per group, for a checkpoint that carries no names (one
        device, DDP): every stage's groups matched by hyper-parameters (`group_key`), in order of first
        appearance, stage by stage, as checkpoint.py merges them, without tied weights' second copies
        (one device holds a tied weight once); and ``{second copy: first copy}`` by name. Collective over
        this replica's pipeline."""
        assert self.topology is not None
        gathered: list[Any] = [None] * len(self.topology.pipeline_ranks(self.replica))
        mine = self._stage_group_names(self.optimizers[0])
        dist.all_gather_object(gathered, mine, group=self._pipeline_groups[self.replica])
        return merge_group_names(gathered)

    def _stage_group_names(self, optimizer: Any) -> tuple[int, list[tuple[str, list[str]]], list[str], list[str]]:
        """This stage's part of `_group_names`: ``(stage, [(group key, names)], first copies, second copies)``."""
        assert self.lightning_module is not None
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        first, second = self._tied_copy_names()
        groups = [
            (group_key(g), [names[id(p)] for p in g["params"] if names[id(p)] not in second])
            for g in optimizer.param_groups
        ]
        return self.stage, groups, first, second

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:  # a directory: a sharded checkpoint, or an earlier version's
            shutil.rmtree(filepath, ignore_errors=True) if Path(filepath).is_dir() else Path(filepath).unlink(True)


def _is_legacy(checkpoint: dict[str, Any]) -> bool:
    """A shard of an earlier version's directory checkpoint (it records its layout in every shard)."""
    return "sizes" in checkpoint.get("pipeline", {})


def _check_checkpoint_layout(state: dict[str, Any], strategy: Any) -> None:
    if not state:
        return
    split = strategy._split
    assert split is not None
    if state.get("num_stages") != strategy.pipeline_stages or state.get("sizes") != split.sizes:
        raise ValueError(
            f"the checkpoint was written by a pipeline of {state.get('num_stages')} stages with layers "
            f"{state.get('sizes')}, this run has {strategy.pipeline_stages} stages with {split.sizes}. Resume with the "
            "same pipeline_stages and balance (pass balance=<the saved list>), or load its weights with "
            "lit_efficient.consolidate_checkpoint into a fresh module (checkpoints of this version reshard)."
        )
