"""PACIStrategy's checkpoints: one save path and one load path, whatever the hosting and the format.

Every hosted stage contributes a share (`checkpoint.merge.rank_share`): its part of Lightning's checkpoint dict
under parameter names, and its rank's pipeline state (`pipeline_state`: accumulation, random streams,
averager). A share is built from Lightning's dict and a `StageRecord`, what the share needs of its stage, read
while the stage lives or kept at the end of training (`final_state`: ``fit`` then takes the stages apart, and
``trainer.save_checkpoint`` after it still writes what a `ModelCheckpoint` at the last step would have). The
shares go to one file on global rank 0 (`checkpoint.single_file`) or into a sharded folder, each process
writing its own (`checkpoint.sharded_write`, in the background with ``async_checkpoint``).

Loading reads the dict one device would have saved (the file as it is; from a folder, this process's part:
`checkpoint.sharded_read`) and gives every hosted stage its weights, optimizer state, schedulers, accumulated
gradients and rank state by parameter name (`checkpoint.restore`), so either layout resumes from the other's.
The functions take the strategy (`lit_efficient.strategy.paci.PACIStrategy`) whose hooks call them.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_efficient.checkpoint import sharded_read, sharded_write
from lit_efficient.checkpoint.async_write import AsyncCheckpointer
from lit_efficient.checkpoint.merge import (
    assemble,
    from_automatic_loops,
    group_key,
    merge_group_names,
    rank_key,
    rank_share,
    regroup_schedulers,
    to_automatic_loops,
)
from lit_efficient.checkpoint.restore import (
    local_accumulation,
    local_optimizer_state,
    local_state_dict,
    unexpected_keys,
)
from lit_efficient.checkpoint.single_file import gather_to_rank_zero, load_file, remove_path, write_atomically
from lit_efficient.replicas.sharded_optimizer import ShardedOptimizer
from lit_efficient.runtime.split import every_part_in_place, only_stage
from lit_efficient.runtime.tied import restore_tied
from lit_efficient.strategy.config import check_checkpoint_path, local_path
from lit_efficient.strategy.hosting import HostedStage
from lit_efficient.transport.collectives import broadcast_flat


@dataclass(frozen=True)
class StageRecord:
    """What a share needs of its stage besides Lightning's dict.

    Attributes:
        stage: The stage.
        replica: Its replica.
        keys: The stage's ``state_dict`` keys.
        group_names: Its optimizer's parameter names, per group, in the optimizer's order.
        extras: `pipeline_state` of the stage.
        tied_copies: Names of its second copies of weights tied to the first stage.
    """

    stage: int
    replica: int
    keys: list[str]
    group_names: list[list[str]]
    extras: dict[str, Any]
    tied_copies: list[str]


@dataclass(frozen=True)
class FinalState:
    """The records of this process's stages at the end of training, the layout they were trained in, and their
    optimizers and schedulers (a validate, test or predict after fit builds stages without them)."""

    records: list[StageRecord]
    layout: dict[str, Any]
    optimizers: list[StageOptimizer]


@dataclass(frozen=True)
class StageOptimizer:
    """What a save reads of a stage besides its record: its optimizer and its LR scheduler configs."""

    optimizer: Any
    scheduler_configs: list[Any]

    @staticmethod
    def of(hosted: list[HostedStage]) -> list[StageOptimizer]:
        return [StageOptimizer(h.optimizer, list(h.scheduler_configs)) for h in hosted]


# -- saving -----------------------------------------------------------------------------------------


def pipeline_state(strategy: Any, hosted: HostedStage) -> dict[str, Any]:
    """What ``hosted``'s rank adds to a checkpoint besides weights and optimizer (`checkpoint.merge` merges it)."""
    module = strategy.lightning_module
    names = {id(p): n for n, p in module.named_parameters()}
    # After a failure mid-action, a window some of whose micro-batches never finished: not one to continue.
    accumulation = hosted.stage.accumulation_state(window=not strategy.stopped_mid_action)
    if "grads" in accumulation:  # by name, so another layout can take its share
        accumulation["grads"] = {
            names[id(p)]: g
            for p, g in zip(hosted.stage.parameters(), accumulation["grads"], strict=True)
            if g is not None
        }
    state: dict[str, Any] = {"stage": hosted.index, "replica": strategy.replica, "accumulation": accumulation}
    if strategy.restored_random_stream is not None:  # restored, not yet put back (before the first training batch)
        state["rng"] = dict(strategy.restored_random_stream)
    else:
        state["rng"] = {"cpu": torch.get_rng_state()}
        if strategy.root_device.type == "cuda":
            state["rng"]["cuda"] = torch.cuda.get_rng_state(strategy.root_device)
    if hosted.averager is not None:  # with the sync period it ran with, for a resume that changes it
        state["averager"] = {**hosted.averager.state_dict(), "local_sgd_steps": strategy.local_sgd_steps}
    if hosted.tied:  # the tied weights' delay line (`runtime.tied`), by this stage's name of its copy
        state["tied"] = {names[id(t.param)]: t.state_dict() for t in hosted.tied}
    return state


