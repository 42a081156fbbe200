"""PACIStrategy's configuration checks: arguments, the module, and the layout before any process starts."""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import os
import signal
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, get_args

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.strategies.launchers.multiprocessing import _disable_module_memory_sharing
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    GradientAccumulationScheduler,
    LearningRateFinder,
    ModelCheckpoint,
    ModelPruning,
    SpikeDetection,
    StochasticWeightAveraging,
    WeightAveraging,
)
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _GlobalStateSnapshot
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.model_registry import _is_registry
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lit_efficient import rank_reaper
from lit_efficient.checkpoint.sharded_write import is_sharded, not_a_checkpoint_folder
from lit_efficient.checks import check_flags, closest_choice, is_count
from lit_efficient.protocol import PIPELINE_METHODS, missing_pipeline_methods
from lit_efficient.replicas.averaging import check_outer_optimizer
from lit_efficient.replicas.fault_tolerance import check_group_range
from lit_efficient.runtime.partition import planned_sizes
from lit_efficient.runtime.schedules import SCHEDULES
from lit_efficient.runtime.split import check_stage_parameters, find_ties, layer_parameter_counts, layer_slots
from lit_efficient.runtime.stage import OnNonFinite
from lit_efficient.runtime.staleness import CORRECTIONS, READS_MOMENTS
from lit_efficient.runtime.topology import Topology
from lit_efficient.transport.failures import lost_peers_error

_PRECISIONS = ("32-true", "bf16-mixed")
WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # `PACIStrategy(wire_dtype=...)`


class _ChecksFirst:
    """A launcher that runs ``PACIStrategy._check_before_launch`` in the one process that starts the
    others: a configuration error is then one message, not one traceback per rank once they run.
    Classes, not a wrapped method: the spawn launcher pickles the strategy and its launcher."""

    def launch(self, function: Any, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        self._check(trainer, function, args, kwargs)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]

    @staticmethod
    def _check(trainer: Trainer | None, function: Any, args: tuple, kwargs: dict) -> None:
        # fit/validate/test/predict's own ckpt_path, whatever its position in the call
        ckpt_path = inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("ckpt_path")
        check_local_path(ckpt_path, "ckpt_path")
        check_checkpoint_path(ckpt_path)
        if trainer is not None and hasattr(trainer.strategy, "_check_before_launch"):
            trainer.strategy._check_before_launch(trainer)


def is_checkpoint_keyword(ckpt_path: Any) -> bool:
    """Whether ``ckpt_path`` is a name Lightning resolves itself ("last", "best", "hpc", a model registry's)."""
    return isinstance(ckpt_path, str) and (ckpt_path in ("last", "best", "hpc") or _is_registry(ckpt_path))


class CheckpointNotFound(FileNotFoundError):
    """A ``ckpt_path`` with no checkpoint there (nothing, or a file or folder of another kind), said before any
    process starts (`check_checkpoint_path`)."""


