"""The stages a process hosts and what Lightning built for each: one record type for both hostings.

A process hosts k stages: k = 1 on processes, k = S with ``devices=1``. `PACIStrategy.setup` builds every
hosted stage the same way (its optimizer and schedulers while only its layers are present, its step hooks,
its tied-weight rule) over the links of the hosting (process or in-process, `lit_efficient.transport`); the
checkpoint hooks then loop over `HostedStage` records, whatever k is.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lit_efficient.checkpoint.single_file import gather_to_rank_zero
from lit_efficient.replicas.averaging import ReplicaAverager
from lit_efficient.runtime.interpreter import PipelineRuntime
from lit_efficient.runtime.split import Split, local_layer_state_dicts, unsplit
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.tied import TiedWeight


@dataclass
class HostedStage:
    """One stage this process hosts, with what Lightning built for it while fitting.

    Attributes:
        runtime: The stage's runtime (`runtime.stage` is the `PipelineStage`).
        optimizer: Its optimizer (Lightning's optimizer object; a `ShardedOptimizer` under ZeRO-1); None outside fit.
        scheduler_configs: Its LR scheduler configs, as Lightning built them for its optimizer.
        epoch_schedulers: Those that step at an epoch's end (the others step with the stage's own steps).
        tied: Its copies of weights tied across stages (the first or the last stage only).
        averager: Its LocalSGD/DiLoCo averager, with replicas.
    """

    runtime: PipelineRuntime
    optimizer: Any = None
    scheduler_configs: list[Any] = field(default_factory=list)
    epoch_schedulers: list[Any] = field(default_factory=list)
    tied: list[TiedWeight] = field(default_factory=list)
    averager: ReplicaAverager | None = None

    @property
    def stage(self) -> PipelineStage:
        """The `PipelineStage`."""
        return self.runtime.stage

    @property
    def index(self) -> int:
        """The stage's number in the pipeline."""
        return self.runtime.stage.stage

    def release_links(self) -> None:
        """The run is over: drop its transports (the neighbours' and the tied weights'), whose groups were
        destroyed (`PACIStrategy.teardown`: they would keep those groups' threads and sockets)."""
        self.runtime.comm = None
        for tied in self.tied:
            tied.exchange = None

    def tied_copy_names(self, names: dict[int, str]) -> tuple[list[str], list[str]]:
        """Names (``names``: parameter id -> name) of this stage's tied weights in tie order: (first copies,
        second copies); one of them is empty."""
        first = [names[id(t.param)] for t in self.tied if t.is_first]
        return first, [names[id(t.param)] for t in self.tied if not t.is_first]


class EditsReachEveryStage:
    """In one process Lightning is shown the last stage's optimizer (`PACIStrategy.setup`: what rank 0 shows it);
    on S processes a callback that writes into ``trainer.optimizers`` (a learning rate set by hand, a warmup) writes
    each rank's own stage's. Here what user code wrote into the shown optimizer's parameter groups since the
    strategy last looked reaches every other hosted stage's group of the same index, before any stage steps again.

    The strategy's own changes are not the user's: `refresh` after each of the last stage's steps (its scheduler)
    and after the epoch schedulers; `apply` at each batch the pipeline is fed. Only the values that changed are
    copied (a stage's own scheduler, stepped on its own schedule, keeps its other values). A group user code adds
    (``add_param_group``, an unfreezing callback) is every stage's, each with its own parameters of it (an empty
    group where it has none), as each rank's own optimizer gets it on processes: added to the shown optimizer
    alone, an earlier stage's parameters were stepped by the last stage's optimizer, and the fit failed at its end
    (a KeyError naming a parameter the last stage does not hold).
    """

    def __init__(self, shown: Any, others: list[Any], parameters: list[list[Tensor]]) -> None:
        """``parameters``: each hosted stage's, in the order of ``others`` then ``shown``."""
        self.shown, self.others = shown, others
        self._stage_of = {id(p): i for i, ps in enumerate(parameters) for p in ps}
        self._seen: list[dict[str, Any]] = []
        self._warned = False
        self.refresh()

    def refresh(self) -> None:
        """Take what the shown optimizer's groups hold now as not the user's."""
        self._seen = [{k: _mark(v) for k, v in g.items() if k not in _OWN} for g in self.shown.param_groups]

    def apply(self) -> None:
        """Copy what changed in the shown optimizer's groups since `refresh` into the other stages' groups."""
        groups = self.shown.param_groups
        for index in range(len(self._seen), len(groups)):
            self._share_added(groups[index], index)
        edits = [
            (j, key, value)
            for j, (group, seen) in enumerate(zip(groups, self._seen, strict=False))  # added groups: its own
            for key, value in group.items()
            if key not in _OWN and (key not in seen or _mark(value) != seen[key])
        ]
        if edits or len(groups) != len(self._seen):
            for other in self.others:
                if len(other.param_groups) != len(groups):
                    self._warn_once(len(groups), len(other.param_groups))
                    continue
                for j, key, value in edits:
                    other.param_groups[j][key] = value.detach().clone() if isinstance(value, Tensor) else value
        self.refresh()

    def _share_added(self, group: dict[str, Any], index: int) -> None:
        """A group added to the shown optimizer at ``index``: each other stage gets one with the same settings and
        its own parameters of it; the shown keeps the rest (the last stage's, and any no stage holds)."""
        if any(len(other.param_groups) != index for other in self.others):
            return  # the stages' groups differ already: `apply` says so
        last = len(self.others)
        owner = [self._stage_of.get(id(p), last) for p in group["params"]]
        own = [k for k in _OWN if k in group]  # the parameters, and their names where torch keeps them

        def of(stage: int) -> dict[str, list]:
            return {k: [x for x, o in zip(group[k], owner, strict=True) if o == stage] for k in own}

        settings = {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in group.items() if k not in _OWN}
        for i, other in enumerate(self.others):
            other.add_param_group({**settings, **of(i)})
        group.update(of(last))

    def _warn_once(self, shown: int, other: int) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"PACIStrategy in one process: trainer.optimizers shows the last stage's optimizer ({shown} parameter "
                f"groups), and a change to its groups reaches a stage whose optimizer has {other}: not there (on "
                "processes each rank's callback changes its own stage's). Build the same groups on every stage (an "
                "empty group is fine) for a change to reach them all.",
                stacklevel=2,
            )


_OWN = ("params", "param_names")  # each stage's by nature


def _mark(value: Any) -> Any:
    """What tells a changed value: itself, or for a tensor (a capturable optimizer's lr) its identity and version
    counter, which an in-place write bumps (no device read: `apply` runs at every micro-batch)."""
    return ("tensor", id(value), value._version) if isinstance(value, Tensor) else value


def gather_model_on_rank_zero(split: Split, replica: int, world_size: int, group: dist.ProcessGroup | None) -> None:
    """Rebuild the whole model on global rank 0 (on the CPU) from every rank's layers: after fit on processes, the
    user's object is complete there. Collective over ``group`` (one rank at a time, streamed)."""
    mine = local_layer_state_dicts(split) if replica == 0 else {}
    gathered = gather_to_rank_zero(mine, world_size, group)
    if gathered is not None:
        state: dict[int, dict[str, Tensor]] = {}
        for part in gathered:
            state.update(part or {})
        unsplit(split, state, torch.device("cpu"))