def live_records(strategy: Any, module_state_on_every_stage: bool = False) -> list[StageRecord]:
    """This process's stages as they are now, each read in its own view of the module (`PACIStrategy.stage_view`).

    What the module holds outside its layers (a buffer registered on it) is in every stage's view, a copy on each
    rank: a checkpoint saves the last stage's alone (global rank 0's, in both formats; the folder kept another
    rank's). ``module_state_on_every_stage``: each stage keeps its own copy, as a healing peer of the same stage
    loads it (`in_memory`)."""
    module = strategy.lightning_module
    own: set[str] = set()
    if not module_state_on_every_stage:
        with only_stage(strategy._split, None):
            own = set(module.state_dict().keys())
    records = []
    for hosted in strategy.hosted:
        with strategy.stage_view(hosted.index):
            names = {id(p): n for n, p in module.named_parameters()}
            optimizer = hosted.optimizer
            groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups] if optimizer else []
            keys = [k for k in module.state_dict() if hosted.index == strategy.pipeline_stages - 1 or k not in own]
            records.append(StageRecord(
                hosted.index, strategy.replica, keys, groups, pipeline_state(strategy, hosted),
                hosted.tied_copy_names(names)[1],
            ))  # fmt: skip
    return records


def final_state(strategy: Any) -> FinalState:
    """At the end of training, before ``fit`` takes the stages apart: what a save after ``fit`` needs."""
    for hosted in strategy.hosted:  # a sharded optimizer gathers its state while its replica group exists
        if isinstance(hosted.optimizer, ShardedOptimizer):
            hosted.optimizer.keep_consolidated()
    return FinalState(live_records(strategy), strategy.layout(), StageOptimizer.of(strategy.hosted))


def save(strategy: Any, checkpoint: dict[str, Any], filepath: Any) -> None:
    """``PACIStrategy.save_checkpoint``: every hosted stage's share into one file on global rank 0 or into a
    sharded folder (in the background with ``async_checkpoint``), during fit and after it. Collective on
    processes: every rank calls it."""
    path = local_path(filepath, "filepath")  # a ModelCheckpoint's own folder was checked before launch
    if strategy.topology is None:  # never set up here: the parent of spawned ranks, after fit
        return _save_weights(strategy, checkpoint, path)
    # Training stages (fit's, running): saved as they are. Otherwise (after fit, or during or after a validate, test
    # or predict, whose stages have no optimizer) the stages fit ended with.
    live = strategy.runtime is not None and strategy.hosted[0].optimizer is not None
    final = strategy.final_state
    if not live and final is None:
        raise RuntimeError(
            "PACIStrategy cannot save a checkpoint here: no fit's stages are left to save (training did not end "
            "normally, or no fit ran: a failed fit keeps no final state, and validate, test and predict train no "
            "optimizer). Save during fit with ModelCheckpoint, and resume from that."
        )
    if live:
        _replicas_agree(strategy)
    records = live_records(strategy) if live else final.records
    layout = strategy.layout() if live else final.layout
    optimizers = StageOptimizer.of(strategy.hosted) if live else final.optimizers
    shares, base = _shares(strategy, checkpoint, records, optimizers)
    distributed = not strategy.in_process
    group = strategy.cpu_group if distributed else None
    saver = strategy.async_checkpointer
    if live and strategy.async_checkpoint and strategy.checkpoint_format == "sharded":
        if saver is None:
            saver = strategy.async_checkpointer = AsyncCheckpointer(distributed, strategy._timeout)
        return saver.save(path, shares, base, layout, sync_group=group)
    if saver is not None:
        saver.wait()  # a synchronous save after an asynchronous one: in order
    if strategy.checkpoint_format == "sharded":
        return sharded_write.save(path, shares, base, layout, group=group, distributed=distributed)
    gathered = gather_to_rank_zero(shares, strategy.world_size, group) if distributed else [shares]
    if gathered is not None:  # global rank 0: every process's shares, one rank at a time
        write_atomically(to_automatic_loops(assemble(base, [s for part in gathered for s in part], layout)), path)
    if distributed:
        dist.barrier(group=group)  # nobody reads or removes it before it is complete


