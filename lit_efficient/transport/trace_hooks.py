"""The transports' calls into the NCCL order recorder (`p2p_trace`): every issue and wait of a point-to-point
operation or collective, recorded when ``LIT_EFFICIENT_P2P_TRACE`` asks, nothing otherwise."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from lit_efficient.transport import p2p_trace


def trace_issue(work: dist.Work, kind: str, peer: int | None, group: dist.ProcessGroup | None, t: Tensor,
                 device: bool, role: str, what: str) -> None:  # fmt: skip
    """Record an operation for the NCCL order check (`p2p_trace`), when ``LIT_EFFICIENT_P2P_TRACE`` asks."""
    rec = p2p_trace.recorder(dist.get_rank)
    if rec is not None:
        name = (group if group is not None else dist.group.WORLD).group_name
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        rec.issue(work, kind, peer, name, ranks, t.numel() * t.element_size(), device, role, what)


def trace_wait(work: dist.Work) -> None:
    rec = p2p_trace.recorder(dist.get_rank)
    if rec is not None:
        rec.wait(work)
