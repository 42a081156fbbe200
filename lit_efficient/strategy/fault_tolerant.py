"""PACIStrategy(fault_tolerance="torchft"): the Lightning side of `replicas.fault_tolerance`.

- **Joining** (`join_after_restore`): right after Lightning restores the run (from ``ckpt_path``, if any) and
  before the first batch, every rank takes a quorum with the live replica groups. A rank behind them (a
  restarted group, or the non-first groups at a fresh start) receives its peer rank's state and resumes from it
  through Lightning's own resume path (weights, optimizer, schedulers, loops, callbacks, data position), as if
  it were a checkpoint file: it continues at the peer's step. Then it takes part in that sync. A rank that
  receives a state at its own step (groups that start together) loads its stages' part only (`heal`).
- **Syncing** (`OuterSync`): at every LocalSGD/DiLoCo sync step (Lightning's ``global_step``, equal in every
  group), after the batch, the pipeline drains and the hosted stages sync over the live groups.
- **Healing state** (`state_for_peer`): the in-memory checkpoint of this process's stages, built by the shares
  every checkpoint is built from (`stage_checkpoints.in_memory`), with the group's layout to check against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lit_efficient.replicas.fault_tolerance import TorchftReplicas, fresh_store
from lit_efficient.strategy import stage_checkpoints


def start_replicas(strategy: Any, trainer: Trainer) -> TorchftReplicas:
    """This rank's torchft membership (collective over the group: rank 0 serves a fresh store for its managers)."""
    server, address = fresh_store() if strategy.global_rank == 0 else (None, None)
    box = [address]
    dist.broadcast_object_list(box, src=0, group=strategy.cpu_group)
    joining = Joining()
    replicas = TorchftReplicas(
        strategy.replica_group_id, strategy.replica_groups, strategy.global_rank, strategy.world_size,
        strategy.min_replica_groups, box[0],
        state=lambda: state_for_peer(strategy, trainer, joining),
        load=lambda ckpt: heal(strategy, trainer, ckpt, joining),
        device=strategy.root_device, quorum_timeout=strategy.p2p_timeout, store_server=server,
    )  # fmt: skip
    join_after_restore(strategy, trainer, replicas, joining)
    if not any(isinstance(cb, OuterSync) for cb in trainer.callbacks):
        trainer.callbacks.insert(0, OuterSync())  # first: a checkpoint at a sync step holds the synced weights
    return replicas


def state_for_peer(strategy: Any, trainer: Trainer, joining: Joining) -> dict[str, Any]:
    """What a healing peer rank loads: this process's stages as an in-memory checkpoint, Lightning's loops,
    callbacks and data position included (called in torchft's quorum thread while this rank waits there), and
    whether this rank is itself joining (its quorum syncs nothing then: `join_after_restore`)."""
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    checkpoint = stage_checkpoints.in_memory(strategy, checkpoint)
    checkpoint["torchft"] = strategy.replicas.state_dict()
    checkpoint["torchft_joining"] = joining.restore_training_state is not None
    checkpoint["torchft_sync"] = sync_settings(strategy)
    return checkpoint


_SYNC_SETTINGS = ("local_sgd_steps", "local_sgd_warmup_steps", "streaming_sync", "outer_optimizer", "outer_lr",
                  "outer_momentum")  # fmt: skip


def sync_settings(strategy: Any) -> dict[str, Any]:
    """When the groups sync and what their all-reduce averages: groups that differ pair one group's sync with
    another's at another step, or average weights with pseudo-gradients, silently."""
    return {name: getattr(strategy, name) for name in _SYNC_SETTINGS}


@dataclass
class Joining:
    """Set while this rank takes its first quorum: Lightning's own ``restore_training_state``, which a heal then
    runs on the peer's state (the loops can still take it there); None afterwards. ``healed``: this rank took the
    state of a live peer that waits in its sync (OuterSync's) in that quorum; a peer that is joining too syncs
    nothing there, and neither does this rank then."""

    restore_training_state: Callable[[], None] | None = None
    healed: bool = False


