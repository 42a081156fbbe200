"""PACIStrategy: the Lightning lifecycle around the pipeline runtime.

Lightning keeps driving the loop: it loads data, calls ``training_step`` once per dataloader batch
(one micro-batch), counts optimizer steps, validates, checkpoints and logs. This strategy turns
each of those calls into the pipeline's: a training batch is fed to this rank's stage, stages step
their own optimizers when their schedule says so, evaluation streams batches forward through the
stages, and every point that needs a consistent model (validation, checkpoints, the end of an
epoch or of training) drains the pipeline first.

The module runs under manual optimization while the strategy owns it, because the stages, not
Lightning, decide when to zero, accumulate and step; the window count Lightning sees
(``trainer.global_step``) is advanced once per N micro-batches on every rank alike, so all ranks
stop, validate and save at the same batch.
"""

from __future__ import annotations

import atexit
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import _collect_rng_states
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.loops.utilities import _is_max_limit_reached
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from typing_extensions import override

from lit_efficient import rank_reaper
from lit_efficient.checkpoint.async_write import AsyncCheckpointer
from lit_efficient.replicas.averaging import OuterOptimizer, ReplicaAverager, stream_offset, sync_due
from lit_efficient.replicas.fault_tolerance import TorchftReplicas, group_settings, lighthouse_address, require_torchft
from lit_efficient.replicas.sharded_optimizer import ShardedOptimizer
from lit_efficient.runtime.clock import Mark, clock_for
from lit_efficient.runtime.host import StageHost
from lit_efficient.runtime.partition import planned_sizes, predicted_utilization
from lit_efficient.runtime.profile import profile_layers
from lit_efficient.runtime.schedules import SCHEDULES, ScheduleName
from lit_efficient.runtime.split import (
    LayerOnOtherStage,
    Split,
    check_stage_parameters,
    every_layer,
    find_ties,
    layer_parameter_counts,
    only_stage,
    separate_tied_copies,
    shared_buffers,
    split_module,
    tie_again,
)
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.staleness import (
    CompiledFirstStepWeightPrediction,
    CorrectionName,
    StalenessCorrection,
    adam_like,
    auto_sync_start_steps,
    make_correction,
    prediction_refusal,
)
from lit_efficient.runtime.tied import TiedWeight, finish_tied, step_settings, tie_delay, tie_stage, untag
from lit_efficient.runtime.topology import Topology
from lit_efficient.strategy import evaluation, stage_checkpoints
from lit_efficient.strategy.config import (
    WIRE_DTYPES,
    RefusedSetting,
    _CheckedMultiProcessingLauncher,
    _CheckedScriptLauncher,
    _refuse_unknown,
    _sharding_applies,
    _warn_single_replica,
    check_before_launch,
    check_kinds,
    check_layers,
    check_options,
    check_replica_groups,
    check_streaming_ties,
    check_sync_start,
    layers_before_launch,
    refuse_unsteppable,
    refusing_settings,
    warn_paci_only,
)
from lit_efficient.strategy.divergence import LossTrend
from lit_efficient.strategy.fault_tolerant import start_replicas
from lit_efficient.strategy.forward_check import forward_outside_layers
from lit_efficient.strategy.hosting import EditsReachEveryStage, HostedStage, gather_model_on_rank_zero
from lit_efficient.strategy.lr_finder import (
    FinderRun,
    apply_suggestion,
    end_finder_run,
    one_progress_bar,
    share_finder_loss,
    start_finder_run,
)
from lit_efficient.strategy.module_hooks import (
    drain_before,
    epoch_ends_where_the_steps_ran,
    undo_module_hooks,
    warn_uncalled_hooks,
    watch_own_train_loss,
)
from lit_efficient.strategy.progress import swap_stock_progress_bar
from lit_efficient.strategy.runs import attempt_store
from lit_efficient.strategy.stage_checkpoints import FinalState
from lit_efficient.strategy.step_hooks import (
    Averaging,
    clips_global_norm,
    install_step_hooks,
    post_norm_before_tied_exchange,
    replace_sigterm_barrier,
    restore_sigterm_barrier,
    scheduler_stepper,
    step_schedulers,
    warn_step_frequency,
    warn_unsynced_end,
)
from lit_efficient.strategy.step_logging import log_once_per_optimizer_step
from lit_efficient.strategy.summary import summarize_the_unsplit_model
from lit_efficient.strategy.trainer_glue import (
    SyncCallbackMetrics,
    agree_on_evaluation_results,
    agree_on_the_checkpoint,
    batch_size_of,
    carry_step_count_to_automatic,
    check_stages_read_alike,
    checkpoints_see_the_users_optimization,
    draw_on_from_the_last_stage,
    first_training_batch,
    give_callbacks_back,
    give_metrics_back,
    keep_launch_random_streams,
    keep_users_sampler,
    normalize_mode,
    point_metrics_at,
    seed_workers_by_replica,
    share_rank_zero_metrics,
    smallest_window,
    streams_untouched,
    throughput_counts_replicas,
    validates_after_this_batch,
    without_sync_advice,
    writers_where_the_predictions_are,
)
from lit_efficient.tools.window import advise_window
from lit_efficient.transport.collectives import broadcast_flat
from lit_efficient.transport.failures import (
    LostPeersError,
    begin_run,
    check_peers_alive,
    clear_published_failure,
    is_raw_comm_error,
    release_peers_keeping_the_store,
    report_failure,
    report_lost_peers,
    report_stop,
)
from lit_efficient.transport.hosting import host_stages
from lit_efficient.transport.local import LocalLinks
from lit_efficient.transport.process import LinkGroups, ProcessLinks, tie_groups
from lit_efficient.transport.wire import WireFormat


class _NoLossHere(dict):
    """``on_train_batch_end``'s ``outputs`` on a rank without the last stage: empty, as documented, and a read of a
    key says why instead of a bare ``KeyError: 'loss'`` (Lightning copies it with ``copy()``: itself)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def copy(self) -> _NoLossHere:
        return self

    def __missing__(self, key: Any) -> Any:
        raise KeyError(
            f"outputs[{key!r}] on {self.where}, which hosts no last stage: the loss is computed on the last stage "
            "(global rank 0), so on_train_batch_end's outputs are empty here. Read them under "
            "`if trainer.strategy.is_last_stage:`."
        )


Balance = Literal["parameters", "uniform", "profile"]


_BIG = 1 << 62  # above every `step_settings` digest (7 bytes)
GROUP_RELEASE_S = 5.0  # how long a failed run waits for its groups to be released before it raises


def _in_place_compile(module: Any) -> Any:
    """How ``module.compile(...)`` (torch's in-place form, which compiles the module's own call) compiles: the stages
    never make that call, so the options go to their layers instead, or None for a module not compiled so. The
    options are the compile context the call holds; where torch keeps it elsewhere, torch.compile's defaults."""
    compiled = getattr(module, "_compiled_call_impl", None)
    if compiled is None:
        return None
    from torch._dynamo.eval_frame import OptimizeContext

    cells = [cell.cell_contents for cell in getattr(compiled, "__closure__", None) or ()]
    found = next((c for c in cells if isinstance(c, OptimizeContext)), None)
    rank_zero_info(
        f"PACIStrategy: {type(module).__name__} was compiled in place (module.compile()), which compiles its own call; "
        "the stages call its layers, so each stage compiles its layers "
        + ("with that call's options." if found is not None else "with torch.compile's default options.")
    )
    return found if found is not None else torch.compile


# The class's names registered as strategy names, lowercased as Lightning looks strings up (`register_strategies`).
CLASS_NAMES = ("pacistrategy", "lit_efficient.pacistrategy")


