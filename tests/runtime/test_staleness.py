"""PACI's staleness corrections against one-process emulations of their documented rules (staleness.py).

The runtime side is a `StageHost` (bit-identical to processes: test_in_process.py), so no process is
spawned. The emulations are written from the rules, not from the implementation: PACI as in
tests/support/runtime_runs.py's `paci_emulation` (forward of micro-batch j on stage s on the weights after
`forward_version` steps, backward recomputed on the current ones), with the correction's change
(`correction_emulation`).
"""

from __future__ import annotations

import math

import pytest
import torch

from lit_efficient import PACIStrategy
from lit_efficient.runtime.partition import partition_uniform, stage_bounds
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.staleness import LRScale, delay_bound, make_correction
from lit_efficient.tools.demo import build_layers, lm_loss
from lit_efficient.transport.local import local_pipeline
from tests.support.runtime_runs import BETAS, EPS, LR, MODEL, correction_emulation
from tests.support.runtime_runs import runtime_batches as _data
from tests.support.runtime_runs import runtime_optimizer as _optimizer

ANNEAL = 4


def _run(layers, correction, stages, accumulate, data, recompute=True, record=None):
    bounds = stage_bounds(partition_uniform(len(layers), stages))
    mine = [layers[lo:hi] for lo, hi in bounds]
    built = []
    for s, ls in enumerate(mine):
        stage = PipelineStage(ls, s, stages, _optimizer([p for layer in ls for p in layer.parameters()]), lm_loss,
                              recompute=recompute)  # fmt: skip
        stage.correction = make_correction(correction, "paci", s, stages, accumulate, ANNEAL)
        built.append(stage)
    if record is not None:
        for stage in built:
            forward = stage.forward

            def spy(j, inputs, batch=None, pending_steps=0, _s=stage.stage, _f=forward):
                record.setdefault(_s, {})[j] = pending_steps
                return _f(j, inputs, batch, pending_steps)

            stage.forward = spy  # type: ignore[method-assign]
    pipe = local_pipeline(built, "paci", accumulate, lambda b: b[0])
    for j, batch in enumerate(data):
        pipe.feed(batch, j)
    pipe.drain()
    return built


def _max_diff(a, b):
    pa = [p for layer in a for p in layer.parameters()]
    pb = [p for layer in b for p in layer.parameters()]
    return max((x - y).abs().max().item() for x, y in zip(pa, pb, strict=True))


@pytest.mark.parametrize(
    "correction",
    ["lr_scale", "weight_prediction", "weight_prediction_first_step", "weight_prediction_first_step_square_shrunk"],
)
@pytest.mark.parametrize(("stages", "accumulate"), [(4, 2), (2, 1)])
def test_correction_equals_its_definition(correction, stages, accumulate):
    data = _data(accumulate * 6)
    got = _run(build_layers(**MODEL), correction, stages, accumulate, data)
    plain = _run(build_layers(**MODEL), None, stages, accumulate, data)
    want = correction_emulation(data, stages, accumulate, correction, ANNEAL)
    for s in range(stages):
        assert _max_diff(got[s].layers, want[s]) <= 1e-5, (s, _max_diff(got[s].layers, want[s]))
    # Stage 0 is stale, so the correction changed its trajectory: the comparison is not vacuous.
    assert _max_diff(got[0].layers, plain[0].layers) > 1e-4


def test_plain_emulation_matches_too():
    """The emulation without a correction is PACI itself (the base the two above build on)."""
    data = _data(12)
    got = _run(build_layers(**MODEL), None, 4, 2, data)
    want = correction_emulation(data, 4, 2, None)
    assert max(_max_diff(got[s].layers, want[s]) for s in range(4)) <= 1e-5


def test_pending_steps_are_the_measured_drift():
    """What the runtime tells a forward about its staleness is the drift its backward then measures."""
    record: dict[int, dict[int, int]] = {}
    stages = _run(build_layers(**MODEL), None, 4, 2, _data(14), record=record)
    for stage in stages:
        measured = {j: after - before for j, before, after in stage.stats.versions}
        assert record[stage.stage] == measured, stage.stage
        assert max(measured.values()) == delay_bound("paci", stage.stage, 4, 2)


