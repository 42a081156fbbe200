"""The only module that talks to the network: point-to-point transfers and collectives.

Stages and averagers describe what they need (tensors, a peer, a group); this module issues the
torch.distributed calls, owns every `Work` handle, and turns a dead or silent peer into an error
that names it instead of a hang.

It also owns the other transport: `LocalExchange`, mailboxes between the stages of a pipeline that
runs whole in one process (``Trainer(devices=1)``). Both answer the same calls; the runtime only asks
`ready` before a receive, which a blocking transport always answers yes.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

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


class PipelineCommError(RuntimeError):
    """A peer stage failed, died or went silent; the message names it."""


# A message is a fixed-size int64 header followed by one payload transfer per tensor. The header
# carries the micro-batch index (checked on arrival: a mismatch is a schedule bug, caught at once)
# and each tensor's dtype and shape, so stages can exchange tuples of any shape and dtype, and
# shapes may change between micro-batches (variable sequence lengths). Headers always travel on a
# CPU (gloo) group: reading one on the host costs no device synchronization when payloads go over
# NCCL.
#
# Gloo transfers are rendezvous: data moves only once the receiver has posted its irecv, so each
# posted-then-awaited receive costs a round trip through both processes' gloo threads, and on a
# busy CPU that is a scheduling delay, not microseconds. Reading the header before posting the
# payload irecvs would put two of them on the pipeline's critical path. Instead both ends of a
# channel (one sender, one receiver) remember the specs of the last message on it, and the receiver
# posts the header AND payload irecvs of those specs at once (possibly early, see `prepost`).
# When the specs change, the sender first sends placeholder payloads of the old specs, which the
# already-posted irecvs absorb, then the real ones: a shape change costs one wasted transfer, the
# steady state none.
_HEADER_LEN = 256
_NONE = -1
_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_REQUIRES_GRAD = 64  # added to a tensor's dtype code when it requires grad on the sending side
_ABORT_KEY = "lit_efficient/abort"

Payload = tuple[Tensor | None, ...]
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
    if len(fields) > _HEADER_LEN:
        raise ValueError(
            f"a stage boundary carries {len(tensors)} tensors whose shapes need {len(fields)} header fields "
            f"(> {_HEADER_LEN}); pass fewer tensors between pipeline layers"
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


@dataclass
class _PostedRecv:
    """The irecvs posted for the next message of one channel: header plus payloads of ``specs``."""

    header: Tensor
    header_work: dist.Work
    specs: Specs
    buffers: list[Tensor]
    works: list[dist.Work]


class PointToPoint:
    """Activations and gradients between neighbouring stages of one pipeline.

    Sends are non-blocking: the `Work` handle and its tensor are kept until the transfer completes
    (the tensor must stay alive until then) and reaped at the next send or in `flush`. Receives
    block with ``timeout`` seconds; a peer that died surfaces within seconds as a closed
    connection, one that hangs after ``timeout``, and either way the error names the peer's stage
    and rank and the micro-batch being waited for.

    Each (sender, receiver) pair is one FIFO channel whose two ends track the specs of its last
    message (see the protocol note above), so every rank must send and receive through one
    `PointToPoint` in the order its schedule says, which the pipeline's schedules guarantee.

    Args:
        stage: This rank's stage (for messages).
        stage_of_rank: Maps a global rank to its stage (for messages).
        device: Where received payloads are allocated.
        timeout: Seconds to wait for one transfer before declaring the peer hung.
        group: Group carrying payloads (None: the default group); gloo on CPU, NCCL on CUDA.
        header_group: CPU (gloo) group carrying headers; None: the same as ``group``.
    """

    def __init__(
        self,
        stage: int,
        stage_of_rank: Callable[[int], int],
        device: torch.device,
        timeout: float,
        group: dist.ProcessGroup | None = None,
        header_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.stage = stage
        self.rank = dist.get_rank()
        self._stage_of_rank = stage_of_rank
        self._device = device
        self._timeout = timedelta(seconds=timeout)
        self._group = group
        self._header_group = header_group if header_group is not None else group
        # (work, tensor kept alive until sent, peer, micro-batch, what)
        self._pending: list[tuple[dist.Work, Tensor, int, int, str]] = []
        self._sent_specs: dict[int, Specs] = {}  # per destination: specs of the last message sent
        self._recv_specs: dict[int, Specs] = {}  # per source: specs of the last message received
        self._posted: dict[int, _PostedRecv] = {}  # per source: irecvs posted for its next message
        self.bytes_sent = 0

    def ready(self, src: int) -> bool:
        """Whether a receive from ``src`` may be issued now: always, since it blocks until the message comes."""
        return True

    @property
    def can_prepost(self) -> bool:
        """Whether receives may be posted ahead of the schedule's order.

        On NCCL, point-to-point operations between two ranks execute in issue order on one stream,
        so an early irecv would queue ahead of a send the peer is waiting for: deadlock.
        """
        return self._device.type == "cpu"

    def send(self, tensors: Payload, dst: int, microbatch: int, what: str) -> None:
        """Start sending ``tensors`` (None entries allowed) for ``microbatch`` to global rank ``dst``."""
        self._reap()
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        fields = encode_header(microbatch, tensors)
        header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
        self._isend(header, dst, self._header_group, microbatch, what)
        specs = _specs_of(tensors)
        expected = self._sent_specs.get(dst)
        if expected is not None and expected != specs:
            for spec in expected:  # placeholders for the payload irecvs the receiver already posted
                if spec is not None:
                    placeholder = torch.empty(spec[1], dtype=spec[0], device=self._device)
                    self._isend(placeholder, dst, self._group, microbatch, what)
        for t in tensors:
            if t is not None:
                payload = t.detach().contiguous()
                self._isend(payload, dst, self._group, microbatch, what)
                self.bytes_sent += payload.numel() * payload.element_size()
        self._sent_specs[dst] = specs

    def prepost(self, src: int) -> None:
        """Post the irecvs for the next message from ``src`` now, if not already posted.

        Call it only for a message that is certain to come (the caller's schedule says so): a
        posted receive cannot be withdrawn, and one left posted would swallow an unrelated later
        message. Does nothing where `can_prepost` is False.
        """
        if self.can_prepost and src not in self._posted:
            self._posted[src] = self._post(src)

    def recv(self, src: int, microbatch: int, what: str) -> Payload:
        """Receive the ``what`` of ``microbatch`` from global rank ``src``; blocks up to the timeout."""
        posted = self._posted.pop(src, None) or self._post(src)
        self._wait(posted.header_work, src, microbatch, what)
        fields = posted.header.tolist()
        got, specs = decode_header(fields)
        if got != microbatch:
            raise PipelineCommError(
                f"stage {self.stage} (rank {self.rank}) expected {what} of micro-batch {microbatch} from rank "
                f"{src} but received micro-batch {got}: the two stages run different schedules"
            )
        for work in posted.works:  # the payloads, or the placeholders sent because the specs changed
            self._wait(work, src, microbatch, what)
        buffers = posted.buffers
        if tuple(specs) != posted.specs:
            buffers, works = self._post_payloads(src, tuple(specs))
            for work in works:
                self._wait(work, src, microbatch, what)
        self._recv_specs[src] = tuple(specs)
        filled = iter(buffers)
        received = tuple(None if spec is None else next(filled) for spec in specs)
        return tuple(
            t.requires_grad_() if t is not None and grad else t
            for t, grad in zip(received, decode_requires_grad(fields), strict=True)
        )

    def _post(self, src: int) -> _PostedRecv:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        header_work = dist.irecv(header, src, group=self._header_group)
        specs = self._recv_specs.get(src, ())
        return _PostedRecv(header, header_work, specs, *self._post_payloads(src, specs))

    def _post_payloads(self, src: int, specs: Specs) -> tuple[list[Tensor], list[dist.Work]]:
        buffers = [torch.empty(spec[1], dtype=spec[0], device=self._device) for spec in specs if spec is not None]
        return buffers, [dist.irecv(buf, src, group=self._group) for buf in buffers]

    def flush(self) -> None:
        """Wait for every send in flight (before a checkpoint, at the end of training)."""
        for work, _, dst, microbatch, what in self._pending:
            self._wait(work, dst, microbatch, what)
        self._pending.clear()

    def _isend(self, t: Tensor, dst: int, group: dist.ProcessGroup | None, microbatch: int, what: str) -> None:
        work = dist.isend(t, dst, group=group)
        self._pending.append((work, t, dst, microbatch, what))

    def _reap(self) -> None:
        # Completed sends release their tensors; an unfinished one stays (its peer is just behind).
        still = []
        for work, t, dst, microbatch, what in self._pending:
            if work.is_completed():
                self._wait(work, dst, microbatch, what)  # raises if the send failed
            else:
                still.append((work, t, dst, microbatch, what))
        self._pending = still

    def _wait(self, work: dist.Work, peer: int, microbatch: int, what: str) -> None:
        try:
            work.wait(self._timeout)
        except RuntimeError as err:
            raise PipelineCommError(self._explain(peer, microbatch, what, err)) from err

    def _explain(self, peer: int, microbatch: int, what: str, err: RuntimeError) -> str:
        me = f"stage {self.stage} (rank {self.rank})"
        them = f"stage {self._stage_of_rank(peer)} (rank {peer})"
        waiting = f"{what} of micro-batch {microbatch}"
        timed_out = "timed out" in str(err).lower()
        if timed_out:
            cause = read_failure()  # a stage further up may have timed out on the real culprit first
            message = (
                f"{me} waited {self._timeout.total_seconds():.0f}s for {waiting} with {them} and got nothing: "
                + (
                    f"the pipeline stopped because {cause}"
                    if cause
                    else "that stage is hung or much slower. If it is only slow, raise PACIStrategy(p2p_timeout=...)."
                )
            )
        else:
            cause = read_failure()
            message = f"{me} lost its connection to {them} while exchanging {waiting}: " + (
                f"the pipeline stopped because {cause}" if cause else f"{them} died (killed? out of memory?)"
            )
        if not timed_out:
            # Only a confirmed failure is published: a timeout may be an innocent rank waiting on a
            # chain that ends at the hung stage, and must not be named as the cause to the others.
            report_failure(message)
        return message


class LocalExchange:
    """The links between the stages of one pipeline that runs in a single process.

    One FIFO mailbox per (sender, receiver) pair of (virtual) ranks, the same channels the process
    transport has. Payloads are handed over as detached tensors, not copies: a sender never writes
    to what it sent (it keeps it only for its own backward, if at all), so a copy would double the
    activations at every stage boundary for nothing.
    """

    def __init__(self) -> None:
        self._boxes: dict[tuple[int, int], deque[tuple[int, Payload]]] = {}

    def endpoint(self, rank: int, stage: int, stage_of_rank: Callable[[int], int]) -> LocalPointToPoint:
        """The transport of the stage that plays ``rank``."""
        return LocalPointToPoint(self, rank, stage, stage_of_rank)

    def box(self, src: int, dst: int) -> deque[tuple[int, Payload]]:
        """The mailbox of messages from ``src`` to ``dst``."""
        return self._boxes.setdefault((src, dst), deque())

    @property
    def pending(self) -> int:
        """Messages sent and not yet received (0 once the pipeline is drained)."""
        return sum(len(box) for box in self._boxes.values())


class LocalPointToPoint:
    """`PointToPoint`'s calls over a `LocalExchange`: sends never wait, a receive takes the next message.

    Args:
        exchange: The mailboxes shared by the pipeline's stages.
        rank: The (virtual) global rank this stage plays, as in the multi-process layout.
        stage: This stage (for messages).
        stage_of_rank: Maps a rank to its stage (for messages).
    """

    can_prepost = False  # nothing to post: a message is in its mailbox or not

    def __init__(self, exchange: LocalExchange, rank: int, stage: int, stage_of_rank: Callable[[int], int]) -> None:
        self.exchange = exchange
        self.rank = rank
        self.stage = stage
        self._stage_of_rank = stage_of_rank
        self.bytes_sent = 0

    def ready(self, src: int) -> bool:
        """Whether the next message from ``src`` has arrived."""
        return bool(self.exchange.box(src, self.rank))

    def send(self, tensors: Payload, dst: int, microbatch: int, what: str) -> None:
        """Put ``tensors`` for ``microbatch`` into ``dst``'s mailbox."""
        # Detached, but saying whether it required grad, as the process transport's header does: the
        # receiving stage makes only those collect a gradient to send back (side inputs get none).
        payload = tuple(None if t is None else t.detach().requires_grad_(t.requires_grad) for t in tensors)
        self.bytes_sent += sum(t.numel() * t.element_size() for t in payload if t is not None)
        self.exchange.box(self.rank, dst).append((microbatch, payload))

    def prepost(self, src: int) -> None:
        """Nothing to do in one process."""

    def recv(self, src: int, microbatch: int, what: str) -> Payload:
        """The next message from ``src``, which must be ``microbatch``'s ``what``."""
        box = self.exchange.box(src, self.rank)
        me, them = f"stage {self.stage}", f"stage {self._stage_of_rank(src)}"
        if not box:
            raise PipelineCommError(
                f"{me} of the in-process pipeline needs {what} of micro-batch {microbatch} from {them}, which has "
                "not sent it: the stages wait on each other (a schedule bug)"
            )
        got, payload = box.popleft()
        if got != microbatch:
            raise PipelineCommError(
                f"{me} expected {what} of micro-batch {microbatch} from {them} but received micro-batch {got}: "
                "the two stages run different schedules"
            )
        return payload

    def flush(self) -> None:
        """Nothing in flight: sends complete at once."""


def _specs_of(tensors: Payload) -> Specs:
    return tuple(None if t is None else (t.dtype, tuple(t.shape)) for t in tensors)


_printed_failure = False


def report_failure(message: str) -> None:
    """Publish the first failure of the run in the rendezvous store, so peers can name the cause, and
    print this process's first one to stderr at once: a launcher that sees a rank die may kill the others
    (Lightning's does, within seconds) before their exception's traceback is printed.

    Best effort: the store may be gone with the rank that hosted it.
    """
    global _printed_failure
    if not _printed_failure:
        _printed_failure = True
        print(f"lit-efficient: pipeline failure: {message}", file=sys.stderr, flush=True)
    try:
        store = dist.distributed_c10d._get_default_store()
        store.compare_set(_ABORT_KEY, "", message)
    except Exception:  # noqa: BLE001 - reporting must never hide the original error
        pass


def read_failure() -> str | None:
    """The first failure published by any rank, if one was and the store is still reachable."""
    try:
        store = dist.distributed_c10d._get_default_store()
        if store.check([_ABORT_KEY]):
            return store.get(_ABORT_KEY).decode() or None
    except Exception:  # noqa: BLE001
        return None
    return None


class TiedExchange:
    """Gradients of a tied parameter between the first and the last stage of one pipeline.

    The two ranks share a two-rank group of their own, so these messages never interleave with the
    stage-to-stage stream of `PointToPoint`. Every message has the parameter's shape and dtype, so
    there is no header. Sends are non-blocking (the tensor is kept alive until it is received);
    receives wait up to ``timeout`` and fail naming the peer.

    Args:
        stage: This rank's stage (for messages).
        peer: Global rank of the other copy's stage.
        peer_stage: That rank's stage (for messages).
        group: The two-rank group of this rank and ``peer``.
        timeout: Seconds a receive waits before declaring the peer hung.
    """

    def __init__(self, stage: int, peer: int, peer_stage: int, group: dist.ProcessGroup, timeout: float) -> None:
        self.stage = stage
        self.peer = peer
        self.peer_stage = peer_stage
        self._group = group
        self._timeout = timedelta(seconds=timeout)
        self._pending: list[tuple[dist.Work, Tensor]] = []
        self.bytes_sent = 0

    def all_reduce(self, t: Tensor) -> None:
        """Sum ``t`` in place with the peer's tensor (both ranks call it at the same step)."""
        self._wait(dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._group, async_op=True), "all-reduce")
        self.bytes_sent += t.numel() * t.element_size()

    def send(self, t: Tensor) -> None:
        """Start sending ``t`` to the peer; ``t`` must not be changed until `flush` (or a later send) reaps it."""
        self._pending = [(w, x) for w, x in self._pending if not w.is_completed()]
        self._pending.append((dist.isend(t, self.peer, group=self._group), t))
        self.bytes_sent += t.numel() * t.element_size()

    def recv(self, like: Tensor) -> Tensor:
        """The next tensor the peer sent, shaped like ``like``; blocks up to the timeout."""
        buf = torch.empty_like(like)
        self._wait(dist.irecv(buf, self.peer, group=self._group), "receive")
        return buf

    def flush(self) -> None:
        """Wait for every send in flight."""
        for work, _ in self._pending:
            self._wait(work, "send")
        self._pending.clear()

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(self._timeout)
        except RuntimeError as err:
            raise PipelineCommError(
                f"stage {self.stage} (rank {dist.get_rank()}) failed the tied-weight gradient {what} with stage "
                f"{self.peer_stage} (rank {self.peer}): {err}"
            ) from err
