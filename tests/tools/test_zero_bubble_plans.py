"""Pure tests of the rank-level plans (interleaved 1F1B, the zero-bubble family, DualPipeV) and their simulation.

Closed forms from the zero-bubble paper (Qi et al., ICLR 2024) with T_F = T_I = T_W: bubble rate
(idle / busy) (p-1)/m for 1F1B, (p-1)/(3m) for ZB-1p (ZB-H1), (p-1)/(v m) for interleaved 1F1B;
ZB-V's only idle time is the one-time fill, so across repeated windows it tends to 0. Orders are
checked against torch.distributed.pipelining's own generators as an oracle.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed.pipelining.schedules as torch_schedules

from lit_efficient.runtime.actions import Action
from lit_efficient.tools.schedule_plans import PLANS, Plan, build_plan, check_plan
from lit_efficient.tools.simulate import DeadlockError, simulate_plan

RANKS = [2, 4, 8]


def run(name, p, m, windows=1, virtual=2, **costs):
    """Simulate with per-rank times F=1, I=1, W=1 (B=2), split evenly over the rank's chunks."""
    plan = build_plan(name, p, m, windows=windows, virtual=virtual)
    chunks = plan.num_stages // p
    return simulate_plan(plan, forward=1 / chunks, backward=2 / chunks, **costs)


def period(name, p, m, virtual=2):
    """Steady time of one window: makespan of 5 windows minus that of 4."""
    return run(name, p, m, 5, virtual).makespan - run(name, p, m, 4, virtual).makespan


def test_task_and_plan_strings_round_trip():
    assert Action.parse("3I2") == Action(3, "I", 2)
    assert str(Action(0, "STEP", 1)) == "0STEP1"
    plan = Plan.parse("0F0 3F0 3I0 3W0 0B0\n1F0 2F0 2B0 1B0", rank_of=[0, 1, 1, 0])
    assert str(plan) == "0F0 3F0 3I0 3W0 0B0\n1F0 2F0 2B0 1B0"
    assert (plan.num_ranks, plan.num_stages) == (2, 4)
    with pytest.raises(ValueError, match="'0X1'"):
        Action.parse("0X1")


def test_split_backward_timeline_by_hand():
    # Two ranks, one stage each: 1I0 is on the critical path, 1W0 runs while its gradient travels.
    plan = Plan.parse("0F0 0I0 0W0\n1F0 1I0 1W0")
    result = simulate_plan(plan, forward=1.0, input_grad=1.0, weight_grad=1.0, comm=0.5)
    assert [(str(s.action), s.start, s.end) for s in result.timeline] == [
        ("0F0", 0.0, 1.0), ("0I0", 4.0, 5.0), ("0W0", 5.0, 6.0),
        ("1F0", 1.5, 2.5), ("1I0", 2.5, 3.5), ("1W0", 3.5, 4.5),
    ]  # fmt: skip
    assert result.makespan == 6.0
    assert result.busy == (3.0, 3.0)


def test_w_before_its_i_deadlocks_and_names_it():
    with pytest.raises(DeadlockError, match="rank 0 waits at 0W0 for 0I0"):
        simulate_plan(Plan.parse("0F0 0W0 0I0"))


@pytest.mark.parametrize("name", PLANS)
@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("m", [8, 16, 32])
def test_every_plan_is_complete_and_runs(name, p, m):
    if name == "dualpipev" and m < 2 * p:
        with pytest.raises(ValueError, match="DualPipeV needs at least"):
            build_plan(name, p, m)
        return
    plan = build_plan(name, p, m, windows=2)
    check_plan(plan)
    result = simulate_plan(plan)
    assert max(result.max_drift) == (1 if name == "paci" else 0)  # only PACI steps between F and B


