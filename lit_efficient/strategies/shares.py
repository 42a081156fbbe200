"""What each stage puts into a checkpoint and takes from it, while the pipeline runs and after ``fit``.

A stage's share (`checkpoint.rank_share`: its weights, optimizer state and schedulers under parameter
names, and the pipeline state) is what both formats are made of: the single file merges every share on
global rank 0 (`checkpoint.assemble`), the sharded folder has every rank write its own (`sharded.save`).
A share is built from Lightning's checkpoint dict and a `StageRecord`: the stage's ``state_dict`` keys,
its optimizer's parameter names, its pipeline state (`PipelineCheckpointing.pipeline_state`) and its tied
weights' second copies.

While the pipeline runs, the record is read from the stage. At the end of training
(`PACIStrategy.on_train_end`, the pipeline drained) it is kept, because ``fit`` then takes the stages
apart: global rank 0 gathers the whole model, the runtime goes, and in one process a tied weight becomes
one parameter again. ``trainer.save_checkpoint(path)`` after ``fit`` builds the shares from the kept
records and the optimizers every rank still holds, so it writes the checkpoint a `ModelCheckpoint` at the
last step would have written, in either format, on every rank (``start_method="popen"``, torchrun,
SLURM) and in one process (``devices=1``).

After a fit whose ranks were spawned (``start_method="spawn"``/``"forkserver"``), they are gone: this
process holds only the trained weights Lightning's launcher brought back (as under Lightning's DDP), and
``save_checkpoint`` writes those, weights only, with a warning saying so.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lit_efficient.strategies import sharded, sharded_read
from lit_efficient.strategies.async_checkpoint import AsyncCheckpointer
from lit_efficient.strategies.checkpoint import assemble, rank_share, to_automatic_loops, write_atomically
from lit_efficient.strategies.sharded_optimizer import ShardedOptimizer

if TYPE_CHECKING:
    from lit_efficient.strategies.paci import PACIStrategy


@dataclass(frozen=True)
class StageRecord:
    """What a share needs of its stage besides Lightning's dict.

    Attributes:
        stage: The stage.
        replica: Its replica.
        keys: The stage's ``state_dict`` keys.
        group_names: Its optimizer's parameter names, per group, in the optimizer's order.
        extras: `PipelineCheckpointing.pipeline_state` (accumulation, random streams, averager).
        tied_copies: Names of its second copies of weights tied to the first stage.
        optimizer: Its optimizer's index in `stage_optimizers` (and in Lightning's ``optimizer_states``, every
            stage's in one process: `InProcessPipeline.every_stage`).
        schedulers: Its slice of Lightning's ``lr_schedulers`` (every stage's in one process, likewise).
    """

    stage: int
    replica: int
    keys: list[str]
    group_names: list[list[str]]
    extras: dict[str, Any]
    tied_copies: list[str]
    optimizer: int
    schedulers: slice


@dataclass(frozen=True)
class FinalState:
    """The records of this process's stages at the end of training, and the layout they were trained in."""

    records: list[StageRecord]
    layout: dict[str, Any]


def live_records(strategy: PACIStrategy) -> list[StageRecord]:
    """This process's stages as they are now: one on a rank, every stage in one process."""
    module = strategy.lightning_module
    assert module is not None
    if strategy._in_process is None:
        return [_record(strategy, module, module.state_dict().keys(), 0, slice(None))]
    in_process = strategy._in_process
    counts = [len(configs) for configs in in_process.scheduler_configs]
    offsets = [sum(counts[:k]) for k in range(len(counts) + 1)]
    records = []
    whole = {"state_dict": module.state_dict()}
    for stage in range(strategy.pipeline_stages):
        with in_process._as_rank(stage, whole) as view:  # acts for the stage; the module holds its layers only
            schedulers = slice(offsets[stage], offsets[stage + 1]) if counts else slice(0, 0)
            records.append(_record(strategy, module, view["state_dict"].keys(), stage, schedulers))
    return records


def stage_optimizers(strategy: PACIStrategy) -> list[Any]:
    """This process's stages' optimizers, as `StageRecord.optimizer` indexes them: its own on a rank, every
    stage's in one process (where Lightning's ``optimizers`` holds the last stage's only, as on global rank 0)."""
    return strategy._in_process.optimizers if strategy._in_process is not None else strategy.optimizers


def keep_final_state(strategy: PACIStrategy) -> None:
    """At the end of training, before ``fit`` takes the stages apart: what a save after ``fit`` needs."""
    strategy._final_state = FinalState(live_records(strategy), strategy.layout())
    for optimizer in stage_optimizers(strategy):  # a sharded one gathers its state while its replica group exists
        if isinstance(optimizer, ShardedOptimizer):
            optimizer.keep_consolidated()