def check_local_path(path: Any, what: str) -> None:
    """Refuse a URL (``s3://...``) where PACIStrategy reads or writes a checkpoint: it writes its own (each stage's
    share gathered into one file, or a folder every rank writes into) and reads them memory-mapped, on a local or
    mounted file system only. ``Path`` took ``s3://bucket/x.ckpt`` for the local folder ``s3:/bucket``, so a save
    landed on the local disk, silently."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
    if "://" in text and not text.startswith("file://"):
        raise ValueError(
            f"{what}={text!r} is a URL: PACIStrategy writes and reads its checkpoints on a local or mounted file "
            "system only (each stage's share gathered into one file, or a sharded folder every rank writes into, "
            "read back memory-mapped). Use a local folder, or the bucket mounted as one (s3fs, gcsfuse, blobfuse), "
            "and copy the checkpoint where it should go."
        )


def local_path(path: str | os.PathLike, what: str) -> Path:
    """A checkpoint path as the file system's: ``file:///tmp/x.ckpt`` is ``/tmp/x.ckpt``, as Lightning (fsspec) reads
    it (``Path`` made it the relative folder ``file:/tmp``); ``~`` expanded; another URL refused (`check_local_path`,
    ``what`` naming the argument)."""
    check_local_path(path, what)
    text = os.fspath(path)
    return Path(os.path.expanduser(text[len("file://") :] if text.startswith("file://") else text))


def check_checkpoint_path(ckpt_path: Any) -> None:
    """Refuse a ``ckpt_path`` that names nothing, with Lightning's words and the fix: every rank would otherwise
    start, then each fail in its own traceback. Lightning's keywords ("last", "best", ...) and URLs are Lightning's
    to resolve (PACIStrategy refuses a URL: `check_local_path`)."""
    if not isinstance(ckpt_path, (str, os.PathLike)):
        return
    path = os.fspath(ckpt_path)
    if is_checkpoint_keyword(path) or ("://" in path and not path.startswith("file://")):
        return
    local = local_path(path, "ckpt_path")
    if local.exists():
        _check_is_a_checkpoint(local, path)
        return
    raise CheckpointNotFound(
        f"Checkpoint file not found: {path} (ckpt_path={path!r}; no file or folder there). Give the path of a .ckpt "
        "file or of a sharded checkpoint folder (at the end of a fit the CLI prints its own as 'resume: --ckpt_path "
        "...'), or ckpt_path='last' for the latest checkpoint of the run's ModelCheckpoint."
    )


def _check_is_a_checkpoint(local: Path, path: str) -> None:
    """Refuse a ``ckpt_path`` that is there but holds no checkpoint, before any process starts: a folder failed in
    every rank with IsADirectoryError, a file of another kind with torch's unpickling error (whose advice, to load
    with weights_only=False, is unsafe), and one file of a sharded checkpoint with a wrong diagnosis."""
    if local.is_dir():
        if is_sharded(local):
            return
        found = sorted(str(p) for pattern in ("*.ckpt", "*/*.ckpt", "*/*/*.ckpt") for p in local.glob(pattern))
        raise CheckpointNotFound(
            f"ckpt_path={path!r}: {not_a_checkpoint_folder(local)}; give a .ckpt file or a sharded checkpoint's folder"
            + (f"; in it: {', '.join(found[:5])}{' ...' if len(found) > 5 else ''}" if found else "")
        )
    if is_sharded(local.parent):
        raise CheckpointNotFound(
            f"ckpt_path={path!r} is one file of the sharded checkpoint {str(local.parent)!r}: pass the folder"
        )
    with open(local, "rb") as f:
        head = f.read(4)
    zipped = head == b"PK\x03\x04" and zipfile.is_zipfile(local)  # a whole zip: its first entry and its index
    if not (zipped or head[:1] == b"\x80"):  # torch.save's zip archive, or its legacy pickle
        raise CheckpointNotFound(
            f"ckpt_path={path!r} is not a checkpoint (not a file torch.save wrote): give a .ckpt file that "
            "ModelCheckpoint or trainer.save_checkpoint wrote, or a sharded checkpoint's folder"
        )


class RefusedSetting(ValueError):
    """A setting refused before anything runs (`PACIStrategy._check_before_launch`): the user's to change, which
    the command line reports as a usage error rather than a traceback."""


@contextmanager
def refusing_settings() -> Iterator[None]:
    """The ValueErrors of the checks inside, raised as `RefusedSetting`s. Only the checks' own code runs inside: the
    module's ``pipeline_layers()`` is called before (`layers_before_launch`), so an error of the user's code keeps its
    type and traceback."""
    try:
        yield
    except RefusedSetting:
        raise
    except ValueError as error:
        raise RefusedSetting(str(error)) from error


def layers_before_launch(module: LightningModule) -> list | None:
    """The module's pipeline layers for the checks before launch, or None where they do not exist yet (built by
    ``configure_model`` or in ``setup()``, or read from the trainer, attached after the launch: setup counts them,
    `PACIStrategy._stage_sizes`). A refusal of the model itself (HFCausalLM's dry run: a ValueError) is raised here,
    once, as the model's."""
    if is_overridden("configure_model", module) or not callable(getattr(module, "pipeline_layers", None)):
        return None
    try:
        layers = list(module.pipeline_layers())
    except (AttributeError, RuntimeError):
        return None
    return layers if all(isinstance(layer, nn.Module) for layer in layers) else None  # a None: built in setup()


def setup_may_build_layers(module: LightningModule) -> bool:
    """Whether ``module.setup()``, Lightning's hook for building layers once the data are known, is the user's own:
    the layers seen before launch may then be placeholders it replaces on every rank (`check_split` is left to
    setup there). The package's models override it only to check their configuration."""
    for cls in type(module).__mro__:
        if "setup" in vars(cls):
            return not cls.__module__.startswith(("lit_efficient.", "lightning."))
    return False


class _CheckedScriptLauncher(_ChecksFirst, _SubprocessScriptLauncher):
    """`_SubprocessScriptLauncher` (``start_method="popen"``, torchrun, SLURM) with the check, and the ranks it
    starts watched by `rank_reaper.RankObserver`, not Lightning's observer (which SIGKILLs this process when a
    rank fails, before it can raise the failure). They do not outlive a failure of this process either
    (`PACIStrategy.on_exception` starts `rank_reaper.watch_after_exit`)."""

    def launch(self, function: Any, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        # Lightning's launch (2.6's `_SubprocessScriptLauncher.launch`, line for line), with the check first and this
        # package's observer.
        self._check(trainer, function, args, kwargs)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            rank_reaper.RankObserver(self.procs).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException as err:
            # This process raises the failure: from here on it is not to be killed for it (its callbacks'
            # on_exception hooks, a save, the user's except/finally run next). Also under a later Trainer of the
            # same script, which launches nothing: the first launch's observer watches its ranks still.
            rank_reaper.stand_down_observers()
            # A collective's raw error (a callback's, a metric share's) names no cause: raise what this rank saw, with
            # the cause a peer published.
            strategy = trainer.strategy if trainer is not None else None
            pipelined = getattr(strategy, "topology", None) is not None and not strategy.in_process  # type: ignore[union-attr]
            if pipelined and (explained := lost_peers_error(strategy.here, err)) is not None:  # type: ignore[union-attr]
                raise explained from err
            raise


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
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except KeyboardInterrupt:
            # An interrupt of this process alone (a notebook's "interrupt kernel", a job manager signalling the
            # main pid) left the ranks training until this process exited (torch's parent-death signal): stop them
            # now, as a terminal's Ctrl-C would, then kill what is left.
            rank_reaper.stop([p.pid for p in self.procs if p.pid is not None], first=signal.SIGINT)
            raise

    def _wrapping_function(self, process_idx: int, trainer: Any, function: Any, args: Any, kwargs: Any, *rest: Any):
        if self._start_method == "forkserver":
            os.environ.clear()
            os.environ.update(self._launch_environ)
            self._launch_state.restore()
            if "OMP_NUM_THREADS" in os.environ:  # a fresh interpreter would honour it; the server's torch did not
                torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
            if isinstance(self._strategy.accelerator, CPUAccelerator):
                args, kwargs = _disable_module_memory_sharing((args, kwargs))
        try:
            return super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)
        except BaseException as exception:
            # Lightning runs the fit of a started rank without its exception handling: the strategy's own would
            # not run, and the rank's peers reported it as "died (killed? out of memory?)", not what it raised.
            if trainer is not None and hasattr(trainer.strategy, "on_exception"):
                trainer.strategy.on_exception(exception)
            if isinstance(exception, (SystemExit, KeyboardInterrupt)):
                # torch's spawn takes a rank's SystemExit or KeyboardInterrupt for a clean exit (Lightning's
                # SIGTERMException is a SystemExit), and the launching process then waited forever for that rank's
                # results: a SIGTERM or a SIGINT to the ranks alone hung it.
                said = {SIGTERMException: " (it received SIGTERM)", KeyboardInterrupt: " (it received SIGINT)"}
                raise RuntimeError(
                    f"rank {process_idx} stopped with {type(exception).__name__}" + said.get(type(exception), "")
                ) from exception
            raise


# DDPStrategy's own parameters that do something under PACIStrategy, explicit in its signature: Lightning's
# accelerator connector reads the first four off the strategy, `setup_distributed` (init_process_group)
# the next two, and the launcher start_method. The rest of DDPStrategy's are refused below.
PASSED_TO_LIGHTNING = (
    "accelerator", "parallel_devices", "cluster_environment", "precision_plugin", "process_group_backend", "timeout",
    "start_method",
)  # fmt: skip
# What Lightning's DDPStrategy keeps for the DistributedDataParallel wrapper it builds in `setup` (and
# its comm hooks); PACIStrategy's `setup` builds no wrapper. The wrapper's own options are read off
# DistributedDataParallel's signature, so a torch release's new ones are refused with the same message.
_DDP_STRATEGY_WRAPPER_OPTIONS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_NO_BUCKETS = "none needed: a stage's gradients go in one flat all-reduce per dtype, no buckets or autograd hooks"
_LOCAL_SGD = (
    "local_sgd_steps=H (post-local SGD's start_localSGD_iter: local_sgd_warmup_steps, whose steps average the weights "
    "rather than the gradients)"
)
_WRAPPER_EQUIVALENTS = {
    "find_unused_parameters": "none needed: a stage gives parameters that got no gradient zeros before reducing",
    "broadcast_buffers": "none per forward; with local_sgd_steps, average_buffers=True averages float buffers",
    "forward_sync_buffers": "none per forward; with local_sgd_steps, average_buffers=True averages float buffers",
    "init_sync": "none, no start-up broadcast: replicas start alike when every rank builds the same model (seeded)",
    "mixed_precision": "Trainer(precision='bf16-mixed')",
    "process_group": "none: each stage's replica group follows from pipeline_stages and the world size",
    "device_mesh": "none: each stage's replica group follows from pipeline_stages and the world size",
    "bucket_cap_mb": _NO_BUCKETS,
    "bucket_cap_mb_list": _NO_BUCKETS,
    "gradient_as_bucket_view": _NO_BUCKETS,
    "batched_grad_copy": _NO_BUCKETS,
    "static_graph": _NO_BUCKETS,
    "model_averaging_period": _LOCAL_SGD,
    "ddp_comm_state": f"PostLocalSGDState: {_LOCAL_SGD}",
    "ddp_comm_hook": f"post_localSGD_hook: {_LOCAL_SGD}; none for compression hooks (fp16, bf16, PowerSGD)",
}
# Other pipeline libraries' names for the micro-batch count or size (GPipe/torchgpipe/fairscale's chunks, torch
# pipelining's n_microbatches, DeepSpeed's micro_batch_size): here the data loader and the accumulation say it.
_MICRO_BATCHES = (
    "a loader batch is one micro-batch (its size: the DataLoader's batch_size); micro-batches per optimizer step N: "
    "Trainer(accumulate_grad_batches=N) or GradientAccumulation(steps=N)"
)
_MICRO_BATCH_NAMES = (
    "chunks", "num_chunks", "microbatches", "num_microbatches", "n_microbatches", "micro_batches", "num_micro_batches",
    "micro_batch_size", "microbatch_size",
)  # fmt: skip
_NOT_USED = {
    **dict.fromkeys(_MICRO_BATCH_NAMES, _MICRO_BATCHES),
    "replicas": (
        "data-parallel replicas come from the world size: devices x num_nodes = pipeline_stages x replicas (2 stages "
        "on devices=4 train 2 replicas); raise Trainer(devices=...) for more"
    ),
    "checkpoint_io": (
        "PACIStrategy writes and reads its checkpoints itself (one file from global rank 0, or with "
        "checkpoint_format='sharded' a folder every rank writes its share of; async_checkpoint=True writes it in "
        "the background) and never calls a CheckpointIO"
    ),
}


def wrapper_options() -> tuple[str, ...]:
    """The options of the DistributedDataParallel wrapper Lightning's DDPStrategy would build, and its hooks'."""
    ddp = [n for n in inspect.signature(DistributedDataParallel.__init__).parameters if n not in ("self", "module")]
    return (*ddp, *_DDP_STRATEGY_WRAPPER_OPTIONS)


def explain_refused(name: str, options: Iterable[str], value: Any = None, show_value: bool = True) -> str:
    """One line saying why keyword ``name`` of PACIStrategy does nothing: a wrapper option, or the closest option."""
    given = f"{name}={value!r}" if show_value else name
    if name in wrapper_options():
        equivalent = _WRAPPER_EQUIVALENTS.get(name, "none")
        wrapper = "configures Lightning's DistributedDataParallel wrapper, never built here; equivalent:"
        return f"{given}: {wrapper} {equivalent}"
    if name in _NOT_USED:
        return f"{given}: {_NOT_USED[name]}"
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"{given}: not an option of PACIStrategy" + (f"; did you mean {close[0]}?" if close else "")


def refusal_footer(names: Iterable[str], options: Iterable[str]) -> str:
    """What a refusal adds after its lines: where gradients are reduced (for wrapper options) and what is accepted."""
    names, options = list(names), list(options)
    text = ""
    if any(n in wrapper_options() for n in names):
        text += (
            "PACIStrategy reduces gradients per stage instead: each stage all-reduces its gradients over its "
            "data-parallel replica group once per optimizer step, after its N-th backward (one flat all-reduce per "
            "dtype; PipelineStage.step calls the reduction step_hooks.install_step_hooks installs, "
            "lit_efficient/strategy/step_hooks.py), or with local_sgd_steps averages weights every H steps "
            "(lit_efficient/replicas/averaging.py).\n"
        )
    own = [n for n in options if n not in PASSED_TO_LIGHTNING]
    return text + (
        f"PACIStrategy's options: {', '.join(own)}; passed through to Lightning's DDPStrategy: "
        f"{', '.join(PASSED_TO_LIGHTNING)}. Nothing else is accepted."
    )


def options_of(init: Callable[..., Any]) -> list[str]:
    """The keyword options of ``init`` (PACIStrategy's ``__init__``): its named parameters but ``self``."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [n for n, p in inspect.signature(init).parameters.items() if p.kind in named and n != "self"]


def _refuse_unknown(given: Mapping[str, Any], init: Callable[..., Any]) -> None:
    """Refuse, in a ValueError, every keyword ``init``'s ``**kwargs`` caught: PACIStrategy would ignore it."""
    if not given:
        return
    options = options_of(init)
    lines = "".join(f"\n  - {explain_refused(name, options, value)}" for name, value in given.items())
    raise ValueError(f"PACIStrategy does not accept:{lines}\n{refusal_footer(given, options)}")


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
    if not is_count(stages):
        raise ValueError(f"pipeline_stages={stages!r} must be an integer >= 1")
    if schedule not in SCHEDULES:
        close = closest_choice(schedule, SCHEDULES)
        hint = f" (did you mean {close!r}?)" if close else ""
        raise ValueError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}{hint}")
    if isinstance(balance, list):
        if len(balance) != stages or not all(is_count(n) for n in balance):
            raise ValueError(f"balance={balance} must list {stages} positive layer counts, one per stage")
    elif balance not in ("parameters", "uniform", "profile"):
        raise ValueError(f"balance={balance!r} must be 'parameters', 'uniform', 'profile' or a list of layer counts")
    number = isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)  # "30" compared with 0: a TypeError
    if not number or not timeout > 0 or math.isinf(timeout):
        raise ValueError(f"p2p_timeout={timeout!r} must be a positive number of seconds")
    if on_nonfinite not in get_args(OnNonFinite):
        raise ValueError(f"on_nonfinite={on_nonfinite!r} must be 'raise' or 'skip'")
    if local_sgd_steps is not None and not is_count(local_sgd_steps):
        raise ValueError(f"local_sgd_steps={local_sgd_steps!r} must be None (sync every step) or an integer >= 1")
    if not is_count(warmup, 0):
        raise ValueError(f"local_sgd_warmup_steps={warmup!r} must be an integer >= 0")
    if outer == "average" and (outer_lr != 0.7 or outer_momentum != 0.9):  # before their ranges: the first fix
        diloco = "outer_optimizer='nesterov'" + (" and local_sgd_steps=H (e.g. 20)" if local_sgd_steps is None else "")
        raise ValueError(
            f"outer_lr={outer_lr} / outer_momentum={outer_momentum} only apply to DiLoCo: "
            f"set {diloco}, or leave them at their defaults"
        )
    check_outer_optimizer(outer, outer_lr, outer_momentum)
    if local_sgd_steps is None and (outer != "average" or warmup != 0):
        asked = f"outer_optimizer={outer!r}" if outer != "average" else f"local_sgd_warmup_steps={warmup}"
        raise ValueError(
            f"{asked} needs local_sgd_steps=H: without it the replicas all-reduce gradients every step and "
            "LocalSGD/DiLoCo never runs. Set local_sgd_steps (the optimizer steps between syncs, e.g. 20), or leave "
            "outer_optimizer and local_sgd_warmup_steps at their defaults."
        )