class PACIStrategy(DDPStrategy):
    """Pipeline-parallel training: split the model into stages over processes and run PACI or 1F1B-flush.

    ``world_size = pipeline_stages x data-parallel replicas``; with one device (``devices=1``) the whole
    pipeline runs in this process instead, bit-identical to ``pipeline_stages`` processes: a process hosts
    k stages (k = 1 on processes, k = S on one device) through the same setup, hooks and checkpoints, over
    process links or in-process links (`lit_efficient.runtime.host`). Each replica's stages sit on
    contiguous ranks, its last stage on the lowest one, so global rank 0 holds the loss, logs and
    shows the progress bar. A dataloader batch is one micro-batch; N micro-batches (from
    ``GradientAccumulation(steps=N)`` or ``Trainer(accumulate_grad_batches=N)``) make one optimizer
    step, and ``trainer.global_step`` counts those steps.

    Args:
        pipeline_stages: Number of stages S each pipeline is split into; must divide the world size. With
            one device in all, the S stages run in this process, bit-identical to S processes (at the same
            intra-op thread count).
        schedule: ``"paci"``: asynchronous, bubble-free 1F1B in which each stage steps after its own
            N-th backward (weight-version drift at most ceil((S-1-s)/N); the stale forwards cost more at
            high learning rates, so warm up at least as long as for flush); ``"1f1b_flush"``: the
            synchronous baseline, exactly large-batch SGD, idle (S-1)/(N+S-1) of the time.
        recompute: Keep only each micro-batch's stage input and RNG state and recompute the forward
            at backward (less activation memory, about one extra forward); default keeps the graph.
        balance: How layers are split: ``"parameters"`` balances parameter counts, ``"uniform"``
            balances layer counts, ``"profile"`` times every layer on the device with a real
            micro-batch and minimizes the slowest stage; or an explicit list of layers per stage.
        p2p_timeout: Seconds a stage waits for a neighbour before failing with an error naming it (also the
            watchdog timeout of the NCCL groups that carry the stages' tensors).
        wire_dtype: The dtype float32 tensors (activations, gradients) cross a stage boundary in:
            ``"float32"`` (exact) or ``"bfloat16"``: half the bytes between stages, each boundary tensor
            rounded to bf16 and cast back on arrival (what it costs: BENCHMARKS.md, "bf16 on the wire").
            Other dtypes travel as they are; tensors under 64 KiB share one transfer either way.
        on_nonfinite: A NaN/Inf loss: ``"raise"`` an error naming the stage, optimizer step and micro-batch, or
            ``"skip"`` that window's update on every stage and replica alike (the fit's end warns how many); a
            NaN/Inf gradient behind a finite loss raises under either value, the weights left as before the window.
        checkpoint_format: ``"file"``: one ordinary Lightning ``.ckpt`` that loads anywhere
            (``Module.load_from_checkpoint``, any strategy's ``ckpt_path``); global rank 0 gathers every stage's
            share and writes it, so it holds the whole model and optimizer state in host memory while saving.
            ``"sharded"``: a folder laid out as Lightning's FSDP sharded checkpoints (``torch.distributed.checkpoint``),
            every rank writing and reading only its own share, in parallel; ``python -m
            lightning.pytorch.utilities.consolidate_checkpoint PATH`` makes the one file of it. Switch to
            ``"sharded"`` when the model and optimizer state (about 16 bytes per parameter with AdamW) approach
            rank 0's host memory or saving stalls training for long. Both resume on any layout, both are atomic.
        async_checkpoint: With ``checkpoint_format="sharded"``: each rank copies its share into host memory and
            a background thread writes it while training continues; the folder is renamed into place once every
            rank's write is complete (``ckpt_path="last"`` finds the previous checkpoint until then). The next
            save and the end of fit wait for it. What a save still stalls: the drain and the copy; what it
            costs: one more copy of the rank's share in host memory while it is written.
        local_sgd_steps: None: replicas all-reduce gradients every step (DDP semantics). H: replicas
            train independently and average parameters every H optimizer steps (LocalSGD/DiLoCo).
        local_sgd_warmup_steps: Optimizer steps before LocalSGD/DiLoCo starts, each ending with the replicas'
            weights averaged (under DiLoCo too, whose anchor starts from the warm-up's last average). With SGD
            that is synchronous data parallelism; an adaptive optimizer (AdamW) keeps each replica's own moments.
        outer_optimizer: ``"average"``: plain parameter averaging; ``"nesterov"``: DiLoCo's outer
            SGD with Nesterov momentum on the averaged pseudo-gradient.
        outer_lr: DiLoCo outer learning rate (needs ``outer_optimizer="nesterov"``).
        outer_momentum: DiLoCo outer Nesterov momentum (needs ``outer_optimizer="nesterov"``).
        average_buffers: Also average floating-point buffers (e.g. BatchNorm statistics) at each sync.
        streaming_sync: Streaming DiLoCo (arXiv 2501.18512) with each stage a fragment: stage s syncs ``s * H // S``
            steps after the others' turn, so one stage's share is on the network at a time instead of the whole
            model every H steps (with ``fault_tolerance``, each turn is a quorum at a drained point). Measured in
            BENCHMARKS.md, "Fault tolerance".
        shard_optimizer_state: ZeRO-1: split each stage's optimizer state by element over the stage's R
            data-parallel replicas, so each holds 1/R of it (AdamW: 8 bytes per weight become 8/R). Gradients are
            reduce-scattered instead of all-reduced and the updated weights all-gathered: the same bytes on the
            wire. Checkpoints hold the whole state by parameter name as without it (consolidated on replica 0
            while saving), so they resume on any layout, sharded or not. Needs an element-wise optimizer
            (SGD, Adam, AdamW, ...); refused with ``local_sgd_steps`` (each replica steps on its own) and
            a ``staleness_correction`` that reads every weight's moments (the ``"weight_prediction*"`` names and
            ``"delay_compensation"``; ``"auto"`` turns itself off instead), and with tied weights; with one replica
            (and in one process) nothing is split. See
            `lit_efficient.replicas.sharded_optimizer`.
        staleness_correction: PACI only (under flush nothing is stale and every value is the identity). Default
            ``"auto"``: with torch's AdamW or Adam (or a subclass that keeps its step), each stale forward (a stage's
            micro-batch whose backward comes after the stage's next step) runs on weights extrapolated by the
            optimizer's own pending update, AdamW's first step included, the window's gradient so far folded into its
            moments (into the second moment only for the share of the window accumulated, the rest expected at its
            running mean: a young window's few micro-batches squared would shrink every predicted step), and the
            backward and the step on the real weights; the prediction is undone by its inverse (up to rounding), so no
            copy of the weights is kept (``"weight_prediction_first_step_inplace"``; on CUDA weights its compiled form,
            one pass over memory per apply or undo instead of ~9, ``"weight_prediction_first_step_compiled"``, compiled
            at each stage's first stale forward, eager with a warning if compiling fails); off with any other optimizer,
            with Adam/AdamW's ``amsgrad`` or ``maximize`` (an update it does not model; the synchronous start still runs
            there), a subclass that overrides ``step()`` (name the prediction if it keeps torch's update), another
            library's AdamW, or a sharded optimizer state; setup says which and why. Measured (BENCHMARKS.md, "PACI at
            depth"): plain PACI ends 13-21% above flush's loss at S=8 N=8 lr 2e-3, the default with ``sync_start_steps``
            below within 0.3% (3 seeds). None (or ``"none"``): plain PACI, the rule of docs/DESIGN.md section 3.
            ``"lr_scale"`` scales each stale stage's learning rate by ``(1 + d_s) ** -(1 - min(1, k /
            staleness_anneal_steps))`` with d_s = ceil((S-1-s)/N) and k its step (PipeMare). ``"weight_prediction"``
            predicts from the second step on (one weight-sized buffer per stage), ``"weight_prediction_first_step"`` is
            the default's rule with that buffer; the other names are the candidates measured in BENCHMARKS.md. See
            `lit_efficient.runtime.staleness`.
        staleness_anneal_steps: Optimizer steps over which ``"lr_scale"`` returns to the plain learning rate.
        sync_start_steps: PACI only: the first K optimizer steps of a fit run in 1F1B-flush order (each window
            drained before the next: nothing stale, the flush bubble), then PACI. ``"auto"`` (default):
            40 with Adam or AdamW whatever their betas (measured enough at beta2 0.9, 0.95 and torch's default
            0.999; 20 were not), 0 with other optimizers.
            Early on Adam moves every weight by about lr a step and a run's outcome is set there: on the benchmark
            grid (BENCHMARKS.md, "PACI at depth") 40 synchronous steps took S=4 N=4 lr 2e-3 from +5.7% to +0.2% of
            flush's loss and S=8 N=4 from +16% to +2.2% (one seed each, the prediction as it is now); 20 were not
            enough; the start without the prediction
            left 1.5-5%. Costs the flush bubble on K steps (the setup log says what share of ``max_steps`` that
            is, and warns when it is a quarter or more). 0: PACI from the first step.
        fault_tolerance: None: a dead rank ends the job (torchrun restarts all of it from the last checkpoint).
            ``"torchft"``: replica groups on torchft (``pip install 'lit-efficient[fault-tolerance]'``): each
            group is one whole pipeline under its own launcher; a group whose rank dies restarts alone and
            heals from a live group's same ranks at their next outer sync, while the others go on. Needs
            ``local_sgd_steps`` (the quorum is taken at the LocalSGD/DiLoCo sync, at a drained point), the
            lighthouse's address in ``TORCHFT_LIGHTHOUSE``, and processes. See docs/fault-tolerance.md.
        replica_group_id: This replica group's index (0, 1, ...); None reads ``REPLICA_GROUP_ID``.
        replica_groups: Replica groups launched (each reads its own shard of the data); None reads
            ``NUM_REPLICA_GROUPS``, and one of the two is required.
        min_replica_groups: Live groups a sync needs to commit; fewer, and the groups keep training locally
            until enough are back.
        compile_layers: ``torch.compile`` each stage's layers: True with torch's defaults, or a dict of
            ``torch.compile``'s keyword arguments (``{"backend": "inductor", "mode": "max-autotune"}``, ...).
            ``trainer.fit(torch.compile(model))`` does the same with that call's options (the pipeline runs
            the layers, not the module's forward, so the module's own steps then run eager around them).
            Measured in BENCHMARKS.md, "torch.compile".
        start_method: How processes are launched: ``"popen"`` re-runs the script per rank (also under
            torchrun/SLURM), ``"spawn"`` starts them from this process (notebooks, tests),
            ``"forkserver"`` forks them from a server that imports what
            ``multiprocessing.set_forkserver_preload`` names once (fast repeated fits; each rank still
            gets this process's environment and its own copy of the module, as under ``"spawn"``),
            ``"fork"`` forks them from this process (Lightning's fork launcher: POSIX only, and not after CUDA
            was initialized in this process).
        accelerator: Passed to Lightning: the accelerator, usually set through ``Trainer(accelerator=...)``.
        parallel_devices: Passed to Lightning: this node's devices, one per rank, usually set through
            ``Trainer(devices=...)``.
        cluster_environment: Passed to Lightning: how ranks find each other (torchrun, SLURM, ...); detected
            when None.
        precision_plugin: Passed to Lightning: the precision plugin, usually set through ``Trainer(precision=...)``
            (``"32-true"`` or ``"bf16-mixed"``).
        process_group_backend: Passed to Lightning: the default process group's backend (``"nccl"``, ``"gloo"``,
            ...); None picks the device's default. Ignored with one device, where there is no process group.
        timeout: Passed to Lightning: the default process group's timeout (start-up), and every collective's
            (the replicas' gradient average, the clipping norm, metrics, checkpoint gathers); a stage waiting
            for its neighbour is bounded by ``p2p_timeout`` instead.
        **kwargs: Refused with a ValueError naming the closest option: anything else, Lightning's
            ``DistributedDataParallel`` options (``find_unused_parameters``, ...; the wrapper is never built,
            each stage reduces its gradients over its replica group itself) and ``checkpoint_io`` (unused).
    """

    strategy_name = "paci"

    def __init__(
        self,
        pipeline_stages: int = 2,
        schedule: ScheduleName = "paci",
        recompute: bool = False,
        balance: Balance | list[int] = "parameters",
        p2p_timeout: float = 600.0,
        wire_dtype: Literal["float32", "bfloat16"] = "float32",
        on_nonfinite: Literal["raise", "skip"] = "raise",
        checkpoint_format: Literal["file", "sharded"] = "file",
        async_checkpoint: bool = False,
        local_sgd_steps: int | None = None,
        local_sgd_warmup_steps: int = 0,
        outer_optimizer: OuterOptimizer = "average",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        average_buffers: bool = True,
        streaming_sync: bool = False,
        shard_optimizer_state: bool = False,
        staleness_correction: CorrectionName | None = "auto",
        staleness_anneal_steps: int = 100,
        sync_start_steps: int | Literal["auto"] = "auto",
        fault_tolerance: Literal["torchft"] | None = None,
        replica_group_id: int | None = None,
        replica_groups: int | None = None,
        min_replica_groups: int = 1,
        compile_layers: bool | dict[str, Any] = False,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        # First, before any value check: a misspelt or ignored keyword must not pass for an option in force.
        _refuse_unknown(kwargs, PACIStrategy.__init__)
        flags = dict(recompute=recompute, average_buffers=average_buffers, streaming_sync=streaming_sync,
                     async_checkpoint=async_checkpoint)  # fmt: skip
        check_kinds(
            flags, start_method, precision_plugin, cluster_environment, timeout, process_group_backend, parallel_devices
        )
        check_options(
            pipeline_stages, schedule, balance, p2p_timeout, on_nonfinite, local_sgd_steps, local_sgd_warmup_steps,
            outer_optimizer, outer_lr, outer_momentum, shard_optimizer_state, staleness_correction,
            staleness_anneal_steps, compile_layers, wire_dtype, checkpoint_format, async_checkpoint,
        )  # fmt: skip
        check_replica_groups(
            fault_tolerance, local_sgd_steps, min_replica_groups, streaming_sync, replica_group_id, replica_groups
        )
        check_sync_start(sync_start_steps)
        warn_paci_only(schedule, staleness_correction, sync_start_steps)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            precision_plugin=precision_plugin, process_group_backend=process_group_backend, timeout=timeout,
            start_method=start_method,
        )  # fmt: skip
        self.staleness_correction = staleness_correction
        self.staleness_anneal_steps = staleness_anneal_steps
        self.sync_start_steps = sync_start_steps
        self.sync_start = 0  # this fit's synchronous start (resolved at setup): steps run in flush order before PACI
        self._in_sync_start = False  # the runtimes run flush's order now
        self.pipeline_stages = pipeline_stages
        self.schedule: ScheduleName = schedule
        self.recompute = recompute
        self.balance = balance
        self.p2p_timeout = p2p_timeout
        self.wire_dtype = wire_dtype
        self.compile_layers = compile_layers
        self._compiled_steps: dict[str, Any] = {}  # a torch.compile-d module's steps, set aside while it trains
        self.on_nonfinite = on_nonfinite
        self._loss_trend = LossTrend()
        # Lightning's learning-rate finder (lr_finder.py): what its run changed on the stages while it runs, and
        # whether one has ended and the run after it is still to start (from its restore, with its suggestion).
        self._finder_run: FinderRun | None = None
        self._after_finder = False
        self._fit_trained = False  # whether this fit's own training run started (`teardown`)
        self._module_logs_train_loss = False  # from its pipeline_loss: the strategy then logs no train_loss
        self._first_batch_unchecked = False
        self._eval_loaders_checked: set[int] | None = None  # on processes: an evaluation's loaders checked so far
        self.checkpoint_format = checkpoint_format
        self.async_checkpoint = async_checkpoint
        self.local_sgd_steps = local_sgd_steps
        self.local_sgd_warmup_steps = local_sgd_warmup_steps
        self.outer_optimizer = outer_optimizer
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.average_buffers = average_buffers
        self.streaming_sync = streaming_sync
        self.shard_optimizer_state = shard_optimizer_state
        self.fault_tolerance = fault_tolerance
        self.replica_group_id = replica_group_id
        self.replica_groups = replica_groups
        self.min_replica_groups = min_replica_groups
        self.replicas: TorchftReplicas | None = None  # this rank's torchft membership (fault_tolerance="torchft")
        self.topology: Topology | None = None
        # The stages this process hosts (one on a rank, every stage with devices=1) and their driver.
        self.hosted: list[HostedStage] = []
        self.runtime: StageHost | None = None
        self.averager: ReplicaAverager | None = None  # the last hosted stage's LocalSGD/DiLoCo averager
        self.async_checkpointer: AsyncCheckpointer | None = None  # the save in flight (checkpoint.async_write)
        self.final_state: FinalState | None = None  # the hosted stages at the end of training (stage_checkpoints.py)
        # A LocalSGD/DiLoCo replica's own weights while an evaluation holds the first replica's (`setup`, `teardown`).
        # (Also while a validation inside fit scores the first replica's: `score_the_first_replica`.)
        self._own_weights: tuple[list[Tensor], list[Tensor]] | None = None
        self._edits: EditsReachEveryStage | None = None  # one process, fitting
        # The callback metrics the last share wrote here from another rank (`trainer_glue.share_rank_zero_metrics`).
        self.metrics_taken: dict[str, Any] = {}
        # Each save's (start, end) on the root device's clock while a `PipelineMonitor` asks (it sets a list at the
        # start of training): a save's writes and collectives stall every stage, and are no pipeline bubble.
        self.pause_spans: list[tuple[Mark, Mark]] | None = None
        # An unfinished window's gradients a checkpoint restored, until training starts (stage_checkpoints.py)
        self.restored_window_grads: list[tuple[Any, list[Tensor | None]]] = []
        self.restored_random_stream: dict[str, Tensor] | None = None  # `stage_checkpoints.reinstate_random_stream`
        self._split: Split | None = None
        self._dp_groups: dict[int, dist.ProcessGroup] = {}
        self._pipeline_groups: dict[int, dist.ProcessGroup] = {}
        self._header_group: dist.ProcessGroup | None = None
        self._p2p_groups: LinkGroups | None = None
        self._signal_group: dist.ProcessGroup | None = None
        self._tie_groups: dict[int, LinkGroups] = {}
        self._launch_streams: dict[str, Any] | None = None
        self._sigterm_pending: deque[tuple[dist.Work, Tensor, int]] = deque()
        self._metric_groups: list[tuple] = []  # the user's metrics with their own sync functions (give_metrics_back)
        self._metrics_pointed_in: int | None = None  # the training epoch whose first batch pointed them
        self._sync_advice_back: Callable[[], None] | None = None  # Lightning's own warning cache (without_sync_advice)
        self._was_automatic = True
        self._eval_index = 0
        self._failed = False
        self._writing_alone = False  # inside a prediction writer's hook, which the last stage's ranks alone run
        self._group_kept = False  # whether this run found the default group formed (`setup_distributed`)
        self._forward_unchecked = False  # whether the fit's first batch is still to check forward (`forward_check`)

    @property
    def wire_format(self) -> WireFormat:
        """How tensors cross stage boundaries (`lit_efficient.transport.wire`), on processes and in one."""
        return WireFormat(WIRE_DTYPES[self.wire_dtype])

    @property
    def in_process(self) -> bool:
        """Whether all stages run in this process: one device in all and ``pipeline_stages`` > 1."""
        return self.pipeline_stages > 1 and self.num_nodes * self.num_processes == 1

    # -- process layout ---------------------------------------------------------------------------

    @property
    def hosted_stages(self) -> list[int]:
        """The stages this process hosts: every stage in one process, this rank's on processes."""
        assert self.topology is not None, "the strategy is not set up yet"
        if self.in_process:
            return list(range(self.pipeline_stages))
        return [self.topology.stage_of(self.global_rank)]

    @property
    def stage(self) -> int:
        """This process's (last hosted) pipeline stage: its rank's on processes, the last in one process (which
        holds the loss, as global rank 0 does on processes)."""
        return self.hosted_stages[-1]

    @property
    def here(self) -> str:
        """This rank, for messages: ``"stage 0 (rank 1)"``."""
        return f"stage {self.stage} (rank {self.global_rank})"

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica."""
        assert self.topology is not None, "the strategy is not set up yet"
        return self.topology.replica_of(self.global_rank)

    @property
    def is_last_stage(self) -> bool:
        """Whether this process hosts the pipeline's last stage: the ranks that run the evaluation steps and
        ``pipeline_loss`` (global rank 0 among them; every process in one process). Guard code in
        ``on_train_epoch_end`` that reads what ``pipeline_loss`` collected with it."""
        return self.stage == self.pipeline_stages - 1

    @property
    def cpu_group(self) -> dist.ProcessGroup | None:
        """The gloo group object collectives use without device copies (None on gloo: the default group)."""
        return self._header_group

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of a replica reads the same micro-batch stream; replicas read different ones.
        if self.fault_tolerance is not None:  # each replica group is its own launch: its shard by its index
            return {"num_replicas": self.replica_groups, "rank": self.replica_group_id}
        world = self.pipeline_stages if self.in_process else self.num_nodes * self.num_processes
        topo = Topology.for_world(world, self.pipeline_stages)
        return {"num_replicas": topo.num_replicas, "rank": topo.replica_of(self.global_rank)}

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        seed_workers_by_replica(dataloader, self.distributed_sampler_kwargs["rank"])
        return dataloader

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self.in_process:
            self._launcher = None  # one process does it all: nothing to launch, whatever start_method says
            return
        # The same launcher, checking the configuration first (`_ChecksFirst`).
        if isinstance(self._launcher, _SubprocessScriptLauncher):
            self._launcher = _CheckedScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        elif isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = _CheckedMultiProcessingLauncher(self, start_method=self._start_method)

    def _check_before_launch(self, trainer: Trainer) -> None:
        """Refuse a layout or accumulation setting that cannot work, before any process starts (`RefusedSetting`s:
        usage errors of the command line)."""
        layers = layers_before_launch(trainer.lightning_module)  # the user's code, outside: its errors are its own
        with refusing_settings():
            check_before_launch(self, trainer, layers)
            if self.fault_tolerance is None:
                return
            if self.in_process:
                raise ValueError(
                    "PACIStrategy(fault_tolerance='torchft') runs each replica group on processes (devices=S, one "
                    "stage per rank, under torchrun or SLURM); with devices=1 there is no rank to heal. Launch "
                    "each group with torchrun --nproc-per-node S."
                )
            require_torchft()
            self.replica_group_id, self.replica_groups = group_settings(
                self.replica_group_id, self.replica_groups, self.min_replica_groups
            )
            lighthouse_address()

    @override
    def setup_distributed(self) -> None:
        # Under torchrun the default group rendezvouses in the elastic agent's store, which a restart
        # hands over with the previous attempt's keys in it: form it under this attempt's own prefix
        # (runs.attempt_store), every later group inherits the prefix. Lightning's own setup then finds
        # the group formed and does the rest (seeds, ranks).
        # A later run in a process that keeps its group (a notebook, a script that fits again) checks its peers;
        # read before the group is formed here (under torchrun, a first run's group is formed just below).
        self._group_kept = dist.is_initialized()
        assert self.cluster_environment is not None
        rank = self.cluster_environment.global_rank()
        store = None if self._group_kept else attempt_store(rank, self._timeout)
        if store is not None:
            backend = self._get_process_group_backend()
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=self.cluster_environment.world_size(),
                timeout=self._timeout, device_id=self.root_device if self.root_device.type != "cpu" else None,
            )  # fmt: skip
            if backend == "nccl":  # as Lightning's own setup does, which now returns early
                atexit.register(_destroy_dist_connection)
        launch_streams = _collect_rng_states(include_cuda=False)  # before Lightning's re-seed replaces them
        super().setup_distributed()
        self._launch_streams = launch_streams

    @override
    def setup_environment(self) -> None:
        begin_run()  # first: a failure of the peer check below is this run's
        if self.in_process:
            # No peer, so no process group: Lightning's collectives see a world of one. No re-seed: the
            # process keeps the random streams one device has here, as every rank of a process pipeline
            # is given them (keep_launch_random_streams), so the streams agree.
            Strategy.setup_environment(self)
            self.topology = Topology(self.pipeline_stages)
            _warn_single_replica(self.local_sgd_steps, self.topology, in_process=True)
            return
        super().setup_environment()
        if self._group_kept:
            check_peers_alive(timedelta(seconds=self.p2p_timeout))  # within the time the first group would wait
        self.topology = Topology.for_world(self.world_size, self.pipeline_stages)
        backend = dist.get_backend()
        # Every rank creates every group, in the same order: new_group is collective.
        # Stage-to-stage transfers get groups of their own, one per direction: on NCCL both directions of
        # a link on one communicator deadlock (transport.process.LinkGroups). And a receive posted ahead that
        # an exception leaves unmatched dies with its group in teardown instead of lingering on the
        # default group, where it would swallow a message of a later fit in this process.
        # The other groups wait as long as the default one: PACIStrategy(timeout=...), not new_group's own default
        # (30 minutes on gloo, 10 on NCCL): a replica's gradient all-reduce, the clipping norm's sum, the signal.
        self._p2p_groups = LinkGroups.create(timeout=timedelta(seconds=self.p2p_timeout))
        wait = {"timeout": self._timeout}
        self._header_group = None if backend == "gloo" else dist.new_group(backend="gloo", **wait)
        if self.global_rank == 0:
            # Every rank is past its earlier run now: a gloo group connects all its pairs as it is made (the p2p
            # groups on gloo, the header group beside NCCL, whose own groups connect at their first use).
            clear_published_failure()
        for stage in range(self.pipeline_stages):
            self._dp_groups[stage] = dist.new_group(self.topology.replica_ranks(stage), **wait)
        for replica in range(self.topology.num_replicas):
            self._pipeline_groups[replica] = dist.new_group(self.topology.pipeline_ranks(replica), **wait)
        self._signal_group = dist.new_group(backend="gloo", **wait)
        if self.topology.num_replicas == 1 and self._launch_streams is not None:
            keep_launch_random_streams(self._launch_streams, self._signal_group)
        if self.fault_tolerance is None:  # with it, the replicas are the other groups, not this world's
            _warn_single_replica(self.local_sgd_steps, self.topology)

    # -- setup / teardown: one path for k = 1 (processes) and k = S (one process) --------------------

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.topology is not None
        self._failed = False  # a failed run's teardown kept rank 0's model split; this run's may gather it again
        self.restored_window_grads = []  # a fit that failed before on_train_start left its restore's here
        self.restored_random_stream = None
        self._epoch_end_seen = False  # whether the last training step was its epoch's last (`end_epoch`)
        # First: whatever loads the training loader during setup (configure_optimizers reading
        # trainer.estimated_stepping_batches, as GPT's default schedule does) builds it with this setting.
        keep_users_sampler(trainer, self.replica_groups if self.fault_tolerance else self.topology.num_replicas)
        if self.in_process:
            self._check_before_launch(trainer)  # nothing is launched in one process, so the check runs now
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        layers = list(module.pipeline_layers())
        sizes = self._stage_sizes(module, layers, trainer)
        ties = find_ties(module, layers, sizes)  # a tied embedding: see lit_efficient.runtime.tied
        shared = shared_buffers(module, layers, sizes)  # before the split: other stages' layers are still here
        replicated = self.topology.num_replicas > 1 or self.fault_tolerance is not None  # torchft: groups apart
        check_streaming_ties(self.streaming_sync, replicated, bool(ties))
        hosted = self.hosted_stages
        # One process keeps the module whole (hosting every stage moves nothing); a rank keeps its stage's layers.
        self._split = split_module(module, layers, sizes, hosted, ties)
        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.topology.num_replicas > 1:
            # Every replica of a stage starts from its first replica's weights, as DDP broadcasts at wrap:
            # under torchrun or SLURM each process builds its own model, and processes not seeded alike
            # would otherwise train R different models on averaged gradients, silently.
            # An evaluation scores the first replica's model; between LocalSGD/DiLoCo syncs this replica's own
            # differs, and a save after the evaluation writes it: `teardown` puts it back.
            self._take_the_first_replicas_weights(layers, keep_own=not fitting and self.local_sgd_steps is not None)
        if fitting:
            self._after_finder = False
            self._fit_trained = False  # set when the fit's own run starts (not a learning-rate finder's): `teardown`
            self._first_batch_unchecked = not self.in_process  # one process reads one stream
            self._forward_unchecked = True
            self._was_automatic = module.automatic_optimization
            module.automatic_optimization = False  # the stages zero, accumulate and step themselves
            if ties and {0, self.pipeline_stages - 1} <= set(hosted):
                # Before the optimizers are built: the last stage's optimizer holds its own copy, as on its rank.
                separate_tied_copies(self._split)
        links = self._links(bool(ties) and fitting)
        if fitting and self.fault_tolerance is not None:
            self.replicas = start_replicas(self, trainer)
        stages = [self._build_stage(s, layers, trainer, fitting, links) for s in hosted]
        for s, part in zip(hosted, stages, strict=True):
            # Watched where the move to the device kept them one tensor (the CPU; a move to a GPU gives each owner
            # its own copy, as it does plain Lightning's model, so nothing is shared there to diverge).
            part.stage.shared_buffers = [
                (name, owner._buffers[key], where)
                for name, owner, key, before, where in shared.get(s, [])
                if owner._buffers.get(key) is before
            ]
        del shared  # the tensors as they were before the move: not kept
        if fitting and ties:
            self._check_tied_settings([(part.lightning[0], part.lightning[3]) for part in stages])
        if fitting and not self.in_process:
            self._sigterm_pending = replace_sigterm_barrier(trainer, self.pipeline_stages, self._signal_group)
        accumulate = max(1, trainer.accumulate_grad_batches)
        if (
            fitting
            and self.schedule == "paci"
            and (advice := advise_window(self.pipeline_stages, accumulate)).too_stale
        ):
            rank_zero_warn(f"PACIStrategy: {advice.text()}")
        self.sync_start = self._resolve_sync_start(trainer, [part.lightning[0] for part in stages]) if fitting else 0
        self._in_sync_start = self.sync_start > 0
        order: ScheduleName = "1f1b_flush" if self._in_sync_start else self.schedule
        self.runtime = host_stages([part.stage for part in stages], order, accumulate, module.pipeline_input, links)
        self.hosted = [
            HostedStage(runtime, *part.lightning) for runtime, part in zip(self.runtime.runtimes, stages, strict=True)
        ]
        self._tied_follow(order)
        self._edits = None
        if fitting:
            # Lightning and every callback see what global rank 0 shows them: its stage's optimizer and schedulers
            # (in one process the last stage's), so LearningRateMonitor's keys are the same in both hostings.
            last = self.hosted[-1]
            self.optimizers, self.lr_scheduler_configs = [last.optimizer], last.scheduler_configs
            self.averager = last.averager
            if len(self.hosted) > 1:  # one process: what user code writes into that optimizer reaches every stage
                self._edits = EditsReachEveryStage(
                    last.optimizer,
                    [h.optimizer for h in self.hosted[:-1]],
                    [list(h.stage.parameters()) for h in self.hosted],
                )
                last.stage.after_step = _then(last.stage.after_step, self._edits.refresh)
        self.setup_precision_plugin()
        self._prepare_runtimes(trainer)
        self.point_metrics()
        self._metrics_pointed_in = None
        self._join_lightning(trainer, fitting)

    def _links(self, tied: bool) -> ProcessLinks | LocalLinks:
        """The transport choice, the one thing the two hostings differ in besides k: process links on processes,
        in-process links in one."""
        if self.in_process:
            return LocalLinks(self.pipeline_stages, self.wire_format)
        assert self.topology is not None
        if tied and not self._tie_groups:
            self._tie_groups = tie_groups(self.topology, self.p2p_timeout)  # collective: every rank has the ties
        return ProcessLinks(
            self.topology, self.global_rank, self.root_device, self.p2p_timeout, self.wire_format, self._p2p_groups,
            self._header_group, self._pipeline_groups.get(self.replica), self._tie_groups,
        )  # fmt: skip

    def _build_stage(
        self, index: int, layers: list, trainer: Trainer, fitting: bool, links: ProcessLinks | LocalLinks
    ) -> _BuiltStage:
        """Stage ``index`` of the hosted ones: its optimizer and schedulers (built by ``configure_optimizers`` while
        only its layers are present, as on its own rank), its `PipelineStage`, and while fitting its step hooks,
        staleness correction and tied-weight rule."""
        module = self.lightning_module
        assert module is not None and self._split is not None
        optimizer, configs, step_wise, epoch_wise = None, [], None, []
        if fitting:
            with self.stage_view(index):
                self._setup_stage_optimizer(trainer, index, layers)
            optimizer, configs = self.optimizers[0], list(self.lr_scheduler_configs)
            step_wise, epoch_wise = step_schedulers(configs, scheduler_stepper(module))
            if index == self.hosted_stages[0]:
                warn_step_frequency(configs)
        first, last = self._split.bounds_of(index)
        stage = PipelineStage(
            layers[first:last], index, self.pipeline_stages, optimizer,
            loss_fn=module.pipeline_loss, scheduler=step_wise, recompute=self.recompute,
            normalize=normalize_mode(trainer), forward_context=self.precision_plugin.forward_context,
            device=self.root_device, on_nonfinite=self.on_nonfinite, first_layer=first,
        )  # fmt: skip
        averager, tied = None, []
        if fitting:
            exact_norm = clips_global_norm(trainer, self.schedule, self.pipeline_stages)
            averaging = None
            if self.local_sgd_steps is not None:
                averaging = Averaging(
                    self.local_sgd_steps, self.local_sgd_warmup_steps, self.outer_optimizer, self.outer_lr,
                    self.outer_momentum, self.average_buffers, self._sync_offset(index),
                )  # fmt: skip
                if index == self.hosted_stages[0]:
                    warn_unsynced_end(trainer, averaging, self.topology.num_replicas, self.streaming_sync)  # type: ignore[union-attr]
            averager = install_step_hooks(
                stage, trainer, self._dp_groups.get(index), self.topology.num_replicas, averaging,  # type: ignore[union-attr]
                links.stage_sum, exact_norm, warn_per_stage_clipping=index == self.hosted_stages[0],
                replicas=self.replicas,
            )  # fmt: skip
            stage.correction = self.correction_for(index, trainer, optimizer)
            if index == self.hosted_stages[0]:
                self._say_why_plain(optimizer)
            if isinstance(stage.correction, CompiledFirstStepWeightPrediction) and index == self.hosted_stages[0]:
                rank_zero_info(
                    "PACIStrategy: stale forwards run on weights predicted in compiled passes (staleness_correction="
                    f"{self.staleness_correction!r}): each stage compiles its prediction once, at its first stale "
                    "forward (seconds; up to a minute the first time on a machine); "
                    "staleness_correction='weight_prediction_first_step_inplace' runs the eager form instead."
                )
            if self._split.ties and index in (0, self.pipeline_stages - 1):
                # For the smallest N of the fit: a schedule that lowers N later needs a longer delay line, which
                # is not rebuilt mid-run (with the current N's the last stage would wait on stage 0, a bubble or
                # a deadlock); a longer delay than the current N needs is only staler, never waits.
                delay = tie_delay(self.pipeline_stages, smallest_window(trainer))
                tied = tie_stage(stage, self._split, self.schedule, delay, links.tied(index, delay))
                if exact_norm and links.stage_sum.can_post and stage.is_last:
                    post_norm_before_tied_exchange(stage, links.stage_sum)  # else its step and stage 0's wait
        return _BuiltStage(stage, (optimizer, configs, epoch_wise, tied, averager))

    def _check_tied_settings(self, ends: list[tuple[Any, list[TiedWeight]]]) -> None:
        """Both copies of each tied weight are stepped with the same optimizer settings, or the fit is refused on
        every rank alike (a collective on processes: every rank calls it, hosting an end of the tie or not)."""
        assert self._split is not None
        ties = self._split.ties
        seen: list[list[tuple[int, str, dict]]] = [[] for _ in ties]  # per tie: (digest, where, settings)
        for optimizer, tied in ends:
            for i, copy in enumerate(tied):
                digest, settings = step_settings(optimizer, copy.param)
                name = ties[i].name if copy.is_first else ties[i].alias
                where = f"{name} on stage {0 if copy.is_first else self.pipeline_stages - 1}"
                seen[i].append((digest, where, settings))
        # Per tie, (-lowest, highest) digest: one MAX all-reduce makes both the group's.
        span = torch.tensor(
            [[-min([d for d, *_ in s], default=_BIG), max([d for d, *_ in s], default=-_BIG)] for s in seen]
        )
        if not self.in_process:
            dist.all_reduce(span, op=dist.ReduceOp.MAX, group=self.cpu_group)
        for i, ((low, high), tie) in enumerate(zip(span.tolist(), ties, strict=True)):
            if -low == high:
                continue
            settings = _settings_apart(seen[i])
            raise ValueError(
                f"The weight tied across stages ({tie.name}, also {tie.alias}) is stepped with other optimizer "
                f"settings on stage 0 than on stage {self.pipeline_stages - 1} ({settings}). Each stage's "
                "configure_optimizers sees only its own layers, where the last stage's copy is "
                f"{tie.alias}: a rule by module type or by name put it in another parameter group. On one device it "
                "is one parameter with one group's settings; the two copies would drift apart. Give both names the "
                f"same group (for example by name: treat {tie.alias!r} as {tie.name!r})."
            )

    def _resolve_sync_start(self, trainer: Trainer, optimizers: list[Any]) -> int:
        """Optimizer steps of this fit's synchronous start: ``sync_start_steps``, or for ``"auto"`` the largest
        `auto_sync_start_steps` of the hosted stages' optimizers (every rank agrees on the largest of all)."""
        if self.schedule != "paci":
            return 0
        if self.sync_start_steps != "auto":
            return int(self.sync_start_steps)
        # A sharded state (ShardedOptimizer) steps the user's optimizer underneath: its betas count.
        steps = max((auto_sync_start_steps(getattr(opt, "optimizer", opt)) for opt in optimizers), default=0)
        if not self.in_process:
            box = torch.tensor([steps], dtype=torch.int64)
            dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.cpu_group)
            steps = int(box.item())
        if steps:
            total = trainer.max_steps
            share = f", {steps / total:.0%} of max_steps={total}" if total > 0 else ""
            text = (
                f"PACIStrategy: the first {steps} optimizer steps run in 1F1B-flush order (sync_start_steps='auto': "
                f"the steps while Adam's moments are young{share}), then PACI."
            )
            if total > 0 and steps >= total:  # "333% of max_steps": no step of this fit is PACI's
                rank_zero_warn(
                    f"PACIStrategy: sync_start_steps='auto' runs the first {steps} optimizer steps in 1F1B-flush order "
                    f"(the steps while Adam's moments are young), and this fit ends at max_steps={total}: the whole "
                    "fit runs 1F1B-flush, no step of it PACI. Set sync_start_steps=0 (or fewer steps than max_steps) "
                    "to run PACI, at the cost of staleness in Adam's first steps (on the benchmark grid 20 of 40 "
                    "steps cost up to 10% of final loss at lr 2e-3)."
                )
            elif total > 0 and steps >= total / 4:  # a short run: PACI's speed-up would apply to little of it
                rank_zero_warn(
                    f"{text} PACI is bubble-free only after it. A lower sync_start_steps trades it for staleness in "
                    "Adam's first steps (on the benchmark grid 20 of 40 steps cost up to 10% of final loss at lr 2e-3)."
                )
            else:
                rank_zero_info(f"{text} Set sync_start_steps to change it.")
        return steps

    def _end_sync_start(self) -> None:
        """The synchronous start is over: every hosted stage runs PACI's order from the next micro-batch (called
        between windows, with nothing in flight; every rank at the same step)."""
        assert self.runtime is not None
        self.runtime.switch_schedule(self.schedule)
        self._tied_follow(self.schedule)
        self._in_sync_start = False

    def _tied_follow(self, order: ScheduleName) -> None:
        """The tied weights' rule follows the runtimes' order (`TiedWeight.follow`): summed gradients, nothing stale,
        in PACI's synchronous start, as under flush."""
        for hosted in self.hosted:
            for tied in hosted.tied:
                tied.follow(order)

    def _say_skipped_windows(self) -> None:
        """Say at the fit's end how many windows ``on_nonfinite="skip"`` skipped (counted by every stage alike; rank 0
        holds the last stage): each was said nowhere, and a run skipping most of its steps ended as a success."""
        skipped = max((hosted.runtime.stage.skipped_windows for hosted in self.hosted), default=0)
        if skipped:
            rank_zero_warn(
                f"PACIStrategy(on_nonfinite='skip') skipped {skipped} optimizer step(s) of this fit: windows with a "
                "non-finite loss, whose update no stage applied (trainer.global_step counts them; the optimizers and "
                "the step-interval schedulers did not step). More than a few mean the run diverges: lower the "
                "learning rate, clip gradients (gradient_clip_val) or look for the batches that overflow."
            )

    def _say_why_plain(self, optimizer: Any) -> None:
        """Say once where ``staleness_correction="auto"`` runs plain PACI, and why (`prediction_refusal`): a warning
        for an Adam the prediction does not know (a subclass overriding step, amsgrad, another library's AdamW),
        whose user expects the defaults' loss; a log line for another kind of optimizer (documented)."""
        if self.staleness_correction != "auto" or self.schedule != "paci" or self.pipeline_stages < 2:
            return
        reason = prediction_refusal(optimizer)
        if reason is None:
            return
        text = f"PACIStrategy: staleness_correction='auto' runs plain PACI, without weight prediction: {reason}."
        sharded = isinstance(optimizer, ShardedOptimizer)
        if not adam_like(optimizer.optimizer if sharded else optimizer):  # sharded: the user's optimizer under it
            rank_zero_info(f"{text} staleness_correction='lr_scale' corrects staleness with any optimizer.")
            return
        if sharded:
            advice = "Without shard_optimizer_state (each replica then holds the whole state) the prediction runs."
        elif prediction_refusal(optimizer, trust_step=True) is None:
            advice = (
                "If its step() keeps torch's update (a wrapper that logs around super().step()), name the prediction: "
                "staleness_correction='weight_prediction_first_step_inplace'; otherwise use 'lr_scale'."
            )
        else:
            advice = "Use torch's AdamW/Adam without amsgrad/maximize, or staleness_correction='lr_scale'."
        rank_zero_warn(
            f"{text} With AdamW, plain PACI ended 13-21% above 1F1B-flush's loss on the benchmark grid at S=8. {advice}"
        )

    def correction_for(self, stage: int, trainer: Trainer, optimizer: Any) -> StalenessCorrection | None:
        """The staleness correction of ``stage`` with its ``optimizer`` (None: off, or nothing to correct there)."""
        accumulate = max(1, trainer.accumulate_grad_batches)
        return make_correction(
            self.staleness_correction, self.schedule, stage, self.pipeline_stages, accumulate,
            self.staleness_anneal_steps, optimizer,
        )  # fmt: skip

    def _join_lightning(self, trainer: Trainer, fitting: bool) -> None:
        """The Lightning side of setup: the drains before the hooks of docs/DESIGN.md section 7, the progress bar,
        the metrics' sync."""
        module = self.lightning_module
        assert module is not None
        share = None if self.in_process else (lambda: share_rank_zero_metrics(trainer))
        epoch_ends_where_the_steps_ran(module, self.is_last_stage, self.here, share)
        if fitting:
            drain_before(module, "on_validation_model_zero_grad", self.drain)
            warn_uncalled_hooks(module, trainer.callbacks)
            self._module_logs_train_loss = False
            watch_own_train_loss(module, self._module_logged_train_loss)
            checkpoints_see_the_users_optimization(trainer)
        # One process, or one stage (every rank the last): every rank runs the writer's hooks.
        alone = None if self.in_process or self.pipeline_stages == 1 else self._alone
        writers_where_the_predictions_are(trainer, self.is_last_stage, alone)
        swap_stock_progress_bar(trainer)
        throughput_counts_replicas(trainer, self.topology.num_replicas if self.topology is not None else 1)
        split = self._split
        summarize_the_unsplit_model(trainer, lambda: split.ties if split else ())
        if not any(isinstance(cb, SyncCallbackMetrics) for cb in trainer.callbacks):
            trainer.callbacks.insert(0, SyncCallbackMetrics())
        agree_on_evaluation_results(trainer)
        agree_on_the_checkpoint(trainer)
        if not self.in_process:
            self._sync_advice_back = without_sync_advice(self.topology.num_replicas)

    def _setup_stage_optimizer(self, trainer: Trainer, index: int, layers: list) -> None:
        """Lightning's `setup_optimizers` while only stage ``index``'s layers are present, refusing anything but one
        optimizer with the way to write it."""
        one = (
            "PACIStrategy steps one optimizer per stage, built by configure_optimizers while only that stage's "
            "layers are present. Put all parameters into one optimizer; param groups are fine (one group per "
            "module, each with its own lr and weight decay)."
        )
        module = self.lightning_module
        inside, module.automatic_optimization = module.automatic_optimization, self._was_automatic
        try:
            # Parsed as the user's module optimizes (automatically), not as the strategy's inside (manual): Lightning's
            # manual parse dropped a scheduler dict's "monitor" and "reduce_on_plateau" (a plateau scheduler was
            # then stepped without its metric, unrefused) and advised stepping schedulers by hand.
            self.setup_optimizers(trainer)
        except ValueError as err:
            if "empty parameter list" not in str(err):
                raise
            raise ValueError(self._empty_optimizer_advice(index, layers, err, one)) from err
        except RuntimeError as err:  # Lightning's advice for several optimizers is manual optimization: not here
            if "multiple optimizers" not in str(err):
                raise
            raise ValueError(f"configure_optimizers returned more than one optimizer. {one}") from err
        finally:
            module.automatic_optimization = inside
        if len(self.optimizers) != 1:
            raise ValueError(f"configure_optimizers returned {len(self.optimizers)} optimizers. {one}")
        refuse_unsteppable(self.optimizers[0])
        assert self.topology is not None and self._split is not None
        if self.shard_optimizer_state and _sharding_applies(self.topology, self.in_process, bool(self._split.ties)):
            # The stage's optimizer state split over its replicas (sharded_optimizer.py); Lightning's schedulers keep
            # the user's optimizer, whose parameter groups the sharded one reads at every step.
            ranks = self.topology.replica_ranks(index)
            self.optimizers = [ShardedOptimizer(self.optimizers[0], self._dp_groups[index], ranks)]

    def _empty_optimizer_advice(self, index: int, layers: list, err: ValueError, one: str) -> str:
        """Why stage ``index``'s optimizer got no parameter, and the fix: the stage has none, it has only frozen
        ones (a fine-tuner's ``filter(lambda p: p.requires_grad, ...)``), or the optimizer was built over other
        modules."""
        assert self._split is not None
        first, last = self._split.bounds_of(index)
        where = f"Stage {index} of {self.pipeline_stages} (layers {first} to {last - 1} of pipeline_layers())"
        params = [p for layer in layers[first:last] for p in layer.parameters()]
        if not params:
            return (
                f"{where} holds no parameters, so its optimizer has none ({err}). Choose a balance "
                "(PACIStrategy(balance=[...])) that puts a layer with parameters on every stage."
            )
        if not any(p.requires_grad for p in params):
            return (
                f"{where} has only frozen parameters (requires_grad=False), and configure_optimizers gave the "
                f"optimizer only trainable ones ({err}). Give it every parameter (self.parameters()): torch's "
                "optimizers step only parameters that received a gradient, so the frozen ones stay as they are, as "
                "on one device; or choose a balance (PACIStrategy(balance=[...])) that puts a trainable layer on "
                "every stage."
            )
        return f"configure_optimizers built an optimizer over modules that are all on other stages ({err}). {one}"

    def _prepare_runtimes(self, trainer: Trainer) -> None:
        """What every hosted stage's runtime takes from Lightning: a configured profiler (`Trainer(profiler=
        "simple")`, ...) gets a row per forward, backward, optimizer step and receive of each stage; compiled
        layers (`compile_layers`, or `fit(torch.compile(model))`)."""
        assert self.runtime is not None
        if not isinstance(trainer.profiler, PassThroughProfiler):  # none configured: the default spans cost nothing
            for runtime in self.runtime.runtimes:
                runtime.profile = trainer.profiler.profile
        compile_fn = self._compile_fn()
        if compile_fn is not None:
            for runtime in self.runtime.runtimes:
                runtime.stage.compile_layers(compile_fn)

    def _compile_fn(self) -> Any:
        """How to compile a layer, or None. A module passed as ``torch.compile(model)`` had its forward and steps
        replaced by compiled ones (Lightning's `from_compiled`); the stages call its layers instead, so those get
        that compile call's options, and its steps run eager until teardown (a compiled validation_step would
        recompile at every batch around the pipeline's answer to ``self(...)``, see evaluation.py)."""
        module = self.lightning_module
        ctx = getattr(module, "_compiler_ctx", None)
        if ctx is not None:
            for name in ("forward", "training_step", "validation_step", "test_step", "predict_step"):
                self._compiled_steps.setdefault(name, module.__dict__.get(name))
                setattr(module, name, ctx[f"original_{name}"])
            return ctx["dynamo_ctx"]
        if self.compile_layers is False:
            compile_fn = _in_place_compile(module)
            if compile_fn is not None:  # its own call, the pipeline's answer to self(...), runs eager until teardown
                self._compiled_steps.setdefault("_compiled_call_impl", module._compiled_call_impl)
                module._compiled_call_impl = None
            return compile_fn
        options = self.compile_layers if isinstance(self.compile_layers, dict) else {}
        return lambda layer: torch.compile(layer, **options)

    def _restore_compiled_steps(self, module: LightningModule) -> None:
        for name, compiled in self._compiled_steps.items():
            if compiled is not None:
                setattr(module, name, compiled)
        self._compiled_steps = {}

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        healthy = not self._failed and trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if healthy and fitting and self.runtime is not None and not self._fit_trained:
            # A fit whose restored loop was already done (resumed at max_steps, or a fault-tolerant group healed at
            # the last step) runs neither on_train_start nor on_train_end: its stages, as restored, are its end
            # (also after a learning-rate finder's run, whose on_train_end recorded the finder's own end).
            self.final_state = stage_checkpoints.final_state(self)
        if module is not None:
            self._restore_compiled_steps(module)  # the module leaves fit compiled, as it came
            undo_module_hooks(module)
        if trainer is not None:
            give_callbacks_back(trainer)
        split = self._split
        self.own_weights_back()  # before the split is gathered: these are its tensors
        if module is not None and split is not None:
            if fitting:
                carry_step_count_to_automatic(trainer)
                module.automatic_optimization = self._was_automatic
            if split.whole:
                tie_again(split)  # tied weights one parameter again, also after a failure: nothing moved out
                untag([t for h in self.hosted for t in h.tied])
            elif healthy:
                # The whole model on global rank 0 (CPU), so the user's object is complete after fit.
                gather_model_on_rank_zero(split, self.replica, self.world_size, self.cpu_group)
            self._split = None if split.whole or healthy else split
        # What Lightning's teardown does with its optimizer (the last hosted stage's), for the other hosted
        # stages': on an accelerator their state would otherwise stay in its memory after fit.
        _optimizers_to_device([h.optimizer for h in self.hosted[:-1] if h.optimizer is not None], torch.device("cpu"))
        self.runtime = None
        if self.replicas is not None:
            self.replicas.shutdown()
            self.replicas = None
        self._let_go_of_the_run(trainer, healthy)
        super().teardown()
        if healthy and isinstance(self.launcher, _MultiProcessingLauncher) and dist.is_initialized():
            # A spawned (or forked) rank lives for this one run and ends right after it: release the
            # default group too while the interpreter is whole. Left to finalization, its gloo threads
            # can abort the process ("terminate called without an active exception", pytorch#179291).
            # Only on success: after a failure a peer may be gone, and the process exits anyway.
            dist.destroy_process_group()

    def _let_go_of_the_run(self, trainer: Trainer | None, healthy: bool = True) -> None:
        """Destroy the run's groups, and first give back what held them or patched Lightning for the run. Nothing may
        keep a destroyed group: it holds its gloo threads and sockets for as long as the Trainer lives, a reference
        cycle of Lightning's that only a full garbage collection frees (a notebook fitting again and again gathered
        them: 9 threads and 15 descriptors more per fit on 2 ranks)."""
        give_metrics_back(self._metric_groups)
        self._metric_groups = []
        self._sigterm_pending.clear()  # a failed fit's broadcasts on the signal group
        if self._sync_advice_back is not None:
            self._sync_advice_back()
            self._sync_advice_back = None
        if trainer is not None:
            restore_sigterm_barrier(trainer)
        self._destroy_groups(wait=healthy)
        for hosted in self.hosted:
            hosted.release_links()

    def _destroy_groups(self, wait: bool = True) -> None:
        """Release the subgroups this strategy made, now, rather than at interpreter exit: a gloo group
        whose worker threads are still alive when Python finalizes aborts the process ("terminate called
        without an active exception", seen at the exit of spawned ranks). Local: no collective.

        After a failure (``wait=False``) a receive posted ahead may still wait on a peer that is alive elsewhere (a
        rank that left the schedule alone, a stop set on its rank only, waits in a collective this rank never
        joins), and a gloo group's destruction joins the thread that waits: forever, the peer held by this process's
        open connections and this process by its teardown (a hang SIGTERM did not end; the failures audit). There
        the groups are let go in the background, for up to `GROUP_RELEASE_S` seconds before this process goes on
        to raise; they are this run's alone (a later run makes its own)."""
        if not dist.is_initialized():
            return
        groups = [*self._dp_groups.values(), *self._pipeline_groups.values()]
        groups += [self._signal_group, self._header_group]
        links = [self._p2p_groups, *self._tie_groups.values()]
        self._dp_groups, self._pipeline_groups, self._tie_groups = {}, {}, {}
        self._signal_group = self._header_group = self._p2p_groups = None

        def release() -> None:
            # In order, each let go of at once: a group's threads are joined, and its connections closed, when its
            # last reference goes; the header group and the links, where a receive may wait, last.
            while groups:
                if (group := groups.pop(0)) is not None:
                    dist.destroy_process_group(group)
                del group
            while links:
                if (link := links.pop(0)) is not None:
                    link.destroy()
                del link

        if wait:
            release()
            return
        releasing = threading.Thread(target=release, daemon=True, name="lit-efficient-release-groups")
        releasing.start()
        releasing.join(GROUP_RELEASE_S)

    def stage_view(self, index: int) -> Any:
        """A context in which the module holds only hosted stage ``index``'s layers, as that stage's own rank holds
        them: its ``state_dict`` keys, its parameters. On a rank hosting that stage alone, nothing changes."""
        assert self._split is not None
        return only_stage(self._split, index)

    def _stage_sizes(self, module: LightningModule, layers: list, trainer: Trainer) -> list[int]:
        check_layers(self.pipeline_stages, self.balance, layers)  # before launch too, unless configure_model builds
        counts = layer_parameter_counts(module, layers)
        # an explicit list: its entries checked in __init__, their sum by check_layers
        sizes = planned_sizes(self.balance, self.pipeline_stages, counts)
        if sizes is None:
            sizes = self._profiled_sizes(module, layers, trainer)
        check_stage_parameters(counts, sizes)
        rank_zero_info(f"PACIStrategy: {len(layers)} layers over {self.pipeline_stages} stages as {sizes}")
        return sizes

    def _say_forward_outside_layers(self, batch: Any) -> None:
        """Warn where the module's forward is not its layers one after another (`forward_check`): the model the
        pipeline trains is the chain, and nothing else would say so. On global rank 0, at the fit's first batch: the
        layers of other stages are there as their structure, which is all a trace on fake tensors needs."""
        module = self.lightning_module
        assert module is not None and self._split is not None
        with every_layer(self._split) as layers:
            found = None if layers is None else forward_outside_layers(module, layers, batch)
        if found is not None:
            rank_zero_warn(
                f"PACIStrategy: {type(module).__name__}.forward is not its pipeline_layers() one after another: "
                f"{found}. The pipeline trains and evaluates the layers chained (layer k on layer k-1's output, the "
                "last one's to pipeline_loss), not forward: move what forward computes between them (a residual, "
                "an activation, a reshape) into a layer."
            )

    def _profiled_sizes(self, module: LightningModule, layers: list, trainer: Trainer) -> list[int]:
        sizes_box: list[Any] = [None]
        if self.global_rank == 0:
            if any(isinstance(layer, LayerOnOtherStage) for layer in layers):
                raise ValueError("balance='profile' needs every layer's weights on rank 0; this module was split")
            batch = first_training_batch(trainer)
            result = profile_layers(module, layers, batch, self.root_device, self.precision_plugin.forward_context)
            sizes_box[0] = result.partition(self.pipeline_stages)
            times = result.stage_times(sizes_box[0])
            rank_zero_info(
                f"PACIStrategy(balance='profile'): stage times {[f'{t * 1e3:.1f} ms' for t in times]}, predicted "
                f"utilization {predicted_utilization(times, trainer.accumulate_grad_batches, self.schedule):.1%}"
            )
        if not self.in_process:  # one process (devices=1) has no group and no peer to tell
            dist.broadcast_object_list(sizes_box, src=0, group=self.cpu_group)
        return list(sizes_box[0])

    # -- training ---------------------------------------------------------------------------------

    @override
    def training_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        assert self.runtime is not None
        module, trainer = self.lightning_module, self.lightning_module.trainer
        if self._after_finder:  # a learning-rate finder ran inside this run (at an epoch's start) and restored
            self._start_run(trainer)
        loop = trainer.fit_loop.epoch_loop
        log_once_per_optimizer_step(trainer)  # rows as one device writes them under accumulation
        self._update_accumulation(trainer, batch_idx)
        if self._forward_unchecked:
            self._forward_unchecked = False
            if self.global_rank == 0:
                self._say_forward_outside_layers(batch)
        if self._first_batch_unchecked or (batch_idx == 0 and not self.in_process):  # the fit's, each epoch's
            self._first_batch_unchecked = False
            check_stages_read_alike(batch, self.topology, self._signal_group, "training", trainer.current_epoch)
        if self._in_sync_start and trainer.global_step >= self.sync_start and self.runtime.drained:
            self._end_sync_start()
        if self._edits is not None:
            self._edits.apply()
        loss = self.runtime.feed(batch, batch_idx)
        epoch_end = self._epoch_end_seen = loop._num_ready_batches_reached()
        if epoch_end:
            self.runtime.drain(step_partial_window=True)
            self._step_epoch_schedulers(trainer, trainer.global_step + 1)  # its last batch ends a window, counted next
        window_end = not loop._should_accumulate()
        if window_end:
            # A window of N micro-batches has been fed on every rank: count Lightning's optimizer
            # step (global_step) here; the stages step their optimizers on their own schedule.
            self._lightning_optimizers[0].step()
            self._log_averaging()
            if self._finder_run is not None and not self.in_process:  # the finder reads a loss on every rank
                loss = share_finder_loss(loss, self._signal_group)
        if loss is None:  # a rank without the last stage: its outputs explain themselves
            return _NoLossHere(self.here)
        # What one device's training_step logs: each micro-batch's loss. As a host copy: a sync on the last stage,
        # which sets the pipeline's pace (Lightning converts progress-bar values with .item() after every batch, a
        # stale one too, so a device tensor would cost a sync per micro-batch): at the window's end, which its row
        # shows, and before a validation in the middle of a window, which reads the micro-batch just trained as one
        # device's does (it read the window before's, and a ModelCheckpoint on train_loss ranked that).
        if window_end or validates_after_this_batch(trainer):
            value = loss.detach().cpu()
            if not self._module_logs_train_loss:  # else the module's own, from pipeline_loss, with its arguments
                size = batch_size_of(batch)
                type(module).log(
                    module, "train_loss", value, prog_bar=True, on_step=True, on_epoch=False, batch_size=size
                )
        if window_end:
            # Not in the finder's run: it raises the rate until the loss blows up, on purpose.
            watched = self.schedule == "paci" and self._finder_run is None
            if watched and (warning := self._loss_trend.observe(trainer.global_step, float(value))):
                rank_zero_warn(warning)
        return {"loss": loss}

    def _module_logged_train_loss(self) -> None:
        self._module_logs_train_loss = True

    def _log_averaging(self) -> None:
        """Log LocalSGD/DiLoCo's numbers from global rank 0, where the logger lives, once per window.

        Both describe rank 0's stage (the last stage; its replicas' dp group), measured by the averager
        at sync time, so logging them costs no collective and no host sync:

        - ``localsgd/divergence``: relative L2 distance ``||w_local - w_mean|| / ||w_mean||`` of this
          replica's stage parameters to the replicas' mean, just before the latest sync (held between
          syncs; logged from the first sync on).
        - ``localsgd/bytes_per_step``: payload bytes this rank's stage handed to averaging collectives
          (the sync all-reduces; the one-time broadcast at construction excluded) divided by the
          stage's optimizer steps so far: about ``sync_bytes / H``.
        """
        averager = self.averager
        if averager is None or self.global_rank != 0:
            return
        log = dict(on_step=True, on_epoch=False, rank_zero_only=True)
        self.lightning_module.log("localsgd/bytes_per_step", averager.bytes_per_step, **log)
        if averager.last_divergence is not None:
            self.lightning_module.log("localsgd/divergence", averager.last_divergence, **log)

    def _update_accumulation(self, trainer: Trainer, batch_idx: int) -> None:
        assert self.runtime is not None
        accumulate = max(1, trainer.accumulate_grad_batches)
        if accumulate != self.runtime.accumulate:
            if not self.runtime.drained or batch_idx % accumulate:  # a window boundary of the new N
                raise RuntimeError(
                    f"accumulate_grad_batches changed to {accumulate} in the middle of a window; change it only at "
                    "epoch starts (GradientAccumulation(steps={epoch: N}) does)"
                )
            self.runtime.accumulate = accumulate
            for hosted in self.hosted:  # a correction counts the window's share in N: built again for the new N
                hosted.stage.correction = self.correction_for(hosted.index, trainer, hosted.optimizer)
        if batch_idx == 0 and self.runtime.drained:
            self.runtime.start_epoch()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.restored_random_stream is not None:
            stage_checkpoints.reinstate_random_stream(self)
        if batch_idx == 0:
            self._epoch_end_seen = False  # not yet, also for an epoch skipped at its first batch (`end_epoch`)
        epoch = self.lightning_module.trainer.current_epoch  # type: ignore[union-attr]
        if epoch != self._metrics_pointed_in:  # the epoch's first batch (a resume's too), after the user's start hooks
            self._metrics_pointed_in = epoch
            self.point_metrics()

    def _step_epoch_schedulers(self, trainer: Trainer, step: int) -> None:
        """At an epoch's end: each rank steps its stages' epoch-interval schedulers; none in a learning-rate finder's
        run (one device's finder removes them). ``step``: the optimizer steps one device has counted there."""
        configs = (c for h in self.hosted for c in h.epoch_schedulers) if self._finder_run is None else ()
        step_with = scheduler_stepper(trainer.lightning_module)
        for config in configs:
            if (trainer.current_epoch + 1) % config.frequency == 0:
                step_with(config.scheduler, step)
        if self._edits is not None:
            self._edits.refresh()  # the schedulers' own values

    def end_epoch(self) -> None:
        """The epoch's end, before any other callback's ``on_train_epoch_end`` (`SyncCallbackMetrics`): drained. Where
        ``on_train_batch_start`` returned -1 (Lightning's "skip the rest of this epoch"), the last training step saw no
        epoch end; one device then steps no optimizer for the window the skip interrupted (the next epoch's first
        batch zeroes its gradients), and its epoch-interval schedulers where Lightning counts the skip as the
        epoch's last batch (2.6 on; 2.4 and 2.5 do not step them): so do the stages. A run stopped inside the epoch
        (``max_steps``, ``max_time``, ``should_stop``) keeps its window for a resume."""
        self.drain()
        if self.runtime is None or self._epoch_end_seen:
            return
        trainer = self.lightning_module.trainer
        if trainer.should_stop or _is_max_limit_reached(trainer.global_step, trainer.max_steps):
            return
        for hosted in self.hosted:
            hosted.stage.drop_window()
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._step_epoch_schedulers(trainer, trainer.global_step)  # the window was dropped, not stepped
        self._epoch_end_seen = True

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # Stages step their own optimizers inside the runtime; Lightning's call only counts the step.
        return None

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        raise RuntimeError("PACIStrategy runs backwards inside the pipeline; manual_backward is not supported")

    @override
    def on_train_start(self) -> None:
        self._start_run(self.lightning_module.trainer)
        super().on_train_start()

    def _start_run(self, trainer: Trainer) -> None:
        """What a training run starts from, also for a second run of the same fit (the learning-rate finder's, then
        the fit's or the rest of the one the finder was called in, after the finder restored its checkpoint): the
        accumulated gradients a restore brought, the schedulers Lightning shows, the synchronous start from the
        run's step, the loss trend. (The tied weights' delay lines are the restore's: `runtime.tied.restore_tied`.)"""
        after_finder, self._after_finder = self._after_finder, False
        self.final_state = None  # what a save after the previous fit used is not this fit's
        stage_checkpoints.reinstate_window_gradients(self)  # Lightning zeroed them since the restore
        self._finder_run = start_finder_run(self.hosted, self.optimizers[0], self.lr_scheduler_configs)
        self._fit_trained = self._fit_trained or self._finder_run is None
        if self._finder_run is not None:
            one_progress_bar(trainer)
        elif after_finder:
            apply_suggestion(trainer, self.hosted)
        assert self.runtime is not None
        if trainer.global_step < self.sync_start and not self._in_sync_start:  # a finder's run before rewound it
            self.runtime.switch_schedule("1f1b_flush")
            self._tied_follow("1f1b_flush")
            self._in_sync_start = True
        self._loss_trend = LossTrend()  # a blow-up of this run's loss against its own trend: one warning

    @override
    def on_train_end(self) -> None:
        if self.runtime is not None:
            self.runtime.drain()
            # Before fit takes the stages apart: for trainer.save_checkpoint after fit.
            self.final_state = stage_checkpoints.final_state(self)
            self._say_skipped_windows()
        finish_tied([t for h in self.hosted for t in h.tied])
        if self._finder_run is not None:  # the finder's run is over: it restores the stages' step counts next
            end_finder_run(self.hosted, self._finder_run)
            self._finder_run = None
            self._after_finder = True  # the next run starts at the next batch, unless its on_train_start comes first
        # Every rank started the same broadcasts; wait for the last ones so no asynchronous work is
        # left in flight when the process group is torn down (a pending gloo work at exit aborts).
        while self._sigterm_pending:
            work, _, _ = self._sigterm_pending.popleft()
            work.wait()
        if self.async_checkpointer is not None:  # last: it raises what a background save raised
            checkpointer, self.async_checkpointer = self.async_checkpointer, None
            checkpointer.close()  # every background save written and published before fit returns

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.failed(exception)
        self.final_state = None  # a save after a failed fit must not write the previous fit's end
        super().on_exception(exception)
        if isinstance(self.launcher, _CheckedScriptLauncher) and self.launcher.procs:
            # This process started the other ranks (start_method="popen"): none may outlive the job (one hung in
            # user code did). A watcher kills them after this process has exited and they had time to end. It
            # hosts the store too: at its exit it lets go of the default group and waits for them to read the cause.
            rank_reaper.watch_after_exit(self.launcher.procs, release=release_peers_keeping_the_store)

    def failed(self, exception: BaseException) -> None:
        """The run failed with ``exception``: said once, first thing. The strategy's own callback calls it before any
        other callback's ``on_exception`` (Lightning calls the strategy's after them): an OnExceptionCheckpoint whose
        save then failed too had replaced the report of what went wrong (and the exception itself)."""
        if self._failed:
            return
        self._failed = True  # (the previous fit's end, `final_state`, goes in `on_exception`, after the callbacks')
        if self.topology is not None and not isinstance(exception, RefusedSetting):  # a refusal is said once, raised
            # In one process every stage runs here, and which one raised is in the traceback: no stage is named (the
            # last stage was, for a failure in stage 0's backward).
            here = f"the pipeline of {self.pipeline_stages} stages in this process" if self.in_process else self.here
            # A peer's failure seen here, raw or as the launcher told it already (`lost_peers_error`): name its cause.
            if not self.in_process and isinstance(exception, LostPeersError) and exception.__cause__ is not None:
                report_lost_peers(here, exception.__cause__, account=str(exception))
            elif not self.in_process and is_raw_comm_error(exception):
                report_lost_peers(here, exception)
            elif isinstance(exception, KeyboardInterrupt):  # Ctrl-C: what the user did, not a failure; peers name it
                report_stop(f"{here} was interrupted (KeyboardInterrupt)")
            elif isinstance(exception, SIGTERMException):  # from outside, maybe after a peer died
                report_stop(
                    f"{here} was stopped by SIGTERM (torchrun sends it to a node's other ranks when one of them "
                    "fails; a job manager, to stop the job)"
                )
            else:
                detail = f": {exception}" if str(exception) else ""
                report_failure(f"{here} raised {type(exception).__name__}{detail}")

    @property
    def stopped_mid_action(self) -> bool:
        """A failure left a hosted stage in the middle of its actions (a forward or backward raised, a peer was
        lost): nothing can be drained. A save then holds each stage's weights after its last step and no unfinished
        window (as one device's checkpoint holds no gradients), and `drain` does nothing."""
        runtime = self.runtime
        return self._failed and runtime is not None and not all(r.quiescent for r in runtime.runtimes)

    # -- evaluation (evaluation.py) ----------------------------------------------------------------

    def drain(self) -> None:
        """Finish every micro-batch in flight on this process's stages (call it on every rank alike).

        Afterwards the model is consistent: every stage has taken exactly the optimizer steps of the
        windows completed so far (``trainer.global_step`` at a window end), and an incomplete window's
        gradients stay accumulated for the next batches. Between batches, under ``schedule="paci"``,
        stage s has otherwise taken up to ``ceil((S-1-s)/N)`` steps fewer than the last stage. The strategy
        drains by itself before validation (and its zero-grad hook), checkpoints, an epoch's end and
        the end of training; a callback that needs a consistent model at another point calls this.
        It costs the pipeline's warm-up once more (S-1 slots) at the next batch.
        """
        if self.runtime is not None and not self.stopped_mid_action:
            if self._edits is not None:
                self._edits.apply()  # a drain may step stages: with what user code set since the last batch
            self.runtime.drain()

    def restored_optimizers(self) -> None:
        """The stages' optimizers were loaded from a checkpoint: what the shown one holds now is not user code's."""
        if self._edits is not None:
            self._edits.refresh()

    def score_the_first_replica(self) -> None:
        """Validation inside fit under LocalSGD/DiLoCo: between syncs the replicas' weights differ, and each replica
        scored its own on its share of the validation set, one logged score of R models, by which ModelCheckpoint
        then ranked and named the first replica's model it saves (and EarlyStopping stopped). Every replica scores
        the first replica's model instead, as an evaluation after fit does; `own_weights_back` puts each replica's
        own back before any other callback's ``on_validation_end`` (a save there keeps each one's for a resume).
        Called by the strategy's own callback after its drain; a broadcast of the stage's weights per validation."""
        module = self.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        if not fitting or self.local_sgd_steps is None or not self._dp_groups or self.fault_tolerance is not None:
            return
        assert self.topology is not None
        if self.topology.num_replicas > 1:
            self._take_the_first_replicas_weights(list(module.pipeline_layers()), keep_own=True)

    def _take_the_first_replicas_weights(self, layers: list, keep_own: bool) -> None:
        """This rank's stage takes its first replica's weights (parameters and buffers); ``keep_own``: keeps its own
        on the host (the device memory does not grow) for `own_weights_back`."""
        assert self._split is not None
        first, last = self._split.bounds_of(self.stage)
        own = [t for layer in layers[first:last] for t in (*layer.parameters(), *layer.buffers())]
        if keep_own:
            self._own_weights = (own, [t.detach().to("cpu", copy=True) for t in own])
        broadcast_flat(own, self._dp_groups[self.stage])

    def own_weights_back(self) -> None:
        """Each replica's own weights back after an evaluation that scored the first replica's: a validation inside
        fit (`score_the_first_replica`) or an evaluation of the fit's weights (`setup`)."""
        if self._own_weights is not None:
            own, kept = self._own_weights
            self._own_weights = None
            with torch.no_grad():
                for tensor, value in zip(own, kept, strict=True):
                    tensor.copy_(value)

    def point_metrics(self) -> None:
        """The module's torchmetrics sync over the last stage's replicas (`trainer_glue.point_metrics_at`), those it
        made since the last call too; nothing in one process (no group). Called at setup, at each training epoch's
        and each evaluation's first batch (after the user's start hooks) and by the strategy's callback before the
        epoch-end hooks."""
        module = self.lightning_module
        if self._dp_groups and module is not None:
            group = self._dp_groups[self.pipeline_stages - 1]
            point_metrics_at(module, group, self.is_last_stage, self.here, self._metric_groups)

    def _start_evaluation(self) -> None:
        self.drain()
        self._eval_index = 0
        self._eval_loaders_checked = None if self.in_process else set()  # each loader's first batch, as a fit's

    def end_evaluation(self) -> None:
        """Every stage draws on from the last stage's random streams (`trainer_glue.draw_on_from_the_last_stage`)."""
        if not self.in_process and self.topology is not None and self.topology.num_stages > 1:
            draw_on_from_the_last_stage(self.topology, self.global_rank, self._signal_group, self.root_device)

    @override
    def on_validation_start(self) -> None:
        self._start_evaluation()

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        self.end_evaluation()

    @override
    def on_test_start(self) -> None:
        self._start_evaluation()

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        self.end_evaluation()

    @override
    def on_predict_start(self) -> None:
        self._start_evaluation()

    @override
    def on_predict_end(self) -> None:
        super().on_predict_end()
        self.end_evaluation()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._evaluation_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._evaluation_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._evaluation_step("predict_step", *args, **kwargs)

    def _evaluation_step(self, hook: str, batch: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.runtime is not None
        # Lightning passes dataloader_idx after batch_idx when there are several loaders: each one's first batch
        loader = args[1] if len(args) > 1 else kwargs.get("dataloader_idx", 0)
        if self._eval_index == 0:
            self.point_metrics()  # made since: in on_validation_start or at the evaluation epoch's start
        if self._eval_loaders_checked is not None and loader not in self._eval_loaders_checked:
            self._eval_loaders_checked.add(loader)
            check_stages_read_alike(batch, self.topology, self._signal_group, hook.removesuffix("_step"), loader=loader)
        # In one process stage 0's pipeline_input draws with the streams put back: the evaluation step's own call draws
        # the same numbers once, as one device's (and as the last stage's rank on processes, whose streams every rank
        # takes at the end); it drew them twice.
        with streams_untouched(self.root_device) if self.in_process else nullcontext():
            outputs = self.runtime.evaluate(batch, self._eval_index)
        self._eval_index += 1
        if outputs is None:
            return None
        module = self.lightning_module
        with streams_untouched(self.root_device):  # what stage 0 computed on, for its shapes: nothing drawn twice
            shapes = evaluation.shapes_of(module.pipeline_input(batch))  # type: ignore[operator]
        with evaluation.forward_answers(module, outputs[0] if len(outputs) == 1 else outputs, hook, shapes):
            return getattr(module, hook)(batch, *args, **kwargs)

    # -- checkpoints (stage_checkpoints.py): one save path, one load path, for every hosting -----------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the module must be split before its stages' weights are loaded

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.drain()  # a checkpoint holds a consistent model: nothing in flight
        return super().lightning_module_state_dict()

    def layout(self) -> dict[str, Any]:
        """The pipeline layout a checkpoint records: what per-rank state (RNG, averaging) depends on."""
        assert self._split is not None and self.topology is not None
        return {
            "num_stages": self.pipeline_stages,
            "num_replicas": self.topology.num_replicas,
            "sizes": self._split.sizes,
            "schedule": self.schedule,
        }

    def _sync_offset(self, stage: int) -> int:
        """How many steps ``stage``'s outer syncs are shifted by (streaming; 0 otherwise)."""
        if not self.streaming_sync or self.local_sgd_steps is None:
            return 0
        return stream_offset(stage, self.pipeline_stages, self.local_sgd_steps)

    def outer_sync_at(self, step: int) -> bool:
        """Whether some stage of the pipeline takes its outer sync at ``step`` (the same answer on every rank)."""
        if self.local_sgd_steps is None:
            return False
        return any(
            sync_due(step, self.local_sgd_steps, self.local_sgd_warmup_steps, self._sync_offset(s))
            for s in range(self.pipeline_stages)
        )

    @property
    def averagers(self) -> list[ReplicaAverager]:
        """The hosted stages' LocalSGD/DiLoCo averagers (none without replicas)."""
        return [h.averager for h in self.hosted if h.averager is not None]

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self._after_a_failure_on_processes():
            rank_zero_warn(
                f"PACIStrategy: no checkpoint written to {filepath} after a pipeline failure on processes "
                "(OnExceptionCheckpoint, or a save in an on_exception hook): the save is collective, and a rank "
                "whose peer failed mid-action may wait in a receive until its timeout. Resume from the last "
                "checkpoint saved before the failure (ModelCheckpoint)."
            )
            return
        if self.replicas is not None:  # a whole-job restart resumes the groups' sync count
            checkpoint["torchft"] = self.replicas.state_dict()
        with self._timed_pause():
            stage_checkpoints.save(self, checkpoint, filepath)  # collective on processes

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return stage_checkpoints.load(self, checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        self._own_weights = None  # an evaluation of a checkpoint: its model is every replica's now
        stage_checkpoints.load_weights(self, checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        stage_checkpoints.load_stage_states(self, checkpoint)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        with self._timed_pause():
            stage_checkpoints.remove(self, filepath)

    @contextmanager
    def _timed_pause(self) -> Iterator[None]:
        spans = self.pause_spans
        if spans is None:
            yield
            return
        clock = clock_for(self.root_device)
        start = clock.mark()
        try:
            yield
        finally:
            spans.append((start, clock.mark()))

    # -- collectives ------------------------------------------------------------------------------

    @contextmanager
    def _alone(self) -> Iterator[None]:
        """A prediction writer's write hooks, which run on the last stage's ranks only: see `_every_rank`."""
        self._writing_alone = True
        try:
            yield
        finally:
            self._writing_alone = False

    def _every_rank(self, call: str) -> None:
        """Refuse a collective of every rank inside a prediction writer's hook: the other stages' ranks run none of
        those hooks, so it waited for them until the group's timeout (30 minutes by default), then blamed a lost
        peer, and a SIGTERM did not end the wait."""
        if self._writing_alone:
            raise RuntimeError(
                f"PACIStrategy: {call} inside a BasePredictionWriter's write hook waits for every rank, but only the "
                "ranks hosting the last stage run those hooks (the predict steps ran there alone), so the others "
                "would never come. Gather the predictions of the last stage's replicas with pl_module.all_gather(...) "
                "(each replica's share, as under DDP), or after trainer.predict returns."
            )

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._every_rank("trainer.strategy.barrier()")
        if self._after_a_failure_on_processes():
            return  # a peer may wait in a receive (the save after a failure writes nothing: `save_checkpoint`)
        super().barrier(*args, **kwargs)

    def _after_a_failure_on_processes(self) -> bool:
        """A failure left a stage mid-action on processes: no collective may start (a peer may never join it). Not
        an exception; a save or barrier in an ``on_exception`` hook then does nothing, and Lightning's own handling
        (the failure's report, the loggers, the teardown, the user's exception) goes on."""
        return not self.in_process and self.stopped_mid_action

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._every_rank("trainer.strategy.broadcast()")
        return super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        # Metrics logged with sync_dist=True come from the last stage of each replica only: reduce
        # them across that stage's replicas, not the world (other stages never log them).
        if group is None and self.topology is not None and self._dp_groups:
            group = self._dp_groups[self.stage]
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        # A module's ``self.all_gather`` runs where its step runs (an evaluation step, pipeline_loss: the last stage
        # of each replica only); over the world it waited forever for the other stages (a hang SIGTERM did not end).
        # LightningModule.all_gather passes the world's group object when given none: that call gathers over this
        # stage's replicas, each replica's share as under DDP (as `reduce` does). The strategy's own default (None)
        # stays the world: callbacks call it on every rank (PipelineMonitor gathers every stage's timings).
        if group is dist.group.WORLD and self.topology is not None and self._dp_groups:
            group = self._dp_groups[self.stage]
        if group is None:
            self._every_rank("trainer.strategy.all_gather()")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not dist.is_initialized():
            return decision  # in one process: nobody to agree with
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag > 0)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name in SCHEDULES:
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"Pipeline-parallel training with the {name} schedule", schedule=name
                )
        # The class's own name as users type it (Trainer(strategy="PACIStrategy"), --trainer.strategy PACIStrategy,
        # or lit_efficient.PACIStrategy, which the CLI passes on as a string when no init_args follow), looked up
        # lowercased by Lightning: each was "invalid strategy name" in a traceback.
        for name in CLASS_NAMES:
            if name not in strategy_registry and cls is PACIStrategy:
                strategy_registry.register(name, cls, description="PACIStrategy with its defaults")


def _then(first: Callable[[], Any] | None, then: Callable[[], None]) -> Callable[[], None]:
    """``first`` (if any), then ``then``: a stage's `after_step` with one more thing to do."""

    def both() -> None:
        if first is not None:
            first()
        then()

    return both


def _settings_apart(ends: list[tuple[int, str, dict]]) -> str:
    """What tells the copies' settings apart, where this process sees both ends (one process); else this rank's."""
    if len(ends) == 2:
        (_, a, first), (_, b, last) = ends
        keys = [k for k in {**first, **last} if first.get(k, "none") != last.get(k, "none")]
        return "; ".join(f"{k}={first.get(k, 'none')!r} for {a}, {last.get(k, 'none')!r} for {b}" for k in keys)
    here = "; ".join(f"{where}: " + ", ".join(f"{k}={v!r}" for k, v in s.items()) for _, where, s in ends)
    return f"here: {here or 'no copy on this rank'}"


class _BuiltStage:
    """A hosted stage before its runtime exists: the stage and what Lightning built for it (`HostedStage`'s
    fields after the runtime, in order)."""

    def __init__(self, stage: PipelineStage, lightning: tuple[Any, list, list, list, Any]) -> None:
        self.stage = stage
        self.lightning = lightning
