"""The only module that talks to the network: point-to-point transfers and collectives.

Stages and averagers describe what they need (tensors, a peer, a group); this module issues the
torch.distributed calls, owns every `Work` handle, and turns a dead or silent peer into an error
that names it instead of a hang.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def all_reduce_flat(tensors: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> int:
    """Sum ``tensors`` in place across ``group`` with one collective, returning the bytes sent.

    Tensors are packed into one contiguous buffer per dtype (one all-reduce each, usually one in
    all) rather than one collective per tensor: per-call latency dominates small tensors, and a
    transformer stage has hundreds of them.
    """
    by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    sent = 0
    for bucket in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for t in bucket:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
        sent += flat.numel() * flat.element_size()
    return sent