def save_from_records(strategy: PACIStrategy, checkpoint: dict[str, Any], filepath: Any) -> None:
    """``PACIStrategy.save_checkpoint`` in the sharded format (in the background with ``async_checkpoint``), and
    in both formats after ``fit``."""
    path = Path(filepath)
    if strategy.topology is None:  # never set up here: the parent of spawned ranks, after fit
        return _save_weights(strategy, checkpoint, path)
    live = strategy.runtime is not None
    final = strategy._final_state
    if not live and final is None:
        raise RuntimeError(
            "PACIStrategy cannot save a checkpoint here: its stages are gone and training did not end normally "
            "(a failed fit keeps no final state). Save during fit with ModelCheckpoint, and resume from that."
        )
    records = live_records(strategy) if live else final.records  # type: ignore[union-attr]
    if strategy._in_process is not None:  # Lightning's dict holds the last stage's optimizer only, as rank 0's
        checkpoint = strategy._in_process.every_stage(checkpoint)
    layout = strategy.layout() if live else final.layout  # type: ignore[union-attr]
    diverged = strategy.local_sgd_steps is not None and strategy.topology.num_replicas > 1
    views = [_view(checkpoint, r) for r in records]
    shares = [_share(strategy, view, r, r.replica == 0 or diverged) for view, r in zip(views, records, strict=True)]
    distributed = strategy._in_process is None
    group = strategy._cpu_group() if distributed else None
    base = views[-1]  # Lightning's dict as global rank 0 (the last stage) built it
    saver = strategy._async_checkpointer
    if live and strategy.async_checkpoint and strategy.checkpoint_format == "sharded":
        if saver is None:
            saver = strategy._async_checkpointer = AsyncCheckpointer(distributed, strategy._timeout)
        return saver.save(path, shares, base, layout, sync_group=group)
    if saver is not None:
        saver.wait()  # a synchronous save after an asynchronous one: in order
    if strategy.checkpoint_format == "sharded":
        return sharded.save(path, shares, base, layout, group=group, distributed=distributed)
    if not distributed:
        return write_atomically(to_automatic_loops(assemble(base, shares, layout)), path)
    gathered = gather_to_rank_zero(shares[0], strategy.world_size, group)
    if gathered is not None:
        write_atomically(to_automatic_loops(assemble(base, gathered, layout)), path)
    dist.barrier(group=group)


def gather_to_rank_zero(obj: Any, world_size: int, group: dist.ProcessGroup | None) -> list[Any] | None:
    """Every rank's ``obj`` on global rank 0, in rank order (None elsewhere): the single file's gather.

    Streamed: rank 0 takes the ranks one at a time, each first sending its object's structure with every
    tensor replaced by its shape and dtype (`_Slot`, pickled: a few KiB), then the tensors' bytes one by one,
    received straight into tensors allocated for them. So rank 0 holds the received tensors once, which is
    the file less its own share, and a sending rank holds nothing more than its share (its host tensors are
    sent from where they lie). ``gather_object`` instead pickled every share on its rank (2x the share) and
    had rank 0 receive every pickle at once and unpickle them beside it: 3.3x the whole file at S=2
    (BENCHMARKS.md, "Checkpoints: host memory"). Collective over ``group`` (gloo); rank 0 gets host tensors,
    a device tensor is copied to the host as it is sent.
    """
    rank = dist.get_rank()
    if rank != 0:
        structure, tensors = _take_tensors(obj)
        dist.send_object_list([structure], dst=0, group=group)
        for tensor in tensors:
            if tensor.numel():
                dist.send(_as_bytes(tensor.cpu().contiguous()), dst=0, group=group)  # a device tensor: one at a time
        return None
    gathered = [obj]
    for src in range(1, world_size):
        box: list[Any] = [None]
        dist.recv_object_list(box, src=src, group=group)
        gathered.append(_fill(box[0], src, group))
    return gathered


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in a share sent to rank 0: its position in the send order, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: Any


def _take_tensors(obj: Any) -> tuple[Any, list[Any]]:
    """``obj`` with each strided tensor replaced by a `_Slot`, and the tensors. Tensors that are the same memory
    (a tied weight's two state-dict entries: two tensor objects, one storage) get one slot, so rank 0 gets one
    tensor for them, as unpickling would have given it."""
    tensors: list[Any] = []
    seen: dict[tuple, _Slot] = {}

    def take(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.layout == torch.strided:
            key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x.device)
            if key not in seen:
                seen[key] = _Slot(len(tensors), tuple(x.shape), x.dtype)
                tensors.append(x.detach())
            return seen[key]
        return _map(x, take)

    return take(obj), tensors


