"""What a stage-boundary message looks like on the wire: its header, and how its tensors travel.

A message is a fixed-size int64 header followed by its payload transfers. The header carries the
micro-batch index (checked on arrival: a mismatch is a schedule bug, caught at once) and each tensor's
dtype and shape, so stages can exchange tuples of any shape and dtype, and shapes may change between
micro-batches (variable sequence lengths). Both ends derive the payload transfers from those specs
with the same `WireFormat` (`WireFormat.plan`), so the header says nothing about them:

- **Packing.** Every tensor below ``pack_below`` bytes (on the wire) shares one byte buffer: a
  boundary that carries a hidden state plus a float64 token count, a mask and rotary tables is then
  two transfers, not five; on NCCL each transfer is a kernel launch and a stream-ordered operation.
  Large tensors travel alone, uncopied.
- **Wire dtype.** ``float32_as=torch.bfloat16`` sends float32 tensors (activations and gradients: the
  residual stream stays fp32 under bf16-mixed) as bfloat16 and casts them back on arrival: half the
  bytes, at the cost of rounding every boundary tensor to bf16's 8 significant bits (BENCHMARKS.md,
  "bf16 on the wire", measures what that does to training). Other dtypes travel as they are; complex
  tensors as their real view.

The in-process transport applies the same cast (`WireFormat.round_trip`), so one process stays
bit-identical to S processes under either format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lit_efficient.runtime.stage import Payload

HEADER_LEN = 256
_NONE = -1
_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
)  # fmt: skip
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_REQUIRES_GRAD = 64  # added to a tensor's dtype code when it requires grad on the sending side
_ALIGN = 16  # bytes: every packed tensor starts at a multiple, so its view has any dtype's alignment

Spec = tuple[torch.dtype, tuple[int, ...]] | None  # a payload tensor's dtype and shape; None for None
Specs = tuple[Spec, ...]


def encode_header(microbatch: int, tensors: Payload) -> list[int]:
    """Header fields for ``tensors``: ``[microbatch, count, (dtype, ndim, *shape) per tensor]``."""
    fields = [microbatch, len(tensors)]
    for t in tensors:
        if t is None:
            fields.append(_NONE)
            continue
        if t.dtype not in _DTYPE_CODE:
            raise TypeError(f"cannot send a {t.dtype} tensor between stages; supported: {list(_DTYPE_CODE)}")
        # The receiver makes a tensor a gradient-collecting leaf only if it required grad here: side
        # inputs (rotary cos/sin, float masks) then get no gradient computed or sent back.
        fields += [_DTYPE_CODE[t.dtype] + _REQUIRES_GRAD * t.requires_grad, t.dim(), *t.shape]
    if len(fields) > HEADER_LEN:
        raise ValueError(
            f"a stage boundary carries {len(tensors)} tensors whose shapes need {len(fields)} header fields "
            f"(> {HEADER_LEN}); pass fewer tensors between pipeline layers"
        )
    return fields


def decode_header(fields: list[int]) -> tuple[int, list[Spec]]:
    """Inverse of `encode_header`: the micro-batch and, per tensor, its dtype and shape (None for None)."""
    microbatch, specs, _ = _decode(fields)
    return microbatch, specs


def decode_requires_grad(fields: list[int]) -> list[bool]:
    """Per tensor of a header: whether it required grad on the sending side (False for None)."""
    return _decode(fields)[2]


def _decode(fields: list[int]) -> tuple[int, list[Spec], list[bool]]:
    microbatch, count, pos = fields[0], fields[1], 2
    specs: list[Spec] = []
    grads: list[bool] = []
    for _ in range(count):
        code = fields[pos]
        if code == _NONE:
            specs.append(None)
            grads.append(False)
            pos += 1
            continue
        ndim = fields[pos + 1]
        specs.append((_DTYPES[code % _REQUIRES_GRAD], tuple(fields[pos + 2 : pos + 2 + ndim])))
        grads.append(code >= _REQUIRES_GRAD)
        pos += 2 + ndim
    return microbatch, specs, grads


def specs_of(tensors: Payload) -> Specs:
    """Each tensor's dtype and shape (None for None): what the header describes."""
    return tuple(None if t is None else (t.dtype, tuple(t.shape)) for t in tensors)


@dataclass(frozen=True)
class Plan:
    """The payload transfers of one message: ``transfers[k]`` is the (dtype, shape) of buffer k; tensor i
    is ``where[i]``: None (a None entry), ``(k, None)`` (buffer k alone) or ``(k, offset)`` (bytes at
    ``offset`` of the packed uint8 buffer k)."""

    transfers: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    where: tuple[tuple[int, int | None] | None, ...]
    wire: tuple[torch.dtype | None, ...] = field(default=())  # per tensor: its dtype on the wire