def _replicas_agree(strategy: Any) -> None:
    """Before a save during fit: the replicas of a stage whose stale forwards restore its weights only up to rounding
    (the in-place prediction, `runtime.staleness`) take their first replica's weights, which the checkpoint keeps.
    Each replica folds its own partial window into the prediction, so each keeps its own rounding residue and the
    replicas drift apart by a few ulp (1e-7 after a few steps); a resume gives every replica the checkpoint's
    weights, so without this it continued the run that saved only up to that drift (4e-7 six steps on). One
    broadcast of the stage's weights per save, over its replicas (stages without such a correction skip it)."""
    if strategy.in_process or strategy.topology.num_replicas == 1 or strategy.local_sgd_steps is not None:
        return  # LocalSGD's replicas differ by design: each keeps its own weights in the checkpoint
    for hosted in strategy.hosted:
        correction = hosted.stage.correction
        if correction is not None and not correction.restores_exactly:
            broadcast_flat(list(hosted.stage.parameters()), strategy._dp_groups[hosted.index])


def in_memory(strategy: Any, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """This process's stages as the dict a resume loads, built in memory from Lightning's ``checkpoint``: what a
    healing peer rank of another replica group loads (`strategy.fault_tolerant`), by the shares a save writes."""
    records = live_records(strategy, module_state_on_every_stage=True)
    shares, base = _shares(strategy, checkpoint, records, StageOptimizer.of(strategy.hosted))
    return assemble(base, shares, strategy.layout())


def _shares(
    strategy: Any, checkpoint: dict[str, Any], records: list[StageRecord], optimizers: list[StageOptimizer]
) -> tuple[list[dict], dict]:
    """Every hosted stage's share (``records`` and ``optimizers``: of the same stages), and Lightning's dict as this
    process's last hosted stage built it (on global rank 0, the last stage's: the base of a file)."""
    diverged = strategy.local_sgd_steps is not None and strategy.topology.num_replicas > 1
    last = len(records) - 1
    # Keys no module tensor has: an on_save_checkpoint hook's (ModelPruning's pruned "weight" in place of the live
    # "weight_orig" and "weight_mask"). Kept with Lightning's own entries, in the last hosted stage's share: they
    # were dropped, and a save during fit after the first pruning held an empty state_dict.
    live = set(strategy.lightning_module.state_dict())
    added = [k for k in checkpoint["state_dict"] if k not in live]
    if added:
        records = [_named_as_saved(r, checkpoint["state_dict"]) for r in records]
    views = [
        _view(strategy, checkpoint, r, o, i == last, added if i == last else [])
        for i, (r, o) in enumerate(zip(records, optimizers, strict=True))
    ]
    shares = [
        _share(view, r, o.optimizer, r.replica == 0 or diverged)
        for view, r, o in zip(views, records, optimizers, strict=True)
    ]
    return shares, views[-1]


def _named_as_saved(record: StageRecord, state: dict[str, Any]) -> StageRecord:
    """``record`` with its optimizer's parameters named as the saved weights name them: a hook that saved torch's
    pruned ``X.weight`` for the live ``X.weight_orig`` (ModelPruning) left the optimizer's state under a name no
    module has before its pruning, and a resume found none for ``X.weight``."""

    def saved_name(name: str) -> str:
        plain = name.removesuffix("_orig")
        return plain if plain != name and name not in state and plain in state else name

    groups = [[saved_name(n) for n in names] for names in record.group_names]
    return dataclasses.replace(record, group_names=groups)


def _view(
    strategy: Any,
    checkpoint: dict[str, Any],
    record: StageRecord,
    stage: StageOptimizer,
    lightnings: bool,
    added: list[str],
) -> dict[str, Any]:
    """Lightning's dict as ``record``'s rank would have built it: its keys (and ``added``, hooks' keys no tensor of
    the module has), its optimizer, its schedulers. Lightning's own entries are those of the stage whose optimizer
    it holds (``lightnings``: the last hosted), hooks' changes (``on_save_checkpoint``) included; another hosted
    stage's are read from its optimizer and schedulers."""
    state = checkpoint["state_dict"]
    view = dict(checkpoint, state_dict={k: state[k] for k in [*record.keys, *added] if k in state})
    if "optimizer_states" in checkpoint and not lightnings:  # none under save_weights_only
        view["optimizer_states"] = [strategy.optimizer_state(stage.optimizer)]
        view["lr_schedulers"] = [c.scheduler.state_dict() for c in stage.scheduler_configs]
    return view


def _share(view: dict[str, Any], record: StageRecord, optimizer: Any, keep_weights: bool) -> dict[str, Any]:
    # The record's names, not the module's: after fit the module may hold other parameter objects (rank 0's
    # is whole again, a tied weight one).
    names = record.group_names if optimizer is not None else None
    if names is not None and [len(n) for n in names] != [len(g["params"]) for g in optimizer.param_groups]:
        raise RuntimeError(
            f"stage {record.stage}: the recorded parameter names per group ({[len(n) for n in names]}) do not match "
            f"its optimizer's groups ({[len(g['params']) for g in optimizer.param_groups]}): the optimizer was "
            "changed after setup; a checkpoint would misname its state"
        )
    return rank_share(view, names, record.extras, keep_weights, tied_copies=record.tied_copies)


def _save_weights(strategy: Any, checkpoint: dict[str, Any], path: Path) -> None:
    rank_zero_warn(
        "trainer.save_checkpoint after a fit whose ranks were spawned (start_method="
        f"{strategy._start_method!r}): they ended with fit, and this process holds only the trained weights "
        "Lightning's launcher brought back (as under DDP). The checkpoint has those weights and no optimizer or "
        "pipeline state: it loads with load_from_checkpoint, but does not resume training. For a checkpoint that "
        "resumes, save during fit (ModelCheckpoint) or launch with start_method='popen' (or torchrun), where "
        "every rank keeps its stage after fit."
    )
    weights = {k: v for k, v in checkpoint.items() if k not in ("optimizer_states", "lr_schedulers")}
    if strategy.checkpoint_format == "sharded":
        sharded_write.save_weights(path, weights)
    else:
        write_atomically(weights, path)


def remove(strategy: Any, filepath: Any) -> None:
    """``PACIStrategy.remove_checkpoint``: global rank 0 removes a file or a sharded folder; with a background save
    in flight, once that save is published (`AsyncCheckpointer.when_published`)."""
    if not strategy.is_global_zero:
        return

    # A link (ModelCheckpoint's save_last="link" rotating its last link out) goes, never its target.
    delete = functools.partial(remove_path, local_path(filepath, "filepath"))
    if strategy.async_checkpointer is not None:
        strategy.async_checkpointer.when_published(delete)
    else:
        delete()


# -- loading ----------------------------------------------------------------------------------------


def load(strategy: Any, checkpoint_path: Any, weights_only: bool | None) -> dict[str, Any]:
    """``PACIStrategy.load_checkpoint``: the dict one device would have saved (from a sharded folder, only what this
    process's stages need), with the step count where the pipeline's loop keeps it."""
    path = local_path(checkpoint_path, "ckpt_path")  # as Lightning's own loader reads it (fsspec)
    check_checkpoint_path(checkpoint_path)  # in one process: nothing was launched to check it before
    if sharded_write.is_sharded(path):  # this process's part only
        module = strategy.lightning_module
        state = module.state_dict()
        names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
        own = [rank_key(s, strategy.replica) for s in strategy.hosted_stages]
        found = sharded_read.read(
            path, state.keys(), names, own, strategy.layout(), targets=state, weights_only=weights_only
        )
    else:
        found = sharded_read.from_consolidated(load_file(path, weights_only))
    if _fitting(strategy) and "optimizer_states" not in found:
        # Lightning's own refusal blamed `ModelCheckpoint.save_weights_only`, which the user of a spawned fit never set.
        raise ValueError(
            f"{path} holds weights only (no optimizer state), so fit(ckpt_path=...) cannot resume from it: it was "
            "written by trainer.save_checkpoint after a fit whose ranks were spawned (start_method 'spawn', 'fork' or "
            "'forkserver'), or with save_weights_only=True. Load its weights instead (YourModule.load_from_checkpoint"
            "(path)) and fit them without ckpt_path; for a checkpoint that resumes, save during fit (ModelCheckpoint) "
            "or launch with start_method='popen' (or torchrun)."
        )
    # Before Lightning restores the loops from it: a one-device file counts steps in the automatic loop.
    return from_automatic_loops(found)


def _own_replica_key(strategy: Any, stage: int, checkpoint: dict[str, Any]) -> str | None:
    """Where this rank's replica of ``stage`` finds weights and optimizer state of its own in a checkpoint: under
    LocalSGD/DiLoCo replicas differ between syncs and a checkpoint keeps each one's, for a fit that continues them on
    the layout they were saved on. Otherwise every replica takes the checkpoint's model, the first replica's: an
    evaluation scores that one model (each replica's own mixed two models into one loss), and on another layout a
    replica's record covers other parameters than its new stage (it mixed two replicas' optimizer states). A run that
    averages every step starts every replica from the first's too (each took its own and they stayed apart for good,
    2e-2 after 10 steps)."""
    pipeline, key = checkpoint.get("pipeline", {}), rank_key(stage, strategy.replica)
    # With another outer optimizer the averager restarts from the first replica's weights (`_load_rank_state`): the
    # replica's own optimizer state would sit beside the first's weights.
    saved_outer = pipeline.get("ranks", {}).get(key, {}).get("averager", {}).get("outer_optimizer")
    continues = (
        strategy.local_sgd_steps is not None
        and _fitting(strategy)
        and pipeline.get("layout") == strategy.layout()
        and saved_outer in (None, strategy.outer_optimizer)
    )
    return key if continues else None


def _fitting(strategy: Any) -> bool:
    trainer = strategy.lightning_module.trainer
    return trainer.state.fn == TrainerFn.FITTING


def load_weights(strategy: Any, checkpoint: dict[str, Any], strict: bool) -> None:
    """``PACIStrategy.load_model_state_dict``: every hosted stage's weights by name (a diverged replica's own)."""
    module = strategy.lightning_module
    own = _own_replica_key(strategy, strategy.stage, checkpoint)
    saved = checkpoint.get("pipeline", {}).get("replicas", {})
    if strategy.local_sgd_steps is None and _fitting(strategy) and rank_key(strategy.stage, strategy.replica) in saved:
        # Said where the dropped weights are (a replica past the first: rank 0 never has any; a sharded folder
        # gives each rank its own only).
        warnings.warn(
            f"this checkpoint holds replica {strategy.replica}'s own weights since its last LocalSGD/DiLoCo sync; "
            "this run averages gradients every step (no local_sgd_steps), so every replica starts from the first "
            "replica's weights and optimizer state, and this replica's own since that sync are dropped. Resume "
            "with the same local_sgd_steps to continue each replica's own.",
            UserWarning,
            stacklevel=2,
        )
    if strict:  # this process's load sees its own keys only: another model's extra layers were dropped silently
        assert strategy._split is not None  # setup splits before any load (`restore_checkpoint_after_setup`)
        with every_part_in_place(strategy._split):
            unexpected = unexpected_keys(checkpoint, module.state_dict().keys())
        if unexpected:
            listed = ", ".join(f'"{k}"' for k in unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(module).__name__}:\n\tUnexpected key(s) in state_dict: "
                f"{listed} ({len(unexpected)} the model does not have). The checkpoint was written for another "
                "model; resume from one of this model, or set strict_loading = False on the LightningModule to "
                "drop them."
            )
    module.load_state_dict(local_state_dict(checkpoint, module, own), strict=strict)