def _fill(structure: Any, src: int, group: dist.ProcessGroup | None) -> Any:
    """The structure `_take_tensors` made on rank ``src``, its tensors received one at a time, in slot order."""
    received: dict[int, torch.Tensor] = {}

    def put(x: Any) -> Any:
        if isinstance(x, _Slot):
            if x.index not in received:  # slots arrive in send order: a walk in the same order as `take`'s
                tensor = torch.empty(x.shape, dtype=x.dtype)
                if tensor.numel():
                    dist.recv(_as_bytes(tensor), src=src, group=group)
                received[x.index] = tensor
            return received[x.index]
        return _map(x, put)

    return put(structure)


def _map(x: Any, fn: Any) -> Any:
    """``x`` with ``fn`` applied to each value of a dict, list or tuple (their types kept), else ``x`` itself:
    what is left (a named tuple, another container) travels pickled, tensors included."""
    if isinstance(x, dict):
        items = {k: fn(v) for k, v in x.items()}
        if type(x) is dict:
            return items
        try:
            return type(x)(items)  # OrderedDict (a state_dict), Lightning's AttributeDict
        except TypeError:
            return items
    if type(x) in (list, tuple):
        return type(x)(fn(v) for v in x)
    return x


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (a view: no copy), for any dtype."""
    return tensor.reshape(-1).view(torch.uint8)


def load_sharded(strategy: PACIStrategy, path: Path, weights_only: bool | None) -> dict[str, Any]:
    """This process's part of a sharded folder, as the dict a single file would give (`sharded_read.read`). Weights
    are read into the module's own tensors; nothing of another stage's is materialized."""
    module = strategy.lightning_module
    assert module is not None
    state = module.state_dict()
    names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    if strategy._in_process is None:
        own = [strategy._rank_key()]
    else:
        own = [f"stage{s}-replica0" for s in range(strategy.pipeline_stages)]
    return sharded_read.read(
        path, state.keys(), names, own, strategy.layout(), targets=state, weights_only=weights_only
    )


def _record(strategy: PACIStrategy, module: nn.Module, keys: Any, optimizer: int, schedulers: slice) -> StageRecord:
    names = {id(p): n for n, p in module.named_parameters()}
    optimizers = stage_optimizers(strategy)
    opt = optimizers[optimizer] if optimizers else None
    groups = [[names[id(p)] for p in g["params"]] for g in opt.param_groups] if opt is not None else []
    return StageRecord(
        strategy.stage, strategy.replica, list(keys), groups, strategy.pipeline_state(),
        list(strategy._tied_copy_names()[1]), optimizer, schedulers,
    )  # fmt: skip


def _view(checkpoint: dict[str, Any], record: StageRecord) -> dict[str, Any]:
    """Lightning's dict as the record's rank would have built it: its keys, its optimizer, its schedulers."""
    state = checkpoint["state_dict"]
    view = dict(checkpoint, state_dict={k: state[k] for k in record.keys if k in state})
    if "optimizer_states" in checkpoint:
        view["optimizer_states"] = [checkpoint["optimizer_states"][record.optimizer]]
    if "lr_schedulers" in checkpoint:
        view["lr_schedulers"] = checkpoint["lr_schedulers"][record.schedulers]
    return view


def _share(strategy: PACIStrategy, view: dict[str, Any], record: StageRecord, keep_weights: bool) -> dict[str, Any]:
    optimizers = stage_optimizers(strategy)
    optimizer = optimizers[record.optimizer] if optimizers else None
    names = _RecordedNames(record.group_names, optimizer)
    return rank_share(view, names, optimizer, record.extras, keep_weights, tied_copies=record.tied_copies)  # type: ignore[arg-type]


class _RecordedNames:
    """The optimizer's parameters under the record's names, where `rank_share` asks a module for them:
    after ``fit`` the module may hold other parameter objects (rank 0's is whole again, a tied weight one)."""

    def __init__(self, group_names: list[list[str]], optimizer: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
        self.pairs = list(zip([n for names in group_names for n in names], params, strict=True))

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self.pairs)


def _save_weights(strategy: PACIStrategy, checkpoint: dict[str, Any], path: Path) -> None:
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
        sharded.save_weights(path, weights)
    else:
        write_atomically(weights, path)
