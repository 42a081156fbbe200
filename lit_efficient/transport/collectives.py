"""Collectives over packed buffers: one all-reduce or broadcast per dtype for a stage's hundreds of tensors, and
a sum of a few numbers in rank order, which one process reproduces bit for bit (`local.LocalStageSum`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lit_efficient.transport.trace_hooks import trace_issue, trace_wait


def all_reduce_flat(tensors: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> int:
    """Sum ``tensors`` in place across ``group`` with one collective, returning the bytes sent.

    Tensors are packed into one contiguous buffer per dtype (one all-reduce each, usually one in
    all) rather than one collective per tensor: per-call latency dominates small tensors, and a
    transformer stage has hundreds of them.
    """

    def all_reduce(flat: Tensor) -> None:
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        trace_issue(work, "all_reduce", None, group, flat, device=True, role="replicas", what="replica all-reduce")
        trace_wait(work)
        work.wait()

    return flat_in_place(tensors, all_reduce)


def sum_in_order(parts: Sequence[Tensor]) -> Tensor:
    """``parts[0] + parts[1] + ...``, added left to right: the one order both transports sum a pipeline's stages in."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def all_reduce_in_rank_order(t: Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Sum ``t`` in place across ``group``, adding the ranks' tensors in rank order (`sum_in_order`).

    An all-reduce adds in its algorithm's order, which one process cannot reproduce (gloo's ring, measured
    at 3 and 4 ranks, does not start at rank 0), so a pipeline in one process (`LocalStageSum`) would differ
    from S processes in the last bit of the sum. Gathering every rank's ``t`` and adding them here gives the
    same bits on every rank, for any group size and backend, as in one process. It costs an all-gather of
    group-size copies of ``t``: meant for a few numbers (a squared norm), not gradients.
    """
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, t.contiguous(), group=group, async_op=True)
    assert work is not None
    # Recorded as the collective it stands for: the order check treats every all_reduce as one collective.
    trace_issue(work, "all_reduce", None, group, t, device=True, role="stages", what="stage sum in rank order")
    trace_wait(work)
    work.wait()
    t.copy_(sum_in_order(parts))


def broadcast_flat(tensors: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> int:
    """Overwrite ``tensors`` in place with the values of ``group``'s first rank, returning the bytes
    handed to the collective. One broadcast per dtype, packed like `all_reduce_flat`."""
    # Global rank of group rank 0; `group_src=` would do this but needs torch >= 2.6.
    src = dist.get_global_rank(group if group is not None else dist.group.WORLD, 0)
    with torch.no_grad():
        return flat_in_place(tensors, lambda flat: dist.broadcast(flat, src=src, group=group))


def flat_in_place(tensors: Sequence[Tensor], collective: Callable[[Tensor], object]) -> int:
    """Run ``collective`` on one packed buffer per (dtype, device) of ``tensors`` and copy the result back
    into them; the bytes handed to it. Also how `replicas.fault_tolerance` packs torchft's all-reduce. A tensor
    given twice (a weight shared by two layers of a stage) is sent once."""
    by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in {id(t): t for t in tensors}.values():
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    sent = 0
    for bucket in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        collective(flat)
        offset = 0
        for t in bucket:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
        sent += flat.numel() * flat.element_size()
    return sent
