"""Process-group links: the point-to-point transfers between stages on different processes.

Stages describe what they need (tensors, a peer); this module issues the torch.distributed calls, owns
every `Work` handle, and turns a dead or silent peer into an error that names it instead of a hang
(`failures`). `PointToPoint` carries activations and gradients in an order that cannot deadlock on NCCL
(`LinkGroups`), `TiedExchange` a tied weight's gradients between the first and the last stage. The same
calls over mailboxes, for stages that share a process, are `local`'s; collectives are `collectives`'.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lit_efficient.runtime.stage import Payload
from lit_efficient.transport.collectives import all_reduce_in_rank_order
from lit_efficient.transport.failures import PipelineCommError, explain_link_failure
from lit_efficient.transport.trace_hooks import trace_issue, trace_wait
from lit_efficient.transport.wire import (
    HEADER_LEN,
    Plan,
    Specs,
    WireFormat,
    decode_header,
    decode_requires_grad,
    encode_header,
    specs_of,
)

# A message is a fixed-size int64 header followed by its payload transfers (lit_efficient.transport.wire:
# the header's fields, the wire dtype, which tensors share one packed buffer). Headers always travel on
# a CPU (gloo) group: reading one on the host costs no device synchronization when payloads go over
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


@dataclass
class _PostedRecv:
    """The irecvs posted for the next message of one channel: header plus the payloads of ``specs``."""

    header: Tensor
    header_work: dist.Work
    specs: Specs
    plan: Plan
    buffers: list[Tensor]
    works: list[dist.Work]


@dataclass(frozen=True)
class LinkGroups:
    """The process groups that carry a pipeline's device payloads: one for each direction of a link.

    ProcessGroupNCCL runs the operations between two ranks of one group on one communicator, in issue
    order, on one stream, for both directions, and a large send completes only when the peer's matching
    receive runs. A stage that queues the receive of its next gradient ahead of the send of its next
    activation, while its neighbour queues the receive of that activation ahead of the gradient's send
    (1F1B's steady state, on every link), deadlocks there. With messages to a lower rank on one group and
    messages to a higher rank on the other, each (group, pair) communicator carries one direction only:
    its k-th send always meets its k-th receive, so no order of issue can hang it, and receives may be
    posted as early as the schedule allows. `lit_efficient.transport.p2p_trace` proves it on recorded runs.

    Both None (the default group for either direction) is gloo's layout only: gloo progresses each
    transfer on its own. `PointToPoint` refuses it on a device.

    Args:
        to_lower: Group carrying messages to a lower global rank.
        to_higher: Group carrying messages to a higher global rank.
    """

    to_lower: dist.ProcessGroup | None = None
    to_higher: dist.ProcessGroup | None = None

    @classmethod
    def create(cls, ranks: Sequence[int] | None = None, timeout: timedelta | None = None) -> LinkGroups:
        """Two new groups of ``ranks`` (default: every rank) on the default backend. Collective: every rank
        calls it, in the same order. ``timeout`` is NCCL's watchdog timeout for their work (None: torch's)."""
        return cls(dist.new_group(ranks, timeout=timeout), dist.new_group(ranks, timeout=timeout))

    @property
    def directed(self) -> bool:
        """Whether the two directions travel on different groups (required on NCCL)."""
        return self.to_lower is not self.to_higher

    def carrying(self, src: int, dst: int) -> dist.ProcessGroup | None:
        """The group of a message from global rank ``src`` to global rank ``dst``."""
        return self.to_higher if dst > src else self.to_lower

    def connect(self, me: int, peers: Sequence[int], device: torch.device, role: str) -> None:
        """Create the communicators between ``me`` and each of ``peers`` now: one tiny message each way.

        NCCL creates a (group, pair) communicator at its first operation, and creating it blocks both ranks
        until both get there. Left to the schedule, a rank's first send in one direction can wait there for
        a peer that first needs this rank's traffic on another link or group (PACI's first tied-weight
        send does, at stage 0). Here every rank creates its links in one global order (ascending pairs),
        so these rendezvous cannot cross. Collective over each link: both ranks call it. On gloo it costs
        two tiny round trips per link, once; it runs there too, so CPU runs issue what GPU runs issue.
        """
        for peer in sorted(peers, key=lambda p: (min(me, p), max(me, p))):
            token = torch.zeros(1, device=device)
            works = []
            for src, dst in ((min(me, peer), max(me, peer)), (max(me, peer), min(me, peer))):
                group = self.carrying(src, dst)
                if me == src:
                    work = dist.isend(token, dst, group=group)
                    trace_issue(work, "send", dst, group, token, device=True, role=role, what="connect")
                else:
                    work = dist.irecv(torch.empty_like(token), src, group=group)
                    trace_issue(work, "recv", src, group, token, device=True, role=role, what="connect")
                works.append(work)
            for work in works:
                trace_wait(work)
                work.wait()

    def destroy(self) -> None:
        """Release both groups (local: no collective)."""
        for group in {id(g): g for g in (self.to_lower, self.to_higher) if g is not None}.values():
            dist.destroy_process_group(group)


class SendsInFlight:
    """The sends of one transport that are not known to be complete, oldest first, by peer and message.

    A send's tensor must stay alive until the transfer is done. NCCL's `Work` reports completion when polled;
    gloo's does not (`is_completed()` stays False until `wait()` is called, however long ago the peer received
    the data), so polling alone kept every gloo send, and its tensor, until the next drain: one activation or
    gradient per micro-batch (0.7 MB per micro-batch of a GPT-2 8 x 256 at 8 x 32 tokens, measured as resident
    memory growing linearly with the steps between validations), and the poll itself grew with every message.
    So a send still in flight when ``window`` later messages have been started to the same peer is waited on:
    in the pipeline's schedules the peer has received it by then (1F1B's stage s sends its activation j + S - s
    only after the gradient of j came back, which the next stage sent after receiving activation j; likewise
    for gradients), so the wait returns at once; forward-only streaming (evaluation) has no messages back and
    cannot wait in a cycle. These waits are traced as waits for the NCCL order check (`p2p_trace`).

    The owner's wait comes with each call rather than being kept: kept, its bound method would tie the owner
    into a reference cycle, and every run's transports, with their groups' gloo threads and sockets, would
    outlive the run until a full garbage collection (a notebook's process grew 20 -> 80 threads in 30
    validations).

    Args:
        window: Messages to one peer after which an earlier message's sends are waited on.
    """

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"send_window={window} must be >= 1")
        self.window = window
        self._messages: dict[int, int] = {}  # per peer: messages started so far
        # (work, tensor kept alive until sent, peer, message number, micro-batch, what, on the device?)
        self._pending: deque[tuple[dist.Work, Tensor, int, int, int, str, bool]] = deque()

    def next_message(self, peer: int, wait: Callable[..., None]) -> None:
        """A new message to ``peer`` starts: release what has completed, and wait for what is ``window``
        messages old with ``wait(work, peer, micro-batch, what, on the device?, traced=...)``, which raises for
        a failed transfer."""
        current = self._messages.get(peer, 0) + 1
        self._messages[peer] = current
        still: deque[tuple[dist.Work, Tensor, int, int, int, str, bool]] = deque()
        for entry in self._pending:
            work, _, dst, number, microbatch, what, device = entry
            if work.is_completed():  # polled, not waited on: the order check does not count it as a wait
                wait(work, dst, microbatch, what, device, traced=False)  # raises if the send failed
            elif dst == peer and number <= current - self.window:
                wait(work, dst, microbatch, what, device)
            else:
                still.append(entry)
        self._pending = still

    def add(self, work: dist.Work, t: Tensor, peer: int, microbatch: int, what: str, device: bool) -> None:
        """A send of the current message to ``peer``, with the tensor to keep alive until it is done."""
        self._pending.append((work, t, peer, self._messages.get(peer, 0), microbatch, what, device))

    def flush(self, wait: Callable[..., None]) -> None:
        """Wait for every send in flight (``wait`` as in `next_message`)."""
        for work, _, dst, _, microbatch, what, device in self._pending:
            wait(work, dst, microbatch, what, device)
        self._pending.clear()

    def __len__(self) -> int:
        return len(self._pending)


class PointToPoint:
    """Activations and gradients between neighbouring stages of one pipeline.

    Sends are non-blocking: the `Work` handle and its tensor are kept until the transfer completes
    (the tensor must stay alive until then) and reaped at a later send or in `flush` (`SendsInFlight`). Receives
    block with ``timeout`` seconds; a peer that died surfaces within seconds as a closed
    connection, one that hangs after ``timeout``, and either way the error names the peer's stage
    and rank and the micro-batch being waited for.

    On a device (NCCL), payload work is waited on the stream, not the host (`Work.wait()` without a
    timeout: a timeout would turn on a blocking host wait, so no receive could overlap compute); the
    host still waits, with ``timeout``, for the header, which travels on the gloo ``header_group``
    ahead of its payloads, so a dead or silent peer is still named within the timeout. A payload that
    never comes after its header did is the NCCL group's own watchdog timeout.

    Each (sender, receiver) pair is one FIFO channel whose two ends track the specs of its last
    message (see the protocol note above), so every rank must send and receive through one
    `PointToPoint` in the order its schedule says, which the pipeline's schedules guarantee.

    Args:
        stage: This rank's stage (for messages).
        stage_of_rank: Maps a global rank to its stage (for messages).
        device: Where received payloads are allocated.
        timeout: Seconds to wait for one transfer before declaring the peer hung.
        groups: Groups carrying payloads, one per direction (`LinkGroups`); gloo on CPU, NCCL on CUDA.
            The default (the default group both ways) is accepted on CPU only.
        header_group: CPU (gloo) group carrying headers; None: the payload group of the message's direction.
        wire: How payloads travel (`lit_efficient.transport.wire.WireFormat`: bf16 on the wire, packing);
            every rank of a pipeline must use the same.
        send_window: Messages to one peer after which an earlier send still in flight is waited for
            (`SendsInFlight`); at least the pipeline's number of stages S, for which 1F1B has the peer
            receive a message before this rank sends the S-th after it. The default suits S <= 6.
    """

    def __init__(
        self,
        stage: int,
        stage_of_rank: Callable[[int], int],
        device: torch.device,
        timeout: float,
        groups: LinkGroups | None = None,
        header_group: dist.ProcessGroup | None = None,
        wire: WireFormat | None = None,
        send_window: int = 8,
    ) -> None:
        groups = groups if groups is not None else LinkGroups()
        if device.type != "cpu" and not groups.directed:
            raise ValueError(
                f"PointToPoint on {device} needs one group per direction (groups=LinkGroups.create()): on NCCL, "
                "both directions of a link on one communicator deadlock at the first steady-state 1F1B step"
            )
        self.stage = stage
        self.rank = dist.get_rank()
        self._stage_of_rank = stage_of_rank
        self._device = device
        self._timeout = timedelta(seconds=timeout)
        self._groups = groups
        self._header_group = header_group
        self.wire = wire if wire is not None else WireFormat()
        self._on_stream = device.type != "cpu"  # payloads are device work: wait on the stream (see above)
        self._sends = SendsInFlight(send_window)
        self._sent_specs: dict[int, Specs] = {}  # per destination: specs of the last message sent
        self._recv_specs: dict[int, Specs] = {}  # per source: specs of the last message received
        self._posted: dict[int, _PostedRecv] = {}  # per source: irecvs posted for its next message
        self.bytes_sent = 0

    def connect(self, peers: Sequence[int]) -> None:
        """Create the communicators to the neighbouring ``peers`` before the first message (`LinkGroups.connect`).

        Every rank of the pipeline calls it at the same point (`PipelineRuntime` does, when it is built).
        """
        self._groups.connect(self.rank, peers, self._device, "p2p")

    def ready(self, src: int) -> bool:
        """Whether a receive from ``src`` may be issued now: always, since it blocks until the message comes."""
        return True

    @property
    def can_prepost(self) -> bool:
        """Whether receives may be posted ahead of the schedule's order: yes, on every backend.

        Each (group, pair) communicator carries one direction (`LinkGroups`), so an early receive only
        ever waits for the next message of its own channel, never ahead of a send the peer waits for.
        """
        return True

    def send(self, tensors: Payload, dst: int, microbatch: int, what: str) -> None:
        """Start sending ``tensors`` (None entries allowed) for ``microbatch`` to global rank ``dst``."""
        self._sends.next_message(dst, self._wait)
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        fields = encode_header(microbatch, tensors)
        header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
        self._isend(header, dst, microbatch, what, device=False)
        specs = specs_of(tensors)
        expected = self._sent_specs.get(dst)
        if expected is not None and expected != specs:
            # Placeholders for the payload irecvs the receiver already posted (the old specs' transfers).
            for dtype, shape in self.wire.plan(expected).transfers:
                self._isend(torch.empty(shape, dtype=dtype, device=self._device), dst, microbatch, what, device=True)
        for payload in self.wire.encode(tensors, self.wire.plan(specs), self._device):
            self._isend(payload, dst, microbatch, what, device=True)
            self.bytes_sent += payload.numel() * payload.element_size()
        self._sent_specs[dst] = specs

    def prepost(self, src: int) -> None:
        """Post the irecvs for the next message from ``src`` now, if not already posted.

        Call it only for a message that is certain to come (the caller's schedule says so): a
        posted receive cannot be withdrawn, and one left posted would swallow an unrelated later
        message.
        """
        if self.can_prepost and src not in self._posted:
            self._posted[src] = self._post(src)

    def recv(self, src: int, microbatch: int, what: str) -> Payload:
        """Receive the ``what`` of ``microbatch`` from global rank ``src``; blocks up to the timeout."""
        posted = self._posted.pop(src, None) or self._post(src)
        self._wait(posted.header_work, src, microbatch, what, device=False)
        fields = posted.header.tolist()  # a CPU tensor: no device sync
        got, specs = decode_header(fields)
        if got != microbatch:
            raise PipelineCommError(
                f"stage {self.stage} (rank {self.rank}) expected {what} of micro-batch {microbatch} from rank "
                f"{src} but received micro-batch {got}: the two stages run different schedules (one rank left it "
                "alone: a stop decided on one rank only, Lightning's trainer.should_stop set there, must be decided "
                "on every rank, e.g. with trainer.strategy.reduce_boolean_decision)"
            )
        for work in posted.works:  # the payloads, or the placeholders sent because the specs changed
            self._wait(work, src, microbatch, what, device=True)
        buffers, plan = posted.buffers, posted.plan
        if tuple(specs) != posted.specs:
            plan = self.wire.plan(tuple(specs))
            buffers, works = self._post_payloads(src, plan, microbatch, what)
            for work in works:
                self._wait(work, src, microbatch, what, device=True)
        self._recv_specs[src] = tuple(specs)
        received = self.wire.decode(buffers, tuple(specs), plan)
        return tuple(
            t.requires_grad_() if t is not None and grad else t
            for t, grad in zip(received, decode_requires_grad(fields), strict=True)
        )

    def _post(self, src: int) -> _PostedRecv:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        group = self._header_group_of(src, self.rank)
        header_work = dist.irecv(header, src, group=group)
        trace_issue(header_work, "recv", src, group, header, device=False, role="header", what="next header")
        specs = self._recv_specs.get(src, ())
        plan = self.wire.plan(specs)
        return _PostedRecv(header, header_work, specs, plan, *self._post_payloads(src, plan, None, "payload"))

    def _post_payloads(
        self, src: int, plan: Plan, microbatch: int | None, what: str
    ) -> tuple[list[Tensor], list[dist.Work]]:
        buffers = [torch.empty(shape, dtype=dtype, device=self._device) for dtype, shape in plan.transfers]
        group = self._groups.carrying(src, self.rank)
        works = []
        for buf in buffers:
            work = dist.irecv(buf, src, group=group)
            label = what if microbatch is None else f"{what} of micro-batch {microbatch}"
            trace_issue(work, "recv", src, group, buf, device=True, role="p2p", what=label)
            works.append(work)
        return buffers, works

    def flush(self) -> None:
        """Wait for every send in flight (before a checkpoint, at the end of training)."""
        self._sends.flush(self._wait)

    def _header_group_of(self, src: int, dst: int) -> dist.ProcessGroup | None:
        return self._header_group if self._header_group is not None else self._groups.carrying(src, dst)

    def _isend(self, t: Tensor, dst: int, microbatch: int, what: str, device: bool) -> None:
        group = self._groups.carrying(self.rank, dst) if device else self._header_group_of(self.rank, dst)
        try:
            work = dist.isend(t, dst, group=group)
        except RuntimeError as err:  # gloo raises at the send itself when the peer is gone
            raise PipelineCommError(self._explain(dst, microbatch, what, err)) from err
        label = f"{what} of micro-batch {microbatch}" if device else f"header of {what} of micro-batch {microbatch}"
        trace_issue(work, "send", dst, group, t, device=device, role="p2p" if device else "header", what=label)
        self._sends.add(work, t, dst, microbatch, what, device)

    def _wait(self, work: dist.Work, peer: int, microbatch: int, what: str, device: bool, traced: bool = True) -> None:
        if traced:
            trace_wait(work)
        try:
            if device and self._on_stream:
                work.wait()  # the compute stream waits; the host goes on (liveness: the header's timeout)
            else:
                work.wait(self._timeout)
        except RuntimeError as err:
            raise PipelineCommError(self._explain(peer, microbatch, what, err)) from err

    def _explain(self, peer: int, microbatch: int, what: str, err: RuntimeError) -> str:
        me = f"stage {self.stage} (rank {self.rank})"
        them = f"stage {self._stage_of_rank(peer)} (rank {peer})"
        waiting = f"{what} of micro-batch {microbatch}"
        return explain_link_failure(
            err,
            timed_out=(
                f"{me} waited {self._timeout.total_seconds():.0f}s for {waiting} with {them} and got nothing",
                "that stage is hung or much slower. If it is only slow, raise PACIStrategy(p2p_timeout=...).",
            ),
            lost=(
                f"{me} lost its connection to {them} while exchanging {waiting}",
                f"{them} died (killed? out of memory?)",
            ),
            peer=them,
        )


class TiedExchange:
    """Gradients of a tied parameter between the first and the last stage of one pipeline.

    The two ranks share two-rank groups of their own (`LinkGroups` of the pair: one per direction, for
    the reason given there), so these messages never interleave with the stage-to-stage stream of
    `PointToPoint`. Every message has the parameter's shape and dtype, so there is no header. Sends are
    non-blocking (the tensor is kept alive until it is received); receives wait up to ``timeout`` (on the
    stream, on a device: see `PointToPoint`) and fail naming the peer.

    Args:
        stage: This rank's stage (for messages).
        peer: Global rank of the other copy's stage.
        peer_stage: That rank's stage (for messages).
        groups: The two groups of this rank and ``peer`` (`LinkGroups.create([rank, peer])`).
        timeout: Seconds a receive waits before declaring the peer hung.
        device: Where the parameter lives. Building the exchange creates its communicators
            (`LinkGroups.connect`): both ranks build theirs at the same point.
        send_window: Sends after which an earlier one still in flight is waited for (`SendsInFlight`): more
            than the tied-weight rule's delay, by which the peer has received it (`runtime.tied`).
    """

    def __init__(
        self,
        stage: int,
        peer: int,
        peer_stage: int,
        groups: LinkGroups,
        timeout: float,
        device: torch.device | str = "cpu",
        send_window: int = 4,
    ) -> None:
        self.stage = stage
        self.peer = peer
        self.peer_stage = peer_stage
        self.rank = dist.get_rank()
        self._groups = groups
        self._timeout = timedelta(seconds=timeout)
        self._sends = SendsInFlight(send_window)
        self.bytes_sent = 0
        groups.connect(self.rank, [peer], torch.device(device), "tied")

    def all_reduce(self, t: Tensor) -> None:
        """Sum ``t`` in place with the peer's tensor (both ranks call it at the same step)."""
        group = self._groups.to_higher  # either group holds both ranks; flush sends nothing else on it
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)
        trace_issue(work, "all_reduce", None, group, t, device=True, role="tied", what="tied-weight all-reduce")
        self._wait(work, "all-reduce", t.device.type != "cpu")
        self.bytes_sent += t.numel() * t.element_size()

    def send(self, t: Tensor) -> None:
        """Start sending ``t`` to the peer; ``t`` must not be changed until `flush` (or a later send) reaps it."""
        self._sends.next_message(self.peer, self._wait_send)
        group = self._groups.carrying(self.rank, self.peer)
        try:
            work = dist.isend(t, self.peer, group=group)
        except RuntimeError as err:  # gloo raises at the send itself when the peer is gone
            raise PipelineCommError(self._explain("send", err)) from err
        trace_issue(work, "send", self.peer, group, t, device=True, role="tied", what="tied-weight gradient")
        self._sends.add(work, t, self.peer, -1, "send", t.device.type != "cpu")
        self.bytes_sent += t.numel() * t.element_size()

    def recv(self, like: Tensor) -> Tensor:
        """The next tensor the peer sent, shaped like ``like``; blocks up to the timeout."""
        buf = torch.empty_like(like)
        group = self._groups.carrying(self.peer, self.rank)
        work = dist.irecv(buf, self.peer, group=group)
        trace_issue(work, "recv", self.peer, group, buf, device=True, role="tied", what="tied-weight gradient")
        self._wait(work, "receive", buf.device.type != "cpu")
        return buf

    def flush(self) -> None:
        """Wait for every send in flight."""
        self._sends.flush(self._wait_send)

    def _wait_send(
        self, work: dist.Work, _peer: int, _microbatch: int, what: str, device: bool, traced: bool = True
    ) -> None:
        self._wait(work, what, device, traced)

    def _wait(self, work: dist.Work, what: str, device: bool, traced: bool = True) -> None:
        if traced:
            trace_wait(work)
        try:
            if device:
                work.wait()  # on the stream, as PointToPoint's payloads
            else:
                work.wait(self._timeout)
        except RuntimeError as err:
            raise PipelineCommError(self._explain(what, err)) from err

    def _explain(self, what: str, err: RuntimeError) -> str:
        them = f"stage {self.peer_stage} (rank {self.peer})"
        head = f"stage {self.stage} (rank {self.rank}) failed the tied-weight gradient {what} with {them}"
        return explain_link_failure(err, timed_out=(head, f"{err}"), lost=(head, f"{them} died ({err})"), peer=them)