def _check_sharding(shard: bool, local_sgd_steps: int | None, correction: str | None) -> None:
    """Refuse what ``shard_optimizer_state=True`` cannot serve, before any process starts."""
    check_flags("PACIStrategy", shard_optimizer_state=shard)
    if not shard:
        return
    if local_sgd_steps is not None:
        raise ValueError(
            f"shard_optimizer_state=True with local_sgd_steps={local_sgd_steps}: under LocalSGD/DiLoCo each replica "
            "steps its own weights between averages and needs its own whole optimizer state, so there is nothing to "
            "split. Drop one of the two (sharding keeps DDP semantics: gradients reduced every step)."
        )
    if correction in READS_MOMENTS:
        raise ValueError(
            f"shard_optimizer_state=True with staleness_correction={correction!r}: the prediction extrapolates "
            "every weight of a stage by its AdamW moments before each stale forward, and a replica holds the moments "
            "of 1/R of them. Use staleness_correction='lr_scale' or None with sharding, or shard_optimizer_state=False."
        )


def check_streaming_ties(streaming_sync: bool, replicated: bool, tied: bool) -> None:
    """Refuse streaming syncs of a model with tied weights over replicas (``replicated``: replicas in the job, or
    torchft replica groups): the first stage's copy of the tied weight (the token table) would be averaged at its
    step, the last stage's copy (the LM head) at another; each replica's two copies then differ by its own drift
    from the mean, and no later sync brings them back together. (streaming_sync needs local_sgd_steps: refused
    at construction, `check_replica_groups`.)"""
    if streaming_sync and replicated and tied:
        raise ValueError(
            "streaming_sync=True does not support tied weights (this model shares a parameter between the first and "
            "the last stage, which would sync it at different steps and let its two copies drift apart): untie "
            "them, or set streaming_sync=False (every stage syncs at the same step)."
        )


