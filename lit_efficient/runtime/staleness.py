"""Staleness corrections for PACI: cheap because each stage's delay is known in advance.

Under PACI a micro-batch's forward on stage s may run on weights up to ceil((S-1-s)/N) optimizer
steps older than those its gradient is applied to (schedules.py); the exact count for each
micro-batch is known when its forward starts (the windows that close before its backward, which the
runtime passes as ``pending_steps``). The corrections below use it; with ``1f1b_flush`` (no staleness) all are
the identity.

The strategy's default (``staleness_correction="auto"``, `make_correction`) is `InPlaceFirstStepWeightPrediction`
with Adam or AdamW (`predictable`), its compiled form `CompiledFirstStepWeightPrediction` on CUDA weights, and
nothing with other optimizers. It goes with the strategy's synchronous start
(``sync_start_steps="auto"``: the first `auto_sync_start_steps` steps in 1F1B-flush order, while Adam's moments are
young): together they ended within 0.3% of flush's loss on the benchmark grid at lr 2e-3, where the prediction
alone left runs up to 5.7% above it and the start alone up to 5.1% (benchmarks/reports/exp31-staleness.md).
The default folds the window's mean so far g into ``m`` as it is, but into ``v`` only for the share f = k/N of the
window accumulated (k of N micro-batches, the stage's count): ``v' = b2 v + (1 - b2) (f g^2 + (1 - f) v_hat)``
(`SquareShrunkWeightPrediction`'s rule). Why: where noise dominates the gradient (late in a run, at low rates) the
mean of k micro-batches squared overstates the window's ``g^2`` by ``sigma^2 (1/k - 1/N)`` in expectation, so the
plain fold divides by too large a ``sqrt(v')`` and every prediction falls short of the step it predicts, coherently
(-8% along the step in windows under a quarter accumulated, `benchmarks/exp31_diagnose.py`); a coherent shortfall
is what costs loss (flush with random errors of the prediction's size does not move). The share still to come is
expected at ``v_hat``. 2,400 steps at lr 5e-4 (GPT 14x64, S=8 N=8): +1.41% against flush on the whole validation
split with the plain fold, +0.18% with this one; the 150-step grid unchanged (within 0.2%).

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
  of step t + 1; Adam: the same with ``g + wd * w`` folded in, its L2 decay being inside m and v, or AdamW's with
  ``decoupled_weight_decay=True``; the current moments alone when the window has no gradient yet; frozen
  parameters not moved; the learning rate the next step will use, times d (a schedule's later steps are read as
  that one: a warmup's stale forwards lag a little, a decay's lead); g before clipping, which acts at the step
  only). Folding g in is what makes the prediction
  good early in training, when the moments are young: without it S=8 N=8 at lr 5e-4 ended +0.6% above
  flush, with it +0.1% (BENCHMARKS.md "PACI at depth"). Then the
  weights are put back, so the backward and the update use the real weights (keep-graph: the kept
  graph holds the forward's activations, the backward reads the real weights, as plain PACI's does;
  recompute: the backward recomputes on the real weights). Memory: one weight-sized buffer per stage
  (the real weights while the predicted ones are in place). Time: two copies and one update
  evaluation of the stage's weights per stale forward. It predicts nothing before the optimizer has
  state, i.e. for the stale forwards of the first window.
- `FirstStepWeightPrediction`: `WeightPrediction` that also predicts the first step (zero moments, the
  window's gradient so far folded in: Adam's first update, ~lr * sign(g) on every coordinate, the largest
  relative step of a run). Issue 31: PACI with the exact weights for its stale forwards trains bit for bit
  as flush (benchmarks/exp31_oracle.py), flush shrugs off random errors of 30% of a step on every forward,
  but the run is decided in its first ~20-45 steps: leaving the first step unpredicted sent S=8 N=8 lr
  2e-3 seed 0 to a plateau (+18.6% against flush), predicting it gave +2.9% (3 seeds: median +0.8%).
  `InPlaceFirstStepWeightPrediction`: the same without the weight-sized buffer (the prediction inverted
  in place, equal up to rounding), in fused multi-tensor operations (`_direction`: lerp and addcdiv, about
  half the passes over memory of the stashing forms' ``step``, a bounded number of operators per stage).
  `CompiledFirstStepWeightPrediction`: `InPlaceFirstStepWeightPrediction` in compiled passes (one per weight).
- Tried for issue 31 and not better (benchmarks/reports, exp31): `DampedWeightPrediction` (half the
  extrapolation), `ShrunkWeightPrediction` (a young window's mean shrunk towards the momentum),
  `MomentumLookAhead` (the last update, recomputed from Adam's moments: PipeNAG/SpecTrain) and
  `DelayCompensation` (DC-ASGD's first-order gradient correction with a g*g Hessian).

Pure PyTorch; a `PipelineStage` holds one correction (``stage.correction``) and calls `step_context`
around its optimizer step and `forward_context` around a forward.
"""

from __future__ import annotations

import inspect
import math
import types
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

# The in-place prediction evaluates the update over batches of parameter pieces in multi-tensor (foreach) operations:
# a batch holds up to max(_CHUNK, 1/_BATCHES of the stage's elements), so its temporaries (three of a batch's size)
# stay a small fraction of the weights, and a stage costs ~_BATCHES x 9 kernels per apply or undo rather than a
# handful of kernels (or Python operations) per parameter and per 65,536 elements.
_CHUNK = 1 << 16
_BATCHES = 16

CorrectionName = Literal[
    "auto",
    "none",
    "lr_scale",
    "weight_prediction",
    "weight_prediction_damped",
    "weight_prediction_shrunk",
    "weight_prediction_momentum",
    "delay_compensation",
    "weight_prediction_first_step",
    "weight_prediction_first_step_shrunk",
    "weight_prediction_first_step_square_shrunk",
    "weight_prediction_first_step_inplace",
    "weight_prediction_first_step_compiled",
]
CORRECTIONS: tuple[CorrectionName, ...] = get_args(CorrectionName)

