"""Lightning's learning-rate finder (`Tuner.lr_find`, the `LearningRateFinder` callback) under PACIStrategy.

The finder runs a short training run of its own at the start of fit: it saves a checkpoint, replaces the
schedulers Lightning shows (``trainer.lr_scheduler_configs``: the last hosted stage's) by one that raises the
rate of the optimizer Lightning shows at every step, records the loss at every window's end, restores the
checkpoint and, with ``update_attr``, sets the suggested rate on the module and on ``trainer.optimizers``. Under
the pipeline every stage steps its own optimizer with its own schedulers, so the strategy carries what the finder
does to the stage Lightning shows over to every hosted stage:

- `start_finder_run`, at the start of each training run: schedulers Lightning shows that are not the stages' own
  are the finder's; every hosted stage steps one like it (on processes each rank's finder replaced its own stage's,
  in one process the others get a copy on their optimizers, starting at the same rate), and steps on a non-finite
  loss or gradient as one device does (the finder raises the rate until the loss blows up; one device records the
  NaN and goes on, ``on_nonfinite="raise"`` would end the user's fit). The stages' epoch-interval schedulers do not
  step in that run (Lightning takes the user's schedulers away for it). At the run's end `end_finder_run` gives
  each stage its own schedulers and setting back, before the finder's restore sets their step counts; the run
  that follows (the fit's, or the rest of the one a finder was called in, at an epoch's start) starts again.
- `share_finder_loss`: Lightning's finder reads a loss on every rank at each window's end (and broadcasts rank 0's
  decision to stop), as under DDP, where every rank has one; on processes the stages before the last have none,
  so during the finder's run every rank gets global rank 0's (the last stage of replica 0, whose loss the finder's
  result is broadcast from anyway).
- `apply_suggestion`, at the start of the training run after the finder's: the suggested rate on every hosted
  stage's optimizer, as Lightning sets it on the one it shows (in one process that is the last stage's only).

The finder's recorded losses are the window's last micro-batch's loss itself, as the strategy's ``outputs`` hold
it; one device records that loss divided by N (Lightning normalizes a step's loss for accumulation). The rates,
the stop and the suggestion are the same: the suggestion looks for the steepest fall and the stop at a ratio.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.tuner.lr_finder import _ExponentialLR, _LinearLR, _LRCallback

from lit_efficient.strategy.hosting import HostedStage
from lit_efficient.strategy.step_hooks import step_as_torch, step_schedulers

# What `_LRFinder._exchange_scheduler` installs (Lightning's private names: the finder has no public type for them)
FINDER_SCHEDULERS = (_LinearLR, _ExponentialLR)


@dataclass
class FinderRun:
    """What a finder's run changed on the hosted stages, given back by `end_finder_run`."""

    schedulers: list[Any]  # each stage's own step schedulers
    on_nonfinite: list[str]  # each stage's own setting


def start_finder_run(hosted: list[HostedStage], shown_optimizer: Any, shown: list[Any]) -> FinderRun | None:
    """When the schedulers Lightning shows (``shown``, on ``shown_optimizer``) are not the stages' own: a finder's
    run, for which every hosted stage steps one like them and steps on non-finite values; None when they are the
    stages' own (a run of the user's)."""
    showing = next((h for h in hosted if h.optimizer is shown_optimizer), None)
    if showing is None or list(shown) == list(showing.scheduler_configs):
        return None
    for config in shown:
        if not isinstance(config.scheduler, FINDER_SCHEDULERS) or config.interval != "step":
            raise ValueError(
                f"PACIStrategy: the LR schedulers Lightning shows were replaced by {type(config.scheduler).__name__} "
                f"(interval {config.interval!r}) after setup. Each stage steps its own optimizer with its own "
                "schedulers, and the strategy carries over only Lightning's learning-rate finder's. Return the "
                "schedulers from configure_optimizers instead, where every stage builds its own."
            )
    run = FinderRun([h.stage.scheduler for h in hosted], [h.stage.on_nonfinite for h in hosted])
    for h in hosted:
        configs = shown if h is showing else [_like(config, h.optimizer) for config in shown]
        # All of the finder's step with the stage's steps; they are torch's, stepped as such (a module's own
        # lr_scheduler_step is written for its own schedulers).
        h.stage.scheduler, _ = step_schedulers(configs, step_as_torch)
        h.stage.on_nonfinite = "step"
    return run


def _like(config: Any, optimizer: Any) -> Any:
    """A copy of the finder's scheduler ``config`` on another stage's ``optimizer``, from the same rate: the finder
    set every parameter group of the optimizer it saw to its lowest rate before building it."""
    finder = config.scheduler
    optimizer = getattr(optimizer, "optimizer", optimizer)  # a sharded state steps the user's optimizer underneath
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = finder.base_lrs[0]
    return dataclasses.replace(config, scheduler=type(finder)(optimizer, finder.end_lr, finder.num_iter))


def one_progress_bar(trainer: Trainer) -> None:
    """The finder's progress bar on global rank 0 only, as Lightning's own bars (every rank drew one)."""
    if trainer.global_rank != 0:
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, _LRCallback):
                callback.progress_bar_refresh_rate = 0


def end_finder_run(hosted: list[HostedStage], run: FinderRun) -> None:
    """Each hosted stage steps its own schedulers again, with its own ``on_nonfinite``."""
    for h, scheduler, setting in zip(hosted, run.schedulers, run.on_nonfinite, strict=True):
        h.stage.scheduler, h.stage.on_nonfinite = scheduler, setting


def share_finder_loss(loss: torch.Tensor | None, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Global rank 0's loss on every rank (a CPU broadcast over ``group``, every rank at the same window end)."""
    value = torch.full((1,), float("nan")) if loss is None else loss.detach().float().reshape(1).cpu()
    dist.broadcast(value, src=0, group=group)
    return value[0]


def apply_suggestion(trainer: Trainer, hosted: list[HostedStage]) -> None:
    """The rate a `LearningRateFinder` with ``update_attr`` suggested in this fit, on every hosted stage's optimizer
    (Lightning set it on the optimizer it shows, after restoring the checkpoint)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        finder = getattr(callback, "optimal_lr", None) if isinstance(callback, LearningRateFinder) else None
        if finder is None or not callback._update_attr:
            continue
        lr = finder.suggestion()
        if lr is None:
            continue
        for h in hosted:
            for group in h.optimizer.param_groups:
                group["lr"] = lr