def _sharding_applies(topology: Topology, in_process: bool, tied: bool) -> bool:
    """Whether ``shard_optimizer_state=True`` splits anything in this layout (it warns where not), refusing tied
    weights: their copies' gradients are combined across stages (`lit_efficient.runtime.tied`) after the
    replicas' reduction, which sharding would leave as chunks laid out differently on each stage."""
    if tied:
        raise ValueError(
            "shard_optimizer_state=True does not support tied weights yet (this model shares a parameter between "
            "the first and the last stage): untie them, or train with shard_optimizer_state=False."
        )
    if in_process or topology.num_replicas == 1:
        where = "in one process" if in_process else f"with world size {topology.world_size}"
        rank_zero_warn(
            f"PACIStrategy(shard_optimizer_state=True) has no effect {where}: each stage has one data-parallel "
            "replica, which holds its whole optimizer state anyway. Use a world size of pipeline_stages x R with "
            "R > 1 replicas for it to split the state R ways."
        )
        return False
    return True


def _warn_single_replica(local_sgd_steps: int | None, topology: Topology, in_process: bool = False) -> None:
    if local_sgd_steps is not None and topology.num_replicas == 1:
        where = (
            "in one process, which hosts one replica of every stage"
            if in_process
            else f"world size {topology.world_size} = pipeline_stages {topology.num_stages} x 1 data-parallel replica"
        )
        rank_zero_warn(
            f"PACIStrategy(local_sgd_steps={local_sgd_steps}) has no effect: {where}, so there is nothing to "
            "average (outer_optimizer and its settings neither). Use more devices (a multiple of pipeline_stages) "
            "or drop local_sgd_steps."
        )


