"""PACIStrategy's configuration checks: arguments, the module, and the layout before any process starts."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from lightning.fabric.strategies.launchers.multiprocessing import _disable_module_memory_sharing
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _GlobalStateSnapshot
from lightning.pytorch.utilities import rank_zero_warn

from lit_efficient.pipeline.schedules import SCHEDULES
from lit_efficient.pipeline.topology import Topology
from lit_efficient.protocol import PIPELINE_METHODS, missing_pipeline_methods

_PRECISIONS = ("32-true", "bf16-mixed")


class _ChecksFirst:
    """A launcher that runs ``PACIStrategy._check_before_launch`` in the one process that starts the
    others: a configuration error is then one message, not one traceback per rank once they run.
    Classes, not a wrapped method: the spawn launcher pickles the strategy and its launcher."""

    def launch(self, function: Any, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None and hasattr(trainer.strategy, "_check_before_launch"):
            trainer.strategy._check_before_launch(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class _CheckedScriptLauncher(_ChecksFirst, _SubprocessScriptLauncher):
    """`_SubprocessScriptLauncher` (``start_method="popen"``, torchrun, SLURM) with the check."""


class _CheckedMultiProcessingLauncher(_ChecksFirst, _MultiProcessingLauncher):
    """`_MultiProcessingLauncher` (``start_method="spawn"``/``"fork"``/``"forkserver"``) with the check.

    ``"forkserver"`` is made to start ranks like ``"spawn"`` does. Lightning treats it like ``"fork"``,
    but a forkserver's children are forked from a server started once per Python process, so they
    carry the server's environment (a stale ``MASTER_PORT`` and ``PL_GLOBAL_SEED`` from the first
    fit), its global torch state, and, on CPU, share the module's parameter memory with each other
    (pickled through shared memory, never forked). Each rank here gets the launching process's
    environment and global state and its own copy of the module, as under ``"spawn"``; what the
    server preloads (``multiprocessing.set_forkserver_preload``) is then imported once, not per rank.
    """

    def launch(self, function: Any, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        if self._start_method == "forkserver":
            # Lightning sets MASTER_PORT just before starting the ranks; set it first so it is captured.
            os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)
            self._launch_environ = dict(os.environ)
            self._launch_state = _GlobalStateSnapshot.capture()
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _wrapping_function(self, process_idx: int, trainer: Any, function: Any, args: Any, kwargs: Any, *rest: Any):
        if self._start_method == "forkserver":
            os.environ.clear()
            os.environ.update(self._launch_environ)
            self._launch_state.restore()
            if "OMP_NUM_THREADS" in os.environ:  # a fresh interpreter would honour it; the server's torch did not
                torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
            if isinstance(self._strategy.accelerator, CPUAccelerator):
                args, kwargs = _disable_module_memory_sharing((args, kwargs))
        return super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)


def _check_arguments(
    stages: int,
    schedule: str,
    balance: Any,
    timeout: float,
    on_nonfinite: str,
    local_sgd_steps: int | None,
    warmup: int,
    outer: str,
    outer_lr: float,
    outer_momentum: float,
) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"pipeline_stages={stages!r} must be an integer >= 1")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if isinstance(balance, list):
        if len(balance) != stages or any(not isinstance(n, int) or n < 1 for n in balance):
            raise ValueError(f"balance={balance} must list {stages} positive layer counts, one per stage")
    elif balance not in ("parameters", "uniform", "profile"):
        raise ValueError(f"balance={balance!r} must be 'parameters', 'uniform', 'profile' or a list of layer counts")
    if not timeout > 0 or math.isinf(timeout):
        raise ValueError(f"p2p_timeout={timeout} must be a positive number of seconds")
    if on_nonfinite not in ("raise", "skip"):
        raise ValueError(f"on_nonfinite={on_nonfinite!r} must be 'raise' or 'skip'")
    if local_sgd_steps is not None and (not isinstance(local_sgd_steps, int) or local_sgd_steps < 1):
        raise ValueError(f"local_sgd_steps={local_sgd_steps!r} must be None (sync every step) or an integer >= 1")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"local_sgd_warmup_steps={warmup!r} must be an integer >= 0")
    if outer not in ("average", "nesterov"):
        raise ValueError(f"outer_optimizer={outer!r} must be 'average' or 'nesterov'")
    if outer == "average" and (outer_lr != 0.7 or outer_momentum != 0.9):
        raise ValueError(
            f"outer_lr={outer_lr} / outer_momentum={outer_momentum} only apply to DiLoCo: "
            "set outer_optimizer='nesterov', or leave them at their defaults"
        )
    if not outer_lr > 0:
        raise ValueError(f"outer_lr={outer_lr} must be > 0")
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum={outer_momentum} must be in [0, 1)")


def _warn_single_replica(local_sgd_steps: int | None, topology: Topology) -> None:
    if local_sgd_steps is not None and topology.num_replicas == 1:
        rank_zero_warn(
            f"PACIStrategy(local_sgd_steps={local_sgd_steps}) has no effect: world size {topology.world_size} = "
            f"pipeline_stages {topology.num_stages} x 1 data-parallel replica, so there is nothing to average. "
            "Use more devices (a multiple of pipeline_stages) or drop local_sgd_steps."
        )


def _check_module(module: LightningModule, precision: Precision) -> None:
    missing = missing_pipeline_methods(module)
    if missing:
        raise TypeError(
            f"{type(module).__name__} cannot be pipelined: it lacks {', '.join(missing)}. PACIStrategy needs the "
            f"pipeline protocol ({', '.join(m + '()' for m in PIPELINE_METHODS)}); see lit_efficient.PipelineModule."
        )
    if not module.automatic_optimization:
        raise ValueError(
            f"{type(module).__name__} uses manual optimization; PACIStrategy schedules forwards, backwards and "
            "steps itself. Use automatic optimization (the default) with configure_optimizers."
        )
    name = getattr(precision, "precision", None)
    if name not in _PRECISIONS or (name == "bf16-mixed" and not isinstance(precision, MixedPrecision)):
        raise ValueError(f"precision={name!r} is not supported by PACIStrategy: use one of {', '.join(_PRECISIONS)}")
