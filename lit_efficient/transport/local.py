"""In-process links: the transport of a pipeline whose stages share one process (``Trainer(devices=1)``).

Mailboxes stand in for every message the process transport (`process`) carries, with the same calls; the
runtime asks `ready` before a receive, and a stage whose message is not there yet pauses (`runtime.host`
gives the others their turns). The stage-to-stage links (`LocalExchange`), the tied-weight exchange
(`LocalTiedLink`) and the sum over the stages of flush's norm clipping (`LocalStageSum`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from torch import Tensor

from lit_efficient.runtime.host import StageHost
from lit_efficient.runtime.interpreter import InputFn
from lit_efficient.runtime.schedules import ScheduleName
from lit_efficient.runtime.stage import Payload, PipelineStage
from lit_efficient.runtime.topology import Topology
from lit_efficient.transport.collectives import sum_in_order
from lit_efficient.transport.failures import PipelineCommError
from lit_efficient.transport.hosting import host_stages
from lit_efficient.transport.wire import WireFormat


class LocalExchange:
    """The links between the stages of one pipeline that runs in a single process.

    One FIFO mailbox per (sender, receiver) pair of (virtual) ranks, the same channels the process
    transport has. Payloads are handed over as detached tensors, not copies: a sender never writes
    to what it sent (it keeps it only for its own backward, if at all), so a copy would double the
    activations at every stage boundary for nothing. Under a wire format that rounds (bf16 on the wire),
    tensors are rounded as the process transport's would be (`WireFormat.round_trip`): the same numerics.

    Args:
        wire: The wire format the process pipeline would use.
    """

    def __init__(self, wire: WireFormat | None = None) -> None:
        self._boxes: dict[tuple[int, int], deque[tuple[int, Payload]]] = {}
        self.wire = wire if wire is not None else WireFormat()

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
        wire = self.exchange.wire
        payload = tuple(
            None if t is None else wire.round_trip(t.detach()).requires_grad_(t.requires_grad) for t in tensors
        )
        self.bytes_sent += sum(t.numel() * wire.wire_dtype(t.dtype).itemsize for t in payload if t is not None)
        self.exchange.box(self.rank, dst).append((microbatch, payload))

    def connect(self, peers: Sequence[int]) -> None:
        """Nothing to connect in one process."""

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


def local_pipeline(
    stages: Sequence[PipelineStage],
    schedule: ScheduleName,
    accumulate: int,
    input_fn: InputFn,
    wire: WireFormat | None = None,
) -> StageHost:
    """Runtimes for ``stages`` (stage 0 first) over one process's `LocalLinks`, each playing the rank it would
    have in a one-replica pipeline of processes, driven by one `StageHost` (`hosting.host_stages`, as the
    strategy builds them). ``wire``: the processes' wire format (bf16 on the wire rounds the boundary tensors
    here as it would there)."""
    return host_stages(stages, schedule, accumulate, input_fn, LocalLinks(len(stages), wire))


class LocalStageSum:
    """The all-reduce over a pipeline's stages (``all_reduce_flat`` over the pipeline group on processes), for
    a pipeline that runs in one process: 1F1B-flush's gradient-norm clipping sums every stage's squared norm
    inside each stage's optimizer step.

    Each stage's k-th `all_reduce` joins the k-th round; a stage whose round is not complete calls `wait`
    (`StageHost.run_others_until`, set by the host), so the other stages take their turns until they
    have contributed. A stage may `post` its contribution before it has to wait for anything else (the last
    stage's squared norm, before it waits for stage 0's tied gradient: stage 0's step, run while the last
    stage waits, needs that norm); its next `all_reduce` then only waits and reads.
    Every stage gets the same sum, added in the order of ``ranks`` (the stages in the order of their ranks on
    processes) by `sum_in_order`, as `all_reduce_in_rank_order` adds them on processes: the same bits at any S.

    Args:
        ranks: The stages in rank order (``[Topology.stage_of(r) for r in range(S)]``).
    """

    can_post = True  # the stages share this process: one may contribute before it waits for anything else

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = list(ranks)
        self._rounds: dict[int, dict[int, Tensor]] = {}  # round -> the stages' contributions so far
        self._calls = dict.fromkeys(self.ranks, 0)  # stage -> rounds it has joined
        self._read: dict[int, int] = {}  # round -> stages that have read its sum
        self._posted: dict[int, int] = {}  # stage -> the round it has posted to and not yet read
        self.wait: Callable[[Callable[[], bool], str], None] | None = None

    def post(self, stage: int, t: Tensor) -> None:
        """Contribute ``t`` to ``stage``'s next round without waiting; its next `all_reduce` reads the sum."""
        if stage in self._posted:
            raise RuntimeError(f"stage {stage} posted to round {self._posted[stage]} twice without reading it")
        k = self._calls[stage]
        self._calls[stage] += 1
        self._rounds.setdefault(k, {})[stage] = t.detach().clone()
        self._posted[stage] = k

    def has_posted(self, stage: int) -> bool:
        """Whether ``stage`` has posted to a round it has not read yet (its next `all_reduce` only reads)."""
        return stage in self._posted

    def all_reduce(self, stage: int, t: Tensor) -> None:
        """Sum ``t`` in place with the other stages' tensors of the same round (waiting for them if needed); after
        a `post`, the posted tensor is this stage's contribution and ``t`` only receives the sum."""
        if stage not in self._posted:
            self.post(stage, t)
        k = self._posted.pop(stage)
        contributions = self._rounds[k]
        if len(contributions) < len(self.ranks):
            if self.wait is None:
                raise RuntimeError("a stage sum waits for other stages and nothing runs them (LocalStageSum.wait)")
            self.wait(lambda: len(contributions) == len(self.ranks), f"the stage-sum of round {k}")
        t.copy_(sum_in_order([contributions[s] for s in self.ranks]))
        self._read[k] = self._read.get(k, 0) + 1
        if self._read[k] == len(self.ranks):  # every stage has its sum: the round is done
            del self._rounds[k], self._read[k]