# Corrections that read every weight's optimizer moments (not possible with a sharded optimizer state) and
# those of them that keep a weight-sized copy of the stage's weights during a stale forward.
READS_MOMENTS = frozenset(c for c in CORRECTIONS if c.startswith("weight_prediction") or c == "delay_compensation")
STASHES = frozenset(
    c for c in CORRECTIONS if c.startswith("weight_prediction") and not c.endswith(("_inplace", "_compiled"))
)


def delay_bound(schedule: str, stage: int, num_stages: int, accumulate: int) -> int:
    """Optimizer steps a forward on ``stage`` can be behind its backward: ceil((S-1-s)/N) under PACI, 0 under flush."""
    return math.ceil((num_stages - 1 - stage) / accumulate) if schedule == "paci" else 0


class StalenessCorrection:
    """No correction: the base both corrections refine (and what ``"none"`` means)."""

    restores_exactly = True  # the weights after a corrected forward are bit for bit those before it

    def step_context(self, optimizer: torch.optim.Optimizer, step: int) -> Any:
        """Context around the stage's ``step``-th (0-based) optimizer step."""
        return nullcontext()

    def forward_context(
        self, params: Sequence[nn.Parameter], optimizer: Any, pending_steps: int, window_weight: Any = None,
        window_microbatches: int | None = None, window_bad: Any = None,
    ) -> Any:  # fmt: skip
        """Context around a forward that ``pending_steps`` optimizer steps separate from its backward, with the
        stage's window so far of weight ``window_weight`` over ``window_microbatches`` backwards; ``window_bad``
        (a 0-dim tensor) > 0 once a micro-batch of the window had a non-finite loss (a prediction also checks the
        stage's own gradient, `nonfinite_window`)."""
        return nullcontext()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint of a drained pipeline must carry for a resume to correct as the uninterrupted run
        would (the stage's accumulation state holds it); most corrections read only the optimizer's state."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict`."""


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

    def __init__(
        self, scale: float = 1.0, accumulate: int | None = None, fold: bool = True, first_step: bool = False,
        stash: bool = True, shrink: Literal["mean", "square"] = "mean",
    ) -> None:  # fmt: skip
        self._stash: list[Tensor] | None = None  # the real weights while predicted ones are in place
        self.scale = scale  # steps predicted per pending step (1: the full extrapolation)
        self.accumulate = accumulate  # set: the window's mean so far is shrunk towards the momentum
        self.shrink = shrink  # with accumulate: "square" shrinks only the mean's square folded into v, towards v_hat
        self.fold = fold  # False: the current moments alone (the last applied update, look-ahead)
        self.first_step = first_step  # also predict the first step (zero moments), not only once state exists
        self.stash = stash  # False: undo the prediction by inverting it in place (no weight-sized buffer)
        # The inversion restores the weights up to rounding (a few ulp per stale forward), a residue that depends on
        # the window's own gradients: replicas of a stage drift apart by it (see `stage_checkpoints`' save).
        self.restores_exactly = stash

    @contextmanager
    def forward_context(
        self, params: Sequence[nn.Parameter], optimizer: Any, pending_steps: int, window_weight: Any = None,
        window_microbatches: int | None = None, window_bad: Any = None,
    ) -> Iterator[None]:  # fmt: skip
        if pending_steps <= 0 or optimizer is None:
            yield
            return
        share = None  # the share of the window accumulated, where the rule shrinks by it and the stage counts
        if self.accumulate and window_microbatches is not None:
            share = min(1.0, window_microbatches / self.accumulate)
        weight = window_weight if self.fold else None
        # A window whose gradient holds a NaN/Inf folds a zero gradient into the prediction (`_masked`): folded, it
        # made the predicted weights NaN, and the in-place undo cannot bring NaN weights back, so a window
        # on_nonfinite="skip" skipped left stage 0 NaN for good, and one raised on left NaN weights behind the error.
        # One rule on every device; where the flag is a CPU tensor it is read first (free), so a finite window pays
        # no masking pass; on a device it is applied without a host sync.
        if weight is not None:
            window_bad = nonfinite_window(params, window_bad)
        if weight is None or (window_bad is not None and window_bad.device.type == "cpu" and not window_bad.item()):
            window_bad = None
        steps = predicted_steps(optimizer, weight, share, self.first_step, self.shrink, window_bad)
        if not steps:  # no optimizer state yet: nothing to extrapolate from
            yield
            return
        params = [p for p in params if id(p) in steps]
        # In place only on fp32/fp64 weights: a bf16 or fp16 weight would lose bits to every inversion.
        if not self.stash and all(p.dtype in (torch.float32, torch.float64) for p in params):
            with self._in_place(params, steps, self.scale * float(pending_steps)):
                yield
            return
        if self._stash is None or len(self._stash) != len(params):
            self._stash = [torch.empty_like(p) for p in params]
        versions = tuple(p._version for p in params)
        with torch.no_grad():
            for p, buf in zip(params, self._stash, strict=True):
                buf.copy_(p)
                p.sub_(steps[id(p)](p), alpha=self.scale * float(pending_steps))
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

    @staticmethod
    @contextmanager
    def _in_place(params: list[nn.Parameter], steps: dict[int, Any], c: float) -> Iterator[None]:
        """``w -> w (1 - c k) - c D`` (D: the step without its decay term ``k w``) and back by the inverse
        ``w = (w' + c D) / (1 - c k)``, D evaluated again on the same moments and gradient, a batch of pieces at
        a time (`_batches`): temporaries of a batch's size instead of a copy of the stage's weights; the restored
        weights equal the real ones up to rounding (a few ulp per stale forward)."""
        batches = _batches(params, steps)
        versions = tuple(p._version for p in params)
        with torch.no_grad():
            for pieces, items in batches:
                num, denom, scale = _direction(items)
                torch._foreach_mul_(pieces, 1 - c * items[0][0].decay)
                torch._foreach_addcdiv_(pieces, num, denom, value=-c * scale)
        torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)
        try:
            yield
        finally:
            with torch.no_grad():
                for pieces, items in batches:
                    num, denom, scale = _direction(items)
                    torch._foreach_addcdiv_(pieces, num, denom, value=c * scale)
                    torch._foreach_div_(pieces, 1 - c * items[0][0].decay)
            torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)