def test_weight_prediction_with_keep_graph_restores_the_weights():
    """Keep-graph: the stale forward's graph survives the restore (version counters), and outside forwards
    the stage always holds the real weights."""
    data = _data(12)
    stages = _run(build_layers(**MODEL), "weight_prediction", 2, 2, data, recompute=False)
    real = [p.detach().clone() for p in stages[0].parameters()]
    assert stages[0].correction is not None and stages[0].correction._stash is not None  # it ran
    assert all(torch.equal(p, r) for p, r in zip(stages[0].parameters(), real, strict=True))


@pytest.mark.parametrize("square_shrunk", [False, True])
def test_in_place_prediction_equals_the_stashed_one_up_to_rounding(monkeypatch, square_shrunk):
    """``stash=False`` predicts the same weights and puts the real ones back by inverting the prediction, a
    chunk of elements at a time: equal to the stashed rule up to rounding, one forward at a time (over a run,
    Adam amplifies the rounding of near-zero gradients, so trajectories are not compared); also with the square
    shrunk by the share of the window accumulated (the default's rule: 2 of 8 micro-batches here)."""
    from lit_efficient.runtime import staleness
    from lit_efficient.runtime.staleness import WeightPrediction

    monkeypatch.setattr(staleness, "_CHUNK", 7)  # chunks that split the parameters unevenly

    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(layer.parameters(), lr=LR, weight_decay=0.1, betas=BETAS)
    for _ in range(2):  # one step taken, a second window accumulated
        layer(torch.randn(4, 16)).sum().backward()
        if opt.state == {}:
            opt.step()
            opt.zero_grad()
    real = [p.detach().clone() for p in layer.parameters()]
    shrink = {"accumulate": 8, "shrink": "square"} if square_shrunk else {}
    seen = []
    for stash in (True, False):
        with WeightPrediction(first_step=True, stash=stash, **shrink).forward_context(
            list(layer.parameters()), opt, 2, torch.tensor(1.0), window_microbatches=2
        ):
            seen.append([p.detach().clone() for p in layer.parameters()])
        assert all(torch.allclose(p, r, rtol=0, atol=1e-6) for p, r in zip(layer.parameters(), real, strict=True))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(*seen, strict=True))
    assert max((a - r).abs().max().item() for a, r in zip(seen[1], real, strict=True)) > 1e-3  # it moved
    if square_shrunk:  # and the shrink moved it elsewhere than the plain rule: the comparison is not vacuous
        with WeightPrediction(first_step=True).forward_context(list(layer.parameters()), opt, 2, torch.tensor(1.0)):
            plain = [p.detach().clone() for p in layer.parameters()]
        assert max((a - b).abs().max().item() for a, b in zip(seen[1], plain, strict=True)) > 1e-5


def test_in_place_prediction_runs_a_bounded_number_of_batched_operations(monkeypatch):
    """The in-place prediction evaluates the update over batches of parameter pieces in multi-tensor operations:
    each element once per evaluation, no batch over its budget, and a count of operator calls (each a kernel
    launch on a GPU) bounded whatever the number of parameters or of 65,536-element chunks. Before, it
    ran ~10 operators per parameter and per chunk: 10,837 for a stage of three GPT-2 Medium blocks, 379 now."""
    from benchmarks.gpu_smoke import operator_calls
    from lit_efficient.runtime import staleness

    monkeypatch.setattr(staleness, "_CHUNK", 64)  # so that the small stage below spans several batches
    calls = {}
    for width in (4, 40):  # ten times the parameters, the same number of batches
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(16, 8)) for _ in range(width)] + [torch.nn.Parameter(torch.randn(999))]
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, betas=BETAS)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        steps = staleness.predicted_steps(opt, torch.tensor(2.0), first_step=True)
        batches = staleness._batches(params, steps)
        budget = max(64, math.ceil(sum(p.numel() for p in params) / staleness._BATCHES))
        assert all(sum(piece.numel() for piece in pieces) <= budget for pieces, _ in batches)
        covered = [torch.zeros(p.numel()) for p in params]
        index = {id(p): i for i, p in enumerate(params)}
        for _, items in batches:
            for step, part in items:
                i = next(index[id(p)] for p in params if steps[id(p)] is step)
                covered[i][part if part is not None else slice(None)] += 1
        assert all(bool((c == 1).all()) for c in covered)  # every element in exactly one piece
        real = [p.detach().clone() for p in params]
        correction, weight = staleness.InPlaceFirstStepWeightPrediction(), torch.tensor(2.0)
        with correction.forward_context(params, opt, 1, weight):
            moved = max((p - r).abs().max().item() for p, r in zip(params, real, strict=True))

        def predicted_forward(params=params, opt=opt, correction=correction, weight=weight) -> None:
            with correction.forward_context(params, opt, 1, weight):
                pass

        calls[width] = operator_calls(predicted_forward)
        assert moved > 1e-4  # it predicted
        assert all(torch.allclose(p, r, rtol=0, atol=1e-6) for p, r in zip(params, real, strict=True))
        assert len(batches) <= 2 * staleness._BATCHES + 1  # greedy packing: each batch but the last over half full
    # Ten times the parameters, not ten times the operators (before: ~10 per parameter and per chunk), and both
    # under the bound that the batches set whatever the stage holds.
    assert calls[40] < 2 * calls[4], calls
    assert max(calls.values()) <= 2 * 12 * (2 * staleness._BATCHES + 1), calls