def heal(strategy: Any, trainer: Trainer, checkpoint: dict[str, Any], joining: Joining) -> None:
    """Load a live peer rank's state. Joining (before the first batch) behind it: through Lightning's resume path,
    loops and data position included. At this rank's own step (groups that start together; a group that missed a
    commit): its stages' state only, the loop being where the peer's is. A group that trained apart from the live
    ones to another step is ended, to rejoin by a restart."""
    theirs, mine = checkpoint["pipeline"]["layout"], strategy.layout()
    if theirs != mine:
        raise ValueError(
            f"replica group {strategy.replica_group_id} cannot heal from a live group that runs another pipeline: "
            f"theirs {theirs}, this group's {mine}. Every group must run the same pipeline_stages, balance and "
            "schedule on the same number of devices."
        )
    theirs, mine = checkpoint.get("torchft_sync", sync_settings(strategy)), sync_settings(strategy)
    if theirs != mine:
        differ = ", ".join(
            f"{k}: theirs {theirs.get(k)!r}, this group's {v!r}" for k, v in mine.items() if theirs.get(k) != v
        )
        raise ValueError(
            f"replica group {strategy.replica_group_id} cannot heal from a live group that syncs otherwise ({differ}): "
            "their outer syncs would pair with this group's at other steps, or average other quantities. Give every "
            "group the same local_sgd_steps, local_sgd_warmup_steps, streaming_sync and outer optimizer settings."
        )
    connector = trainer._checkpoint_connector
    at_my_step = checkpoint["global_step"] == trainer.global_step
    if joining.restore_training_state is not None:
        joining.healed = not checkpoint.get("torchft_joining", False)
        if not at_my_step:
            rank_zero_info(f"replica group {strategy.replica_group_id} heals from a live group at step "
                           f"{checkpoint['global_step']}")  # fmt: skip
            connector._loaded_checkpoint = checkpoint
            connector.restore_model()
            connector.restore_datamodule()
            connector.restore_callbacks()
            joining.restore_training_state()
            connector._loaded_checkpoint = {}
            return
    elif not at_my_step:
        # A group that formed a quorum of its own (it joined while the live groups were further from their sync than
        # the lighthouse's join timeout) trained apart; its loop cannot jump mid-epoch. Ending its processes lets
        # its launcher restart it, and a restart joins through the resume path above.
        raise RuntimeError(
            f"replica group {strategy.replica_group_id} is at step {trainer.global_step} and the live groups at step "
            f"{checkpoint['global_step']}: it trained apart from them, in a quorum of its own, which happens when it "
            "joins while they are further from their next sync than the lighthouse's join timeout. Restarting the "
            "group (torchrun --max-restarts) rejoins it at their step; to avoid it, start the lighthouse with "
            "--join_timeout_ms above the time local_sgd_steps optimizer steps take."
        )
    # At this rank's own step (torchft's start-up sync of groups that start together, which picks the source group
    # rank by rank; a group that missed a commit): the stages' part of Lightning's resume path, weights, then
    # optimizers and schedulers. The loops stay, as on the group's ranks that took nothing: Lightning skips the
    # sanity check on a restored loop, and one rank skipping it while its neighbour ran it hung the pipeline.
    connector._loaded_checkpoint = checkpoint
    connector.restore_model()
    connector.restore_optimizers_and_schedulers()
    connector._loaded_checkpoint = {}


def join_after_restore(strategy: Any, trainer: Trainer, replicas: TorchftReplicas, joining: Joining) -> None:
    """Take the first quorum right after Lightning's restore, where a healed state can still become the loops'."""
    connector = trainer._checkpoint_connector
    restore = connector.restore_training_state

    def restore_then_join() -> None:
        restore()
        loaded = connector._loaded_checkpoint
        if loaded and "torchft" in loaded:  # a whole-job restart: the groups' sync count resumes too
            replicas.load_state_dict(loaded["torchft"])
        joining.restore_training_state, joining.healed = restore, False
        try:
            # Only a rank that healed takes part in the sync at its new step: the live groups it healed from wait
            # in theirs. A rank at its own state (a fresh start, or a whole job restarted from a checkpoint) has
            # nothing to sync at this step: a checkpoint at a sync step holds the synced weights (OuterSync runs
            # before the checkpoint callbacks), and syncing again would apply DiLoCo's outer step twice (a zero
            # pseudo-gradient, but the momentum moves the weights).
            replicas.sync(lambda: due_averagers(strategy, trainer.global_step) if joining.healed else [])
        finally:
            joining.restore_training_state = None
        connector.restore_training_state = restore  # once per fit

    connector.restore_training_state = restore_then_join


def due_averagers(strategy: Any, step: int) -> list[Any]:
    """This process's stages that sync at ``step`` (all of them, or under streaming those whose turn it is)."""
    return [a for a in strategy.averagers if step >= 1 and a.is_sync_step(step)]


class OuterSync(Callback):
    """Drains the pipeline and syncs its stages over the live replica groups at every step where a stage of the
    pipeline syncs (every LocalSGD/DiLoCo sync step; under streaming, every stage's turn), the strategy's own
    callback, inserted first. Logs ``fault_tolerance/live_groups`` and
    ``fault_tolerance/committed`` (1 when the sync was committed, 0 when a fault dropped it)."""

    def __init__(self) -> None:
        self._last_step = -1

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_step = trainer.global_step  # joining synced this step (a resume's first batches are in it)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        strategy = trainer.strategy
        replicas = getattr(strategy, "replicas", None)
        step = trainer.global_step
        if replicas is None or step == self._last_step or step < 1:
            return
        self._last_step = step
        if not strategy.outer_sync_at(step):
            return
        strategy.drain()
        committed = replicas.sync(lambda: due_averagers(strategy, step))
        log = dict(on_step=True, on_epoch=False, rank_zero_only=True)
        pl_module.log("fault_tolerance/live_groups", float(replicas.participants), **log)
        pl_module.log("fault_tolerance/committed", float(committed), **log)