def _fused_prediction(
    ws: list[Tensor], ms: list[Tensor], vs: list[Tensor], gs: list[Tensor], weight: Tensor, bad: Tensor, a: Tensor,
    s: Tensor, bc2: Tensor, f: Tensor, vc: Tensor, b1: float, b2: float, eps: float,
) -> None:  # fmt: skip
    """``w <- a w + s m' / (sqrt(v' / bc2) + eps)`` for every weight, ``m'``, ``v'`` Adam's moments with the window's
    mean ``g / weight`` folded in (its square as ``f mean^2 + vc v``: the square shrunk towards ``v_hat`` by the share
    f of the window accumulated, ``vc = (1 - f) / (1 - b2^t)``; f = 1, vc = 0 where it is not shrunk): the in-place
    prediction's apply (``a = 1 - c k``, ``s = -c lr / bc1``) and its undo (``a = 1 / (1 - c k)``, ``s = c lr / bc1 /
    (1 - c k)``), which evaluates the same ``m' / (...)`` on the same inputs. ``a``, ``s``, ``bc2``, ``f`` and ``vc``
    are 0-dim tensors on the weights' device, so a new learning rate, step count or share is not a recompilation.
    Written for `torch.compile` (one pass per weight); run eagerly it is slow."""
    for w, m, v, g in zip(ws, ms, vs, gs, strict=True):
        mean = torch.where(bad > 0, 0.0, g / weight)  # a window flagged non-finite folds no gradient
        num = torch.lerp(m, mean, 1 - b1)
        den = (torch.lerp(v, mean * mean * f + v * vc, 1 - b2) / bc2).sqrt() + eps
        w.copy_(w * a + s * (num / den))


# False (after one warning) once a compilation has failed in this process: every stage then takes the eager form.
_COMPILER_WORKS = {"ok": True}


def _compiled_prediction() -> Any:
    """A compiled `_fused_prediction` of its own (a fresh code object): torch.compile keeps its graphs per code object
    and at most ``recompile_limit`` (8) of them, and each stage needs one per update key (a stage, its own shapes)."""
    fn = types.FunctionType(_fused_prediction.__code__.replace(), _fused_prediction.__globals__, "_fused_prediction")
    # No size asserts in the compiled code: the graph's guards check every input's sizes and strides already (the
    # asserts re-check each of the 4 x n tensors at every call).
    return torch.compile(fn, dynamic=False, fullgraph=True, options={"size_asserts": False})


def _fused_groups(params: list[nn.Parameter], steps: dict[int, Any]) -> dict[tuple, list[nn.Parameter]]:
    """The fp32 parameters `_fused_prediction` covers, by update key: moments exist and the window has a gradient."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        step = steps[id(p)]
        _, _, _, _, _, _, zero_moments, no_gradient, _ = step.key
        if p.dtype == torch.float32 and not zero_moments and not no_gradient:
            groups.setdefault(step.key, []).append(p)
    return groups


def _run_fused(
    fn: Any, groups: dict[tuple, list[nn.Parameter]], steps: dict[int, Any], c: float, undo: bool
) -> bool:  # fmt: skip
    """Apply (or undo) the prediction of ``groups`` with ``fn`` (`_compiled_prediction`); False, with every weight as it
    was, if a compilation failed."""
    done: list[tuple] = []
    for key, params in groups.items():
        try:
            _fused_call(fn, key, params, steps, c, undo)
        except Exception as err:  # noqa: BLE001 - any compiler failure leaves the eager form
            if undo:  # the apply ran these very graphs: this is not a compiler failure
                raise
            for applied in done:  # put back what the groups before this one predicted
                _fused_call(fn, applied, groups[applied], steps, c, undo=True)
            _COMPILER_WORKS["ok"] = False
            warnings.warn(
                f"The compiled weight prediction failed to compile ({type(err).__name__}: {str(err)[:200]}); this "
                "process runs the eager form (the same rule, ~4x the passes over memory; on an H200 at GPT-2 "
                "Medium's shape its kernels took 5.6 ms per block against 0.17 ms compiled, enough to cost PACI its "
                "lead over 1F1B-flush: fix the compiler (Triton on CUDA) or weigh schedule='1f1b_flush'). "
                "staleness_correction='weight_prediction_first_step_inplace' asks for the eager form directly.",
                stacklevel=2,
            )
            return False
        done.append(key)
    return True


def _fused_call(fn: Any, key: tuple, params: list[nn.Parameter], steps: dict[int, Any], c: float, undo: bool) -> None:
    """One update key's apply (``w -> w (1 - c k) - c D``) or undo (its inverse) through ``fn``."""
    lr, decay, b1, b2, eps, t, _, _, square = key
    bc1, bc2 = _bias_corrections(key)
    a, s = 1 - c * decay, c * lr / bc1
    shrink = (1.0, 0.0) if square is None else (square, (1 - square) / (1 - b2**t))
    coef = (1 / a, s / a, bc2, *shrink) if undo else (a, -s, bc2, *shrink)
    # Filled on the device (a kernel argument each): a tensor built from host values would be a blocking host-to-
    # device copy, a host sync per apply and per undo on CUDA.
    device = params[0].device
    a_t, s_t, bc2_t, f_t, vc_t = (torch.full((), x, dtype=torch.float32, device=device) for x in coef)
    ms, vs, gs = (list(x) for x in zip(*(steps[id(p)].sliced(None) for p in params), strict=True))
    weight, bad = steps[id(params[0])].weight, steps[id(params[0])].bad
    bad = torch.zeros((), dtype=weight.dtype, device=weight.device) if bad is None else bad  # None: a finite window
    fn([p.detach() for p in params], ms, vs, gs, weight, bad, a_t, s_t, bc2_t, f_t, vc_t, b1, b2, eps)