class LocalTiedLink:
    """The tied-weight exchange between the first and the last stage of a pipeline that runs in one process.

    `end` gives each of the two stages its side, answering `Exchange`'s calls like `process.TiedExchange`.
    Sends are mailbox appends of the sent tensor itself (the rule never changes a tensor it sent); an
    all-reduce posts a copy of its operand. A receive or an all-reduce whose message is not there calls
    `wait`, set by the host of the stages (`StageHost.run_others_until`): the other stages take
    their turns until it is.
    """

    def __init__(self) -> None:
        self._sent: tuple[deque[Tensor], deque[Tensor]] = (deque(), deque())  # to the first stage, to the last
        self._summands: tuple[deque[Tensor], deque[Tensor]] = (deque(), deque())
        self.wait: Callable[[Callable[[], bool], str], None] | None = None

    def end(self, is_first: bool) -> LocalTiedEnd:
        """The first stage's side (``is_first``) or the last stage's."""
        return LocalTiedEnd(self, is_first)

    @property
    def pending(self) -> int:
        """Messages sent and not yet received (0 after `finish_tied`)."""
        return sum(len(box) for box in (*self._sent, *self._summands))

    def _until(self, box: deque[Tensor], what: str) -> Tensor:
        if not box:
            if self.wait is None:
                raise RuntimeError(f"{what} is not there and nothing runs the other stages (LocalTiedLink.wait)")
            self.wait(lambda: bool(box), what)
        return box.popleft()


class LocalTiedEnd:
    """One stage's side of a `LocalTiedLink`: the `Exchange` calls of the tied-weight rule.

    Args:
        link: The link shared with the other stage.
        is_first: Whether this is the first stage's side.
    """

    def __init__(self, link: LocalTiedLink, is_first: bool) -> None:
        self.link = link
        self.is_first = is_first
        self._inbox, self._outbox = (0, 1) if is_first else (1, 0)
        self.bytes_sent = 0
        self._peer = "the last stage" if is_first else "stage 0"

    def all_reduce(self, t: Tensor) -> None:
        """Sum ``t`` in place with the peer's tensor of the same update (waiting for it if needed)."""
        self.link._summands[self._outbox].append(t.detach().clone())  # the peer adds it after ``t`` has changed
        self.bytes_sent += t.numel() * t.element_size()
        t.add_(self.link._until(self.link._summands[self._inbox], f"the tied-weight all-reduce with {self._peer}"))

    def send(self, t: Tensor) -> None:
        """Hand ``t`` to the peer (not copied: the rule does not change it afterwards)."""
        self.link._sent[self._outbox].append(t)
        self.bytes_sent += t.numel() * t.element_size()

    def recv(self, like: Tensor) -> Tensor:
        """The next tensor the peer sent (waiting for it if needed)."""
        return self.link._until(self.link._sent[self._inbox], f"the tied-weight gradient from {self._peer}")

    def flush(self) -> None:
        """Nothing in flight: sends complete at once."""


class LocalLinks:
    """What the stages of a pipeline that runs whole in one process need to reach each other: the answer to
    `process.ProcessLinks`'s calls over mailboxes. A link whose message is not there yet lets the other stages
    take their turns (`attach` gives it the host that drives them).

    Args:
        num_stages: The pipeline's S (one replica: stage s plays global rank ``Topology(S).rank_of(s)``).
        wire: The wire format the processes would use (bf16 on the wire rounds the same here).
    """

    def __init__(self, num_stages: int, wire: WireFormat | None = None) -> None:
        self.topology = Topology(num_stages)
        self.exchange = LocalExchange(wire)
        self.tie_link = LocalTiedLink()
        self.stage_sum = LocalStageSum([self.topology.stage_of(r) for r in range(num_stages)])

    def rank_of(self, stage: int) -> int:
        """The global rank ``stage`` plays (as on processes with one replica)."""
        return self.topology.rank_of(stage)

    def p2p(self, stage: int) -> LocalPointToPoint | None:
        """The mailboxes of ``stage``; None in a one-stage pipeline."""
        if self.topology.num_stages == 1:
            return None
        return self.exchange.endpoint(self.rank_of(stage), stage, self.topology.stage_of)

    def tied(self, stage: int, delay: int) -> LocalTiedEnd:
        """``stage``'s side (the first or the last) of the tied-weight exchange."""
        return self.tie_link.end(stage == 0)

    def attach(self, host: StageHost) -> None:
        """A link waiting for a message gives the host's other stages their turns until it is there."""
        self.tie_link.wait = self.stage_sum.wait = host.run_others_until