def check_layers(pipeline_stages: int, balance: Any, layers: list) -> None:
    """Refuse more stages than ``pipeline_layers()`` has layers, or an explicit split that does not fit them; the
    message lists the layers (a GPT(n_layer=4) has 6: its embedding and head are layers too). And sparse gradients."""
    if pipeline_stages > len(layers):
        raise ValueError(
            f"PACIStrategy(pipeline_stages={pipeline_stages}) exceeds the {len(layers)} layers of pipeline_layers() "
            f"({describe_layers(layers)}): use at most {len(layers)} stages, or split the model into more layers"
        )
    if isinstance(balance, list) and sum(balance) != len(layers):  # its length and entries: checked in __init__
        raise ValueError(
            f"PACIStrategy(balance={balance}) sums to {sum(balance)} layers, but pipeline_layers() has {len(layers)} "
            f"({describe_layers(layers)}): make the counts add up to {len(layers)}"
        )
    _refuse_sparse_gradients(layers)


def check_split(module: LightningModule, layers: list, pipeline_stages: int, balance: Any) -> None:
    """What setup refuses about the layers' structure, refused before any process starts (once, in the launching
    process of a spawn, forkserver or popen launch, instead of on every rank after it; under torchrun or SLURM
    each rank's launch): a layer not registered in the module, a module registered twice, a parameter in no layer
    or shared across stages otherwise than as a tie, a stage without parameters. The same functions setup runs;
    the sharing and the stages' parameters need the split, known here unless ``balance="profile"`` measures it."""
    counts = layer_parameter_counts(module, layers)
    layer_slots(module, layers)
    sizes = planned_sizes(balance, pipeline_stages, counts)
    if sizes is not None:
        find_ties(module, layers, sizes)
        check_stage_parameters(counts, sizes)


def describe_layers(layers: list) -> str:
    """``[GPTEmbedding, Block, Block, GPTHead]`` -> ``"GPTEmbedding, 2 x Block, GPTHead"``."""
    runs: list[list[Any]] = []
    for name in (type(layer).__name__ for layer in layers):
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return ", ".join(name if count == 1 else f"{count} x {name}" for name, count in runs)


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
        raise ValueError(unsupported_precision(name))


def unsupported_precision(name: Any) -> str:
    """The refusal of a Trainer precision PACIStrategy does not train in (fit's, and `lit-efficient plan`'s)."""
    low = ""
    if isinstance(name, str) and name.endswith("-true"):
        dtype = "float64" if name == "64-true" else "bfloat16"
        hf = f" or HFCausalLM(dtype='{dtype}')" if dtype == "bfloat16" else ""
        low = (
            f" (for weights, gradients and optimizer state in {dtype}, build the model in that dtype, model.to("
            f"torch.{dtype}){hf}, and keep precision='32-true': the pipeline trains it as one device does)"
        )
    if name == "16-mixed":  # the string on CPU is taken: Lightning runs it there as bf16-mixed
        low = (
            " (float16 with a gradient scaler, on a GPU or as a MixedPrecision plugin with a GradScaler, which "
            "PACIStrategy does not train with; precision='16-mixed' on CPU runs, as Lightning turns it into "
            "bf16-mixed there)"
        )
    return f"precision={name!r} is not supported by PACIStrategy: use one of {', '.join(_PRECISIONS)}{low}"


def check_options(
    pipeline_stages: int, schedule: str, balance: Any, p2p_timeout: float, on_nonfinite: str,
    local_sgd_steps: int | None, local_sgd_warmup_steps: int, outer_optimizer: str, outer_lr: float,
    outer_momentum: float, shard_optimizer_state: bool, staleness_correction: str | None,
    staleness_anneal_steps: int, compile_layers: Any, wire_dtype: str, checkpoint_format: str,
    async_checkpoint: bool,
) -> None:  # fmt: skip
    """`PACIStrategy`'s options, checked in its ``__init__``: a ValueError naming the value and the fix."""
    _check_arguments(
        pipeline_stages, schedule, balance, p2p_timeout, on_nonfinite, local_sgd_steps, local_sgd_warmup_steps,
        outer_optimizer, outer_lr, outer_momentum,
    )  # fmt: skip
    _check_sharding(shard_optimizer_state, local_sgd_steps, staleness_correction)
    if staleness_correction is not None and staleness_correction not in CORRECTIONS:
        raise ValueError(
            f"staleness_correction={staleness_correction!r} is not one of {', '.join(CORRECTIONS)} (or None: off)"
        )
    if not isinstance(compile_layers, (bool, dict)):
        raise ValueError(
            f"compile_layers={compile_layers!r} must be True, False or a dict of torch.compile's keyword "
            "arguments, e.g. {'backend': 'inductor', 'mode': 'max-autotune'}"
        )
    if isinstance(compile_layers, dict):
        _check_compile_options(compile_layers)
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype={wire_dtype!r} must be one of {', '.join(map(repr, WIRE_DTYPES))}")
    if not is_count(staleness_anneal_steps):
        raise ValueError(f"staleness_anneal_steps={staleness_anneal_steps!r} must be an integer >= 1")
    if checkpoint_format not in ("file", "sharded"):
        raise ValueError(
            f"checkpoint_format={checkpoint_format!r} must be 'file' (one Lightning .ckpt) or 'sharded' (a folder "
            "every rank writes its own share into)"
        )
    if async_checkpoint and checkpoint_format != "sharded":
        raise ValueError(
            f"async_checkpoint=True writes sharded checkpoints in the background; checkpoint_format="
            f"{checkpoint_format!r} is one file that global rank 0 writes. Pass checkpoint_format='sharded'."
        )