@contextmanager
def _compiled_in_place(
    fn: Any, fused: dict[tuple, list[nn.Parameter]], rest: list[nn.Parameter], steps: dict[int, Any], c: float
) -> Iterator[None]:
    """`CompiledFirstStepWeightPrediction`'s apply and undo: ``fused`` in compiled passes, ``rest`` eagerly."""
    params = [p for group in fused.values() for p in group] + rest
    versions = tuple(p._version for p in params)
    with torch.no_grad():
        ok = _run_fused(fn, fused, steps, c, undo=False)
    if not ok:
        rest = params
    torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)
    with InPlaceFirstStepWeightPrediction._in_place(rest, steps, c) if rest else nullcontext():
        try:
            yield
        finally:
            if ok:
                with torch.no_grad():
                    _run_fused(fn, fused, steps, c, undo=True)
                torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)


def _pieces(p: Tensor, size: int = _CHUNK) -> Iterator[tuple[Tensor, slice | None]]:
    """A parameter as views of ``size`` of its flattened elements (the whole of it if not contiguous)."""
    if not p.is_contiguous():
        yield p, None
        return
    flat = p.view(-1)
    for start in range(0, flat.numel(), size):
        part = slice(start, start + size)
        yield flat[part], part


def _batches(params: list[nn.Parameter], steps: dict[int, Any]) -> list[tuple[list[Tensor], list[tuple[Any, Any]]]]:
    """The stage's weights as batches for `_direction`: ``(pieces, [(step, part), ...])``, each of one update key
    (the same hyper-parameters, step count and kind of moments) and at most ``max(_CHUNK, 1/_BATCHES of the stage's
    elements)`` elements, a larger parameter cut into pieces of that size."""
    budget = max(_CHUNK, math.ceil(sum(p.numel() for p in params) / _BATCHES))
    done: list[tuple[list[Tensor], list[tuple[Any, Any]]]] = []
    filling: dict[tuple, tuple[list[Tensor], list[tuple[Any, Any]], list[int]]] = {}
    for p in params:
        step = steps[id(p)]
        for piece, part in _pieces(p, budget):
            pieces, items, size = filling.setdefault(step.key, ([], [], [0]))
            if pieces and size[0] + piece.numel() > budget:
                done.append((pieces, items))
                pieces, items, size = filling[step.key] = ([], [], [0])
            pieces.append(piece)
            items.append((step, part))
            size[0] += piece.numel()
    return done + [(pieces, items) for pieces, items, _ in filling.values() if pieces]


class FirstStepWeightPrediction(WeightPrediction):
    """`WeightPrediction` from the first window on: before the optimizer has state, the first step is predicted
    from zero moments with the window's gradient so far folded in (AdamW's first update, ``~ lr * sign(g)``).

    Plain `WeightPrediction` leaves the stale forwards of the first window (run before any step) on the
    initial weights, though Adam's first step is the largest relative change of a run (every coordinate moves
    by ~lr: 2-3% of the weights at lr 2e-3 in the benchmark's GPT). At S=8 N=8 lr 2e-3 that one unpredicted step
    decided seed 0: +18.6% with it, +2.9% predicted (issue 31). Memory and time: `WeightPrediction`'s (one
    weight-sized buffer per stale stage; per stale forward two copies and one update evaluation of the
    stage's weights), plus zero moments for one parameter at a time during the first window.
    """

    def __init__(self) -> None:
        super().__init__(first_step=True)


class InPlaceFirstStepWeightPrediction(WeightPrediction):
    """`FirstStepWeightPrediction` without the weight-sized buffer: the prediction ``w -> w (1 - c k) - c D``
    is undone by its inverse ``(w' + c D) / (1 - c k)`` with ``D`` evaluated again (see ``_in_place``).

    Memory: the temporaries of one batch of pieces (`_batches`: three of at most max(65,536, 1/16 of the stage's)
    elements, so at most 3/16 of the stage's weights, for the length of the apply or of the undo), no copy of the
    stage's weights; with Adam's L2 decay (``Adam(weight_decay>0)``, not AdamW) one weight-sized temporary for the
    stale forward (the window's sum with ``weight * wd * w`` added, which the apply and the undo both read).
    Time: two update evaluations per stale forward instead of one evaluation and two copies, in multi-tensor
    operations: about 2 x 9 per batch, ~380 operator calls (GPU kernels) for a stage of three GPT-2
    Medium blocks where a loop over parameters and 65,536-element chunks ran ~10,800. The restored weights
    equal the real ones up to rounding (a few ulp per stale forward), so a run is not bit-identical to
    `FirstStepWeightPrediction`'s; Adam amplifies such differences in near-zero gradients.

    With ``accumulate`` (N; what ``"auto"`` and the names build) the square folded into ``v`` is shrunk by the share
    of the window accumulated, as `SquareShrunkWeightPrediction` (the module's docstring says why): two more
    multi-tensor operations per batch of pieces while a window is young.
    """

    def __init__(self, accumulate: int | None = None) -> None:
        super().__init__(first_step=True, stash=False, accumulate=accumulate, shrink="square")