@dataclass(frozen=True)
class WireFormat:
    """How the tensors of a message travel (module docstring). Both ends of a link must use the same.

    Args:
        float32_as: The dtype float32 tensors travel in: ``torch.float32`` (exact) or ``torch.bfloat16``.
        pack_below: Tensors smaller than this many bytes on the wire share one buffer.
    """

    float32_as: torch.dtype = torch.float32
    pack_below: int = 64 << 10

    def __post_init__(self) -> None:
        if self.float32_as not in (torch.float32, torch.bfloat16):
            raise ValueError(f"float32_as={self.float32_as} must be torch.float32 or torch.bfloat16")

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a tensor of ``dtype`` travels in."""
        if dtype == torch.float32:
            return self.float32_as
        if dtype.is_complex:
            return torch.float32 if dtype == torch.complex64 else torch.float64  # its real view
        return dtype

    def round_trip(self, t: Tensor) -> Tensor:
        """What arrives when ``t`` is sent: ``t`` itself unless its wire dtype rounds it."""
        wire = self.wire_dtype(t.dtype)
        return t if wire == t.dtype or t.is_complex() else _to_wire(t, wire).to(t.dtype)

    def plan(self, specs: Specs) -> Plan:
        """The transfers of a message of ``specs`` (deterministic: both ends compute the same)."""
        transfers: list[tuple[torch.dtype, tuple[int, ...]]] = []
        where: list[tuple[int, int | None] | None] = []
        wires: list[torch.dtype | None] = []
        packed: list[tuple[int, int]] = []  # (tensor index, offset)
        offset = 0
        for i, spec in enumerate(specs):
            if spec is None:
                where.append(None)
                wires.append(None)
                continue
            dtype, shape = spec
            wire = self.wire_dtype(dtype)
            wire_shape = (*shape, 2) if dtype.is_complex else shape
            nbytes = _numel(wire_shape) * wire.itemsize
            wires.append(wire)
            if nbytes >= self.pack_below:
                where.append((len(transfers), None))
                transfers.append((wire, wire_shape))
            else:
                where.append(None)  # filled below, once the packed buffer's index is known
                packed.append((i, offset))
                offset += -(-nbytes // _ALIGN) * _ALIGN
        if packed:
            k = len(transfers)
            transfers.append((torch.uint8, (offset,)))
            for i, off in packed:
                where[i] = (k, off)
        return Plan(tuple(transfers), tuple(where), tuple(wires))

    def encode(self, tensors: Payload, plan: Plan, device: torch.device) -> list[Tensor]:
        """The buffers to send for ``tensors``, one per transfer of ``plan``."""
        out: list[Tensor | None] = [None] * len(plan.transfers)
        for t, loc, wire in zip(tensors, plan.where, plan.wire, strict=True):
            if t is None or loc is None:
                continue
            k, offset = loc
            # A conjugate or negative view (z.conj(), its .imag) is lazy: view_as_real refuses it, a byte view of a
            # one-element one too, until it is resolved (nothing to do for any other tensor).
            x = t.detach().resolve_conj().resolve_neg()
            x = torch.view_as_real(x) if x.is_complex() else _to_wire(x, wire)
            if offset is None:
                out[k] = x.contiguous()
                continue
            if out[k] is None:
                out[k] = torch.zeros(plan.transfers[k][1], dtype=torch.uint8, device=device)
            flat = x.contiguous().reshape(-1)
            if flat.numel() and flat.stride(0) != 1:  # one element at another stride counts as contiguous (a .imag)
                flat = flat.clone(memory_format=torch.contiguous_format)
            raw = flat.view(torch.uint8)
            out[k][offset : offset + raw.numel()].copy_(raw)  # type: ignore[index]
        return out  # type: ignore[return-value]

    def decode(self, buffers: list[Tensor], specs: Specs, plan: Plan) -> Payload:
        """The tensors of a message of ``specs`` from its received ``buffers``, in their own dtypes."""
        out: list[Tensor | None] = []
        for spec, loc, wire in zip(specs, plan.where, plan.wire, strict=True):
            if spec is None or loc is None:
                out.append(None)
                continue
            dtype, shape = spec
            k, offset = loc
            if offset is None:
                x = buffers[k]
            else:
                wire_shape = (*shape, 2) if dtype.is_complex else shape
                n = _numel(wire_shape) * wire.itemsize  # type: ignore[union-attr]
                # A copy: the segment is small, and a view would keep the whole buffer alive.
                x = buffers[k][offset : offset + n].view(wire).reshape(wire_shape).clone()
            out.append(torch.view_as_complex(x) if dtype.is_complex else x.to(dtype))
        return tuple(out)


def _to_wire(t: Tensor, wire: torch.dtype) -> Tensor:
    """``t`` in its wire dtype. float32 to bfloat16 saturates at bfloat16's largest finite values: float32's own
    extremes round past them to infinities, and Hugging Face's additive attention masks are
    ``torch.finfo(float32).min``, so a masked row (left padding) became all -inf and its softmax NaN."""
    if wire == torch.bfloat16 and t.dtype == torch.float32:
        limit = torch.finfo(torch.bfloat16).max
        # Finite values only: a real infinity (an overflow) stays one, for on_nonfinite to see.
        return torch.where(t.isinf(), t, t.clamp(-limit, limit)).to(wire)
    return t.to(wire)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
