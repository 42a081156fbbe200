"""What runs around each stage's local optimizer step under PACIStrategy, and the lagged SIGTERM check.

The stages step on their own; `install_step_hooks` installs on a stage what Lightning would do around a step:
the data-parallel gradient reduction (an all-reduce, or under ``shard_optimizer_state`` the sharded
optimizer's reduce-scatter) or the LocalSGD/DiLoCo averager, and gradient clipping; `step_schedulers` makes
step-interval LR schedulers step with the stage's own steps. `replace_sigterm_barrier` makes Lightning's
per-batch SIGTERM broadcast asynchronous (a barrier per micro-batch would undo PACI's overlap).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor

from lit_efficient.replicas.averaging import ReplicaAverager, ReplicaMean, sync_due
from lit_efficient.replicas.sharded_optimizer import ShardedOptimizer
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.tied import is_tied, squared_grad_norm
from lit_efficient.strategy.trainer_glue import global_step_reading
from lit_efficient.transport.collectives import all_reduce_flat


class StageSum(Protocol):
    """The sum over a pipeline's stages that flush's norm clipping needs: `transport.process.GroupStageSum` on
    processes, `transport.local.LocalStageSum` in one process."""

    can_post: bool

    def all_reduce(self, stage: int, t: Tensor) -> None: ...
    def has_posted(self, stage: int) -> bool: ...


@dataclass(frozen=True)
class Averaging:
    """LocalSGD/DiLoCo across a stage's replicas (`PACIStrategy`'s options of the same names)."""

    steps: int
    warmup_steps: int
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float
    average_buffers: bool
    offset: int = 0  # this stage's shift of its syncs (streaming)


def warn_unsynced_end(trainer: Trainer, averaging: Averaging, num_replicas: int, streaming: bool) -> None:
    """Say, once, when ``max_steps`` ends the fit between two LocalSGD/DiLoCo syncs: the replicas' weights then
    differ, and what the fit leaves (the model after fit, a save, an evaluation of it) is the first replica's,
    not their average. Not under streaming syncs, where the stages sync in turns and never all at one step."""
    steps = trainer.max_steps
    if streaming or num_replicas < 2 or steps is None or steps < 1:
        return
    if sync_due(steps, averaging.steps, averaging.warmup_steps, 0):
        return
    after = steps - averaging.warmup_steps
    last = averaging.warmup_steps + (after // averaging.steps) * averaging.steps
    rank_zero_warn(
        f"PACIStrategy: max_steps={steps} ends the fit {steps - last} optimizer step(s) after the last "
        f"{'LocalSGD' if averaging.outer_optimizer == 'average' else 'DiLoCo'} sync (step {last}, every "
        f"local_sgd_steps={averaging.steps}), so the replicas' weights differ at its end and the model it leaves "
        "(after fit, in a checkpoint, evaluated) is the first replica's, not their average. Set max_steps to "
        f"{averaging.warmup_steps} + a multiple of {averaging.steps} for a synced end.",
        category=UserWarning,
    )


def scheduler_stepper(module: Any) -> Callable[[Any, int], None]:
    """How a stage steps one of its schedulers at its ``step``-th optimizer step: as Lightning does, through the
    module's ``lr_scheduler_step`` where the module overrides it (what Lightning asks of a scheduler that does not
    follow torch's API, timm's say, and where a user steps on a schedule of their own), else ``scheduler.step()``.
    The override reads ``trainer.global_step`` as one device's at that step (timm's ``step_update(num_updates=
    self.trainer.global_step)``): a stage steps before the strategy counts the window, and under PACI at its own
    time. No monitored metric: ReduceLROnPlateau is refused (`step_schedulers`)."""
    if type(module).lr_scheduler_step is LightningModule.lr_scheduler_step:
        return step_as_torch

    def step_through_the_hook(scheduler: Any, step: int) -> None:
        with global_step_reading(module.trainer, step):
            module.lr_scheduler_step(scheduler, None)

    return step_through_the_hook


def step_as_torch(scheduler: Any, step: int) -> None:
    """Step a torch scheduler (a `step_schedulers` stepper that ignores the stage's step)."""
    scheduler.step()


def step_schedulers(
    configs: list[Any], stepper: Callable[[Any, int], None]
) -> tuple[_SchedulerGroup | None, list[Any]]:
    """A stage's LR scheduler configs as (the step-interval ones, stepped with the stage's own steps; the
    epoch-interval ones, stepped by the strategy at an epoch's end). Refuses ReduceLROnPlateau."""
    step_wise, epoch_wise = [], []
    for config in configs:
        # Parsed as the user's automatic module (PACIStrategy._setup_stage_optimizer): reduce_on_plateau is what the
        # dict says, or whether the scheduler is torch's ReduceLROnPlateau.
        if config.reduce_on_plateau or isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                f"{type(config.scheduler).__name__} (a scheduler stepped with a monitored metric: reduce_on_plateau) "
                "is not supported under PACIStrategy: each stage steps its own scheduler without the monitored metric. "
                "Use a step- or epoch-based scheduler."
            )
        (step_wise if config.interval == "step" else epoch_wise).append(config)
    return (_SchedulerGroup(step_wise, stepper) if step_wise else None), epoch_wise


