"""Staleness corrections for PACI: cheap because each stage's delay is known in advance.

Under PACI a micro-batch's forward on stage s may run on weights up to ceil((S-1-s)/N) optimizer
steps older than those its gradient is applied to (schedules.py); the exact count for each
micro-batch is known when its forward starts (the windows that close before its backward, which the
runtime passes as ``pending_steps``). Two corrections use it; both are off by default, and with
``1f1b_flush`` (no staleness) both are the identity.

- `LRScale` (PipeMare's learning-rate rescheduling, Yang et al. 2021): stage s steps with its learning
  rate multiplied by ``(1 + d_s) ** -(1 - min(1, k / K))``, where ``d_s = ceil((S-1-s)/N)`` is its
  delay bound, k its own step count and K the annealing horizon: 1/(1+d_s) at the first step, rising
  geometrically to 1 at step K, plain PACI afterwards. Stale stages take smaller steps while the
  weights move fastest, early in training. Memory: none. Time: none.
- `WeightPrediction` (SpecTrain / PipeOptim style): the forward of a micro-batch with ``pending_steps``
  = d > 0 runs on weights extrapolated by the optimizer's own pending update, ``w - d * lr * u``, with
  ``u`` the update the optimizer would apply at its next step if the window's gradient were the mean
  g of what the stage has accumulated of it so far (AdamW: ``m' = b1 m + (1 - b1) g``,
  ``v' = b2 v + (1 - b2) g^2``, ``u = m'_hat / (sqrt(v'_hat) + eps) + wd * w`` with the bias corrections
  of step t + 1; Adam: the same, its L2 decay being inside m and v; the current moments alone when the
  window has no gradient yet; the scheduled learning rate). Folding g in is what makes the prediction
  good early in training, when the moments are young: without it S=8 N=8 at lr 5e-4 ended +0.6% above
  flush, with it +0.1% (BENCHMARKS.md "PACI at depth"). Then the
  weights are put back, so the backward and the update use the real weights (keep-graph: the kept
  graph holds the forward's activations, the backward reads the real weights, as plain PACI's does;
  recompute: the backward recomputes on the real weights). Memory: one weight-sized buffer per stage
  (the real weights while the predicted ones are in place). Time: two copies and one update
  evaluation of the stage's weights per stale forward.

Pure PyTorch; a `PipelineStage` holds one correction (``stage.correction``) and calls `step_context`
around its optimizer step and `forward_context` around a forward.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

import torch
from torch import Tensor, nn

CorrectionName = Literal["none", "lr_scale", "weight_prediction"]
CORRECTIONS: tuple[CorrectionName, ...] = ("none", "lr_scale", "weight_prediction")


def delay_bound(schedule: str, stage: int, num_stages: int, accumulate: int) -> int:
    """Optimizer steps a forward on ``stage`` can be behind its backward: ceil((S-1-s)/N) under PACI, 0 under flush."""
    return math.ceil((num_stages - 1 - stage) / accumulate) if schedule == "paci" else 0


class StalenessCorrection:
    """No correction: the base both corrections refine (and what ``"none"`` means)."""

    def step_context(self, optimizer: torch.optim.Optimizer, step: int) -> Any:
        """Context around the stage's ``step``-th (0-based) optimizer step."""
        return nullcontext()

    def forward_context(
        self, params: Sequence[nn.Parameter], optimizer: Any, pending_steps: int, window_weight: Any = None
    ) -> Any:
        """Context around a forward that ``pending_steps`` optimizer steps separate from its backward."""
        return nullcontext()


class LRScale(StalenessCorrection):
    """PipeMare's rescheduling: scale the stage's learning rate by ``(1 + delay) ** -(1 - min(1, k / anneal_steps))``.

    Args:
        delay: The stage's delay bound d_s (`delay_bound`).
        anneal_steps: K, the stage's optimizer steps over which the scale returns to 1.
    """

    def __init__(self, delay: int, anneal_steps: int) -> None:
        if anneal_steps < 1:
            raise ValueError(f"anneal_steps={anneal_steps} must be >= 1")
        self.delay = delay
        self.anneal_steps = anneal_steps

    def factor(self, step: int) -> float:
        """The learning-rate multiplier at the stage's ``step``-th optimizer step."""
        return (1.0 + self.delay) ** -(1.0 - min(1.0, step / self.anneal_steps))

    @contextmanager
    def step_context(self, optimizer: torch.optim.Optimizer, step: int) -> Iterator[None]:
        factor = self.factor(step)
        if factor == 1.0:
            yield
            return
        saved = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        try:
            yield
        finally:  # the scheduler, not this scale, owns the learning rate between steps
            for group, lr in zip(optimizer.param_groups, saved, strict=True):
                group["lr"] = lr