def test_first_step_prediction_is_adams_first_step():
    """Before the optimizer has state, ``first_step`` predicts the first update from zero moments: with the
    whole window accumulated it is the update AdamW then applies."""
    from lit_efficient.runtime.staleness import WeightPrediction

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(layer.parameters(), lr=LR, weight_decay=0.1, betas=BETAS)
    layer(torch.randn(4, 8)).sum().backward()
    with WeightPrediction().forward_context(list(layer.parameters()), opt, 1, torch.tensor(1.0)):
        unchanged = [p.detach().clone() for p in layer.parameters()]
    with WeightPrediction(first_step=True).forward_context(list(layer.parameters()), opt, 1, torch.tensor(1.0)):
        predicted = [p.detach().clone() for p in layer.parameters()]
    before = [p.detach().clone() for p in layer.parameters()]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(unchanged, before, strict=True))  # no state: no prediction
    assert all(torch.allclose(a, p, rtol=0, atol=1e-6) for a, p in zip(predicted, layer.parameters(), strict=True))


def test_square_shrunk_prediction_folds_the_expected_square_of_the_window_still_to_come():
    """``weight_prediction_first_step_square_shrunk``: with k of N micro-batches accumulated, ``m`` takes the window's
    mean so far (as ``weight_prediction``) and ``v`` takes ``f mean^2 + (1 - f) v_hat`` (f = k / N) instead of
    ``mean^2``; with the whole window accumulated it is the update AdamW then applies."""
    from lit_efficient.runtime.staleness import predicted_steps

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(layer.parameters(), lr=LR, weight_decay=0.1, betas=BETAS)
    for _ in range(3):
        layer(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    p = layer.weight
    layer(torch.randn(4, 8)).pow(2).sum().backward()
    p.grad.mul_(2)  # the sum of two micro-batches' gradients: k = 2 of N = 8
    state = opt.state[p]
    t, (b1, b2) = float(state["step"]), BETAS
    mean = p.grad / 2
    v_hat = state["exp_avg_sq"] / (1 - b2**t)
    m = b1 * state["exp_avg"] + (1 - b1) * mean
    v = b2 * state["exp_avg_sq"] + (1 - b2) * (0.25 * mean * mean + 0.75 * v_hat)
    want = LR * ((m / (1 - b1 ** (t + 1))) / ((v / (1 - b2 ** (t + 1))).sqrt() + EPS) + 0.1 * p)
    got = predicted_steps(opt, torch.tensor(2.0), share=0.25, shrink="square")[id(p)](p)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    plain = predicted_steps(opt, torch.tensor(2.0))[id(p)](p)
    assert not torch.allclose(got, plain, rtol=1e-3, atol=0)  # the shrink changed the step: not vacuous
    # The whole window accumulated (f = 1): AdamW's next update, which the optimizer then applies.
    full = predicted_steps(opt, torch.tensor(8.0), share=1.0, shrink="square")[id(p)](p)
    assert torch.allclose(full, predicted_steps(opt, torch.tensor(8.0))[id(p)](p), rtol=1e-6, atol=0)


def test_lr_scale_factor_and_where_corrections_apply():
    rule = LRScale(delay=1, anneal_steps=10)
    assert (
        rule.factor(0) == 0.5 and rule.factor(5) == pytest.approx(2**-0.5) and rule.factor(10) == rule.factor(99) == 1
    )
    assert make_correction("lr_scale", "1f1b_flush", 0, 8, 4, 10) is None  # no staleness under flush
    assert make_correction("weight_prediction", "paci", 7, 8, 4, 10) is None  # the last stage is never stale
    assert make_correction("none", "paci", 0, 8, 4, 10) is None
    assert delay_bound("paci", 0, 8, 4) == 2
    with pytest.raises(ValueError, match="staleness_correction='bogus'"):
        PACIStrategy(staleness_correction="bogus")  # type: ignore[arg-type]


def test_auto_is_the_in_place_first_step_prediction_where_the_optimizer_is_predictable():
    """The strategy's default: the in-place first-step prediction on a stale stage with AdamW or Adam, off with an
    optimizer whose update it does not know (SGD, amsgrad), on the last stage and under flush."""
    from lit_efficient.runtime.staleness import InPlaceFirstStepWeightPrediction

    params = list(torch.nn.Linear(2, 2).parameters())
    adamw, adam = torch.optim.AdamW(params), torch.optim.Adam(params)
    for opt in (adamw, adam):
        assert type(make_correction("auto", "paci", 0, 4, 4, 10, opt)) is InPlaceFirstStepWeightPrediction
    assert make_correction("auto", "paci", 0, 4, 4, 10, torch.optim.SGD(params, lr=0.1)) is None
    assert make_correction("auto", "paci", 0, 4, 4, 10, torch.optim.AdamW(params, amsgrad=True)) is None
    assert make_correction("auto", "paci", 3, 4, 4, 10, adamw) is None  # the last stage is never stale
    assert make_correction("auto", "1f1b_flush", 0, 4, 4, 10, adamw) is None
    assert PACIStrategy().staleness_correction == "auto"
    auto = make_correction("auto", "paci", 0, 4, 4, 10, adamw)
    assert auto.accumulate == 4 and auto.shrink == "square"  # built with N: the share of the window shrinks v


class _OwnAdamW(torch.optim.AdamW):
    """A user's subclass that keeps torch's step (a Lightning-friendly wrapper, say)."""


class _ClippedAdamW(torch.optim.AdamW):
    """A user's subclass whose step is not torch's update."""

    def step(self, closure=None):
        before = [p.detach().clone() for g in self.param_groups for p in g["params"]]
        super().step(closure)
        params = [p for g in self.param_groups for p in g["params"]]
        with torch.no_grad():
            for p, b in zip(params, before, strict=True):
                p.copy_(b + (p - b).clamp(-2e-3, 2e-3))


class AdamW(torch.optim.Optimizer):
    """Another library's AdamW (bitsandbytes' keeps its moments as state1/state2): the same name, not torch's."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})


def test_prediction_knows_optimizers_by_class_not_by_name():
    """By name, a user's AdamW subclass got plain PACI without a word; another library's class named AdamW was
    predicted with torch's rule (a KeyError 'exp_avg' after the synchronous start) and a subclass stepping otherwise
    silently wrongly; a named prediction with amsgrad failed only at the first stale forward, naming an option the
    user had not set (an optimizer audit)."""
    from lit_efficient.runtime.staleness import (
        InPlaceFirstStepWeightPrediction,
        auto_sync_start_steps,
        prediction_refusal,
    )

    params = list(torch.nn.Linear(2, 2).parameters())
    own = _OwnAdamW(params)
    assert type(make_correction("auto", "paci", 0, 4, 4, 10, own)) is InPlaceFirstStepWeightPrediction
    assert auto_sync_start_steps(own) == 40
    clipped, foreign = _ClippedAdamW(params), AdamW(params)
    assert prediction_refusal(clipped) == "_ClippedAdamW overrides step(), so its update may not be torch's Adam's"
    assert make_correction("auto", "paci", 0, 4, 4, 10, clipped) is None
    named = "weight_prediction_first_step_inplace"  # the user vouches for its step: accepted
    assert type(make_correction(named, "paci", 0, 4, 4, 10, clipped)) is InPlaceFirstStepWeightPrediction
    assert make_correction("auto", "paci", 0, 4, 4, 10, foreign) is None
    assert auto_sync_start_steps(foreign) == 40  # an Adam by kind: its moments are young at first all the same
    with pytest.raises(ValueError, match=r"'weight_prediction_first_step_inplace' reads Adam's moments .*: the "
                       r"optimizer is not torch.optim.Adam or AdamW, nor a subclass of one \(.*\.AdamW\)"):  # fmt: skip
        make_correction(named, "paci", 0, 4, 4, 10, foreign)
    with pytest.raises(ValueError, match=r"AdamW has amsgrad=True, which the prediction does not model\. Use "):
        make_correction(named, "paci", 0, 4, 4, 10, torch.optim.AdamW(params, amsgrad=True))
    assert make_correction("lr_scale", "paci", 0, 4, 4, 10, foreign) is not None  # any optimizer


def test_a_window_flagged_non_finite_folds_no_gradient_into_the_prediction():
    """On a device the stage passes its window's non-finite flag into the prediction (no host sync), which takes
    the window's mean as 0 there, in the step form and in the in-place form's fused passes: a NaN gradient made
    the predicted weights NaN, and the in-place undo cannot restore NaN weights (a numerics audit). Emulated with
    a CPU flag handed to the functions the device path runs."""
    from lit_efficient.runtime.staleness import _batches, _direction, predicted_steps

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    layer(torch.randn(2, 4)).sum().backward()
    opt.step()  # moments exist
    params = list(layer.parameters())
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    flagged = predicted_steps(opt, torch.tensor(2.0), window_bad=torch.tensor(1.0))
    for p in params:
        p.grad = torch.zeros_like(p)
    zero = predicted_steps(opt, torch.tensor(2.0))
    for p in params:
        assert torch.isfinite(flagged[id(p)](p)).all() and torch.equal(flagged[id(p)](p), zero[id(p)](p))
        p.grad = torch.full_like(p, float("nan"))
    for (_, items), (_, zero_items) in zip(_batches(params, flagged), _batches(params, zero), strict=True):
        (num, denom, _), (znum, zdenom, _) = _direction(items), _direction(zero_items)
        assert all(torch.equal(a, b) for a, b in zip(num + denom, znum + zdenom, strict=True))
    unflagged = predicted_steps(opt, torch.tensor(2.0))  # the flag is what guards: without it, NaN
    assert not torch.isfinite(unflagged[id(params[0])](params[0])).all()
    # The stage's path on CPU (the flag read on the host first) predicts what the device path does: one rule.
    from lit_efficient.runtime.staleness import InPlaceFirstStepWeightPrediction

    real = [p.detach().clone() for p in params]
    expected = [(p - zero[id(p)](p)).detach() for p in params]  # one pending step, a zero gradient folded
    with InPlaceFirstStepWeightPrediction().forward_context(params, opt, 1, torch.tensor(2.0), 1, torch.tensor(1.0)):
        assert all(torch.allclose(p, e, rtol=0, atol=1e-6) for p, e in zip(params, expected, strict=True))
    assert all(torch.allclose(p, r, rtol=0, atol=1e-6) for p, r in zip(params, real, strict=True))  # finite again


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_window_of_own_non_finite_gradient_folds_no_gradient_either(value):
    """A NaN/Inf in the stage's own gradient behind a finite loss (no flag from downstream: a sqrt at 0) is flagged
    by the prediction itself (`nonfinite_window`): the stage's step raises on it, but the stale forwards before that
    step folded it, and the in-place undo left NaN weights behind the error. Each form, stashed and in place, then
    predicts with a zero gradient folded, and puts finite weights back."""
    from lit_efficient.runtime.staleness import (
        FirstStepWeightPrediction,
        InPlaceFirstStepWeightPrediction,
        predicted_steps,
    )

    params, opt = _stage_with_a_window()
    real = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None if p.grad is None else torch.zeros_like(p)
    zero = predicted_steps(opt, torch.tensor(2.0), first_step=True)
    expected = [(p - zero[id(p)](p)).detach() if id(p) in zero else p.detach().clone() for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    params[1].grad.view(-1)[3] = value  # one element of one parameter
    for form in (FirstStepWeightPrediction(), InPlaceFirstStepWeightPrediction()):
        with form.forward_context(params, opt, 1, torch.tensor(2.0), 1):
            assert all(torch.allclose(p, e, rtol=0, atol=1e-6) for p, e in zip(params, expected, strict=True))
        assert all(torch.allclose(p, r, rtol=0, atol=1e-6) for p, r in zip(params, real, strict=True)), form


def test_in_place_prediction_keeps_low_precision_weights_exact():
    """bf16 weights would lose bits to every in-place inversion: the in-place rule predicts them with a stash, so
    they come back bit for bit."""
    from lit_efficient.runtime.staleness import InPlaceFirstStepWeightPrediction

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8).to(torch.bfloat16)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    layer(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
    real = [p.detach().clone() for p in layer.parameters()]
    with InPlaceFirstStepWeightPrediction().forward_context(list(layer.parameters()), opt, 1, torch.tensor(1.0)):
        moved = any(not torch.equal(p, r) for p, r in zip(layer.parameters(), real, strict=True))
    assert moved and all(torch.equal(p, r) for p, r in zip(layer.parameters(), real, strict=True))


def test_step_count_reads_a_device_step_once_per_value(monkeypatch):
    """A step tensor off the CPU (fused or capturable Adam) is read once per value: the prediction needs it at every
    stale forward, and each read would be a host sync. Emulated on CPU by a tensor whose device
    reports non-CPU and whose reads are counted."""
    from lit_efficient.runtime import staleness

    class DeviceStep(torch.Tensor):
        reads = 0

        @property
        def device(self):  # type: ignore[override]
            return torch.device("cuda", 0)

        def __float__(self):
            DeviceStep.reads += 1
            return super().__float__()

    step = torch.tensor(3.0).as_subclass(DeviceStep)
    assert staleness.step_count(step) == staleness.step_count(step) == 3.0 and DeviceStep.reads == 1
    step.add_(1.0)  # the optimizer's in-place increment bumps the version
    assert staleness.step_count(step) == 4.0 and DeviceStep.reads == 2
    assert staleness.step_count(torch.tensor(7.0)) == 7.0  # a CPU step: read directly


def _stage_with_a_window(seed: int = 0):
    """A stage's parameters (two AdamW groups: decayed weights, undecayed biases, and a frozen-gradient one), after
    one step and with a second window's gradient accumulated: a stale forward's state."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    weights = [model[0].weight, model[2].weight]
    biases = [model[0].bias, model[2].bias]
    opt = torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=LR, weight_decay=0.1)
    for _ in range(2):
        model(torch.randn(8, 16)).square().mean().backward()
        if not opt.state:
            opt.step()
            opt.zero_grad()
    model[2].bias.grad = None  # a parameter without a gradient in this window: the eager form's case
    return list(model.parameters()), opt


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("microbatches", [None, 2])
def test_compiled_prediction_equals_the_eager_one_up_to_rounding(microbatches):
    """The compiled apply and undo (one pass per weight, `_fused_prediction`) predict the eager form's weights and
    put the real ones back up to rounding, per update key (two AdamW groups) and with the eager form for what it
    does not cover (a parameter without a gradient in the window); the autograd versions are left as they were.
    With the window's count (2 of 8 micro-batches) both shrink the folded square by it, as the default does."""
    from lit_efficient.runtime.staleness import CompiledFirstStepWeightPrediction, InPlaceFirstStepWeightPrediction

    params, opt = _stage_with_a_window()
    real = [p.detach().clone() for p in params]
    versions = [p._version for p in params]
    seen = []
    for correction in (InPlaceFirstStepWeightPrediction(8), CompiledFirstStepWeightPrediction(8)):
        for pending in (1, 2):
            with correction.forward_context(params, opt, pending, torch.tensor(1.0), window_microbatches=microbatches):
                seen.append([p.detach().clone() for p in params])
            assert all(torch.allclose(p, r, rtol=1e-6, atol=1e-7) for p, r in zip(params, real, strict=True))
    assert [p._version for p in params] == versions
    for eager, compiled in zip(seen[:2], seen[2:], strict=True):
        for e, c, r in zip(eager, compiled, real, strict=True):
            step = (e - r).abs().max().item()
            assert step > 1e-3  # it moved, by about a learning rate
            assert (c - e).abs().max().item() < 1e-3 * step