# torch.compile's modes (its docstring); a wrong one is refused only when a stage compiles, after the launch
_COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _check_compile_options(options: dict[str, Any]) -> None:
    """``compile_layers``'s keys and mode, now: torch.compile would refuse them only at setup, on every rank."""
    allowed = [k for k in inspect.signature(torch.compile).parameters if k != "model"]
    for key in options:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"compile_layers={options!r}: {key!r} is not an argument of torch.compile; {hint}it takes "
                f"{', '.join(allowed)}."
            )
    if options.get("mode") not in _COMPILE_MODES:
        raise ValueError(
            f"compile_layers={options!r}: mode={options['mode']!r} is not one of torch.compile's modes "
            f"{', '.join(map(repr, _COMPILE_MODES[1:]))}."
        )
    backend = options.get("backend")
    if isinstance(backend, str):  # a callable is the user's own backend
        from torch._dynamo import list_backends  # torch.compile imports it anyway; it refuses a name at its first call

        known = list_backends(exclude_tags=())
        if backend not in known:
            close = difflib.get_close_matches(backend, known, n=1)
            raise ValueError(
                f"compile_layers={options!r}: backend={backend!r} is not a torch.compile backend; "
                + (f"did you mean {close[0]!r}? " if close else "")
                + "'inductor' is the default (torch._dynamo.list_backends() lists the others)."
            )


_START_METHODS = ("popen", "spawn", "fork", "forkserver")


def check_kinds(
    flags: dict[str, Any], start_method: Any, precision_plugin: Any, cluster_environment: Any, timeout: Any,
    process_group_backend: Any = None, parallel_devices: Any = None,
) -> None:  # fmt: skip
    """Options of the wrong kind, refused now, before any check that reads them: a string for a flag is truthy and
    would switch it on (``"no"``; read as True, ``async_checkpoint="false"`` was told to need the sharded format),
    and the arguments passed through to Lightning's DDP machinery fail deep inside it, in every rank, or are dropped
    (a precision given as a string left the run in float32), without naming the option."""
    check_flags("PACIStrategy", **flags)
    if start_method not in _START_METHODS:
        raise ValueError(f"start_method={start_method!r} must be one of {', '.join(map(repr, _START_METHODS))}")
    kinds = [("precision_plugin", precision_plugin, Precision, "Trainer(precision='bf16-mixed')"),
             ("cluster_environment", cluster_environment, ClusterEnvironment,
              "an instance such as lightning.fabric.plugins.environments.SLURMEnvironment()"),
             ("timeout", timeout, timedelta, "datetime.timedelta(minutes=30)")]  # fmt: skip
    for name, value, kind, example in kinds:
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"{name}={value!r} must be a {kind.__name__} or None; pass {example}")
    if timeout is not None and timeout <= timedelta(0):
        raise ValueError(f"timeout={timeout!r} must be positive: how long a collective waits for a slow rank")
    if process_group_backend is not None and not _known_backend(process_group_backend):
        known = ", ".join(repr(b) for b in dist.Backend.backend_list if b not in ("undefined", "fake"))
        raise ValueError(
            f"process_group_backend={process_group_backend!r} is not a torch.distributed backend: one of {known} "
            "(or per device, as 'cpu:gloo,cuda:nccl'), or None for the accelerator's (gloo on CPU, nccl on CUDA)"
        )
    if parallel_devices is not None and not (
        isinstance(parallel_devices, (list, tuple)) and all(isinstance(d, torch.device) for d in parallel_devices)
    ):
        raise ValueError(
            f"parallel_devices={parallel_devices!r} must be a list of torch.device or None; leave it None and set "
            "Trainer(accelerator=..., devices=...)"
        )


def _known_backend(name: Any) -> bool:
    """``gloo``, ``nccl``, ... or a per-device form ``cpu:gloo,cuda:nccl``."""
    if not isinstance(name, str) or not name:
        return False
    return all(part.rpartition(":")[2].lower() in dist.Backend.backend_list for part in name.split(","))


def check_sync_start(sync_start_steps: Any) -> None:
    """``sync_start_steps`` is ``"auto"`` or a count of optimizer steps >= 0."""
    if sync_start_steps == "auto":
        return
    if not is_count(sync_start_steps, 0):
        raise ValueError(
            f"sync_start_steps={sync_start_steps!r} must be 'auto' or an int >= 0 (optimizer steps run in 1F1B-flush "
            "order before PACI; 0: PACI from the first step)"
        )


def refuse_unsteppable(optimizer: Any) -> None:
    """Refuse, before training, an optimizer whose ``step`` needs a closure (LBFGS re-evaluates the loss in its line
    search; a stage holds its accumulated gradients, not the loss): it crashed at the first optimizer step, where one
    device trains (the optimizers audit)."""
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{type(optimizer).__name__}.step needs a closure that computes the loss again (a line search or several "
            "evaluations per step); a pipeline stage steps once on the gradients it accumulated, and has no loss to "
            "call. Use a first-order optimizer (SGD, Adam, AdamW, ...) in configure_optimizers."
        )


def _refuse_sparse_gradients(layers: list) -> None:
    """An ``nn.Embedding(sparse=True)`` gives sparse gradients, which crashed the first optimizer step's finite check
    (one device trains; the optimizers audit): a window's accumulation, that check and the replicas' reduction are
    dense."""
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
                raise ValueError(
                    f"{type(m).__name__}(sparse=True) gives sparse gradients, which PACIStrategy does not handle (a "
                    "window's accumulation, the finite check and the replicas' reduction are dense). Build it with "
                    "sparse=False (the default); a dense optimizer (SGD, Adam, AdamW) then steps it as on one device."
                )


