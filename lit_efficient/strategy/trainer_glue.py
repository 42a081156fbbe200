"""What PACIStrategy adjusts in Lightning's Trainer and loops, and reads from them.

The sampler a one-replica pipeline keeps (the user's own), the random streams every stage starts from (its
loader's workers' too), the step count Lightning reads after fit, the callback metrics every rank must agree on
(`SyncCallbackMetrics`, the strategy's own callback), where torchmetrics sync, how gradients are normalized, a
batch's size, and the check that the stages of a pipeline read the same batches.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states, pl_worker_init_function
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

from lit_efficient.runtime.profile import first_batch
from lit_efficient.runtime.topology import Topology


class SyncCallbackMetrics(Callback):
    """The strategy's own callback, first among the trainer's callbacks.

    Copies rank 0's callback metrics (it holds the last stage) to every rank before checkpoint and
    early-stopping callbacks read them at a validation's, a test's and an epoch's end, so all ranks take the same
    decisions (at a batch's end each ModelCheckpoint's own hook does: `checkpoints_see_the_users_optimization`);
    and drains the pipeline (and under LocalSGD/DiLoCo has every replica score the first replica's model:
    `PACIStrategy.score_the_first_replica`)
    before any other callback's ``on_validation_start``, ``on_train_epoch_end`` (there also ending an epoch
    cut short: `PACIStrategy.end_epoch`) and ``on_train_end``:
    Lightning calls the callbacks' hooks (and the module's) before the strategy's, and a validation in
    the middle of a window or a run stopped by ``max_steps`` mid-epoch would otherwise show them stage 0
    still a step behind (docs/DESIGN.md section 7). Before the user's epoch-end hooks, points the metrics the module
    made during the epoch at the last stage's group (`PACIStrategy.point_metrics`; the strategy also does at each
    epoch's and evaluation's first batch).
    """

    def _sync(self, trainer: Trainer) -> None:
        share_rank_zero_metrics(trainer)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.drain()  # type: ignore[attr-defined]
        trainer.strategy.score_the_first_replica()  # type: ignore[attr-defined]

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.point_metrics()  # type: ignore[attr-defined]

    @override
    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.point_metrics()  # type: ignore[attr-defined]

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.own_weights_back()  # type: ignore[attr-defined]
        self._sync(trainer)
        agree_on_deferred_saves(trainer)
        trainer.strategy.end_evaluation()  # type: ignore[attr-defined]  # before a ModelCheckpoint saves the streams

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Before any other callback's: the failure said (a save that fails too must not hide it), and under
        # LocalSGD each replica's own weights back (OnExceptionCheckpoint saves each one's for a resume).
        trainer.strategy.failed(exception)  # type: ignore[attr-defined]
        trainer.strategy.own_weights_back()  # type: ignore[attr-defined]

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.point_metrics()  # type: ignore[attr-defined]
        trainer.strategy.end_epoch()  # type: ignore[attr-defined]
        self._sync(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.drain()  # type: ignore[attr-defined]

    @override
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._sync(trainer)  # as after a validation: a callback's on_test_end found nothing on the other ranks
        trainer.strategy.end_evaluation()  # type: ignore[attr-defined]

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.end_evaluation()  # type: ignore[attr-defined]


def throughput_counts_replicas(trainer: Trainer, replicas: int) -> None:
    """Lightning's ThroughputMonitor makes a rank's rates job-wide by multiplying them by the world size: the S stages
    of a replica read the same samples, so its ``samples_per_sec`` (and batches, items, FLOPs) were S times the job's.
    Multiplied by the replicas instead (each reads its share of the data). Its throughputs are built in the
    callbacks' ``setup``, before the strategy's."""
    for callback in trainer.callbacks:
        if isinstance(callback, ThroughputMonitor):
            for throughput in callback._throughputs.values():
                throughput.world_size = replicas


def share_rank_zero_metrics(trainer: Trainer) -> None:
    """Every rank takes global rank 0's callback metrics (it hosts the last stage, which logs the loss and what the
    evaluation steps and pipeline_loss log), and a key rank 0 does not log from the lowest rank that does: what stage
    0 logs in ``pipeline_input`` (a one-device training_step logs it there too). Every rank then holds the same keys
    and values: a ModelCheckpoint monitoring such a key found it on stage 0's rank only, which saved (a collective)
    while rank 0 skipped, a hang. A value taken from another rank is not this rank's to share again: Lightning
    refreshes a rank's own keys at each batch's end, never a taken one, whose copy (rank 0's) won every later share
    and froze the key at its first value. Rank 0 says once which keys its logger and progress bar do not show (they
    are fed by its own logging). A collective of every rank; nothing with one process."""
    if trainer.world_size == 1:
        return
    strategy: Any = trainer.strategy
    metrics = trainer.callback_metrics
    taken = strategy.metrics_taken  # what the last share wrote here from another rank, by identity
    own = {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in metrics.items() if taken.get(k) is not v}
    every: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(every, own)
    source: dict[str, int] = {}
    for rank, theirs in enumerate(every):
        for key in theirs:
            source.setdefault(key, rank)
    taken = {key: every[rank][key] for key, rank in source.items() if rank != trainer.global_rank}
    metrics.update(taken)
    strategy.metrics_taken = taken
    elsewhere = sorted(key for key, rank in source.items() if rank != 0)
    if trainer.global_rank == 0 and elsewhere:
        rank_zero_warn(
            f"self.log({', '.join(map(repr, elsewhere))}) ran on a rank without the last stage (in pipeline_input or "
            "a hook of an earlier stage's process): checkpoint and early-stopping callbacks see it, the logger and "
            "the progress bar (global rank 0's, with the last stage) do not. To chart it, log it in pipeline_loss, "
            "which runs on the last stage."
        )


def agree_on_deferred_saves(trainer: Trainer) -> None:
    """A ModelCheckpoint defers a save to the next validation's end where, at a batch's end, its monitored key is
    missing; between two metric shares a key logged on one stage's ranks only (train_loss on the last stage's,
    what pipeline_input logs on stage 0's) is missing on the others, and the ranks that deferred then saved (a
    collective) at the validation's end alone: a hang. A save stays deferred where every rank deferred it: the key
    was missing on them all, as on one device. A collective of every rank per checkpoint callback; nothing with
    one process."""
    if trainer.world_size == 1:
        return
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            deferred = callback._defer_save_until_validation
            callback._defer_save_until_validation = trainer.strategy.reduce_boolean_decision(deferred, all=True)


def validates_after_this_batch(trainer: Trainer) -> bool:
    """Whether Lightning runs a validation after the training batch in progress: its own test, read during the
    step (the batch's progress is counted before it; a time-based ``val_check_interval`` is read a moment early)."""
    loop = trainer.fit_loop
    epoch_loop = loop.epoch_loop
    if loop._data_fetcher is None or epoch_loop._skip_next_val:
        return False
    return epoch_loop._should_check_val_fx(loop._data_fetcher)


def _reads_metrics_now(callback: Any, trainer: Trainer) -> bool:
    """Whether a ``ModelCheckpoint`` may read the callback metrics at this training batch, for a checkpoint that
    monitors a metric or names one in its filename: a save not skipped, at a step multiple of
    ``every_n_train_steps`` or with a ``train_time_interval`` (whose decision is rank 0's clock, broadcast inside
    the hook). The same answer on every rank. Only the last stage (rank 0) logs the training loss: a checkpoint
    that reads it found it on rank 0 alone, which then saved (a collective) while the other ranks skipped the save
    and trained on, a hang; so every rank takes rank 0's metrics first."""
    if not isinstance(callback, ModelCheckpoint) or not (callback.monitor or _metrics_named(callback.filename)):
        return False
    every = callback._every_n_train_steps
    due = callback._train_time_interval is not None or (every >= 1 and trainer.global_step % every == 0)
    return due and not callback._should_skip_saving_checkpoint(trainer)


@functools.cache
def _metrics_named(filename: str | None) -> bool:
    """Whether a checkpoint filename template names a metric besides the epoch and the step (parsed once)."""
    return bool(set(re.findall(r"\{([^}:]+)", filename or "")) - {"epoch", "step"})


def agree_on_evaluation_results(trainer: Trainer) -> None:
    """``trainer.validate``/``trainer.test`` return on every rank what rank 0 (the last stage) logged.

    Only the last stage computes the loss, so another stage's rank logged nothing and a user's
    ``trainer.validate(...)[0]["val_loss"]`` failed there with a KeyError (plain DDP returns every rank
    its own values). The loops' ``run`` is wrapped once per trainer: a collective of every rank,
    after the callbacks' ``on_*_end`` (where `SyncCallbackMetrics` already made the callback metrics
    agree). The fit loop's validation returns nothing to the user and is left alone."""
    if trainer.world_size == 1:
        return
    for loop in (trainer.validate_loop, trainer.test_loop):
        if getattr(loop, "_lit_efficient_agrees", False):
            continue
        run = loop.run

        def run_and_share(*args: Any, _run: Any = run, **kwargs: Any) -> Any:
            results = _run(*args, **kwargs)
            results = [{k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in r.items()} for r in results]
            return trainer.strategy.broadcast(results, src=0)

        loop.run = run_and_share  # type: ignore[method-assign]
        loop._lit_efficient_agrees = True  # type: ignore[attr-defined]


def agree_on_the_checkpoint(trainer: Trainer) -> None:
    """Every rank restores the same checkpoint (or none), or every rank raises naming what each resolved.

    Lightning resolves ``ckpt_path`` on each rank on its own: ``"last"`` is the newest checkpoint in
    ModelCheckpoint's folder as this rank's file system shows it. On node-local disks only global rank 0's node
    had it, so the other node's ranks started afresh while rank 0's restored, and their collectives met out of
    order: the run hung (plain DDP fails there on a mismatched collective). The restore is wrapped once per
    trainer: one small collective of every rank before it (the path each resolved, or None)."""
    connector = trainer._checkpoint_connector
    if getattr(connector, "_lit_efficient_agrees", False):
        return
    restore = connector._restore_modules_and_callbacks

    def restore_agreed(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> None:
        if trainer.world_size > 1 and dist.is_initialized():
            every: list[Any] = [None] * dist.get_world_size()
            group = getattr(trainer.strategy, "cpu_group", None)  # gloo beside NCCL: no device copy of the strings
            dist.all_gather_object(every, None if checkpoint_path is None else str(checkpoint_path), group=group)
            if len(set(every)) > 1:
                found = ", ".join(f"rank {r}: {p!r}" for r, p in enumerate(every))
                raise RuntimeError(
                    f"PACIStrategy: the ranks resolved different checkpoints to restore ({found}). Every rank must "
                    'read the same checkpoint: with ckpt_path="last", each rank looks in ModelCheckpoint\'s dirpath '
                    "on its own node, and on node-local disks only global rank 0's node has the checkpoints. Put "
                    "dirpath on a file system every node sees, or pass the path of a checkpoint every rank can read"
                )
        if not args and "weights_only" not in kwargs and "weights_only" in inspect.signature(restore).parameters:
            kwargs["weights_only"] = weights_only_given_to_run(trainer)
        restore(checkpoint_path, *args, **kwargs)

    connector._restore_modules_and_callbacks = restore_agreed  # type: ignore[method-assign]
    connector._lit_efficient_agrees = True  # type: ignore[attr-defined]


def weights_only_given_to_run(trainer: Trainer) -> bool | None:
    """The ``weights_only`` the user gave fit, validate, test or predict. Lightning's ``Trainer._run`` restores a
    strategy that restores after its setup without it (Lightning 2.6's second ``_restore_modules_and_callbacks``
    call), so the load saw None whatever was asked: a checkpoint the user wanted loaded safely was unpickled in
    full, with a warning at most. Read from that call's frame, the restore's caller; None where it is not found."""
    frame = sys._getframe(1)
    for _ in range(4):
        if frame is None:
            break
        if frame.f_code.co_name == "_run" and frame.f_locals.get("self") is trainer:
            value = frame.f_locals.get("weights_only")
            return value if isinstance(value, bool) else None
        frame = frame.f_back
    return None


@contextmanager
def global_step_reading(trainer: Trainer, step: int) -> Iterator[None]:
    """``trainer.global_step`` reads ``step`` inside: set on the counter Lightning reads for it now (the manual loop's
    under the strategy's inside; the automatic loop's inside a ModelCheckpoint's hook, whose save drains the
    pipeline and steps stages: `checkpoints_see_the_users_optimization`), put back after."""
    loop = trainer.fit_loop.epoch_loop
    counted = (
        loop.automatic_optimization.optim_progress.optimizer.step.total
        if trainer.lightning_module.automatic_optimization
        else loop.manual_optimization.optim_step_progress.total
    )
    shown, counted.completed = counted.completed, step
    try:
        yield
    finally:
        counted.completed = shown


def carry_step_count_to_automatic(trainer: Trainer) -> None:
    """Lightning reads ``global_step`` from the automatic-optimization counter once the module is back
    in automatic mode; copy the count the pipeline advanced so it stays right after ``fit``."""
    loop = trainer.fit_loop.epoch_loop
    steps = loop.manual_optimization.optim_step_progress.total
    auto = loop.automatic_optimization.optim_progress.optimizer.step.total
    auto.ready, auto.completed = steps.ready, steps.completed


def checkpoints_see_the_users_optimization(trainer: Trainer) -> None:
    """Each ModelCheckpoint's batch-end hook runs as under the module's own automatic optimization, not the
    strategy's inside (manual: the stages step themselves). Lightning's manual branch there ignores
    ``train_time_interval`` (a time-based checkpoint never saved), saves a monitored metric's stale value at an
    epoch's last batch where the automatic one waits for that epoch's validation, and warns that the state is the
    one after the step, which is what a drained pipeline's is. Before the hook, every rank takes rank 0's callback
    metrics where it may read them (`_reads_metrics_now`). With ``train_time_interval`` the hook runs once per
    optimizer step (the first batch end that sees it; a save needs a new step anyway): Lightning broadcasts rank 0's
    clock at each call, a barrier that at every micro-batch would stall the pipeline. `give_callbacks_back` undoes
    it."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and "on_train_batch_end" not in callback.__dict__:
            _shadow(callback, "on_train_batch_end", _as_automatic(callback))


def _as_automatic(callback: ModelCheckpoint) -> Callable[..., None]:
    hook = callback.on_train_batch_end
    seen: list[int | None] = [None]  # the global step at the last call

    def on_train_batch_end(trainer: Trainer, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        if callback._train_time_interval is not None:
            if trainer.global_step == seen[0]:
                return
            seen[0] = trainer.global_step
        if _reads_metrics_now(callback, trainer):
            share_rank_zero_metrics(trainer)
        carry_step_count_to_automatic(trainer)  # trainer.global_step reads the automatic loop's counter then
        # The strategy logs train_loss at window ends, one device's training_step at every batch: before the first
        # window ends it is missing here only, and the hook deferred a save to the first validation that one device
        # never makes (an extra checkpoint at that step, ranked among the top k).
        unlogged = (
            callback.monitor == "train_loss"
            and "train_loss" not in trainer.callback_metrics
            and not getattr(trainer.strategy, "_module_logs_train_loss", False)  # the module's own: as one device's
        )
        deferred = callback._defer_save_until_validation
        pl_module.automatic_optimization = True
        try:
            hook(trainer, pl_module, *args, **kwargs)
        finally:
            pl_module.automatic_optimization = False
            if unlogged:
                callback._defer_save_until_validation = deferred

    return on_train_batch_end


def writers_where_the_predictions_are(
    trainer: Trainer, last_stage: bool, alone: Callable[[], AbstractContextManager[None]] | None = None
) -> None:
    """A ``BasePredictionWriter`` writes on the ranks of the last stage only (one per replica, as DDP's ranks each
    write their share): elsewhere the predict steps never ran, and every prediction it was given was None (a
    ``torch.cat`` of them raised on stage 0's ranks and ended the job). On the last stage's ranks its write hooks
    run within ``alone`` (where the other ranks run none: the strategy refuses a collective of every rank there,
    which waited for them until the group's timeout). `give_callbacks_back` undoes it."""
    for callback in trainer.callbacks:
        if isinstance(callback, BasePredictionWriter):
            for hook in ("on_predict_batch_end", "on_predict_epoch_end"):
                if hook in callback.__dict__:
                    continue
                if not last_stage:
                    _shadow(callback, hook, _nothing_to_write)
                elif alone is not None:
                    _shadow(callback, hook, _within(alone, getattr(callback, hook)))


def _within(context: Callable[[], AbstractContextManager[None]], hook: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with context():
            return hook(*args, **kwargs)

    return run


def _nothing_to_write(*args: Any, **kwargs: Any) -> None:
    """A prediction writer's hook on a rank without the last stage."""


def _shadow(callback: Callback, hook: str, replacement: Callable[..., Any]) -> None:
    """``callback.<hook>`` replaced on the instance, marked so `give_callbacks_back` finds it."""

    def shadowed(*args: Any, **kwargs: Any) -> Any:
        return replacement(*args, **kwargs)

    shadowed.lit_efficient = True  # type: ignore[attr-defined]
    setattr(callback, hook, shadowed)


def give_callbacks_back(trainer: Trainer) -> None:
    """The callbacks' own hooks again (`checkpoints_see_the_users_optimization`,
    `writers_where_the_predictions_are`)."""
    for callback in trainer.callbacks:
        for hook, value in list(vars(callback).items()):
            if getattr(value, "lit_efficient", False):
                delattr(callback, hook)


def keep_launch_random_streams(streams: dict[str, Any], group: dist.ProcessGroup) -> None:
    """With one replica the user's own loader is kept (keep_users_sampler), and its sampler may draw from
    the global streams (``DataLoader(shuffle=True)`` without a generator seeds its permutation from torch's
    stream when an epoch starts). Every stage must then draw what one device draws: global rank 0's streams
    as they were before Lightning's re-seed at setup (which replaced the state the model's construction had
    advanced, so the pipeline read another order than one device; and without ``seed_everything`` each rank
    kept its own, so the stages of one pipeline read different batches). A collective of every rank. The
    host streams only (Lightning's own collect/set): a CUDA generator is per device and draws no sampler."""
    box = [streams]
    dist.broadcast_object_list(box, src=0, group=group)
    _set_rng_states(box[0])


def draw_on_from_the_last_stage(topology: Topology, rank: int, group: dist.ProcessGroup, device: torch.device) -> None:
    """After an evaluation, every rank of this rank's pipeline takes its last stage's random streams: the host's
    (torch's, numpy's, Python's) and its device's CUDA generator, set on this rank's own device. Only the last stage
    ran the user's evaluation steps, which draw from them as on one device (a sample from a prior, a random crop, a
    diffusion model's noise on the GPU); the other stages' streams stayed behind, and what every stage draws next
    must agree: a Dataset's augmentation, ``on_after_batch_transfer``'s, an epoch's shuffle, a loader's worker seeds.
    Left apart, stage 0 computed on another augmentation than the one the last stage scored, silently (or an epoch
    later the first batches' check refused the run, blaming the data). The stages' own streams (the layers' dropout)
    are kept apart from these (`PipelineStage`). A collective of the pipeline; called at the strategy's first
    callback's evaluation end (before a ModelCheckpoint saves each rank's streams) and at the strategy's own (after
    a callback that drew on the last stage's rank only). A collective of every rank on ``group``, the strategy's
    gloo group of the whole world (an object collective without device copies, as its others; on NCCL the
    pipelines' groups would move the objects through the GPU): each rank takes its own pipeline's last stage's."""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, random_streams(device), group=group)
    set_random_streams(every[topology.rank_of(topology.num_stages - 1, topology.replica_of(rank))], device)


def random_streams(device: torch.device) -> tuple[dict[str, Any], Tensor | None]:
    """This process's random streams: the host's (torch's, numpy's, Python's) and ``device``'s CUDA generator."""
    return _collect_rng_states(include_cuda=False), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_random_streams(streams: tuple[dict[str, Any], Tensor | None], device: torch.device) -> None:
    host, cuda = streams
    _set_rng_states(host)
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


@contextmanager
def streams_untouched(device: torch.device) -> Iterator[None]:
    """Whatever runs inside draws nothing from this process's random streams: they are put back as they were."""
    kept = random_streams(device)
    try:
        yield
    finally:
        set_random_streams(kept, device)


def keep_users_sampler(trainer: Trainer, num_replicas: int) -> None:
    """With one replica every stage reads the user's own loader, so the pipeline sees exactly the batches one
    device would: Lightning would wrap it in a shuffling DistributedSampler of one replica (another order),
    as the strategy is a parallel one. Set before anything in setup loads the loader: once loaded, Lightning
    keeps it for the run (before this was set first, GPT's default schedule, which reads
    ``estimated_stepping_batches`` in ``configure_optimizers``, got the pipeline other batches than one device)."""
    if num_replicas == 1:
        trainer._accelerator_connector.use_distributed_sampler = False


def seed_workers_by_replica(loader: Any, replica: int) -> None:
    """``seed_everything(workers=True)``: Lightning gives a loader without a ``worker_init_fn`` one that seeds each
    worker by the process's global rank, so the stages of one pipeline (ranks 0 and 1 of one replica) drew
    different random numbers in their loader's workers (a random crop, noise, masking) and read different
    batches: the first batches' check refused the run on processes. Seeded here by the replica instead, before
    Lightning's (which fills only a ``worker_init_fn`` still None): every stage of a replica draws what DDP's
    rank of that index draws, one replica what one device draws. A ``worker_init_fn`` of the user's own is kept."""
    if int(os.environ.get("PL_SEED_WORKERS", 0)) and getattr(loader, "worker_init_fn", False) is None:
        loader.worker_init_fn = functools.partial(pl_worker_init_function, rank=replica)


def normalize_mode(trainer: Trainer) -> Literal["mean", "tokens"]:
    for callback in trainer.callbacks:
        mode = getattr(callback, "normalize", None)
        if mode in ("mean", "tokens") and hasattr(callback, "get_accumulate_grad_batches"):
            return mode
    return "mean"


def smallest_window(trainer: Trainer) -> int:
    """The smallest N this fit will use: a ``GradientAccumulation`` schedule's smallest (it changes N at epoch
    starts), else the Trainer's. What is built once for the whole fit and depends on N growing as N shrinks
    (PACI's tied-weight delay, ceil(S / N)) is built for it."""
    windows = [max(1, trainer.accumulate_grad_batches)]
    for callback in trainer.callbacks:
        if hasattr(callback, "min_accumulate_grad_batches"):
            windows.append(callback.min_accumulate_grad_batches)
    return min(windows)


def point_metrics_at(
    module: LightningModule, group: dist.ProcessGroup, hosts_last_stage: bool, here: str, pointed: list[tuple]
) -> None:  # fmt: skip
    """torchmetrics sync over the last stage's replicas: the only ranks that update and compute them.

    Each metric the module holds and ``pointed`` has not gets a `LastStageSync` as its ``dist_sync_fn`` and is
    appended to ``pointed`` with its own (for `give_metrics_back`); one the module no longer holds gets its own back and
    is let go (a metric made anew each epoch is not kept alive with its states). The strategy calls this again at
    each epoch's and evaluation's first batch and before the epoch-end hooks, for a metric the module made after
    setup (in ``on_fit_start``, at an epoch's start), which had synced over the whole world while only the last stage
    computes it: a hang."""
    held = [m for m in module.modules() if isinstance(m, Metric)]
    ids = {id(m) for m in held}
    give_metrics_back([entry for entry in pointed if id(entry[0]) not in ids])
    pointed[:] = [entry for entry in pointed if id(entry[0]) in ids]
    known = {id(m) for m, _ in pointed}
    for m in held:
        if id(m) not in known:
            pointed.append((m, m.dist_sync_fn))
            m.dist_sync_fn = LastStageSync(group, None if hosts_last_stage else here, type(m).__name__)


class LastStageSync:
    """A module's torchmetrics metric's ``dist_sync_fn``: gathers over the last stage's replicas, the only ranks that
    update and compute it; on a rank hosting no last stage (a callback's hook, unguarded epoch-end code computing
    it) raises what to guard, where the gather over a group the rank is not in said "stack expects a non-empty
    TensorList". Held here, not in the metric's ``process_group``: a copy of the module (``copy.deepcopy``, a
    metric's ``clone`` in ``on_fit_start``) shares it, and a pickle of it (``torch.save(module)``) leaves it out, the
    copy syncing as torchmetrics' default; a process group neither copies nor pickles ("cannot pickle
    ProcessGroup")."""

    def __init__(self, group: dist.ProcessGroup, here: str | None, name: str) -> None:
        self.group, self.here, self.name = group, here, name

    def __call__(self, result: Tensor, group: Any = None) -> list[Tensor]:
        if self.here is not None:
            raise RuntimeError(
                f"A torchmetrics {self.name} of the module was computed on {self.here}, which hosts no last stage: "
                "the evaluation steps and pipeline_loss update it on the last stage's ranks only, so it holds nothing "
                "here. Guard the code that computes it (a callback's or an epoch-end hook) with `if "
                "trainer.strategy.is_last_stage:`; what the last stage logs reaches every rank."
            )
        from torchmetrics.utilities.distributed import gather_all_tensors

        return gather_all_tensors(result, group=self.group)

    def __deepcopy__(self, memo: dict) -> LastStageSync:
        return self

    def __reduce__(self) -> tuple:
        return (_torchmetrics_default, ())


def _torchmetrics_default() -> None:
    """What an unpickled `LastStageSync` becomes: no ``dist_sync_fn`` (torchmetrics' own gather)."""
    return None


_SYNC_ADVICE = "It is recommended to use `self.log("


class _WithoutSyncAdvice:
    """Lightning's result-collection warnings (its module's `WarningCache`, which it forwards to) without the advice
    to log an epoch-level value with ``sync_dist=True``: with one replica that reduce is over one rank (the last
    stage's), so every run on processes that logs an epoch-level metric was told to add what changes nothing."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def warn(self, message: str, stacklevel: int = 5, **kwargs: Any) -> None:
        if not message.startswith(_SYNC_ADVICE):
            self.cache.warn(message, stacklevel=stacklevel + 1, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)


def without_sync_advice(num_replicas: int) -> Callable[[], None]:
    """From now on Lightning does not advise ``sync_dist=True`` when there is ``num_replicas == 1`` (with more, each
    replica logs its share, and the advice stands); returns what puts its own cache back, which it keeps deduping
    with (catching the warning instead, ``warnings.catch_warnings``, reset the registries: other warnings came back
    every fit)."""
    from lightning.pytorch.trainer.connectors.logger_connector import result

    own = result.warning_cache
    if num_replicas == 1 and not isinstance(own, _WithoutSyncAdvice):
        result.warning_cache = _WithoutSyncAdvice(own)

    def put_back() -> None:
        result.warning_cache = own

    return put_back


def give_metrics_back(metrics: list[tuple]) -> None:
    """Each metric's own sync function again (`point_metrics_at`) when the run's groups are destroyed: the user's
    module must not keep a dead group (a later run's sync would use it), nor keep its gloo threads and sockets
    alive."""
    for m, sync in metrics:
        m.dist_sync_fn = sync


def first_training_batch(trainer: Trainer) -> Any:
    # Without a trace in the loader's random streams: only rank 0 draws it (profile.first_batch).
    return first_batch(trainer.fit_loop._data_source.dataloader())


def first_tensor(batch: Any) -> Tensor | None:
    """The batch's first tensor with a batch dimension (through nested tuples, lists and dicts), or None.
    Its first dimension is the micro-batch size the strategy and `PipelineMonitor` count."""
    first = batch
    while isinstance(first, (list, tuple)) and first:
        first = first[0]
    if isinstance(first, dict) and first:
        first = next(iter(first.values()))
    return first if isinstance(first, Tensor) and first.dim() > 0 else None


def batch_size_of(batch: Any) -> int | None:
    first = first_tensor(batch)
    return None if first is None else int(first.shape[0])


def check_stages_read_alike(
    batch: Any, topology: Topology, group: dist.ProcessGroup, loop: str, epoch: int | None = None, loader: int = 0
) -> None:
    """Raise on every rank when the stages of a pipeline read different first batches of a ``loop`` ("training",
    "validation", ...; of training ``epoch``). Stage 0 computes on its batch's inputs and the last stage scores the
    result against its own batch's labels: batches that differ train (or evaluate) on mismatched pairs, silently.
    The strategy gives every rank rank 0's random streams and the same loader, so this catches data that each
    process draws or orders on its own (a generator seeded from the OS, a file listing in another order, an
    epoch's reshuffle drawn from a stream the ranks consumed differently). At the first batch of a fit, of each
    training epoch and of each evaluation loader (``loader``, its dataloader_idx): a collective of every rank."""
    of_epoch = f" of epoch {epoch}" if epoch else f" of dataloader {loader}" if loader else ""
    every: list[Any] = [None] * topology.world_size
    dist.all_gather_object(every, batch_fingerprint(batch), group=group)
    for replica in range(topology.num_replicas):
        first = topology.rank_of(0, replica)
        differ = [r for r in topology.pipeline_ranks(replica) if every[r] != every[first]]
        if differ:
            stages = ", ".join(f"stage {topology.stage_of(r)} (rank {r})" for r in differ)
            raise RuntimeError(
                f"PACIStrategy: the stages of a pipeline read different first {loop} batches{of_epoch}: stage 0 (rank "
                f"{first}) and {stages}. Stage 0 computes on its batch and the last stage scores against its own "
                "batch's labels, so every stage must read the same batches in the same order (the strategy gives "
                "every rank rank 0's random streams and the user's loader). Look for data each process draws or "
                "orders on its own: a generator seeded from the OS (np.random.default_rng(), random.Random()) in "
                "a Dataset, collate_fn or setup(), a worker_init_fn of your own seeding by the global rank, files "
                "listed in a process-dependent order; seed it from torch.initial_seed() (a worker_init_fn: leave it "
                "to seed_everything(workers=True)) or sort it. A loader or collate_fn that gives each stage part of "
                "the batch (branching on the stage or rank) is refused too: every stage receives the whole batch."
            )


def batch_fingerprint(batch: Any) -> str:
    """A digest of a batch's structure and values, equal on two processes for equal batches: tensors and numpy
    arrays by dtype, shape and bytes; mappings (a dict, Hugging Face's ``BatchEncoding``), lists, tuples, named
    tuples and dataclasses walked; Python scalars and strings by value; any other object by its type's name
    alone (its repr may carry its address, a set's order its process's hash seed). torch's pytree took a
    dataclass, a ``BatchEncoding`` and a numpy array for opaque leaves, so their contents went unseen: stages
    that read different batches of those trained on, silently."""
    digest = hashlib.blake2b(digest_size=16)
    _digest(batch, digest)
    return digest.hexdigest()


def _digest(value: Any, digest: Any, path: frozenset[int] = frozenset()) -> None:
    kind = type(value)
    digest.update(f"<{kind.__module__}.{kind.__qualname__}>".encode())
    if isinstance(value, Tensor):
        t = value.detach().cpu()
        t = (t if t.layout == torch.strided else t.to_dense()).contiguous().reshape(-1)
        digest.update(f"{t.dtype}{tuple(value.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray) and not value.dtype.hasobject:
        digest.update(f"{value.dtype}{value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, np.ndarray):  # holding Python objects (strings): their bytes would be addresses
        _digest(value.tolist(), digest, path)
    elif isinstance(value, np.generic):
        _digest(value.item(), digest, path)
    elif isinstance(value, (str, bytes, int, float, bool, type(None))):
        digest.update(repr(value).encode())
    elif id(value) in path:  # a container holding itself (a dataclass pointing back at its parent)
        digest.update(b"<cycle>")
    elif isinstance(value, Mapping):
        inside = path | {id(value)}
        for key, item in value.items():
            _digest(key, digest, inside)
            _digest(item, digest, inside)
    elif isinstance(value, (list, tuple)):
        digest.update(f"[{len(value)}]".encode())
        inside = path | {id(value)}
        for item in value:
            _digest(item, digest, inside)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        inside = path | {id(value)}
        for field in dataclasses.fields(value):
            digest.update(field.name.encode())
            _digest(getattr(value, field.name), digest, inside)
