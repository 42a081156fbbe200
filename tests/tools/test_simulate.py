"""Pure tests of the pipeline simulator against hand timelines and the closed forms of docs/DESIGN.md section 3."""

from __future__ import annotations

import math

import pytest

from lit_efficient.runtime.actions import Action
from lit_efficient.tools.simulate import (
    DeadlockError,
    Slot,
    flush_utilization,
    paci_drift_bound,
    simulate,
    simulate_streams,
)

STAGES = [2, 4, 8]


def test_two_stage_timeline_by_hand():
    result = simulate_streams(["0F0 0B0", "1F0 1B0"], forward=1.0, backward=2.0, comm=0.5)
    assert [(str(a), start, end) for _, a, start, end in result.timeline] == [
        ("0F0", 0.0, 1.0),
        ("0B0", 5.0, 7.0),  # waits for 1B0 (ends 4.5) + comm
        ("1F0", 1.5, 2.5),  # waits for 0F0 + comm
        ("1B0", 2.5, 4.5),
    ]
    assert result.makespan == 7.0
    assert result.busy == (3.0, 3.0)
    assert result.utilization == (3 / 7, 3 / 7)
    assert result.bubble_fraction == pytest.approx(4 / 7)


def test_per_stage_costs_and_step_time():
    result = simulate_streams(["0F0 0B0 0STEP0", "1F0 1B0 1STEP0"], forward=[1.0, 3.0], backward=[2.0, 4.0], step=0.5)
    assert result.timeline[-1] == Slot(1, Action(1, "STEP", 0), 8.0, 8.5)
    assert result.timeline[1] == Slot(0, Action(0, "B", 0), 8.0, 10.0)
    assert result.makespan == 10.5
    assert result.busy == (3.5, 7.5)


@pytest.mark.parametrize("backward", [2.0, 1.0])
@pytest.mark.parametrize("num_stages", STAGES)
@pytest.mark.parametrize("accumulate", [1, 4, 8, 16])
def test_flush_utilization_matches_closed_form(num_stages, accumulate, backward):
    result = simulate("1f1b_flush", num_stages, accumulate, accumulate, forward=1.0, backward=backward)
    expected = flush_utilization(num_stages, accumulate)
    assert result.makespan == (accumulate + num_stages - 1) * (1.0 + backward)
    assert result.utilization == pytest.approx([expected] * num_stages, abs=1e-12)
    assert result.bubble_fraction == pytest.approx((num_stages - 1) / (accumulate + num_stages - 1))


def test_flush_utilization_examples_from_design():
    assert flush_utilization(8, 8) == pytest.approx(0.533, abs=1e-3)
    assert flush_utilization(8, 16) == pytest.approx(0.696, abs=1e-3)


@pytest.mark.parametrize("backward", [2.0, 1.0])
@pytest.mark.parametrize("num_stages", STAGES)
@pytest.mark.parametrize("accumulate", [1, 4, 8])
def test_paci_steady_state_is_bubble_free(num_stages, accumulate, backward):
    result = simulate("paci", num_stages, accumulate, 4 * accumulate + 2 * num_stages, forward=1.0, backward=backward)
    assert result.steady_utilization == (1.0,) * num_stages
    assert result.utilization[0] < 1.0  # warm-up and drain are still in the whole-run figure


def test_flush_steady_state_keeps_its_bubble():
    result = simulate("1f1b_flush", 4, 4, 16)
    assert max(result.steady_utilization) < 1.0


def test_steady_window_is_none_when_stage0_never_alternates():
    result = simulate("paci", 4, 2, 4)  # 4 micro-batches all fit in stage 0's warm-up
    assert result.steady_window is None
    assert all(math.isnan(u) for u in result.steady_utilization)


@pytest.mark.parametrize("num_stages", STAGES)
@pytest.mark.parametrize("accumulate", [1, 2, 4, 8])
def test_paci_max_drift_is_the_closed_form(num_stages, accumulate):
    result = simulate("paci", num_stages, accumulate, 3 * accumulate + 2 * num_stages)
    expected = tuple(paci_drift_bound(num_stages, accumulate, s) for s in range(num_stages))
    assert result.max_drift == expected
    assert expected[-1] == 0
    if accumulate >= num_stages - 1:
        assert set(expected[:-1]) == {1}


def test_paci_drift_degenerates_to_pipedream_at_one_microbatch_per_step():
    assert simulate("paci", 4, 1, 12).max_drift == (3, 2, 1, 0)