def warn_step_frequency(configs: list[Any]) -> None:
    """The one warning for step-interval schedulers with a ``frequency`` > 1, which step elsewhere than on one
    device (docs/compatibility.md)."""
    counted = [c for c in configs if c.interval == "step" and c.frequency > 1]
    if counted:
        names = ", ".join(f"{type(c.scheduler).__name__}(frequency={c.frequency})" for c in counted)
        rank_zero_warn(
            f"PACIStrategy steps a step-interval LR scheduler every `frequency` optimizer steps of the run ({names}). "
            "Lightning counts micro-batches within each epoch instead (batch_idx + 1, at its optimizer steps), so "
            "with accumulate_grad_batches > 1, or epochs whose length is not a multiple of the frequency, one device "
            "steps it at other steps and its learning rates differ. Here it steps every `frequency` optimizer steps "
            "at any N, across epochs and resumes; frequency=1 steps alike on both."
        )


def install_step_hooks(
    stage: PipelineStage,
    trainer: Trainer,
    replica_group: dist.ProcessGroup | None,
    num_replicas: int,
    averaging: Averaging | None,
    stage_sum: StageSum,
    exact_norm: bool,
    warn_per_stage_clipping: bool,
    replicas: ReplicaMean | None = None,
) -> ReplicaAverager | None:
    """Install the gradient reduction across ``stage``'s replicas (over ``replica_group``) or its LocalSGD/DiLoCo
    averager, and gradient clipping as the Trainer asks; returns the averager, if any.

    Args:
        stage: The stage.
        trainer: Its Trainer (``gradient_clip_val`` and ``gradient_clip_algorithm``).
        replica_group: The stage's data-parallel group; None with one replica.
        num_replicas: Replicas of the stage.
        averaging: LocalSGD/DiLoCo instead of reducing gradients every step; None: reduce every step.
        stage_sum: The sum over the pipeline's stages, for flush's global norm.
        exact_norm: Whether norm clipping clips the pipeline's global norm (flush) or each stage's own (paci).
        warn_per_stage_clipping: Say, once, that per-stage norm clipping is not one device's (the first stage
            set up in a process says it).
        replicas: Fault-tolerant replica groups (`replicas.fault_tolerance.TorchftReplicas`): the averager
            reduces over the live groups, and only counts steps here; the groups sync at drained points
            (`strategy.fault_tolerant.OuterSync`).
    """
    averager = None
    if isinstance(stage.optimizer, ShardedOptimizer):
        # ZeRO-1: reduce-scatter to each replica's chunk instead of the all-reduce (sharded_optimizer.py).
        stage.reduce_gradients = stage.optimizer.reduce_gradients
    elif num_replicas > 1 and averaging is None:
        group = replica_group

        def reduce_gradients(grads: list[Tensor], totals: Tensor) -> Tensor:
            # Sum over replicas with the window's weight and non-finite count in the same
            # collective: dividing by the summed weight gives the mean over every replica's items,
            # and every replica sees every replica's NaN flag (so all skip the same window).
            totals = totals.clone()
            all_reduce_flat([*grads, totals[:2]], group)
            return totals

        stage.reduce_gradients = reduce_gradients
    if averaging is not None and replicas is not None:
        averager = ReplicaAverager(
            torch.nn.ModuleList(stage.layers), None, averaging.steps, averaging.warmup_steps,
            averaging.outer_optimizer, averaging.outer_lr, averaging.outer_momentum, averaging.average_buffers,
            mean=replicas, offset=averaging.offset,
        )  # fmt: skip
        stage.after_step = averager.count_step
    elif averaging is not None and num_replicas > 1:
        # Each stage syncs inside its own dp group when its own step count says so (the same
        # count on every replica): no cross-stage barrier, PACI stays asynchronous. The
        # constructor is collective over the group (one broadcast of replica 0's weights).
        averager = ReplicaAverager(
            torch.nn.ModuleList(stage.layers), replica_group, averaging.steps, averaging.warmup_steps,
            averaging.outer_optimizer, averaging.outer_lr, averaging.outer_momentum, averaging.average_buffers,
            offset=averaging.offset,
        )  # fmt: skip
        stage.after_step = lambda: averager.after_step() and None
    clip_val = trainer.gradient_clip_val
    if clip_val:
        algorithm = trainer.gradient_clip_algorithm or "norm"
        sharded_group = replica_group if isinstance(stage.optimizer, ShardedOptimizer) else None
        stage.clip_gradients = _clipper(
            float(clip_val), algorithm, stage, stage_sum, exact_norm, sharded_group, warn_per_stage_clipping
        )
    return averager