class GroupStageSum:
    """The sum over a pipeline's stages of one tensor per stage (flush's squared gradient norms), over the
    pipeline's process group, added in rank order (`collectives.all_reduce_in_rank_order`): the same bits as
    `local.LocalStageSum` in one process.

    Args:
        group: The pipeline's group (its S ranks).
    """

    can_post = False  # every stage of the sum is on another process: a contribution is the collective itself

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def all_reduce(self, stage: int, t: Tensor) -> None:
        """Sum ``t`` in place with every other stage's tensor of the same step."""
        all_reduce_in_rank_order(t, self.group)

    def has_posted(self, stage: int) -> bool:
        """Never: contributions are not posted ahead on processes."""
        return False


class ProcessLinks:
    """What a process's stage needs to reach the other stages of its pipeline when every stage has its own
    process: its `PointToPoint` to its neighbours, the `TiedExchange` of a tied weight with the other end of the
    pipeline, and the stage sum over the pipeline (`GroupStageSum`). The groups are the strategy's, created
    collectively at setup; building a link is collective between the ranks it joins (their communicators).

    Args:
        topology: The layout of stages and replicas over ranks.
        rank: This process's global rank.
        device: Where payloads live.
        timeout: Seconds a stage waits for a neighbour (`PointToPoint`, `TiedExchange`).
        wire: How payloads travel.
        p2p_groups: The stage-to-stage groups, one per direction (`LinkGroups`).
        header_group: The CPU group message headers travel on (None on gloo: the payload group).
        pipeline_group: This replica's pipeline (its S ranks), for the stage sum.
        tie_groups: Per replica, the groups of its first and last stage (for a tied weight; empty without).
    """

    def __init__(
        self,
        topology: Any,
        rank: int,
        device: torch.device,
        timeout: float,
        wire: WireFormat,
        p2p_groups: LinkGroups | None,
        header_group: dist.ProcessGroup | None,
        pipeline_group: dist.ProcessGroup | None,
        tie_groups: dict[int, LinkGroups],
    ) -> None:
        self.topology = topology
        self.rank = rank
        self.device = device
        self.timeout = timeout
        self.wire = wire
        self.p2p_groups = p2p_groups
        self.header_group = header_group
        self.tie_groups = tie_groups
        self.stage_sum = GroupStageSum(pipeline_group)

    def rank_of(self, stage: int) -> int:
        """The global rank of ``stage`` in this process's replica."""
        return self.topology.rank_of(stage, self.topology.replica_of(self.rank))

    def p2p(self, stage: int) -> PointToPoint | None:
        """The links of ``stage`` (this process's) to its neighbours; None in a one-stage pipeline."""
        if self.topology.num_stages == 1:
            return None
        return PointToPoint(
            stage, self.topology.stage_of, self.device, self.timeout, groups=self.p2p_groups,
            header_group=self.header_group, wire=self.wire, send_window=self.topology.num_stages + 1,
        )  # fmt: skip

    def tied(self, stage: int, delay: int) -> TiedExchange:
        """The tied-weight exchange of ``stage`` (the first or the last) with the other end; ``delay`` is the rule's
        delay in updates, within which the peer receives what was sent (`runtime.tied`)."""
        last = self.topology.num_stages - 1
        peer_stage = last if stage == 0 else 0
        groups = self.tie_groups[self.topology.replica_of(self.rank)]
        return TiedExchange(
            stage, self.rank_of(peer_stage), peer_stage, groups, self.timeout, self.device, send_window=delay + 2
        )

    def attach(self, host: Any) -> None:
        """Nothing to attach: every link blocks until its message is there."""


def tie_groups(topology: Any, timeout: float) -> dict[int, LinkGroups]:
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
