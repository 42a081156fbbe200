"""What runs around each stage's local optimizer step under PACIStrategy, and the lagged SIGTERM check.

The stages step on their own; this mixin installs what Lightning would do around a step: step-interval
LR schedulers stepping with the stage's own steps, the data-parallel gradient reduction (an all-reduce, or
under ``shard_optimizer_state`` the sharded optimizer's reduce-scatter) or the LocalSGD/DiLoCo averager,
gradient clipping, the staleness correction, and Lightning's per-batch SIGTERM broadcast made asynchronous
(a barrier per micro-batch would undo PACI's overlap).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor

from lit_efficient.averaging import ReplicaAverager
from lit_efficient.pipeline.comm import all_reduce_flat, all_reduce_in_rank_order
from lit_efficient.pipeline.stage import PipelineStage
from lit_efficient.pipeline.staleness import StalenessCorrection, make_correction
from lit_efficient.strategies.sharded_optimizer import ShardedOptimizer
from lit_efficient.strategies.tied import counted_in_global_norm, is_tied


class LocalStepHooks:
    """PACIStrategy's step hooks (a mixin over the strategy's configuration, topology and groups)."""

    topology: Any
    lr_scheduler_configs: Any
    _local_stage_sum: Any  # pipeline.local.LocalStageSum in one process under flush, else None

    def _step_schedulers(self) -> _SchedulerGroup | None:
        step_wise, self._epoch_schedulers = [], []
        for config in self.lr_scheduler_configs:
            # Lightning builds the configs under manual optimization (the strategy's), which leaves
            # reduce_on_plateau False and drops "monitor": the scheduler's own type says it.
            if config.reduce_on_plateau or isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise ValueError(
                    "ReduceLROnPlateau is not supported under PACIStrategy: each stage steps its own scheduler "
                    "without the monitored metric. Use a step- or epoch-based scheduler."
                )
            (step_wise if config.interval == "step" else self._epoch_schedulers).append(config)
        return _SchedulerGroup(step_wise) if step_wise else None

    def correction_for(self, stage: int, trainer: Trainer) -> StalenessCorrection | None:
        """The staleness correction of ``stage`` (None: off, or nothing to correct there)."""
        accumulate = max(1, trainer.accumulate_grad_batches)
        return make_correction(
            self.staleness_correction, self.schedule, stage, self.pipeline_stages, accumulate,
            self.staleness_anneal_steps,
        )  # fmt: skip

    def _install_step_hooks(self, stage: PipelineStage, trainer: Trainer) -> None:
        assert self.topology is not None
        replicas = self.topology.num_replicas
        if isinstance(stage.optimizer, ShardedOptimizer):
            # ZeRO-1: reduce-scatter to each replica's chunk instead of the all-reduce (sharded_optimizer.py).
            stage.reduce_gradients = stage.optimizer.reduce_gradients
        elif replicas > 1 and self.local_sgd_steps is None:
            group = self._dp_groups[self.stage]

            def reduce_gradients(grads: list[Tensor], totals: Tensor) -> Tensor:
                # Sum over replicas with the window's weight and non-finite count in the same
                # collective: dividing by the summed weight gives the mean over every replica's items,
                # and every replica sees every replica's NaN flag (so all skip the same window).
                totals = totals.clone()
                all_reduce_flat([*grads, totals[:2]], group)
                return totals

            stage.reduce_gradients = reduce_gradients
        if self.local_sgd_steps is not None and replicas > 1:
            # Each stage syncs inside its own dp group when its own step count says so (the same
            # count on every replica): no cross-stage barrier, PACI stays asynchronous. The
            # constructor is collective over the group (one broadcast of replica 0's weights).
            module = torch.nn.ModuleList(stage.layers)
            self.averager = ReplicaAverager(
                module, self._dp_groups[self.stage], self.local_sgd_steps, self.local_sgd_warmup_steps,
                self.outer_optimizer, self.outer_lr, self.outer_momentum, self.average_buffers,
            )  # fmt: skip
            averager = self.averager
            stage.after_step = lambda: averager.after_step() and None
        clip_val = trainer.gradient_clip_val
        if clip_val:
            sharded = isinstance(stage.optimizer, ShardedOptimizer)
            algorithm = trainer.gradient_clip_algorithm or "norm"
            stage.clip_gradients = self._clipper(float(clip_val), algorithm, sharded, stage.stage)

    def _clipper(self, value: float, algorithm: str, sharded: bool = False, stage_index: int = 0):
        if algorithm == "value":
            return lambda params: torch.nn.utils.clip_grad_value_(params, value)
        group = self._pipeline_groups.get(self.replica)  # None in one process: the stages sum among themselves
        local_sum = self._local_stage_sum  # in one process under flush (in_process.py); None on processes

        def sum_over_stages(squared: Tensor) -> None:
            # Both add the stages' squared norms in rank order (`sum_in_order`): one process and S processes
            # clip with the same bits at any S (an all-reduce's order is its algorithm's).
            if local_sum is not None:
                local_sum.all_reduce(stage_index, squared)
            else:
                all_reduce_in_rank_order(squared, group)

        # shard_optimizer_state: each replica's gradients are its chunk and zeros, so the replicas' sum of
        # squares is the stage's (one more all-reduce of one number; sharding refuses tied weights).
        replicas = self._dp_groups[self.stage] if sharded else None
        exact = self.schedule == "1f1b_flush" and self.pipeline_stages > 1
        if not exact and self.pipeline_stages > 1 and not getattr(self, "_warned_clipping", False):
            self._warned_clipping = True  # once per strategy: in one process every stage builds a clipper
            rank_zero_warn(
                f"Trainer(gradient_clip_val={value}) under PACIStrategy(schedule='paci') clips each of the "
                f"{self.pipeline_stages} stages' gradient norms to {value} separately, so the whole model's norm "
                f"can reach sqrt({self.pipeline_stages}) x {value} = {value * self.pipeline_stages**0.5:.3g}: "
                "stages step at different times, and a global norm would make each wait for the others (PACI "
                "would no longer be bubble-free). schedule='1f1b_flush' clips the global norm, exactly as one "
                "device; clipping by value (gradient_clip_algorithm='value') is the same under both.",
                category=UserWarning,
            )

        def clip_norm(params: list[torch.nn.Parameter]) -> None:
            if not exact:  # a tied weight's copies must scale alike: paci clips it by its own norm
                for p in params:
                    if is_tied(p) and p.grad is not None:
                        torch.nn.utils.clip_grad_norm_([p], value)
                params = [p for p in params if not is_tied(p)]
            grads = [p.grad for p in params if p.grad is not None]
            if local_sum is not None and local_sum.has_posted(stage_index):
                # Posted before its tied exchange (`_post_norm_before_tied_exchange`): the sum is read into it.
                squared = torch.zeros(1, device=self.root_device, dtype=torch.float32)
            else:
                squared = _squared_norm(params, self.root_device)
            if replicas is not None:
                all_reduce_flat([squared], replicas)
            if exact:
                # flush: every stage steps together, so the global norm across stages is exact.
                sum_over_stages(squared)
            # paci: stages step at different times; each clips its own norm (<= the global one).
            scale = (value / (squared.sqrt() + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(scale.to(g.dtype))

        return clip_norm

    def _post_norm_before_tied_exchange(self, stage: PipelineStage) -> None:
        """In one process under flush with norm clipping, on the last stage of a tied weight: put its squared norm
        into the stages' sum (`LocalStageSum.post`) before it waits for stage 0's tied gradient.

        While the last stage waits there, stage 0 runs its own step, whose clipping needs every stage's squared
        norm; the last stage could only give its own after the wait, so both would wait for each other. Posting
        it first is exact: the last stage's copy of a tied weight is not counted in the norm (stage 0's copy
        counts the combined gradient once, `counted_in_global_norm`), so the exchange changes nothing the last
        stage's part sums. On processes the order stays exchange, then norm (two blocking collectives must come
        in one order on every rank); the numbers are the same.
        """
        local_sum, exchange = self._local_stage_sum, stage.exchange_tied
        assert local_sum is not None and exchange is not None and stage.is_last

        def post_then_exchange() -> None:
            local_sum.post(stage.stage, _squared_norm(list(stage.parameters()), self.root_device))
            exchange()

        stage.exchange_tied = post_then_exchange

    def _replace_sigterm_barrier(self, trainer: Trainer) -> None:
        """Make Lightning's per-batch SIGTERM broadcast asynchronous, lagged, and once per window.

        Lightning broadcasts rank 0's SIGTERM flag before every training batch and waits for it: a
        barrier per micro-batch, which ties stage 0 to the last stage and undoes PACI's overlap
        (measured: stage 0 idled ~19% of its time there). Here every rank starts the broadcast at the
        first batch of each window (a collective per micro-batch costs host time on every rank; a
        window is the unit a stop lands on anyway) and waits only for broadcasts started at least S
        batches earlier, which in a running pipeline have long completed (no stage runs more than S-1
        micro-batches ahead of the last). All ranks start and read the same broadcasts at the same
        batches, so they still stop together.
        """
        loop = trainer.fit_loop.epoch_loop
        if not hasattr(loop, "_broadcast_sigterm_tensor") or self.world_size == 1:
            return
        pending: deque[tuple[dist.Work, Tensor]] = deque()
        self._sigterm_pending = pending  # finished in on_train_end: no collective outlives training
        started_at: deque[int] = deque()  # the batch count at which each pending broadcast started
        lag, group, batches = self.pipeline_stages, self._signal_group, [0]

        def broadcast_sigterm() -> None:
            batches[0] += 1
            if (loop.batch_idx + 1) % max(1, trainer.accumulate_grad_batches) == 0:  # a window's first batch
                flag = torch.tensor([int(bool(getattr(trainer, "received_sigterm", False)))], dtype=torch.int32)
                pending.append((dist.broadcast(flag, src=0, group=group, async_op=True), flag))
                started_at.append(batches[0])
            while started_at and started_at[0] <= batches[0] - lag:
                started_at.popleft()
                work, seen = pending.popleft()
                work.wait()
                if int(seen[0]) == 1:  # a CPU tensor: no device synchronization
                    raise SIGTERMException()

        loop._broadcast_sigterm_tensor = broadcast_sigterm


def _squared_norm(params: list[torch.nn.Parameter], device: torch.device) -> Tensor:
    """The squared norm ``params`` add to a pipeline-wide gradient norm (a tied weight's second copy not counted)."""
    squared = torch.zeros(1, device=device, dtype=torch.float32)
    for p in params:
        if p.grad is not None and counted_in_global_norm(p):
            squared += p.grad.detach().float().pow(2).sum()
    return squared


class _SchedulerGroup:
    """Steps the step-interval LR schedulers with every local optimizer step of a stage."""

    def __init__(self, configs: list[Any]) -> None:
        self.configs = configs
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        for config in self.configs:
            if self.steps % config.frequency == 0:
                config.scheduler.step()