class CompiledFirstStepWeightPrediction(InPlaceFirstStepWeightPrediction):
    """`InPlaceFirstStepWeightPrediction` whose apply and undo are one compiled pass over each parameter
    (`torch.compile` of `_fused_prediction`: reads w, m, v and g once, writes w, no temporaries). The eager form
    makes ~9 passes over memory per apply or undo (`_direction`, then the update: ~88 bytes moved per fp32 weight
    against 20) and, on CPU, one dispatch per tensor and operator; Inductor makes one kernel per update key, writing
    the weights in place, no allocation (its output code on CPU). Measured on one CPU thread
    (benchmarks/reports/exp31-staleness.md, "The compiled prediction"): apply + undo 2.1x faster than the eager form
    for a block of 50K weights (where the compiled call's guards over 48 tensors dominate), 3.4x for 790K.

    ``"auto"`` is this form on CUDA weights; elsewhere ``"weight_prediction_first_step_compiled"`` asks for it (on CPU
    it needs a C++ compiler). What it does not cover (the first step's zero moments, a window without a gradient yet,
    bf16 weights) takes the eager form. Cost: a compilation per stage and update key in each process, at the first
    stale forward (three blocks on one CPU thread: 46 s with Inductor's cache empty, 7 s with it warm; gpu_smoke's
    ``weight_prediction`` check). A failed compilation warns once and leaves the eager form for the rest of the
    process. The result equals the eager form's up to rounding, not bit for bit (another order of operations).
    """

    def __init__(self, accumulate: int | None = None) -> None:
        super().__init__(accumulate)
        self._fn: Any = None  # this stage's `_compiled_prediction`, made at its first stale forward

    @property
    def compiled(self) -> bool:
        """Whether this stage predicts in compiled passes: it has compiled, and no compilation in the process failed."""
        return self._fn is not None and _COMPILER_WORKS["ok"]

    def _in_place(self, params: list[nn.Parameter], steps: dict[int, Any], c: float) -> Any:  # type: ignore[override]
        fused = _fused_groups(params, steps) if _COMPILER_WORKS["ok"] else {}
        if not fused:
            return InPlaceFirstStepWeightPrediction._in_place(params, steps, c)
        covered = {id(p) for group in fused.values() for p in group}
        if self._fn is None:
            self._fn = _compiled_prediction()
        return _compiled_in_place(self._fn, fused, [p for p in params if id(p) not in covered], steps, c)


class DampedWeightPrediction(WeightPrediction):
    """`WeightPrediction` extrapolating half of each pending step: ``w - 0.5 * d * lr * u`` (issue 31, candidate
    4: a prediction that overshoots would do better damped; it did not, 2.782 against 2.861 and plain 2.805 at
    S=8 N=8 lr 2e-3 seed 0). Memory and time: `WeightPrediction`'s."""

    def __init__(self, scale: float = 0.5) -> None:
        super().__init__(scale=scale)


class ShrunkWeightPrediction(WeightPrediction):
    """`WeightPrediction` with the window's mean gradient so far shrunk towards the momentum, ``f * mean +
    (1 - f) * m_hat`` (f: the share of the window accumulated), so a young window's one or two micro-batches
    weigh less in the predicted step. Memory and time: `WeightPrediction`'s."""

    def __init__(self, accumulate: int, first_step: bool = False) -> None:
        super().__init__(accumulate=accumulate, first_step=first_step)


class SquareShrunkWeightPrediction(WeightPrediction):
    """`FirstStepWeightPrediction` with only the mean's square shrunk: ``v' = b2 v + (1 - b2) (f mean^2 + (1 - f)
    v_hat)`` (f = k/N, k of the window's N micro-batches accumulated), ``m'`` as in `WeightPrediction`. A young
    window's mean of k micro-batches squared overstates the full window's ``g^2`` by ``sigma^2 (1/k - 1/N)`` where
    noise dominates the gradient, so folding it into ``v`` shrinks the predicted step coherently; the expected square
    of the share still to come is ``v_hat``'s. The default's rule in the stashing form (the one the benchmarks
    compare rules with). Memory and time: `WeightPrediction`'s."""

    def __init__(self, accumulate: int) -> None:
        super().__init__(accumulate=accumulate, first_step=True, shrink="square")


class MomentumLookAhead(WeightPrediction):
    """Look-ahead by the last applied update (PipeNAG-style, SpecTrain's first rule): ``w - d * lr * u`` with u
    from the current moments alone, which is AdamW's last update recomputed from its state (at the next
    step's learning rate), so no copy of the previous weights is kept. Memory and time: `WeightPrediction`'s."""

    def __init__(self) -> None:
        super().__init__(fold=False)


class DelayCompensation(StalenessCorrection):
    """DC-ASGD (Zheng et al. 2017) on the window's gradient: ``g + lam * f * g * g / sqrt(v_hat) * (w_now - w_fwd)``.

    A stale micro-batch's gradient was taken on weights ``w_fwd`` older than the ``w_now`` it is applied
    to; the first-order correction ``H (w_now - w_fwd)`` with the diagonal Hessian approximated by
    ``lam * g * g`` (DC-ASGD-a: ``lam = lam0 / sqrt(v_hat)``, Adam's second moment as the mean square).
    ``w_now - w_fwd`` is d times the last applied update, recomputed from AdamW's moments (no weight
    buffer), and ``f`` the share of the window's micro-batches that ran stale (counted at their forwards),
    weighted by their d. Memory: none beyond one parameter's temporaries. Time: a few element-wise passes
    over the stage's weights per optimizer step.
    """

    def __init__(self, accumulate: int, lam0: float = 2.0) -> None:
        self.accumulate = accumulate
        self.lam0 = lam0
        self._steps = 0  # optimizer steps taken
        self._stale: dict[int, int] = {}  # target step -> sum of the pending steps of its stale forwards

    def forward_context(
        self, params: Sequence[nn.Parameter], optimizer: Any, pending_steps: int, window_weight: Any = None,
        window_microbatches: int | None = None, window_bad: Any = None,
    ) -> Any:  # fmt: skip
        if pending_steps > 0:
            target = self._steps + pending_steps
            self._stale[target] = self._stale.get(target, 0) + pending_steps
        return nullcontext()

    def state_dict(self) -> dict[str, Any]:
        # The stale forwards of the window not yet stepped, by their step's distance from now: a checkpoint in the
        # middle of a window resumed without them, and its step corrected a smaller share (6e-2 in the weights).
        pending = [[target - self._steps, count] for target, count in sorted(self._stale.items())]
        return {"stale": torch.tensor(pending, dtype=torch.int64)} if pending else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stale = state.get("stale")
        self._stale = {} if stale is None else {self._steps + int(d): int(n) for d, n in stale.tolist()}

    @contextmanager
    def step_context(self, optimizer: torch.optim.Optimizer, step: int) -> Iterator[None]:
        share = self._stale.pop(self._steps, 0) / self.accumulate
        self._steps += 1
        if share and optimizer.state:
            with torch.no_grad():
                for group in optimizer.param_groups:
                    lr, wd = float(group["lr"]), float(group.get("weight_decay", 0.0))
                    decay = wd if decouples_weight_decay(optimizer, group) else 0.0  # Adam's L2: inside m and v
                    b1, b2 = group["betas"]
                    for p in group["params"]:
                        state = optimizer.state.get(p)
                        if not state or p.grad is None:
                            continue
                        t = float(state["step"])
                        v_hat = state["exp_avg_sq"] / (1 - b2**t)
                        denom = v_hat.sqrt() + group["eps"]
                        last = -lr * (state["exp_avg"] / (1 - b1**t) / denom + decay * p)  # ~ w_now - w_prev
                        p.grad.add_(self.lam0 * share * p.grad * p.grad / denom * last)
        yield