def clips_global_norm(trainer: Trainer, schedule: str, num_stages: int) -> bool:
    """Whether the stages clip the pipeline's global gradient norm (flush) rather than each its own (paci)."""
    clips_norm = bool(trainer.gradient_clip_val) and (trainer.gradient_clip_algorithm or "norm") == "norm"
    return clips_norm and schedule == "1f1b_flush" and num_stages > 1


def _clipper(
    value: float,
    algorithm: str,
    stage: PipelineStage,
    stage_sum: StageSum,
    exact: bool,
    sharded_group: dist.ProcessGroup | None,
    warn: bool,
) -> Callable[[list[torch.nn.Parameter]], Any]:
    if algorithm == "value":
        return lambda params: torch.nn.utils.clip_grad_value_(params, value)
    num_stages = stage.num_stages
    if not exact and num_stages > 1 and warn:
        rank_zero_warn(
            f"Trainer(gradient_clip_val={value}) under PACIStrategy(schedule='paci') clips each of the "
            f"{num_stages} stages' gradient norms to {value} separately, so the whole model's norm "
            f"can reach sqrt({num_stages}) x {value} = {value * num_stages**0.5:.3g}: "
            "stages step at different times, and a global norm would make each wait for the others (PACI "
            "would no longer be bubble-free). schedule='1f1b_flush' clips the global norm, exactly as one "
            "device; clipping by value (gradient_clip_algorithm='value') is the same under both.",
            category=UserWarning,
        )
    device, index = stage.device, stage.stage

    def clip_norm(params: list[torch.nn.Parameter]) -> None:
        if not exact:  # a tied weight's copies must scale alike: paci clips it by its own norm
            for p in params:
                if is_tied(p) and p.grad is not None:
                    torch.nn.utils.clip_grad_norm_([p], value)
            params = [p for p in params if not is_tied(p)]
        grads = [p.grad for p in params if p.grad is not None]
        if stage_sum.has_posted(index):
            # Posted before its tied exchange (`post_norm_before_tied_exchange`): the sum is read into it.
            squared = torch.zeros(1, device=device, dtype=torch.float32)
        else:
            squared = squared_grad_norm(params, device)
        if sharded_group is not None:
            # shard_optimizer_state: each replica's gradients are its chunk and zeros, so the replicas' sum of
            # squares is the stage's (one more all-reduce of one number; sharding refuses tied weights).
            all_reduce_flat([squared], sharded_group)
        if exact:
            # flush: every stage steps together, so the global norm across stages is exact. Added in rank order on
            # processes and in one process alike: the same bits at any S (an all-reduce's order is its algorithm's).
            stage_sum.all_reduce(index, squared)
        # paci: stages step at different times; each clips its own norm (<= the global one).
        scale = (value / (squared.sqrt() + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))

    return clip_norm