def _torch_order(cls, p, m, v):
    """torch's own per-rank order (its schedule IR without the communication), from a stand-in self."""
    rounds = max(1, m // p)
    fake = SimpleNamespace(
        pp_group_size=p, n_local_stages=v, _n_microbatches=m, microbatches_per_round=m // rounds,
        num_stages=p * v, _num_stages=p * v,
    )  # fmt: skip
    out = []
    for rank in range(p):
        actions = [a for a in cls._calculate_single_rank_operations(fake, rank) if a is not None]
        subs = [s for a in actions for s in (a.sub_actions or (a,))]  # DualPipeV's overlapped F+B, in order
        out.append([f"{s.stage_index}{s.computation_type.value}{s.microbatch_index}" for s in subs])
    return out


@pytest.mark.parametrize(
    ("name", "cls", "virtual"),
    [
        ("interleaved_1f1b", torch_schedules.ScheduleInterleaved1F1B, 2),
        ("interleaved_1f1b", torch_schedules.ScheduleInterleaved1F1B, 3),
        ("zb1p", torch_schedules.ScheduleInterleavedZeroBubble, 1),
        ("zb1p", torch_schedules.ScheduleInterleavedZeroBubble, 2),
        ("zbv", torch_schedules.ScheduleZBVZeroBubble, 2),
        ("dualpipev", torch_schedules.ScheduleDualPipeV, 2),
    ],
)
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [2, 4, 8, 12])
def test_orders_match_torch(name, cls, virtual, p, m):
    if (name == "dualpipev" and m < 2 * p) or (name in ("interleaved_1f1b", "zb1p") and m % max(1, m // p)):
        with pytest.raises(ValueError):  # torch's __init__ refuses these too
            build_plan(name, p, m, virtual=virtual)
        return
    mine = [[str(t) for t in rank if t.kind != "STEP"] for rank in build_plan(name, p, m, virtual=virtual).tasks]
    assert mine == _torch_order(cls, p, m, virtual)


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("m", [8, 16, 32])  # the closed forms assume m >= p
def test_closed_form_bubble_rates(p, m):
    assert run("1f1b_flush", p, m).bubble_rate == pytest.approx((p - 1) / m, abs=1e-12)
    assert run("zb1p", p, m, virtual=1).bubble_rate == pytest.approx((p - 1) / (3 * m), abs=1e-12)
    for v in (2, 4):
        if m % p == 0:
            assert run("interleaved_1f1b", p, m, virtual=v).bubble_rate == pytest.approx((p - 1) / (v * m), abs=1e-12)


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("m", [16, 32])
def test_zbv_idles_only_in_the_fill(p, m):
    busy = 3 * m  # F + I + W per micro-batch per rank
    # One window: the last rank's wait for the first activation, (p-1) chunk forwards of 1/2 each.
    assert run("zbv", p, m).bubble_rate == pytest.approx((p - 1) / 2 / busy, abs=1e-12)
    # Repeated windows: ZB-V's parallelogram tiles, like PACI's unbroken stream; ZB-1p and 1F1B do not.
    assert period("zbv", p, m) == pytest.approx(busy)
    assert period("paci", p, m) == pytest.approx(busy)
    assert period("zb1p", p, m, virtual=1) == pytest.approx(busy + (p - 1))
    assert period("1f1b_flush", p, m) == pytest.approx(busy + 3 * (p - 1))


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("m", [8, 16])
def test_peak_activations(p, m):
    one_f_one_b = tuple(float(p - r) for r in range(p))
    assert run("1f1b_flush", p, m).peak_activations == one_f_one_b
    assert run("paci", p, m, windows=3).peak_activations == one_f_one_b
    # ZB-H1: 1F1B's peak (p, on the first rank) but on every rank: a late W keeps its activation.
    assert run("zb1p", p, m, virtual=1).peak_activations == (float(p),) * p
    assert max(run("zbv", p, m).peak_activations) == p  # ZB-V: p micro-batches, as 1F1B's first stage
    assert run("gpipe", p, m).peak_activations == (float(m),) * p
    # Interleaved 1F1B, v=2: rank 0 warms up with (v-1)p + 2(p-1) half-size chunk forwards, then one more.
    assert run("interleaved_1f1b", p, m).peak_activations[0] == min(2 * m, p + 2 * (p - 1) + 1) / 2


def test_bad_plan_arguments_name_the_value():
    with pytest.raises(ValueError, match="'zb2p'"):
        build_plan("zb2p", 2, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_ranks=0"):
        build_plan("zbv", 0, 4)
    with pytest.raises(ValueError, match="virtual=0"):
        build_plan("interleaved_1f1b", 2, 4, virtual=0)
    with pytest.raises(ValueError, match="stage 1 micro-batch 0 runs F: need F B or F I W"):
        check_plan(Plan.parse("0F0 0B0\n1F0"))
    with pytest.raises(ValueError, match="input_grad has 1 costs for 4 stages"):
        simulate_plan(build_plan("zbv", 2, 4), input_grad=[1.0])