def predictable(optimizer: Any) -> bool:
    """Whether weight prediction knows ``optimizer``'s update (`prediction_refusal` has no reason against it)."""
    return prediction_refusal(optimizer) is None


def prediction_refusal(optimizer: Any, trust_step: bool = False) -> str | None:
    """Why weight prediction cannot predict ``optimizer``'s next update, or None where it can: torch's Adam or AdamW
    or a subclass of either, without amsgrad or maximize. By class, not by name: bitsandbytes' ``AdamW`` keeps its
    moments under other keys (a KeyError after the synchronous start) and a user's ``AdamW`` may step otherwise.
    A subclass that overrides ``step`` is refused unless ``trust_step`` (the user named a prediction: a wrapper
    that logs around ``super().step()`` keeps torch's rule). A sharded state (`ShardedOptimizer`) holds 1/R of
    the moments and is refused."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, _TORCH_ADAMS):
        held = "holds 1/R of the moments (shard_optimizer_state=True)" if name == "ShardedOptimizer" else (
            f"is not torch.optim.Adam or AdamW, nor a subclass of one ({type(optimizer).__module__}.{name})"
        )  # fmt: skip
        return f"the optimizer {held}"
    # torch's own Adam update is the rule the prediction computes; unwrapped: torch wraps a class's step() with
    # its profiling hook at the first instance.
    torch_steps = (torch.optim.Adam.step, torch.optim.AdamW.step)
    if not trust_step and inspect.unwrap(type(optimizer).step) not in map(inspect.unwrap, torch_steps):
        return f"{name} overrides step(), so its update may not be torch's Adam's"
    flags = [f for f in ("amsgrad", "maximize") if any(g.get(f) for g in optimizer.param_groups)]
    if flags:
        return f"{name} has {' and '.join(f'{f}=True' for f in flags)}, which the prediction does not model"
    return None


# AdamW subclasses Adam from torch 2.7 on only: both, for the torch releases pyproject admits.
_TORCH_ADAMS = (torch.optim.Adam, torch.optim.AdamW)


def check_predictable(optimizer: Any, asked: str = "weight prediction") -> None:
    """Raise, naming ``asked`` and the reason, where weight prediction cannot predict ``optimizer``'s update (a
    subclass's own step trusted: the user named a prediction)."""
    refusal = prediction_refusal(optimizer, trust_step=True)
    if refusal is not None:
        raise ValueError(
            f"{asked} reads Adam's moments and predicts torch's AdamW/Adam update: {refusal}. Use "
            "staleness_correction='lr_scale' (any optimizer), 'auto' (plain PACI where it cannot predict) or None."
        )


def adam_like(optimizer: Any) -> bool:
    """Whether ``optimizer`` is an Adam by kind: torch's (or a subclass), or a class named Adam/AdamW of another
    library (its moments are young in its first steps too, predictable or not)."""
    return isinstance(optimizer, _TORCH_ADAMS) or type(optimizer).__name__ in ("AdamW", "Adam")


# Steps of PACI's synchronous start with Adam or AdamW, whatever beta2: measured enough at beta2 = 0.9, 0.95 and
# 0.999, where 20 were not (at 0.95, nor at 0.9 whose 2 / (1 - beta2) is 20): benchmarks/reports/exp31-staleness.md.
YOUNG_MOMENT_STEPS = 40


def auto_sync_start_steps(optimizer: Any) -> int:
    """The steps of PACI's synchronous start for ``optimizer`` (`PACIStrategy(sync_start_steps="auto")`): 40 for an
    Adam or AdamW, whatever its betas, 0 for any other optimizer. Early on the moments rest on few gradients, each
    update is close to ``lr * sign(g)`` (the largest relative change of a run), a prediction from a partial window
    gets whole coordinates wrong, and the run's outcome is set there. Measured on the benchmark grid (S=8 N=8 and
    S=4 N=4, lr 2e-3, 3 seeds): 40 synchronous steps were enough at beta2 = 0.9, 0.95 and 0.999; 20 were not at
    0.95 nor at 0.9, although 2 / (1 - beta2), the second moment's steady depth, is 20 there; 2 / (1 - beta2) at
    torch's default 0.999 would have meant 2,000 steps of flush's bubble."""
    if not adam_like(optimizer) or not optimizer.param_groups:
        return 0
    return YOUNG_MOMENT_STEPS


# id of a device step tensor -> (a weak reference to it, its version, its value); the reference tells a reused id.
_STEP_COUNTS: dict[int, tuple[weakref.ref, int, float]] = {}


def step_count(step: Tensor | float) -> float:
    """Adam's step count as a float, without a host sync per stale forward: a step kept on a device (fused or
    capturable Adam) is read once per value, the in-place increment of each optimizer step bumping its version."""
    if not isinstance(step, Tensor) or step.device.type == "cpu":
        return float(step)
    seen = _STEP_COUNTS.get(id(step))
    if seen is None or seen[0]() is not step or seen[1] != step._version:
        seen = _STEP_COUNTS[id(step)] = (weakref.ref(step), step._version, float(step))
    return seen[2]


