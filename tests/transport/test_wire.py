"""The wire format on its own (no processes): packing and the wire dtype give back what was sent."""

from __future__ import annotations

import pytest
import torch

from lit_efficient.transport.wire import WireFormat, specs_of


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
        # Lazy views: a conjugate (`z.conj()`: view_as_real refused it on processes) and a negative one (its imag).
        torch.randn(3, 2, generator=g, dtype=torch.complex64).conj(),
        torch.randn(3, 2, generator=g, dtype=torch.complex64).conj().imag,
        torch.randn((), generator=g, dtype=torch.complex64).conj().imag,  # one element at stride 2: no byte view
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
    assert len(plan.transfers) == 2 and plan.transfers[1][0] == torch.uint8  # the eight small ones together


def test_bf16_wire_rounds_float32_only_and_halves_its_bytes():
    wire = WireFormat(torch.bfloat16, pack_below=1024)
    sent = _message()
    plan, got = _send(wire, sent)
    assert plan.transfers[0] == (torch.bfloat16, (16, 64))
    assert torch.equal(got[0], sent[0].to(torch.bfloat16).float()) and got[0].dtype == torch.float32
    assert 0 < (got[0] - sent[0]).abs().max() <= sent[0].abs().max() * 2**-8  # bf16's 8 significant bits
    for a, b in zip(sent[2:-2], got[2:-2], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)  # float64, bool, int64, complex, bf16: untouched
    for a, b in zip(sent[-2:], got[-2:], strict=True):
        assert torch.equal(b, a.to(torch.bfloat16).float())  # float32 views, rounded as any float32
    assert torch.equal(wire.round_trip(sent[0]), got[0])  # what the in-process transport hands over


@pytest.mark.parametrize("pack_below", [1, 1 << 20], ids=["alone", "packed"])
def test_bf16_wire_keeps_an_attention_masks_extremes_finite(pack_below):
    """Hugging Face's additive masks hold torch.finfo(float32).min, which rounds past bfloat16's largest finite value
    to -inf: a fully masked row (left padding) then had a softmax of NaN and the loss was NaN. The wire saturates."""
    low = torch.finfo(torch.float32).min
    mask = torch.tensor([[0.0, low, low], [low, low, low]])  # the second row: a left-padded position, all masked
    wire = WireFormat(torch.bfloat16, pack_below=pack_below)
    _, (got,) = _send(wire, (mask,))
    assert torch.isfinite(got).all() and got[1, 0] == -torch.finfo(torch.bfloat16).max
    assert torch.isfinite(torch.softmax(got, dim=-1)).all()
    assert torch.equal(wire.round_trip(mask), got)  # one process and processes alike
    overflow = torch.tensor([float("inf"), -float("inf"), float("nan"), 1.0])  # an overflowed activation stays so
    (back,) = _send(wire, (overflow,))[1]
    assert back[0] == float("inf") and back[1] == -float("inf") and back[2].isnan() and back[3] == 1.0


def test_only_float32_or_bfloat16_on_the_wire():
    with pytest.raises(ValueError, match="float32_as"):
        WireFormat(torch.float16)


def _fit(devices: int, wire_dtype: str) -> dict[str, torch.Tensor]:
    from lightning.pytorch import Trainer

    from lit_efficient import PACIStrategy
    from lit_efficient.data import TextDataModule
    from lit_efficient.models import GPT

    torch.manual_seed(0)
    model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=32)
    strategy = PACIStrategy(pipeline_stages=2, wire_dtype=wire_dtype, start_method="forkserver")
    Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=3, accumulate_grad_batches=2,
        val_check_interval=3, limit_val_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    ).fit(model, datamodule=TextDataModule(block_size=32, batch_size=4, max_bytes=60_000))  # fmt: skip
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # spawned Trainer ranks read it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread per stage on both sides, as tests/strategy/test_one_process.py compares them
    yield
    torch.set_num_threads(threads)


@pytest.mark.multiproc
def test_bf16_wire_in_one_process_equals_two_processes(one_thread):
    """The in-process pipeline rounds its boundary tensors as the processes' wire does: bit-identical."""
    one, two, exact = _fit(1, "bfloat16"), _fit(2, "bfloat16"), _fit(1, "float32")
    assert max((one[k] - two[k]).abs().max().item() for k in one) == 0.0
    assert max((one[k] - exact[k]).abs().max().item() for k in one) > 0.0  # the rounding took effect


def test_wire_dtype_is_refused_unless_float32_or_bfloat16():
    from lit_efficient import PACIStrategy

    with pytest.raises(ValueError, match="wire_dtype='float16'"):
        PACIStrategy(wire_dtype="float16")
