"""PointToPoint on real processes (gloo): messages arrive intact and in order whatever their shapes.

The receiver posts the payload irecvs of the previous message's specs together with the header
(sometimes early, through `prepost`), and the sender covers a change of specs with placeholders;
these tests drive every transition of that protocol and compare each received tensor bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lit_efficient.transport.collectives import all_reduce_in_rank_order, flat_in_place, sum_in_order
from lit_efficient.transport.failures import PipelineCommError
from lit_efficient.transport.local import LocalStageSum
from lit_efficient.transport.process import PointToPoint
from lit_efficient.transport.wire import WireFormat
from tests.support.multiproc import spawn, values

pytestmark = pytest.mark.multiproc


def _message(i: int) -> tuple[torch.Tensor | None, ...]:
    """Message ``i`` of a stream whose specs stay, change shape, change dtype, gain and lose Nones."""
    g = torch.Generator().manual_seed(i)
    kinds = [
        ((4, 8), None),
        ((4, 8), None),  # unchanged: payloads arrive in the pre-posted buffers
        ((4, 8), None),
        ((3, 8), None),  # shape change: placeholders absorb the posted irecvs
        ((3, 8), (2,)),  # a tensor more
        (None, (2,)),  # first tensor now None
        (None, (2,)),
        ((5,), (2,)),
        ((5,), (2,)),
        (),  # an empty message
        ((6, 2), None),
        ((6, 2), None),
    ]
    shapes = kinds[i % len(kinds)]
    out: list[torch.Tensor | None] = []
    for k, shape in enumerate(shapes):
        if shape is None:
            out.append(None)
        elif k == 1 and i % 2:
            out.append(torch.randint(0, 100, shape, generator=g))  # int64 on odd messages: a dtype change
        else:
            out.append(torch.randn(shape, generator=g))
    return tuple(out)


def _same(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    return all(
        (x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def _exchange(rank, world, messages, prepost_every, wire=None):
    comm = PointToPoint(rank, lambda r: r, torch.device("cpu"), timeout=60.0, wire=wire)
    wire = comm.wire
    if rank == 0:
        for i in range(messages):
            comm.send(_message(i), 1, i, "activations")
            comm.send(_message(i + 1000), 1, i + 1000, "activations")
            if i % 5 == 4:
                comm.flush()  # sends complete in between, too
        comm.flush()
        return "sent"
    bad = []
    for i in range(messages):
        for j in (i, i + 1000):
            if prepost_every and j % prepost_every == 0:
                comm.prepost(0)
                comm.prepost(0)  # a second call is a no-op: one message, one posted receive
            got = comm.recv(0, j, "activations")
            if not _same(got, tuple(None if t is None else wire.round_trip(t) for t in _message(j))):
                bad.append(j)
    return bad


@pytest.mark.parametrize(
    ("prepost_every", "wire"),
    [
        (0, None),
        (1, None),
        (3, None),
        (1, WireFormat(torch.bfloat16)),  # every tensor packed into one buffer, float32 as bf16
        (3, WireFormat(torch.bfloat16, pack_below=64)),  # (4, 8) fp32 alone, (2,) int64 packed
    ],
)
def test_every_message_arrives_intact_across_spec_changes(prepost_every, wire):
    """Intact: bit for bit, or as the wire format rounds it (float32 as bf16)."""
    results = spawn(_exchange, 2, 24, prepost_every, wire, timeout=120)
    sent, bad = values(results)
    assert sent == "sent"
    assert bad == [], f"messages received wrong: {bad}"


def _mismatch(rank, world):
    comm = PointToPoint(rank, lambda r: r, torch.device("cpu"), timeout=30.0)
    if rank == 0:
        comm.send((torch.ones(3),), 1, 7, "activations")  # its payload is never received: no flush
        dist.barrier()  # stay alive until the receiver has read the header
        return None
    try:
        comm.recv(0, 6, "activations")
        message = "no error"
    except PipelineCommError as err:
        message = str(err)
    dist.barrier()
    return message


def test_a_message_for_another_micro_batch_is_a_clear_error():
    message = spawn(_mismatch, 2, timeout=60)[1]["ok"]
    assert "expected activations of micro-batch 6" in message
    assert "received micro-batch 7" in message


def _stage_sums(rank: int, world_size: int, cases: list[list[float]]) -> list[float]:
    sums = []
    for parts in cases:
        t = torch.tensor([parts[rank]])
        all_reduce_in_rank_order(t)
        sums.append(t.item())
    return sums


def _local_stage_sums(parts: list[float]) -> list[float]:
    local = LocalStageSum(list(range(len(parts))))
    for s, p in enumerate(parts):
        local.post(s, torch.tensor([p]))
    sums = []
    for s in range(len(parts)):
        t = torch.zeros(1)
        local.all_reduce(s, t)
        sums.append(t.item())
    return sums


@pytest.mark.parametrize("stages", [3, 4])
def test_stage_sum_on_processes_equals_one_process_bit_for_bit(stages):
    """Flush's norm clipping sums the stages' squared norms: `all_reduce_in_rank_order` on processes,
    `LocalStageSum` in one process. With one number 1 (on each stage in turn) and the others 2**-24 the
    sum's last bit depends on the order (1 + 2**-24 rounds back to 1, 2**-24 + 2**-24 does not); gloo's
    all-reduce, which the processes used before, gave 1 + 2**-23 where one process gives 1 for some of
    these placements (a different clipping scale in one process than on processes)."""
    cases = [[1.0 if s == big else 2.0**-24 for s in range(stages)] for big in range(stages)]
    orders = {sum_in_order([torch.tensor([p]) for p in parts]).item() for parts in cases}
    assert len(orders) > 1  # the order matters for these numbers
    here = [_local_stage_sums(parts) for parts in cases]
    on_processes = values(spawn(_stage_sums, stages, cases, timeout=120))  # per rank, per case
    assert [list(case) for case in zip(*on_processes, strict=True)] == here


def _many_messages(rank, world, messages, window):
    comm = PointToPoint(rank, lambda r: r, torch.device("cpu"), timeout=60.0, send_window=window)
    if rank == 0:
        held = []
        for i in range(messages):
            comm.send((torch.full((64, 64), float(i)),), 1, i, "activations")
            held.append(len(comm._sends))
        comm.flush()
        return max(held)
    return all(comm.recv(0, i, "activations")[0][0, 0].item() == i for i in range(messages))


def test_sends_are_released_within_the_window_on_gloo():
    """gloo's Work reports a send complete only once waited on: without the window every sent tensor stayed alive
    until the next drain (resident memory grew by an activation per micro-batch)."""
    held, received = values(spawn(_many_messages, 2, 60, 3, timeout=120))
    assert received is True
    # Two transfers a message (header, payload), the last 3 messages' at most; it was all 120 of them.
    assert held <= 2 * 3, f"{held} sends in flight after 60 messages with a window of 3"


def test_a_tensor_given_twice_is_packed_and_sent_once():
    """The replicas' weight broadcasts pass a stage's parameters, where a weight shared by two of its layers appears
    twice: each caller deduplicated them itself; the packing does it once for every collective."""
    shared, other = torch.ones(3), torch.full((2,), 2.0)
    seen = []

    def double(flat):
        seen.append(flat.numel())
        flat.mul_(2)

    sent = flat_in_place([shared, other, shared], double)
    assert seen == [5] and sent == 5 * 4
    assert shared.tolist() == [2.0] * 3 and other.tolist() == [4.0] * 2  # each doubled once