def warn_paci_only(schedule: str, staleness_correction: Any, sync_start_steps: Any) -> None:
    """A PACI-only setting that asks for something, given with ``schedule="1f1b_flush"``: taken (a config that switches
    the schedule alone must keep working), said once. Under flush nothing is stale: the correction and the synchronous
    start do nothing, and the user who set them for a comparison would not know."""
    if schedule != "1f1b_flush":
        return
    asked = {}
    if staleness_correction not in ("auto", None, "none"):
        asked["staleness_correction"] = staleness_correction
    if sync_start_steps not in ("auto", 0):
        asked["sync_start_steps"] = sync_start_steps
    if asked:
        listed = ", ".join(f"{k}={v!r}" for k, v in asked.items())
        rank_zero_warn(
            f"{listed} with schedule='1f1b_flush': PACI options, which do nothing here (flush trains on current "
            "weights: nothing is stale, every window already runs synchronously). Use schedule='paci' for them, or "
            "leave them out."
        )


def check_replica_groups(
    fault_tolerance: str | None,
    local_sgd_steps: int | None,
    min_replica_groups: Any,
    streaming_sync: bool,
    replica_group_id: Any = None,
    replica_groups: Any = None,
) -> None:
    """Refuse a ``fault_tolerance`` or ``streaming_sync`` setting that cannot work (what needs the launch is checked
    before it), and torchft's group options (``replica_group_id``, ``replica_groups``, ``min_replica_groups`` other
    than its default 1) without it: they would be ignored. A sharded optimizer state is refused by its own check: it
    needs per-step gradient averaging, and this needs ``local_sgd_steps``."""
    if replica_group_id is not None and not is_count(replica_group_id, 0):
        raise ValueError(
            f"PACIStrategy(replica_group_id={replica_group_id!r}) must be an integer >= 0: this replica group's "
            "index, 0..replica_groups-1 (or None to read it from the launch environment)"
        )
    if replica_groups is not None and not is_count(replica_groups):
        raise ValueError(
            f"PACIStrategy(replica_groups={replica_groups!r}) must be an integer >= 1: the number of replica groups "
            "launched (or None to read it from the launch environment)"
        )
    given = {"replica_group_id": replica_group_id, "replica_groups": replica_groups}
    if not (type(min_replica_groups) is int and min_replica_groups == 1):  # True is not the default 1
        given["min_replica_groups"] = min_replica_groups
    given = {k: v for k, v in given.items() if v is not None}
    if fault_tolerance is None and given:
        listed = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(
            f"{listed}: options of fault_tolerance='torchft' (replica groups launched apart, healing from each other), "
            "which is off. Set fault_tolerance='torchft' too, or leave them out: data-parallel replicas of one "
            "launch come from the world size (devices x num_nodes = pipeline_stages x replicas)."
        )
    if streaming_sync and local_sgd_steps is None:
        raise ValueError(
            "streaming_sync=True staggers the stages' LocalSGD/DiLoCo syncs: set local_sgd_steps=H too, or leave "
            "streaming_sync False (replicas then reduce gradients every step)."
        )
    if fault_tolerance not in (None, "torchft"):
        raise ValueError(f"fault_tolerance={fault_tolerance!r} must be None or 'torchft'.")
    if fault_tolerance is None:
        return
    if not is_count(min_replica_groups):
        raise ValueError(f"min_replica_groups={min_replica_groups!r} must be an integer >= 1.")
    if replica_groups is not None:  # else the launch's environment gives the count, checked there
        check_group_range(replica_group_id, replica_groups, min_replica_groups)
    if local_sgd_steps is None:
        raise ValueError(
            "fault_tolerance='torchft' takes its quorum at the LocalSGD/DiLoCo outer sync: set local_sgd_steps=H "
            "(and outer_optimizer='nesterov' for DiLoCo). Per-step gradient averaging across replica groups is "
            "not supported: it would drain the pipeline at every step."
        )


def check_accumulate(value: Any, spelled: str = "Trainer(accumulate_grad_batches={!r}):") -> None:
    """Refuse an N that is not an integer >= 1 (True and None included, which Lightning would take as 1 or
    refuse elsewhere); ``spelled`` names where it was set (the plan names the config key)."""
    if not is_count(value):
        raise ValueError(
            f"{spelled.format(value)} micro-batches per optimizer step must be an integer >= 1. Set it to N, or "
            "leave it at 1 and use GradientAccumulation(steps=N)."
        )


# Lightning callbacks that need the whole pipeline in one process: (why not on processes, what to do there).
_WHOLE_PIPELINE_ONLY: dict[type, tuple[str, str]] = {
    WeightAveraging: (
        "it averages a copy of the whole module, and a rank holds only its stage's layers",
        "drop the callback",
    ),
    ModelPruning: (
        "it prunes the whole module, and a rank holds only its stage's layers (the others are placeholders: it "
        "failed at the first epoch's end)",
        "prune with torch.nn.utils.prune in your module's on_train_epoch_end, on the layers it holds",
    ),
    SpikeDetection: (
        "it reads outputs['loss'] at every batch end, which only the last stage's ranks have",
        "watch train_loss (logged per step by the last stage) with a callback of your own",
    ),
}