def load_stage_states(strategy: Any, checkpoint: dict[str, Any]) -> None:
    """``PACIStrategy.load_optimizer_state_dict``: every hosted stage takes its optimizer state, schedulers,
    accumulated gradients and rank state by parameter name, as its own rank would. The last hosted stage's
    schedulers are left in ``checkpoint`` for Lightning, which restores them right after (they are the ones
    it holds)."""
    module = strategy.lightning_module
    names = {id(p): n for n, p in module.named_parameters()}
    pipeline = checkpoint.get("pipeline", {})
    same_layout = pipeline.get("layout") == strategy.layout()
    carried = [k for k in _PER_RANK if k != "averager" or strategy.local_sgd_steps is not None]  # else unused
    ranks = pipeline.get("ranks", {}).values()
    dropped = [] if same_layout else [_PER_RANK[k] for k in carried if any(k in r for r in ranks)]
    # From what every rank reads (a sharded folder gives a rank its own replica's record only, and rank 0 has none):
    # the saved run kept each replica's own where it averaged replicas with LocalSGD/DiLoCo.
    kept_own = (pipeline.get("layout") or {}).get("num_replicas", 1) > 1 and any("averager" in r for r in ranks)
    if not same_layout and strategy.local_sgd_steps is not None and kept_own:
        dropped.append(_REPLICAS_OWN)
    if dropped:
        rank_zero_warn(
            f"resuming a checkpoint of layout {pipeline.get('layout')} on {strategy.layout()}: weights, optimizer, "
            f"schedulers, loops and accumulated gradients carry over by parameter name; the per-rank state does "
            f"not: {'; '.join(dropped)}."
        )
    # A checkpoint without the names (one device's, DDP's) is read by the concatenation rule over every stage's
    # groups: computed here, outside any stage's view, on every rank alike (a collective on processes).
    needs_names = strategy.hosted[-1].optimizer is not None and not pipeline.get("optimizer_by_name")
    group_names = _group_names(strategy) if needs_names else None

    def names_by_group() -> Any:
        assert group_names is not None, "a checkpoint with optimizer_by_name needs no group names"
        return group_names

    strategy.restored_window_grads = []  # only this restore's (an earlier fit's unreinstated ones never leak)
    strategy.restored_random_stream = None
    tied, tied_states = [], []  # this process's tied-weight copies and what the checkpoint kept of each
    saved_schedulers = checkpoint.get("lr_schedulers", [])
    given: set[int] = set()  # the checkpoint's tensors an earlier stage's optimizer holds now
    for hosted in strategy.hosted:
        key = rank_key(hosted.index, strategy.replica)
        with strategy.stage_view(hosted.index):
            if hosted.optimizer is not None:
                own_state = _own_replica_key(strategy, hosted.index, checkpoint)  # its replica's own, where kept
                optimizer = hosted.optimizer
                state, group_map = local_optimizer_state(checkpoint, module, optimizer, own_state, names_by_group)
                optimizer.load_state_dict(_own_copy(state, given))
                saved_groups = len(checkpoint["optimizer_states"][0]["param_groups"])
                schedulers = regroup_schedulers(saved_schedulers, group_map, saved_groups)
                if hosted is strategy.hosted[-1]:
                    checkpoint["lr_schedulers"] = schedulers  # Lightning restores them next, as on rank 0
                else:  # zip, not strict: what Lightning's restore does with its own
                    for config, saved in zip(hosted.scheduler_configs, schedulers, strict=False):
                        config.scheduler.load_state_dict(saved)
        own = key if same_layout else None
        accumulation = local_accumulation(checkpoint, [names[id(p)] for p in hosted.stage.parameters()], own)
        mine = pipeline.get("ranks", {}).get(key, {}) if same_layout else {}
        _load_rank_state(strategy, hosted, mine, accumulation, checkpoint.get("global_step", 0))
        tied += hosted.tied  # by the name of each copy, as its accumulated gradient above
        tied_states += [mine.get("tied", {}).get(names[id(t.param)]) for t in hosted.tied]
    restore_tied(tied, tied_states)  # continued, or (another layout, an older checkpoint) started again
    strategy.restored_optimizers()


