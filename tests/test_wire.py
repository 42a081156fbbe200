"""The wire format on its own (no processes): packing and the wire dtype give back what was sent."""

from __future__ import annotations

import pytest
import torch

from lit_efficient.pipeline.wire import WireFormat, specs_of


def _message() -> tuple[torch.Tensor | None, ...]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(16, 64, generator=g),  # 4 KiB of float32: the hidden state
        None,
        torch.tensor(37.0, dtype=torch.float64),  # a token count (0-dim)
        torch.rand(16, generator=g) > 0.5,  # a mask
        torch.randint(0, 9, (3, 5), generator=g),  # int64
        torch.randn(4, 3, generator=g, dtype=torch.complex64),  # rotary freqs_cis
        torch.randn(2, 3, generator=g).to(torch.bfloat16),
    )


def _send(wire: WireFormat, tensors):
    plan = wire.plan(specs_of(tensors))
    buffers = [b.clone() for b in wire.encode(tensors, plan, torch.device("cpu"))]  # as if received
    assert [(b.dtype, tuple(b.shape)) for b in buffers] == list(plan.transfers)
    return plan, wire.decode(buffers, specs_of(tensors), plan)


@pytest.mark.parametrize("pack_below", [1, 64, 1 << 20])
def test_native_wire_gives_back_every_tensor_bit_for_bit(pack_below):
    sent = _message()
    _, got = _send(WireFormat(pack_below=pack_below), sent)
    for a, b in zip(sent, got, strict=True):
        assert (a is None and b is None) or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))


def test_small_tensors_share_one_transfer_and_large_ones_travel_alone():
    plan, _ = _send(WireFormat(pack_below=1024), _message())
    assert plan.transfers[0] == (torch.float32, (16, 64))  # alone, uncopied
    assert len(plan.transfers) == 2 and plan.transfers[1][0] == torch.uint8  # the five small ones together


def test_bf16_wire_rounds_float32_only_and_halves_its_bytes():
    wire = WireFormat(torch.bfloat16, pack_below=1024)
    sent = _message()
    plan, got = _send(wire, sent)
    assert plan.transfers[0] == (torch.bfloat16, (16, 64))
    assert torch.equal(got[0], sent[0].to(torch.bfloat16).float()) and got[0].dtype == torch.float32
    assert 0 < (got[0] - sent[0]).abs().max() <= sent[0].abs().max() * 2**-8  # bf16's 8 significant bits
    for a, b in zip(sent[2:], got[2:], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)  # float64, bool, int64, complex, bf16: untouched
    assert torch.equal(wire.round_trip(sent[0]), got[0])  # what the in-process transport hands over


def test_only_float32_or_bfloat16_on_the_wire():
    with pytest.raises(ValueError, match="float32_as"):
        WireFormat(torch.float16)