def predicted_steps(
    optimizer: torch.optim.Optimizer, window_weight: Tensor | None = None, share: float | None = None,
    first_step: bool = False, shrink: Literal["mean", "square"] = "mean", window_bad: Tensor | None = None,
) -> dict[int, Any]:  # fmt: skip
    """Per parameter (by id) with optimizer state: ``w -> lr * u``, the change the next step would make.

    Args:
        optimizer: The stage's AdamW or Adam.
        window_weight: The weight of the window accumulated so far (the stage's ``_window[0]``): each
            parameter's ``grad / window_weight`` is folded into the moments as the next step's gradient.
            None: the window has no gradient yet, the current moments alone.
        share: The share f of the window's micro-batches accumulated (0 to 1), to shrink the window's mean so far
            towards the momentum: the pending step's gradient is estimated as ``f * mean + (1 - f) * m_hat``.
            None: ``mean``.
        shrink: With ``share``: ``"mean"`` as above; ``"square"`` keeps ``mean`` in the first moment and folds
            ``f * mean^2 + (1 - f) * v_hat`` into the second instead of ``mean^2``.
        window_bad: A 0-dim flag, > 0 once the window's gradient holds a NaN/Inf (`nonfinite_window`: a
            micro-batch's non-finite loss, or the stage's own gradient): the window's mean is then taken as 0
            (`_masked`). None: not masked.

    Raises for an optimizer whose update this module does not know.
    """
    check_predictable(optimizer)
    out: dict[int, Any] = {}
    # The window's weight stays a device tensor: no host sync on the forward path. A window that has
    # gradients has weight > 0 (clamped only so a zero-weight window divides zeros by a tiny number).
    weight = None if window_weight is None else window_weight.clamp_min(torch.finfo(window_weight.dtype).tiny)
    for group in optimizer.param_groups:
        lr, wd = float(group["lr"]), float(group.get("weight_decay", 0.0))  # lr: the next step's (scheduled)
        decoupled = decouples_weight_decay(optimizer, group)
        for p in group["params"]:
            if not p.requires_grad:  # frozen: the step leaves it where it is, whatever state it kept
                continue
            state = optimizer.state.get(p)
            # The window's mean gradient so far stands for the pending step's gradient.
            g = p.grad if weight is not None and p.grad is not None else None
            if g is not None and wd and not decoupled:
                # Adam's L2 decay: the step folds g + wd * w into both moments, so the window's sum gains
                # weight * wd * w (a temporary per parameter, for coupled Adam with decay only).
                g = g + (wd * weight) * p.detach()
            if not state:
                if not first_step or g is None:
                    continue
                state = {"step": 0.0, "exp_avg": None, "exp_avg_sq": None}  # zero moments, never allocated
            beta1, beta2 = group["betas"]
            t = step_count(state["step"])
            out[id(p)] = _adam_step(
                state["exp_avg"],
                state["exp_avg_sq"],
                g,
                weight,
                lr,
                wd,
                beta1,
                beta2,
                group["eps"],
                t,
                decoupled,
                share,
                shrink,
                window_bad,
            )
    return out


def decouples_weight_decay(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``group``'s weight decay is decoupled (AdamW's ``w -= lr * wd * w``; Adam's with
    ``decoupled_weight_decay=True``, torch 2.7 on) rather than Adam's L2 term, added to the gradient."""
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