def reinstate_window_gradients(strategy: Any) -> None:
    """``PACIStrategy.on_train_start``: the unfinished window's gradients a checkpoint restored, given back to their
    parameters. Lightning calls ``lightning_module.zero_grad()`` between the restore and the fit loop (``_run_stage``),
    which set them to None while the stage kept the window's weight and micro-batch count: a resumed window then
    stepped on its new micro-batches' gradients alone, divided by the whole window's weight."""
    for stage, grads in strategy.restored_window_grads:
        for p, g in zip(stage.parameters(), grads, strict=True):
            if g is not None and p.grad is None:
                p.grad = g
    strategy.restored_window_grads = []


def reinstate_random_stream(strategy: Any) -> None:
    """``PACIStrategy.on_train_batch_start``: this rank's random stream as the checkpoint saved it (dropout masks
    continue exactly), put back at the first training batch after a restore rather than at the restore: in between
    Lightning starts the training loader's epoch, and a plain shuffled loader draws its order from this stream
    there. One device draws it from the stream the script seeded; so does a rank now (a plain loader restarts its
    epoch on a resume: the order it restarts in is one device's). Later epochs draw from the checkpoint's stream:
    the uninterrupted run's orders after a mid-epoch checkpoint, neither run's after an epoch-end one
    (docs/checkpoints.md; `lit_efficient.data.ResumableLoader` is exact from both)."""
    saved, strategy.restored_random_stream = strategy.restored_random_stream, None
    torch.set_rng_state(saved["cpu"])
    if "cuda" in saved and strategy.root_device.type == "cuda":
        torch.cuda.set_rng_state(saved["cuda"], strategy.root_device)