def post_norm_before_tied_exchange(stage: PipelineStage, stage_sum: Any) -> None:
    """In one process under flush with norm clipping, on the last stage of a tied weight: put its squared norm
    into the stages' sum (`LocalStageSum.post`) before it waits for stage 0's tied gradient.

    While the last stage waits there, stage 0 runs its own step, whose clipping needs every stage's squared
    norm; the last stage could only give its own after the wait, so both would wait for each other. Posting
    it first is exact: the last stage's copy of a tied weight is not counted in the norm (stage 0's copy
    counts the combined gradient once, `counted_in_global_norm`), so the exchange changes nothing the last
    stage's part sums. On processes the order stays exchange, then norm (two blocking collectives must come
    in one order on every rank); the numbers are the same.
    """
    exchange = stage.exchange_tied
    assert exchange is not None and stage.is_last

    def post_then_exchange() -> None:
        stage_sum.post(stage.stage, squared_grad_norm(list(stage.parameters()), stage.device))
        exchange()

    stage.exchange_tied = post_then_exchange


def replace_sigterm_barrier(
    trainer: Trainer, lag: int, group: dist.ProcessGroup | None
) -> deque[tuple[dist.Work, Tensor, int]]:
    """Make Lightning's per-batch SIGTERM broadcast asynchronous, lagged, and once per window; returns the
    broadcasts in flight, each with the batch count it started at (the strategy finishes them in
    ``on_train_end``: no collective outlives a training run, and the next run starts with none).

    Lightning broadcasts rank 0's SIGTERM flag before every training batch and waits for it: a
    barrier per micro-batch, which ties stage 0 to the last stage and undoes PACI's overlap
    (measured: stage 0 idled ~19% of its time there). Here every rank starts the broadcast at the
    first batch of each window (a collective per micro-batch costs host time on every rank; a
    window is the unit a stop lands on anyway) and waits only for broadcasts started at least ``lag`` (S)
    batches earlier, which in a running pipeline have long completed (no stage runs more than S-1
    micro-batches ahead of the last). All ranks start and read the same broadcasts at the same
    batches, so they still stop together.
    """
    pending: deque[tuple[dist.Work, Tensor, int]] = deque()
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor") or trainer.world_size == 1:
        return pending
    batches = [0]

    def broadcast_sigterm() -> None:
        batches[0] += 1
        if (loop.batch_idx + 1) % max(1, trainer.accumulate_grad_batches) == 0:  # a window's first batch
            flag = torch.tensor([int(bool(getattr(trainer, "received_sigterm", False)))], dtype=torch.int32)
            pending.append((dist.broadcast(flag, src=0, group=group, async_op=True), flag, batches[0]))
        while pending and pending[0][2] <= batches[0] - lag:
            work, seen, _ = pending.popleft()
            work.wait()
            if int(seen[0]) == 1:  # a CPU tensor: no device synchronization
                raise SIGTERMException()

    loop._broadcast_sigterm_tensor = broadcast_sigterm
    _notify_sigterm_without_a_barrier(trainer)
    return pending


def restore_sigterm_barrier(trainer: Trainer) -> None:
    """Lightning's own per-batch SIGTERM broadcast again (`replace_sigterm_barrier`'s is on the run's group, which
    is destroyed at teardown: kept on the loop, it would keep that group's gloo threads and sockets alive with the
    Trainer, and another fit with this Trainer would first install its own anyway)."""
    trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def _notify_sigterm_without_a_barrier(trainer: Trainer) -> None:
    """Lightning's SIGTERM handler does what this one does and then broadcasts the flag on the default group and
    waits for it. Under this strategy no rank joins that broadcast (the per-window one of `replace_sigterm_barrier`
    spreads rank 0's flag), so a signalled rank sat in it until the group's timeout or a kill: when torch's spawn
    stops the survivors of a failed rank with SIGTERM they were killed 30 s later. Lightning registers the handler
    after the strategy's setup, from this attribute."""
    connector = trainer._signal_connector
    if not hasattr(connector, "_sigterm_notifier_fn"):
        return

    def notify(signum: Any, frame: Any) -> None:
        if not connector.received_sigterm and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)  # the ranks this process started, as Lightning's handler does
        connector.received_sigterm = True

    connector._sigterm_notifier_fn = notify


class _SchedulerGroup:
    """Steps the step-interval LR schedulers with every local optimizer step of a stage, each at its ``frequency``.
    ``steps`` counts the run's optimizer steps: a resume sets it to the checkpoint's (`stage_checkpoints`), or a
    ``frequency`` > 1 would step at other steps than the uninterrupted run."""

    def __init__(self, configs: list[Any], stepper: Callable[[Any, int], None]) -> None:
        self.configs = configs
        self.stepper = stepper
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        for config in self.configs:
            if self.steps % config.frequency == 0:
                self.stepper(config.scheduler, self.steps)