@pytest.mark.usefixtures("one_thread")
def test_a_compiler_failure_warns_once_and_leaves_the_eager_form(monkeypatch):
    """No C++ compiler, no Triton: the first compilation fails, the process warns once (naming the eager option)
    and predicts with the eager form, the weights of an update key compiled before the failure put back first."""
    from lit_efficient.runtime import staleness

    calls, compiled_prediction = [], staleness._compiled_prediction

    def second_key_fails():
        fn = compiled_prediction()

        def run(*args):
            calls.append(len(args[0]))
            if len(calls) == 2:
                raise RuntimeError("no C++ compiler")
            return fn(*args)

        return run

    monkeypatch.setattr(staleness, "_compiled_prediction", second_key_fails)
    monkeypatch.setitem(staleness._COMPILER_WORKS, "ok", True)
    params, opt = _stage_with_a_window()
    with staleness.InPlaceFirstStepWeightPrediction().forward_context(params, opt, 1, torch.tensor(1.0)):
        eager = [p.detach().clone() for p in params]
    correction = staleness.CompiledFirstStepWeightPrediction()
    failed = "failed to compile.*no C.. compiler.*weight_prediction_first_step_inplace"
    with pytest.warns(UserWarning, match=failed), correction.forward_context(params, opt, 1, torch.tensor(1.0)):
        fell_back = [p.detach().clone() for p in params]
    # The eager prediction, once (the key compiled before the failure was put back, up to rounding).
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(fell_back, eager, strict=True))
    assert staleness._COMPILER_WORKS["ok"] is False
    calls.clear()
    with correction.forward_context(params, opt, 1, torch.tensor(1.0)):
        pass
    assert calls == []  # the process does not try again


