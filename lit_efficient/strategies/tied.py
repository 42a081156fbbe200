"""Wiring a weight tied between the first and the last stage into a strategy's stages.

The rule lives in `lit_efficient.pipeline.tied`, the transport in `comm.TiedExchange` (or, for a
pipeline in one process, `pipeline.tied.LocalTiedLink`); this file only finds a stage's copies, makes
the two-rank groups and installs the hooks (`tie_stage`, for both).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from torch import nn

from lit_efficient.pipeline.comm import LinkGroups, TiedExchange
from lit_efficient.pipeline.schedules import ScheduleName
from lit_efficient.pipeline.stage import PipelineStage
from lit_efficient.pipeline.tied import Exchange, TiedWeight, tie_delay
from lit_efficient.pipeline.topology import Topology
from lit_efficient.strategies.split import Split

TIED_ATTR = "_lit_efficient_tied"  # set on a tied copy: clipping treats it once, see `tied_aware_norm`


def tie_groups(topology: Topology, timeout: float) -> dict[int, LinkGroups]:
    """Per replica, the groups of its first and its last stage, one per direction (`LinkGroups`: on NCCL,
    PACI's two-way exchange on one communicator would deadlock), with ``timeout`` seconds as NCCL's watchdog
    timeout. Collective: every rank calls it."""
    first, last = 0, topology.num_stages - 1
    return {
        r: LinkGroups.create(
            sorted({topology.rank_of(first, r), topology.rank_of(last, r)}), timedelta(seconds=timeout)
        )
        for r in range(topology.num_replicas)
    }


def install_tied_weights(
    stage: PipelineStage,
    split: Split,
    schedule: ScheduleName,
    accumulate: int,
    topology: Topology,
    rank: int,
    groups: LinkGroups,
    timeout: float,
) -> list[TiedWeight]:
    """Install the tied-weight rule on this rank's ``stage`` (first or last) for every tie of ``split``, over
    a `TiedExchange` with the other copy's rank."""
    s, last = topology.stage_of(rank), topology.num_stages - 1
    if not split.ties or s not in (0, last):
        return []
    replica = topology.replica_of(rank)
    peer_stage = last if s == 0 else 0
    peer = topology.rank_of(peer_stage, replica)
    delay = tie_delay(topology.num_stages, accumulate)
    # The peer receives a tied gradient at most `delay` updates after it was sent (pipeline.tied).
    exchange = TiedExchange(s, peer, peer_stage, groups, timeout, stage.device, send_window=delay + 2)
    return tie_stage(stage, split, schedule, delay, exchange)


def tie_stage(
    stage: PipelineStage, split: Split, schedule: ScheduleName, delay: int, exchange: Exchange
) -> list[TiedWeight]:
    """Install the rule on ``stage`` (the first or the last) for every tie of ``split``: its copy of each tied
    weight, found at the copy's place in the module, exchanged over ``exchange``."""
    tied = []
    for tie in split.ties:
        part, name = tie.first if stage.is_first else tie.last
        _, parent, attr = split.slots[part]
        param = parent._modules[attr].get_parameter(name)  # type: ignore[union-attr]
        setattr(param, TIED_ATTR, stage.is_first)  # True on the copy counted in a pipeline-wide norm
        tied.append(TiedWeight(param, stage.is_first, schedule, delay, exchange))
    stage.exchange_tied = _all(tied)
    return tied


def untag(tied: list[TiedWeight]) -> None:
    """Take the tied-weight mark off ``tied``'s copies (a module kept whole in one process, after training)."""
    for t in tied:
        t.param.__dict__.pop(TIED_ATTR, None)


def _all(tied: list[TiedWeight]) -> Callable[[], None]:
    def exchange() -> None:
        for t in tied:
            t()

    return exchange


def counted_in_global_norm(param: nn.Parameter) -> bool:
    """Whether a pipeline-wide gradient norm counts ``param``: a tied weight's second copy holds the same
    gradient as the first, so the exact (flush) norm counts it once."""
    return getattr(param, TIED_ATTR, True)


def is_tied(param: nn.Parameter) -> bool:
    """Whether ``param`` is one copy of a weight tied across stages."""
    return hasattr(param, TIED_ATTR)
