"""A weight tied between the first and the last pipeline stage (input embedding and LM head).

Each of the two stages holds its own copy of the parameter and steps it with its own optimizer.
Both copies start equal; the rule below gives both the same gradient at every update, so with the
same optimizer settings they stay equal at every weight version (both copies after update k hold
the same tensor; under PACI's default correction stage 0's copy also carries the in-place weight
prediction's rounding residue, ~1e-8, `runtime.staleness`). The two stages talk through
`transport.process.TiedExchange` (or, in one process, `transport.local.LocalTiedLink`); this file owns
the rule and its installation on a stage.

- ``1f1b_flush`` (exact, Megatron's embedding group): at update k both stages sum their gradients
  ``G_k = g_first_k + g_last_k`` (one all-reduce in a two-rank group) and step with it: the unsplit model's
  gradient up to the order of summation (each side's window summed first, where one device adds both sides per
  micro-batch: float rounding, ~1e-8, which Adam can lift to ~1e-6 in rows with tiny second moments). Flush's
  last stage reaches its step first and waits there for stage 0, which it would wait for at its next forward
  anyway: no added idle time.
- ``paci`` (asynchronous, delayed embedding-side gradient): at update k both stages apply
  ``G_k = g_last_k + g_first_{k-d}`` with ``d = ceil(S / N)`` (no first-stage term for k < d; N the
  smallest window of the fit where a schedule changes it: the line is built once, and a d longer than
  the current N needs only makes the term staler, while a shorter one would make the last stage wait). The
  last stage sends ``g_last_k`` to stage 0 at its update k, which always precedes stage 0's update k;
  stage 0 sends ``g_first_k`` to the last stage, which applies it at its update k + d. ``d`` is the
  smallest delay for which that message has always been sent when the last stage needs it (stage 0
  starts micro-batch ``(k+1)N - 1`` only after finishing window ``k - d``), so neither stage ever
  waits on the other: PACI stays bubble-free. Staleness bound: the embedding-side term of update k
  is ``d`` updates late and was itself computed with weights up to ``ceil((S-1)/N)`` versions old
  (stage 0's drift bound), so at most ``d + ceil((S-1)/N)`` versions (2 once N >= S without a schedule;
  with one, d is its smallest N's); the
  LM-head-side term has no staleness (drift 0 on the last stage). Cost: stage 0 keeps the last
  ``d`` gradients of the parameter (d x its size) and the ``d`` gradients still in flight at the end
  of training are never applied.
- PACI's synchronous start (``PACIStrategy(sync_start_steps=K)``: its first K updates in 1F1B-flush order) sums the
  two gradients as under ``1f1b_flush``, so nothing is stale there, tied weights included; the delay line starts
  where PACI's order does (`TiedWeight.follow`): its first ``d`` updates use the LM-head term only, as at a start.

A checkpoint keeps the delay line (`TiedWeight.state_dict`): both stages' update count and stage 0's ``d``
gradients the last stage has not applied yet. A save drains the pipeline, so both stages have made the same
updates K; the messages in flight then are exactly stage 0's last ``d`` gradients (those of updates K-d..K-1).
A restore (`restore_tied`) continues the line: stage 0 sends them again, in their order, before its
update K's, and the last stage applies them at its updates K..K+d-1, as the uninterrupted run does. Where the
line cannot continue (another layout, or another smallest N and so another ``d``) both stages restart it: its
first ``d`` updates then use the LM-head term only.

Gradients are exchanged after normalization (divided by the window's weight), so token-weighted
accumulation combines them exactly. Only updates that are applied count: a window skipped for a
non-finite loss is skipped on both stages alike, so the two update counts stay equal.

When the whole pipeline runs in one process, `LocalTiedLink` stands in for the transport: the same
rule, the same messages, in mailboxes. Under ``paci`` every message is there when it is needed (the
order argument above holds for any order of the stages' turns). Under ``1f1b_flush`` the last stage
reaches its all-reduce first, while stage 0 still has the window's backwards to run; no stage of one
process can block, so the waiting stage lets the others take their turns until the peer's gradient
is there (`LocalTiedLink.wait`, which `StageHost` provides), as its rank would wait in the
collective. The sum of two tensors does not depend on the order of its operands, so both copies get
bit for bit what the two-rank all-reduce gives them.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lit_efficient.runtime.schedules import ScheduleName
from lit_efficient.runtime.split import Split
from lit_efficient.runtime.stage import PipelineStage

TIED_ATTR = "_lit_efficient_tied"  # set on a tied copy: a pipeline-wide gradient norm counts it once


class Exchange(Protocol):
    """What the rule needs from the transport (`transport.process.TiedExchange`, or `transport.local.LocalTiedEnd`)."""

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
        exchange: The transport to the other copy's stage (dropped when the run is over: `HostedStage.release_links`).
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
        self.order: ScheduleName = schedule  # the order the pipeline runs now (`follow`)
        self.line_start: int | None = 0 if schedule == "paci" else None  # PACI's delay line: its first update
        self._own: deque[Tensor] = deque()  # first stage, paci: its gradients not yet applied

    def follow(self, order: ScheduleName) -> None:
        """The pipeline runs ``order`` from the next window, at a drained pipeline on both stages alike (PACI's
        synchronous start runs flush's order first): under flush's order the two copies sum their gradients as
        under ``1f1b_flush``, under PACI's the delay line runs, started at the first update in that order (kept where
        it already runs, as a checkpoint restored it)."""
        self.order = order
        if self.schedule != "paci":
            return
        if order == "1f1b_flush":
            self.line_start = None
        elif self.line_start is None:
            self.line_start = self.updates

    @property
    def _in_line(self) -> int:
        """Updates made since the delay line started (0 while the copies sum their gradients)."""
        return 0 if self.line_start is None else self.updates - self.line_start

    def state_dict(self) -> dict[str, Any]:
        """The delay line as a checkpoint keeps it, at a drained pipeline: the updates made and, on the first stage
        under PACI, its gradients the last stage has not applied yet (oldest first; ``{"0": ...}``: a checkpoint
        folder keeps dicts, not lists)."""
        state: dict[str, Any] = {"schedule": self.schedule, "delay": self.delay, "updates": self.updates}
        if self.schedule == "paci":  # -1: not started (a synchronous start); a folder keeps no None
            state["line_start"] = -1 if self.line_start is None else self.line_start
        if self.schedule == "paci" and self.is_first:
            state["pending"] = {str(i): g for i, g in enumerate(self._own)}
        return state

    def resume(self, state: dict[str, Any] | None) -> None:
        """Continue the delay line a checkpoint kept (``state``, `state_dict`'s) where it was built for the same
        schedule and delay, otherwise start it again (its first ``delay`` updates use the LM-head term only). The
        line must be empty (`restore_tied` empties it first). Continuing, the first stage sends its pending gradients
        again, in their order: the last stage receives them at the updates where the uninterrupted run does. Both
        stages decide alike: they saved the same schedule, delay and update count."""
        if state is None or (state["schedule"], state["delay"]) != (self.schedule, self.delay):
            return
        self.updates = int(state["updates"])
        if self.schedule != "paci":
            return
        start = int(state.get("line_start", 0))  # an older checkpoint: its line ran from 0
        self.line_start = None if start < 0 else start
        if self.line_start is None and self.order == "paci":  # saved inside a synchronous start this run has not
            self.line_start = self.updates
        if not self.is_first:
            return
        pending = state.get("pending", {})  # a folder drops an empty dict: no update made yet
        if len(pending) != min(self.delay, self._in_line):
            raise RuntimeError(
                f"the checkpoint's tied-weight delay line holds {len(pending)} pending gradients after "
                f"{self.updates} updates at delay {self.delay}: it was not saved at a drained pipeline"
            )
        p = self.param
        for i in range(len(pending)):
            own = pending[str(i)].to(device=p.device, dtype=p.dtype)
            self._own.append(own)
            self.exchange.send(own)

    def __call__(self) -> None:
        p = self.param
        if p.grad is None:
            p.grad = p.detach().new_zeros(p.shape)  # unused in this window: its contribution is zero
        g = p.grad
        k, self.updates = self._in_line, self.updates + 1
        if self.line_start is None:  # 1F1B-flush, or PACI's synchronous start
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
    were sent, so no transfer outlives the run; the lines are empty afterwards (no update made)."""
    if not tied:
        return
    rounds = min(tied[0].delay, tied[0]._in_line)
    for _ in range(rounds):
        for t in tied:
            if not t.is_first:
                t.exchange.recv(t.param)
    for t in tied:
        t.exchange.flush()
        t._own.clear()
        t.updates = 0
        t.line_start = 0 if t.schedule == "paci" and t.order == "paci" else None


def restore_tied(tied: list[TiedWeight], states: list[dict[str, Any] | None]) -> None:
    """A checkpoint's restore (a resume at a fit's start, the learning-rate finder's restore, a torchft heal):
    empty the lines of what they have in flight (`finish_tied`: a finder inside the fit's run started while the
    run's last gradients were in flight), then continue each from its ``states`` entry (`TiedWeight.resume`; None
    starts it again). Every rank hosting an end of the tie calls it at the same point of the run."""
    finish_tied(tied)
    for t, state in zip(tied, states, strict=True):
        t.resume(state)


def tie_stage(
    stage: PipelineStage, split: Split, schedule: ScheduleName, delay: int, exchange: Exchange
) -> list[TiedWeight]:
    """Install the rule on ``stage`` (the first or the last) for every tie of ``split``: its copy of each tied
    weight, found at the copy's place in the module, exchanged over ``exchange``."""
    tied = []
    for tie in split.ties:
        part, name = tie.first if stage.is_first else tie.last
        _, parent, attr = split.slots[part]
        param = parent._modules[attr].get_parameter(name)  # type: ignore[union-attr]
        setattr(param, TIED_ATTR, stage.is_first)  # True on the copy counted in a pipeline-wide norm
        tied.append(TiedWeight(param, stage.is_first, schedule, delay, exchange))
    stage.exchange_tied = _all(tied)
    return tied


def untag(tied: list[TiedWeight]) -> None:
    """Take the tied-weight mark off ``tied``'s copies (a module kept whole in one process, after training)."""
    for t in tied:
        t.param.__dict__.pop(TIED_ATTR, None)


def _all(tied: list[TiedWeight]) -> Callable[[], None]:
    def exchange() -> None:
        for t in tied:
            t()

    return exchange


def step_settings(optimizer: Any, param: nn.Parameter) -> tuple[int, dict[str, Any]]:
    """The settings ``optimizer`` steps ``param`` with (its parameter group's, less the parameters; empty if no
    group holds it), with a digest of them that fits an int64. Each stage builds its own optimizer over its own
    copy of a tied weight, seeing only its own layers: a rule by module type or by name there may give the copies
    different settings (an ``nn.Linear`` LM head's weight decayed, the ``nn.Embedding``'s not), and the copies
    would drift apart where one device steps one parameter with one group's settings."""
    groups = getattr(optimizer, "param_groups", None) or []
    held = [g for g in groups if any(p is param for p in g["params"])]
    # Not the parameters or their names (`named_parameters()` groups): each stage's differ by nature.
    settings = {k: v for k, v in sorted(held[0].items()) if k not in ("params", "param_names")} if held else {}
    plain = {k: v.tolist() if isinstance(v, Tensor) else v for k, v in settings.items()}  # not the tensor's device
    digest = hashlib.blake2b(repr(plain).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big"), settings


def counted_in_global_norm(param: nn.Parameter) -> bool:
    """Whether a pipeline-wide gradient norm counts ``param``: a tied weight's second copy holds the same
    gradient as the first, so the exact (flush) norm counts it once."""
    return getattr(param, TIED_ATTR, True)


def squared_grad_norm(params: list[nn.Parameter], device: torch.device) -> Tensor:
    """The squared norm ``params``' gradients add to a pipeline-wide gradient norm (a tied weight's second copy not
    counted), in fp32 on ``device``: no host sync."""
    squared = torch.zeros(1, device=device, dtype=torch.float32)
    for p in params:
        if p.grad is not None and counted_in_global_norm(p):
            squared += p.grad.detach().float().pow(2).sum()
    return squared


def is_tied(param: nn.Parameter) -> bool:
    """Whether ``param`` is one copy of a weight tied across stages."""
    return hasattr(param, TIED_ATTR)