@pytest.mark.parametrize("num_stages", STAGES)
@pytest.mark.parametrize("accumulate", [1, 2, 4, 8])
def test_flush_never_drifts(num_stages, accumulate):
    result = simulate("1f1b_flush", num_stages, accumulate, 3 * accumulate + 1)  # + a partial window
    assert result.max_drift == (0,) * num_stages
    assert result.mean_drift == 0.0
    assert all(len(d) == 3 * accumulate + 1 for d in result.drift)


@pytest.mark.parametrize("num_stages", STAGES)
@pytest.mark.parametrize("accumulate", [4, 8, 16])
def test_paci_over_flush_makespan_tends_to_flush_utilization(num_stages, accumulate):
    cycle = 3.0  # forward 1 + backward 2
    ratios = []
    for windows in (1, 4, 32):
        micro = windows * accumulate
        paci = simulate("paci", num_stages, accumulate, micro).makespan
        flush = simulate("1f1b_flush", num_stages, accumulate, micro).makespan
        # One fill and one drain for PACI, one per window for flush.
        assert paci == (micro + num_stages - 1) * cycle
        assert flush == windows * (accumulate + num_stages - 1) * cycle
        ratios.append(paci / flush)
    limit = flush_utilization(num_stages, accumulate)
    assert ratios[0] == 1.0
    assert ratios[0] > ratios[1] > ratios[2] > limit
    assert ratios[2] - limit == pytest.approx((num_stages - 1) / (32 * (accumulate + num_stages - 1)))


def test_slowest_stage_sets_the_pace():
    result = simulate("paci", 3, 4, 40, forward=[1.0, 2.0, 1.0], backward=[2.0, 4.0, 2.0])
    # The bottleneck never idles; the others idle half the time, up to where the window cuts a period.
    assert result.steady_utilization[1] == 1.0
    assert result.steady_utilization == pytest.approx([0.5, 1.0, 0.5], abs=0.01)


def test_comm_latency_only_delays_a_pipeline_that_has_no_slack():
    free = simulate("paci", 4, 4, 32).makespan
    assert simulate("paci", 4, 4, 32, comm=0.25).makespan > free


def test_deadlock_is_detected_and_named():
    # Stage 1 runs both forwards before any backward, stage 0 wants 1B0 before sending F1.
    streams = ["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"]
    with pytest.raises(DeadlockError, match=r"stage 0 waits at 0B0 for 1B0; stage 1 waits at 1F1 for 0F1"):
        simulate_streams(streams)


def test_backward_before_own_forward_deadlocks():
    with pytest.raises(DeadlockError, match="stage 0 waits at 0B0 for 0F0"):
        simulate_streams(["0B0 0F0"])


def test_missing_action_in_a_neighbour_deadlocks():
    with pytest.raises(DeadlockError, match="stage 1 waits at 1F1 for 0F1"):
        simulate_streams(["0F0 0B0", "1F0 1B0 1F1 1B1"])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: simulate_streams(["0F0 0B0", "0F0 0B0"]), "action 0F0 is in the stream of stage 1"),
        (lambda: simulate_streams([]), "streams is empty"),
        (lambda: simulate_streams(["0F0 0B0"], forward=-1.0), "forward=-1.0"),
        (lambda: simulate_streams(["0F0 0B0"], comm=math.nan), "comm=nan"),
        (lambda: simulate("paci", 2, 2, 4, backward=[1.0]), "backward has 1 costs for 2 stages"),
        (lambda: simulate("paci", 2, 2, -1), "num_microbatches=-1"),
        (lambda: simulate("paci", 0, 4, 4), r"num_stages=0 must be >= 1"),  # was "streams is empty"
        (lambda: simulate("1f1b_flush", 2, 0, 4), r"accumulate=0 must be >= 1"),
        (lambda: simulate("gpipe", 2, 2, 4), "'gpipe'"),
        (lambda: flush_utilization(0, 2), "num_stages=0"),
        (lambda: paci_drift_bound(4, 0, 1), "accumulate=0"),
        (lambda: paci_drift_bound(4, 2, 4), "stage=4"),
    ],
)
def test_bad_arguments_name_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_run_of_no_micro_batch_has_no_bubble():
    """Nothing ran and nothing waited: 0, where the empty run reported a bubble of 100%."""
    result = simulate("paci", 4, 4, 0)
    assert result.makespan == 0 and result.bubble_fraction == 0.0