# What a resume on another layout cannot carry of a rank's state (the checkpoint's per-rank record), and so what
# the resumed run starts afresh.
_REPLICAS_OWN = (
    "the replicas past the first start from the first's weights and optimizer state (their own since the last "
    "LocalSGD/DiLoCo sync are dropped: a replica's record holds its old stage's parameters)"
)
_PER_RANK = {
    "rng": "dropout masks start afresh",
    "averager": (
        "LocalSGD/DiLoCo restart from the loaded weights (DiLoCo's anchor is those weights, its outer momentum "
        "empty, its steps counted from the checkpoint's)"
    ),
    "tied": (
        "a weight tied between the first and the last stage restarts its delay line under PACI (its first "
        "ceil(S/N) updates use the LM-head side's gradient only)"
    ),
}


def _load_rank_state(
    strategy: Any, hosted: HostedStage, state: dict[str, Any], accumulation: dict | None, global_step: int
) -> None:  # fmt: skip
    # The stage's own step count, random stream and staleness correction's counts come from its own record (same
    # layout only: a stage's staleness is its layout's): local_accumulation carries only an unfinished window, by name.
    own = {k: v for k, v in state.get("accumulation", {}).items() if k in ("version", "rng", "correction")}
    if accumulation or own:
        hosted.stage.load_accumulation_state({**own, **(accumulation or {})})
    if accumulation and "grads" in accumulation:  # as the stage holds them now: on its device
        strategy.restored_window_grads.append((hosted.stage, [p.grad for p in hosted.stage.parameters()]))
    if hosted.stage.scheduler is not None:  # every frequency counts the run's optimizer steps
        hosted.stage.scheduler.steps = global_step
    averager, saved = hosted.averager, state.get("averager")
    if averager is not None and saved is not None and saved["outer_optimizer"] != averager.outer_optimizer:
        # A switch between LocalSGD and DiLoCo (or DiLoCo's outer optimizer) on a resume: the saved averager's
        # state means something else to this one (an anchor and momentum, or none). Every replica of the stage
        # reads the same record, so all restart alike (a collective).
        rank_zero_warn(
            f"the checkpoint's LocalSGD/DiLoCo averager of stage {hosted.index} used outer_optimizer="
            f"{saved['outer_optimizer']!r}; this run's is {averager.outer_optimizer!r} "
            f"(PACIStrategy(outer_optimizer=...)): it restarts from the first replica's weights at step {global_step} "
            f"(DiLoCo's anchor is those weights, its outer momentum empty). Resume with outer_optimizer="
            f"{saved['outer_optimizer']!r} to continue it."
        )
        saved = None
    if averager is not None and saved is not None:
        period = saved.get("local_sgd_steps", strategy.local_sgd_steps)  # recorded since 12-06
        if period != strategy.local_sgd_steps and hosted is strategy.hosted[-1]:  # said once per process
            rank_zero_warn(
                f"the checkpoint's run synced its replicas every {period} steps; this run syncs every "
                f"{strategy.local_sgd_steps} (PACIStrategy(local_sgd_steps=...)): from step {global_step} on the "
                f"syncs follow the new period, counted from the run's first step, and each replica continues from "
                f"its own weights until the next one. Resume with local_sgd_steps={period} to continue the run as "
                "it was."
            )
        averager.load_state_dict(saved)
    elif averager is not None:  # built at setup from the initial weights: anchor it at the loaded ones
        averager.restart(global_step)
    if "rng" in state:  # put back at the first training batch (`reinstate_random_stream`)
        strategy.restored_random_stream = state["rng"]