def test_auto_compiles_the_prediction_on_cuda_weights(monkeypatch):
    """``"auto"`` is the compiled form where the weights are on CUDA (one pass over memory per apply or undo instead
    of ~9) and the eager in-place form elsewhere; the compiled form is asked for by name on any device."""
    from lit_efficient.runtime.staleness import CompiledFirstStepWeightPrediction, InPlaceFirstStepWeightPrediction

    params = list(torch.nn.Linear(2, 2).parameters())
    adamw = torch.optim.AdamW(params)
    assert type(make_correction("auto", "paci", 0, 4, 4, 10, adamw)) is InPlaceFirstStepWeightPrediction
    named = make_correction("weight_prediction_first_step_compiled", "paci", 0, 4, 4, 10, adamw)
    assert type(named) is CompiledFirstStepWeightPrediction
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert type(make_correction("auto", "paci", 0, 4, 4, 10, adamw)) is CompiledFirstStepWeightPrediction


@pytest.mark.usefixtures("one_thread")
def test_compiled_prediction_builds_no_tensor_from_host_values(monkeypatch):
    """The compiled form's coefficients (learning rate, bias corrections: host floats that change every step) are
    filled on the weights' device: a tensor built from host values is a blocking host-to-device copy on CUDA, a host
    sync per apply and per undo, which a pipeline must not make per micro-batch (gpu_smoke's ``weight_prediction``
    counts them on a GPU)."""
    from lit_efficient.runtime import staleness

    monkeypatch.setitem(staleness._COMPILER_WORKS, "ok", True)
    params, opt = _stage_with_a_window()
    correction = staleness.CompiledFirstStepWeightPrediction()
    with correction.forward_context(params, opt, 1, torch.tensor(1.0)):  # compiles
        pass

    def from_host(*args, **kwargs):
        raise AssertionError("a tensor built from host values at a stale forward")

    for name in ("tensor", "as_tensor"):
        monkeypatch.setattr(torch, name, from_host)
    real = [p.detach().clone() for p in params]
    with correction.forward_context(params, opt, 1, torch.ones(())):
        moved = max((p - r).abs().max().item() for p, r in zip(params, real, strict=True))
    # Predicted, and in compiled passes: the eager fallback (taken on any error in the compiled call) did not run.
    assert moved > 1e-3 and correction.compiled