def _adam_step(
    m: Tensor | None, v: Tensor | None, g: Tensor | None, weight: Tensor | None, lr: float, wd: float, b1: float,
    b2: float, eps: float, t: float, decoupled: bool, share: float | None = None, shrink: str = "mean",
    bad: Tensor | None = None,
):  # fmt: skip
    # Evaluated parameter by parameter (forward_context), so the folded moments exist for one parameter at a time.
    # m and v None: zero moments (the first step, before the optimizer has state); then g is not None.
    def sliced(part: slice | None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        if part is None:
            return m, v, g
        return tuple(None if x is None else x.reshape(-1)[part] for x in (m, v, g))  # type: ignore[return-value]

    def step(w: Tensor | None, part: slice | None = None) -> Tensor:
        """``lr * u`` at weights ``w``; None: without the decoupled decay term (``step.decay * w``). ``part``: of
        the flattened parameter's elements only (its temporaries are that part's size)."""
        mt, vt, gt = sliced(part)
        tt = t
        if gt is not None:
            mean = _masked(gt / weight, bad)
            square = None
            if share is not None and share < 1 and t > 0:  # shrink a young window's mean towards the momentum
                f = share
                if shrink == "square":  # or only its square, towards v_hat (the expected square)
                    square = f * mean * mean + (1 - f) * (vt / (1 - b2**t))
                else:
                    mean = f * mean + (1 - f) * (mt / (1 - b1**t))
            # (1 - b2) * mean * mean, not (1 - b2) * (mean * mean): the rounding the emulation and in-place form share.
            folded = (1 - b2) * mean * mean if square is None else (1 - b2) * square
            if mt is None:  # zero moments: b1 * 0 + ... adds nothing
                mt, vt = (1 - b1) * mean, folded
            else:
                mt, vt = b1 * mt + (1 - b1) * mean, b2 * vt + folded
            tt = t + 1
        u = (mt / (1 - b1**tt)) / ((vt / (1 - b2**tt)).sqrt() + eps)
        if wd and decoupled and w is not None:
            u = u + wd * w
        return lr * u

    step.decay = lr * wd if decoupled else 0.0  # type: ignore[attr-defined]
    # What `_direction` batches pieces of parameters by: pieces with one key share every scalar of the update.
    # The share by which the square folded into v is shrunk (`SquareShrunkWeightPrediction`), where it applies.
    square = share if shrink == "square" and share is not None and share < 1 and t > 0 and g is not None else None
    step.key = (lr, step.decay, b1, b2, eps, t, m is None, g is None, square)  # type: ignore[attr-defined]
    step.sliced = sliced  # type: ignore[attr-defined]
    step.weight = weight  # type: ignore[attr-defined]
    step.bad = bad  # type: ignore[attr-defined]
    return step


def nonfinite_window(params: Sequence[nn.Parameter], loss_bad: Tensor | None) -> Tensor | None:
    """A 0-dim flag, > 0 where the window's gradient so far holds a NaN/Inf: after a micro-batch's non-finite loss
    (``loss_bad``, the stage's flag from downstream) or in the stage's own gradient behind a finite loss (a sqrt at
    0, an overflow), which the stage's step raises on but which reaches the prediction first. The step's own test
    (the gradients' norms, one fused pass, summed in float64: fp16 norms summed in fp16 overflowed where the step's
    did not; the largest magnitude, ``ord=inf``, is 50x slower on CPU), on the device."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return loss_bad
    own = gradients_nonfinite(grads)
    return own if loss_bad is None else torch.maximum(own, loss_bad.to(own.device, torch.float64))


def gradients_nonfinite(grads: Sequence[Tensor]) -> Tensor:
    """A 0-dim float64 flag on the gradients' device, 1 where any of ``grads`` (non-empty) holds a NaN/Inf: their
    norms (one fused pass) summed in float64, so fp16 norms do not overflow in the sum. The stage's step and the
    prediction (`nonfinite_window`) test alike."""
    return (~torch.isfinite(torch.stack(torch._foreach_norm(grads)).to(torch.float64).sum())).to(torch.float64)


def _masked(mean: Tensor, bad: Tensor | None) -> Tensor:
    """The window's mean, 0 where ``bad`` flags a non-finite window (NaN * 0 is NaN: a select, not a product)."""
    return mean if bad is None else torch.where(bad > 0, torch.zeros((), dtype=mean.dtype, device=mean.device), mean)


def _direction(items: list[tuple[Any, slice | None]]) -> tuple[list[Tensor], list[Tensor], float]:
    """``(nums, denoms, scale)`` of a batch of parameter pieces of one update key (`_batches`), with ``scale * num /
    denom`` each piece's step without its decay term: what the in-place prediction applies and undoes, in fused
    multi-tensor operations (lerp, addcdiv: about half the passes over memory of ``step``, and a handful of kernels
    per batch). The window's mean is not shrunk (``accumulate`` is for ``step`` only)."""
    first = items[0][0]
    lr, _, b1, b2, eps, t, _, _, square = first.key
    bc1, bc2 = _bias_corrections(first.key)
    ms, vs, gs = (list(x) for x in zip(*(step.sliced(part) for step, part in items), strict=True))
    if gs[0] is not None:
        mean = torch._foreach_div(gs, first.weight)
        if first.bad is not None:  # a window flagged non-finite (`forward_context`): one more pass, in place
            flagged, zero = first.bad > 0, torch.zeros((), dtype=mean[0].dtype, device=mean[0].device)
            for x in mean:
                torch.where(flagged, zero, x, out=x)
        num = torch._foreach_mul(mean, 1 - b1) if ms[0] is None else torch._foreach_lerp(ms, mean, 1 - b1)
        torch._foreach_mul_(mean, mean)
        if square is not None:  # f mean^2 + (1 - f) v_hat: the expected square of the share still to come
            torch._foreach_mul_(mean, square)
            torch._foreach_add_(mean, vs, alpha=(1 - square) / (1 - b2**t))
        if vs[0] is None:
            torch._foreach_mul_(mean, 1 - b2)
            denom = mean
        else:
            denom = torch._foreach_lerp(vs, mean, 1 - b2)
        torch._foreach_div_(denom, bc2)
    else:
        num, denom = ms, torch._foreach_div(vs, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    return num, denom, lr / bc1


def _bias_corrections(key: tuple) -> tuple[float, float]:
    """Adam's bias corrections ``(1 - b1 ** t', 1 - b2 ** t')`` of the pending step for an update key (`_adam_step`'s
    ``key``), as the eager (`_direction`) and the compiled (`_fused_call`) prediction use them: t' = t + 1 with the
    window's gradient folded into the moments, t (the current moments alone) when the window has none yet."""
    _, _, b1, b2, _, t, _, no_gradient, _ = key
    tt = t if no_gradient else t + 1
    return 1 - b1**tt, 1 - b2**tt


def make_correction(
    name: str | None, schedule: str, stage: int, num_stages: int, accumulate: int, anneal_steps: int,
    optimizer: Any = None,
) -> StalenessCorrection | None:  # fmt: skip
    """The correction ``name`` for ``stage``, or None when it would change nothing (off, flush, last stage).

    ``"auto"`` (the strategy's default) is `InPlaceFirstStepWeightPrediction` where the stage's ``optimizer`` is
    one whose update it predicts (`predictable`: AdamW, Adam), and off with any other (SGD, a sharded state)."""
    if name is None or name == "none":
        return None
    if name not in CORRECTIONS:
        raise ValueError(f"staleness_correction={name!r} is not one of {', '.join(CORRECTIONS)} (or None)")
    delay = delay_bound(schedule, stage, num_stages, accumulate)
    if delay == 0:
        return None
    if name == "auto":
        if not predictable(optimizer):
            return None  # plain PACI; the strategy says why (`prediction_refusal`)
        on_cuda = any(p.is_cuda for group in optimizer.param_groups for p in group["params"])
        form = CompiledFirstStepWeightPrediction if on_cuda else InPlaceFirstStepWeightPrediction
        return form(accumulate)
    if name in READS_MOMENTS and optimizer is not None:
        check_predictable(optimizer, f"staleness_correction={name!r}")  # at setup, not after the synchronous start
    factories: dict[str, Any] = {
        "lr_scale": lambda: LRScale(delay, anneal_steps),
        "weight_prediction": WeightPrediction,
        "weight_prediction_first_step": FirstStepWeightPrediction,
        "weight_prediction_first_step_inplace": lambda: InPlaceFirstStepWeightPrediction(accumulate),
        "weight_prediction_first_step_compiled": lambda: CompiledFirstStepWeightPrediction(accumulate),
        "weight_prediction_damped": DampedWeightPrediction,
        "weight_prediction_shrunk": lambda: ShrunkWeightPrediction(accumulate),
        "weight_prediction_first_step_shrunk": lambda: ShrunkWeightPrediction(accumulate, first_step=True),
        "weight_prediction_first_step_square_shrunk": lambda: SquareShrunkWeightPrediction(accumulate),
        "weight_prediction_momentum": MomentumLookAhead,
        "delay_compensation": lambda: DelayCompensation(accumulate),
    }
    return factories[name]()
