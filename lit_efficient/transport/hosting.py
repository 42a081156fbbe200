"""The runtimes of the stages one process hosts, wired to whatever carries their messages: one construction for
a rank's stage over process links and for a whole pipeline in one process over mailboxes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from lit_efficient.runtime.host import StageHost
from lit_efficient.runtime.interpreter import InputFn, PipelineRuntime
from lit_efficient.runtime.schedules import ScheduleName
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.topology import Topology


class Links(Protocol):
    """What `host_stages` needs of a transport (`process.ProcessLinks`, `local.LocalLinks`)."""

    topology: Topology

    def rank_of(self, stage: int) -> int: ...

    def p2p(self, stage: int) -> Any: ...

    def attach(self, host: StageHost) -> None: ...


def host_stages(
    stages: Sequence[PipelineStage], schedule: ScheduleName, accumulate: int, input_fn: InputFn, links: Links
) -> StageHost:
    """A `StageHost` driving one `PipelineRuntime` per stage of ``stages`` (in stage order), each playing the
    global rank ``links`` gives it, with its neighbours' ranks, ``input_fn`` on the first stage, and ``links``'
    point-to-point endpoint; a link that waits gets the host (`Links.attach`)."""
    runtimes = []
    for stage in stages:
        prev_rank, next_rank = links.topology.neighbours(links.rank_of(stage.stage))
        first_input = input_fn if stage.is_first else None
        p2p = links.p2p(stage.stage)
        runtimes.append(PipelineRuntime(stage, schedule, accumulate, first_input, p2p, prev_rank, next_rank))
    host = StageHost(runtimes)
    links.attach(host)
    return host