def test_each_stage_compiles_its_prediction_into_its_own_cache(monkeypatch):
    """torch.compile keeps at most ``recompile_limit`` (8) graphs per code object, a hard error beyond under
    ``fullgraph``, and a stage needs one per update key and shape set: an in-process pipeline of 8 stages with 2
    parameter groups needs 14. `_compiled_prediction` gives each stage's correction a fresh code object: with the
    limit lowered to 2, two of them take 2 shape sets each, twice what one cache holds (Dynamo's eager backend:
    the caches are the question, not Inductor's code); one shared function fails there."""
    import torch._dynamo.config as dynamo_config
    import torch._dynamo.exc

    from lit_efficient.runtime import staleness

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", dynamic=False, fullgraph=True))
    one = torch.ones(())

    def call(fn, n: int) -> None:
        with torch.no_grad():
            fn([torch.ones(n)], [torch.zeros(n)], [torch.ones(n)], [torch.ones(n)], one, 0 * one, one, -one, one,
               one, 0 * one, 0.9, 0.95, 0.1)  # fmt: skip

    # Dynamo's own patch, not monkeypatch: pytest 9.2's monkeypatch undoes an attribute missing from the module's
    # __dict__ (Dynamo's config keeps its entries elsewhere) by deleting it, which removed `recompile_limit` for
    # every later test of the session and failed each torch.compile test after this one.
    before = dynamo_config.recompile_limit
    with dynamo_config.patch(recompile_limit=2):
        torch._dynamo.reset()
        for fn in (staleness._compiled_prediction(), staleness._compiled_prediction()):
            for n in (1, 2):
                call(fn, n)
        shared = staleness._compiled_prediction()
        for n in (1, 2):
            call(shared, n)
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            call(shared, 3)  # the premise: one code object holds no more
    torch._dynamo.reset()
    assert dynamo_config.recompile_limit == before  # back as it was for the tests after this one