def check_before_launch(strategy: Any, trainer: Trainer, layers: list | None) -> None:
    """Refuse a layout or accumulation setting of ``strategy`` (a `PACIStrategy`) that cannot work, before any
    process starts (the launchers above call it in the launching process; one process calls it in setup);
    ``layers``: `layers_before_launch`'s."""
    world = strategy.num_nodes * strategy.num_processes
    if strategy._checkpoint_io is not None and type(strategy._checkpoint_io) is not TorchCheckpointIO:
        raise ValueError(
            f"Trainer(plugins=[{type(strategy._checkpoint_io).__name__}(...)]) would be ignored: PACIStrategy writes "
            "and reads its checkpoints itself (each stage's share, gathered into one file or written as a "
            "sharded folder) and never calls a CheckpointIO. Remove the plugin; for saves that do not stall "
            "training use PACIStrategy(checkpoint_format='sharded', async_checkpoint=True)."
        )
    module = trainer.lightning_module
    compiled = module._compiler_ctx is not None or getattr(module, "_compiled_call_impl", None) is not None
    if isinstance(strategy._launcher, _MultiProcessingLauncher) and compiled:
        form = "trainer.fit(torch.compile(model))" if module._compiler_ctx is not None else "model.compile()"
        raise ValueError(
            f"{form} cannot start ranks with PACIStrategy(start_method="
            f"{strategy._start_method!r}): they get a pickled copy of the module, and a compiled module's forward "
            "does not pickle (or, compiled in place, arrives eager). Pass the module uncompiled with "
            "PACIStrategy(compile_layers={...}) holding the same torch.compile options (each stage compiles its own "
            "layers), or launch with start_method='popen' / torchrun / SLURM, where every rank runs your script and "
            "compiles itself."
        )
    if world > 1 and world % strategy.pipeline_stages:
        raise ValueError(
            f"PACIStrategy(pipeline_stages={strategy.pipeline_stages}) does not divide the world size {world} "
            f"(devices={strategy.num_processes} x num_nodes={strategy.num_nodes}): world size = pipeline_stages x "
            "data-parallel replicas. Use a number of devices that is a multiple of pipeline_stages, or "
            "pipeline_stages that divides it."
        )
    check_accumulate(trainer.accumulate_grad_batches)
    for callback in trainer.callbacks:
        if isinstance(callback, GradientAccumulationScheduler):  # its own error blames manual optimization
            raise ValueError(
                f"Lightning's GradientAccumulationScheduler(scheduling={callback.scheduling}) does not work under "
                "PACIStrategy, which runs the module under manual optimization (the stages step themselves). "
                f"Use lit_efficient.GradientAccumulation(steps={callback.scheduling}): the same {{epoch: N}} "
                "schedule, which the pipeline reads."
            )
        if isinstance(callback, BaseFinetuning):
            raise ValueError(
                f"{type(callback).__name__} is not supported under PACIStrategy: it unfreezes modules by adding their "
                "parameters to trainer.optimizers[0], which is one stage's optimizer (each rank's own on processes, "
                "the last stage's in one process), so other stages' weights were stepped at other rates than one "
                "device's, or by the wrong stage. Give configure_optimizers every parameter from the start (torch's "
                "optimizers step only parameters that received a gradient), freeze with requires_grad_(False), and "
                "unfreeze with requires_grad_(True) in your own callback's on_train_epoch_start: each stage then "
                "steps its own layers once they have gradients, as one device does."
            )
        if isinstance(callback, StochasticWeightAveraging):
            raise ValueError(
                "StochasticWeightAveraging is not supported under PACIStrategy: it replaces the LR schedule by one "
                "the stages' own optimizers never see and averages a copy of the whole module, which on a rank holds "
                "only its stage (in one process it trained other weights than one device, silently). Use "
                "lightning.pytorch.callbacks.EMAWeightAveraging in one process (devices=1), or drop the callback."
            )
        replicated = world > strategy.pipeline_stages
        if isinstance(callback, LearningRateFinder) and strategy.shard_optimizer_state and replicated:
            raise ValueError(
                "LearningRateFinder / Tuner.lr_find does not work with PACIStrategy(shard_optimizer_state=True) on "
                "replicas: Lightning's finder builds its scheduler on the optimizer it is shown, which must be a "
                "torch Optimizer, and there that is the sharded state (ShardedOptimizer). The rates, losses and "
                "suggestion do not depend on sharding: find the rate with shard_optimizer_state=False, then train "
                "with it on."
            )
        whole = next((why for kind, why in _WHOLE_PIPELINE_ONLY.items() if isinstance(callback, kind)), None)
        if whole is not None and world > 1 and strategy.pipeline_stages > 1:
            raise ValueError(
                f"{type(callback).__name__} is not supported on processes under PACIStrategy: {whole[0]}. It works as "
                f"on one device with the whole pipeline in one process (devices=1); on processes, {whole[1]}."
            )
        if isinstance(callback, SpikeDetection) and callback.atol is not None and trainer.accumulate_grad_batches > 1:
            rank_zero_warn(
                f"PACIStrategy: SpikeDetection(atol={callback.atol}) compares outputs['loss'], which under the "
                f"pipeline is the micro-batch's loss itself: one device's is divided by accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}. Scale atol by it, or use rtol alone (a ratio reads alike)."
            )
        check = getattr(callback, "check_accumulation_source", None)
        if callable(check):
            check(trainer)
        # ActivationCheckpointing's plan on the whole model, PipelineMonitor's one monitor
        check = getattr(callback, "check_before_launch", None)
        if callable(check):
            check(
                trainer,
                layers_may_come_later=setup_may_build_layers(module) or is_overridden("configure_model", module),
            )
        if isinstance(callback, ModelCheckpoint):  # its folder, as Lightning resolves it at setup
            logged = trainer.loggers[0].save_dir if trainer.loggers else None
            folder = callback.dirpath or logged or trainer.default_root_dir
            check_local_path(folder, "ModelCheckpoint(dirpath)" if callback.dirpath else "ModelCheckpoint's folder")
        if strategy.async_checkpoint and isinstance(callback, ModelCheckpoint) and callback.save_last == "link":
            raise ValueError(
                "ModelCheckpoint(save_last='link') with PACIStrategy(async_checkpoint=True): the link would point at "
                "a checkpoint still being written in the background, and after a crash then ckpt_path='last' finds "
                "no checkpoint and trains from scratch. Use save_last=True (a copy, written after the save in "
                "flight), or async_checkpoint=False."
            )
    for logger in trainer.loggers:
        if strategy.checkpoint_format == "sharded" and getattr(logger, "_log_model", False):
            name = type(logger).__name__
            rank_zero_warn(
                f"PACIStrategy: {name}(log_model={logger._log_model!r}) uploads the checkpoints ModelCheckpoint writes "
                "as files (Lightning's scan keeps files only); checkpoint_format='sharded' writes each as a folder, "
                f"so {name} uploads no model, and says nothing. Use checkpoint_format='file', or log the folders "
                "yourself (wandb: an Artifact's add_dir)."
            )
    _check_module(trainer.lightning_module, strategy.precision_plugin)
    if layers is not None:
        check_layers(strategy.pipeline_stages, strategy.balance, layers)
        if not setup_may_build_layers(module):
            check_split(module, layers, strategy.pipeline_stages, strategy.balance)