class WeightPrediction(StalenessCorrection):
    """Forward stale micro-batches on ``w - pending_steps * lr * u`` (the optimizer's pending update u)."""

    def __init__(self) -> None:
        self._stash: list[Tensor] | None = None  # the real weights while predicted ones are in place

    @contextmanager
    def forward_context(
        self, params: Sequence[nn.Parameter], optimizer: Any, pending_steps: int, window_weight: Any = None
    ) -> Iterator[None]:
        if pending_steps <= 0 or optimizer is None:
            yield
            return
        steps = predicted_steps(optimizer, window_weight)
        if not steps:  # no optimizer state yet: nothing to extrapolate from
            yield
            return
        params = [p for p in params if id(p) in steps]
        if self._stash is None or len(self._stash) != len(params):
            self._stash = [torch.empty_like(p) for p in params]
        versions = tuple(p._version for p in params)
        with torch.no_grad():
            for p, buf in zip(params, self._stash, strict=True):
                buf.copy_(p)
                p.sub_(steps[id(p)](p), alpha=float(pending_steps))
        # Autograd saves a parameter with its version; put the counters back so a kept graph accepts the
        # restore below (the same device as the local step's, stage.py: keep-graph PACI).
        torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, buf in zip(params, self._stash, strict=True):
                    p.copy_(buf)
            torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)


def predicted_steps(optimizer: torch.optim.Optimizer, window_weight: Tensor | None = None) -> dict[int, Any]:
    """Per parameter (by id) with optimizer state: ``w -> lr * u``, the change the next step would make.

    Args:
        optimizer: The stage's AdamW or Adam.
        window_weight: The weight of the window accumulated so far (the stage's ``_window[0]``): each
            parameter's ``grad / window_weight`` is folded into the moments as the next step's gradient.
            None: the window has no gradient yet, the current moments alone.

    Raises for an optimizer whose update this module does not know.
    """
    name = type(optimizer).__name__
    unusual = any(g.get("amsgrad") or g.get("maximize") for g in optimizer.param_groups)
    if name not in ("AdamW", "Adam") or unusual:
        raise ValueError(
            f"staleness_correction='weight_prediction' knows the updates of AdamW and Adam (without amsgrad or "
            f"maximize), not this {name}; "
            "use staleness_correction='lr_scale' or one of those optimizers"
        )
    out: dict[int, Any] = {}
    # The window's weight stays a device tensor: no host sync on the forward path. A window that has
    # gradients has weight > 0 (clamped only so a zero-weight window divides zeros by a tiny number).
    weight = None if window_weight is None else window_weight.clamp_min(torch.finfo(window_weight.dtype).tiny)
    for group in optimizer.param_groups:
        lr, wd = float(group["lr"]), float(group.get("weight_decay", 0.0))  # lr: the next step's (scheduled)
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            beta1, beta2 = group["betas"]
            t = float(state["step"])
            # The window's mean gradient so far stands for the pending step's gradient.
            g = p.grad if weight is not None and p.grad is not None else None
            out[id(p)] = _adam_step(
                state["exp_avg"], state["exp_avg_sq"], g, weight, lr, wd, beta1, beta2, group["eps"], t, name == "AdamW"
            )
    return out


def _adam_step(
    m: Tensor, v: Tensor, g: Tensor | None, weight: Tensor | None, lr: float, wd: float, b1: float, b2: float,
    eps: float, t: float, decoupled: bool,
):  # fmt: skip
    # Evaluated parameter by parameter (forward_context), so the folded moments exist for one parameter at a time.
    def step(w: Tensor) -> Tensor:
        mt, vt, tt = m, v, t
        if g is not None:
            mean = g / weight
            mt, vt, tt = b1 * m + (1 - b1) * mean, b2 * v + (1 - b2) * mean * mean, t + 1
        u = (mt / (1 - b1**tt)) / ((vt / (1 - b2**tt)).sqrt() + eps)
        if wd and decoupled:
            u = u + wd * w
        return lr * u

    return step


def make_correction(
    name: str | None, schedule: str, stage: int, num_stages: int, accumulate: int, anneal_steps: int
) -> StalenessCorrection | None:
    """The correction ``name`` for ``stage``, or None when it would change nothing (off, flush, last stage)."""
    if name is None or name == "none":
        return None
    if name not in CORRECTIONS:
        raise ValueError(f"staleness_correction={name!r} is not one of {', '.join(CORRECTIONS)} (or None)")
    delay = delay_bound(schedule, stage, num_stages, accumulate)
    if delay == 0:
        return None
    return LRScale(delay, anneal_steps) if name == "lr_scale" else WeightPrediction()
