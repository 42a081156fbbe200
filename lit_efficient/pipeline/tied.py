"""A weight tied between the first and the last pipeline stage (input embedding and LM head).

Each of the two stages holds its own copy of the parameter and steps it with its own optimizer.
Both copies start equal; the rule below gives both the same gradient at every update, so with the
same optimizer settings they stay equal at every weight version (both copies after update k hold
the same tensor). The two stages talk through `comm.TiedExchange`; this file owns the rule only.

- ``1f1b_flush`` (exact, Megatron's embedding group): at update k both stages sum their gradients
  ``G_k = g_first_k + g_last_k`` (one all-reduce in a two-rank group) and step with it: exactly the
  unsplit model's gradient. Flush's last stage reaches its step first and waits there for stage 0,
  which it would wait for at its next forward anyway: no added idle time.
- ``paci`` (asynchronous, delayed embedding-side gradient): at update k both stages apply
  ``G_k = g_last_k + g_first_{k-d}`` with ``d = ceil(S / N)`` (no first-stage term for k < d). The
  last stage sends ``g_last_k`` to stage 0 at its update k, which always precedes stage 0's update k;
  stage 0 sends ``g_first_k`` to the last stage, which applies it at its update k + d. ``d`` is the
  smallest delay for which that message has always been sent when the last stage needs it (stage 0
  starts micro-batch ``(k+1)N - 1`` only after finishing window ``k - d``), so neither stage ever
  waits on the other: PACI stays bubble-free. Staleness bound: the embedding-side term of update k
  is ``d`` updates late and was itself computed with weights up to ``ceil((S-1)/N)`` versions old
  (stage 0's drift bound), so at most ``ceil(S/N) + ceil((S-1)/N)`` versions (2 once N >= S); the
  LM-head-side term has no staleness (drift 0 on the last stage). Cost: stage 0 keeps the last
  ``d`` gradients of the parameter (d x its size) and the ``d`` gradients still in flight at the end
  of training are never applied; after resuming from a checkpoint both stages restart the delay
  line (its first d updates use the LM-head term only).

Gradients are exchanged after normalization (divided by the window's weight), so token-weighted
accumulation combines them exactly. Only updates that are applied count: a window skipped for a
non-finite loss is skipped on both stages alike, so the two update counts stay equal.

When the whole pipeline runs in one process, `LocalTiedLink` stands in for the transport: the same
rule, the same messages, in mailboxes. Under ``paci`` every message is there when it is needed (the
order argument above holds for any order of the stages' turns). Under ``1f1b_flush`` the last stage
reaches its all-reduce first, while stage 0 still has the window's backwards to run; no stage of one
process can block, so the waiting stage lets the others take their turns until the peer's gradient
is there (`LocalTiedLink.wait`, which `LocalPipeline` provides), as its rank would wait in the
collective. The sum of two tensors does not depend on the order of its operands, so both copies get
bit for bit what the two-rank all-reduce gives them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Protocol

from torch import Tensor, nn

from lit_efficient.pipeline.schedules import ScheduleName


class Exchange(Protocol):
    """What the rule needs from the transport (`comm.TiedExchange`, or an in-process stand-in)."""

    def all_reduce(self, t: Tensor) -> None: ...
    def send(self, t: Tensor) -> None: ...
    def recv(self, like: Tensor) -> Tensor: ...
    def flush(self) -> None: ...


def tie_delay(num_stages: int, accumulate: int) -> int:
    """Updates by which PACI applies the first stage's gradient of a tied weight late: ceil(S / N)."""
    return math.ceil(num_stages / accumulate)


class TiedWeight:
    """One stage's copy of a tied parameter and the rule that keeps it equal to the other copy.

    Install it as `PipelineStage.exchange_tied`: it is called after the stage's gradients are
    normalized and before its optimizer update.

    Args:
        param: This stage's copy.
        is_first: Whether this is the first stage (the embedding's side) or the last (the LM head's).
        schedule: ``"1f1b_flush"`` (exact sum) or ``"paci"`` (delayed first-stage gradient).
        delay: PACI's delay d in updates (`tie_delay`); ignored under flush.
        exchange: The transport to the other copy's stage.
    """

    def __init__(
        self, param: nn.Parameter, is_first: bool, schedule: ScheduleName, delay: int, exchange: Exchange
    ) -> None:
        if delay < 1:
            raise ValueError(f"delay={delay} must be >= 1 (ceil(S / N))")
        self.param = param
        self.is_first = is_first
        self.schedule = schedule
        self.delay = delay
        self.exchange = exchange
        self.updates = 0
        self._own: deque[Tensor] = deque()  # first stage, paci: its gradients not yet applied

    def __call__(self) -> None:
        p = self.param
        if p.grad is None:
            p.grad = p.detach().new_zeros(p.shape)  # unused in this window: its contribution is zero
        g = p.grad
        k, self.updates = self.updates, self.updates + 1
        if self.schedule == "1f1b_flush":
            self.exchange.all_reduce(g)
        elif self.is_first:
            own = g.detach().clone()
            g.copy_(self.exchange.recv(g))  # the last stage's update-k gradient, sent at its update k
            if len(self._own) == self.delay:
                g.add_(self._own.popleft())
            self._own.append(own)
            self.exchange.send(own)  # applied by the last stage at its update k + delay
        else:
            self.exchange.send(g.detach().clone())
            if k >= self.delay:
                g.add_(self.exchange.recv(g))


def finish_tied(tied: list[TiedWeight]) -> None:
    """End of training: absorb the first stage's gradients still in flight (never applied), in the order they
    were sent, so no transfer outlives the run."""
    if not tied:
        return
    rounds = min(tied[0].delay, tied[0].updates)
    for _ in range(rounds):
        for t in tied:
            if t.schedule == "paci" and not t.is_first:
                t.exchange.recv(t.param)
    for t in tied:
        t.exchange.flush()
        t._own.clear()


class LocalTiedLink:
    """The tied-weight exchange between the first and the last stage of a pipeline that runs in one process.

    `end` gives each of the two stages its side, answering `Exchange`'s calls like `comm.TiedExchange`.
    Sends are mailbox appends of the sent tensor itself (the rule never changes a tensor it sent); an
    all-reduce posts a copy of its operand. A receive or an all-reduce whose message is not there calls
    `wait`, set by the driver of the stages (`LocalPipeline.run_others_until`): the other stages take
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