_ADAMS = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "Adam, L2 decay": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=0.1),
    "Adam, decoupled decay": lambda params: torch.optim.Adam(
        params, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True
    ),
}


@pytest.mark.parametrize("form", ["stashed", "in place"])
@pytest.mark.parametrize("make", _ADAMS.values(), ids=_ADAMS.keys())
def test_a_whole_windows_prediction_is_the_optimizers_next_step(make, form):
    """With the whole window accumulated (d = 1) the predicted weights are the ones the real step then gives, at the
    first steps and later, for each decay: Adam's L2 decay was dropped (it folds g + wd * w into both moments: 35%
    of coordinates predicted the wrong way at a first step) and Adam's decoupled one (torch 2.7's
    ``decoupled_weight_decay=True``) taken for none. A frozen parameter with state stays where the step leaves it."""
    from lit_efficient.runtime.staleness import FirstStepWeightPrediction, InPlaceFirstStepWeightPrediction

    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    params = list(layers.parameters())
    optimizer = make(params)
    for state_steps in range(3):
        if state_steps == 2:
            layers[0].bias.requires_grad_(False)  # frozen after it gained state (a fine-tuning freeze)
            layers[0].bias.grad = None
        for _ in range(2):  # the window: two micro-batches' gradients summed, weight 2
            layers(torch.randn(5, 8)).pow(2).mean().backward()
        correction = FirstStepWeightPrediction() if form == "stashed" else InPlaceFirstStepWeightPrediction(None)
        with correction.forward_context(params, optimizer, 1, window_weight=torch.tensor(2.0)):
            predicted = [p.detach().clone() for p in params]
        before = [p.detach().clone() for p in params]
        for p in params:
            if p.grad is not None:
                p.grad.div_(2)  # the step's gradient: the window's mean
        optimizer.step()
        optimizer.zero_grad()
        for got, start, p in zip(predicted, before, params, strict=True):
            step = (p.detach() - start).abs().max()
            assert (got - p.detach()).abs().max() <= 1e-5 * max(step, 1e-3), (state_steps, tuple(p.shape))
        if state_steps == 2:
            assert torch.equal(predicted[1], before[1])  # frozen: not moved