def _group_names(strategy: Any) -> tuple[list[list[str]], dict[str, str]]:
    """The unsplit optimizer's parameter names per group, for a checkpoint that carries no names (one device,
    DDP): every stage's groups matched by position or by hyper-parameters (`merged_groups`),
    as `checkpoint.merge` merges them, without tied weights' second copies (one device holds a tied weight
    once); and ``{second copy: first copy}`` by name. Collective over this replica's pipeline on processes."""
    module = strategy.lightning_module
    parts = []
    for hosted in strategy.hosted:
        with strategy.stage_view(hosted.index):
            names = {id(p): n for n, p in module.named_parameters()}
            first, second = hosted.tied_copy_names(names)
            groups = [
                (group_key(g), [names[id(p)] for p in g["params"] if names[id(p)] not in second])
                for g in hosted.optimizer.param_groups
            ]
            parts.append((hosted.index, groups, first, second))
    if not strategy.in_process:
        group = strategy._pipeline_groups[strategy.replica]
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, parts, group=group)
        parts = [p for part in gathered for p in part]
    return merge_group_names(parts)


def _own_copy(state: dict[str, Any], given: set[int]) -> dict[str, Any]:
    """``state`` with a copy of every tensor another stage's optimizer was given already, and those tensors noted.

    ``Optimizer.load_state_dict`` keeps the checkpoint's tensors when they already have the parameter's dtype and
    device. A one-device checkpoint holds a tied weight's state once, and both stages' copies take it (the last
    stage's by the first's name): on S processes each rank has its own; in one process the two optimizers would
    update one pair of moment buffers, twice per step.
    """
    out = {}
    for index, entry in state["state"].items():
        mine = {}
        for key, value in entry.items():
            if isinstance(value, Tensor):
                value = value.clone() if id(value) in given else value
                given.add(id(value))
            mine[key] = value
        out[index] = mine
    return dict(state, state=out)
