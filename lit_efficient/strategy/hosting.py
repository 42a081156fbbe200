"""The stages a process hosts and what Lightning built for each: one record type for both hostings.

A process hosts k stages: k = 1 on processes, k = S with ``devices=1``. `PACIStrategy.setup` builds every
hosted stage the same way (its optimizer and schedulers while only its layers are present, its step hooks,
its tied-weight rule) over the links of the hosting (process or in-process, `lit_efficient.transport`); the
checkpoint hooks then loop over `HostedStage` records, whatever k is.
"""

from __future__ import annotations

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
