"""Pure tests of the action string form and the schedule generators, written as string fixtures."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lit_efficient.runtime.actions import Action, format_actions, parse_actions
from lit_efficient.runtime.schedules import SCHEDULES, stage_actions


def stream(schedule, stage, num_stages, accumulate, start=0, stop=None, step_at_stop=False, limit=None):
    actions = stage_actions(schedule, stage, num_stages, accumulate, start, stop, step_at_stop)
    return format_actions(itertools.islice(actions, limit) if limit is not None else actions)


# S=3, N=2, micro-batches [0, 4): two full windows, so both schedules end with STEP1.
PACI_S3_N2 = [
    "0F0 0F1 0F2 0B0 0F3 0B1 0STEP0 0B2 0B3 0STEP1",
    "1F0 1F1 1B0 1F2 1B1 1STEP0 1F3 1B2 1B3 1STEP1",
    "2F0 2B0 2F1 2B1 2STEP0 2F2 2B2 2F3 2B3 2STEP1",
]
FLUSH_S3_N2 = [
    "0F0 0F1 0B0 0B1 0STEP0 0F2 0F3 0B2 0B3 0STEP1",
    "1F0 1F1 1B0 1B1 1STEP0 1F2 1F3 1B2 1B3 1STEP1",
    "2F0 2B0 2F1 2B1 2STEP0 2F2 2B2 2F3 2B3 2STEP1",
]


@pytest.mark.parametrize(("schedule", "expected"), [("paci", PACI_S3_N2), ("1f1b_flush", FLUSH_S3_N2)])
def test_exact_streams_s3_n2(schedule, expected):
    assert [stream(schedule, s, 3, 2, stop=4) for s in range(3)] == expected


def test_unbounded_paci_stream_prefix():
    assert stream("paci", 0, 3, 2, limit=12) == "0F0 0F1 0F2 0B0 0F3 0B1 0STEP0 0F4 0B2 0F5 0B3 0STEP1"
    assert stream("1f1b_flush", 0, 3, 2, limit=8) == "0F0 0F1 0B0 0B1 0STEP0 0F2 0F3 0B2"


def test_start_mid_window_and_partial_last_window():
    # Range [3, 6) with N=4: window 0's tail {3}, then window 1's head {4, 5} (partial).
    assert stream("1f1b_flush", 1, 2, 4, start=3, stop=6) == "1F3 1B3 1STEP0 1F4 1B4 1F5 1B5"
    assert stream("1f1b_flush", 1, 2, 4, start=3, stop=6, step_at_stop=True) == (
        "1F3 1B3 1STEP0 1F4 1B4 1F5 1B5 1STEP1"
    )
    assert stream("paci", 0, 2, 4, start=3, stop=6, step_at_stop=True) == ("0F3 0F4 0B3 0STEP0 0F5 0B4 0B5 0STEP1")


def test_step_at_stop_on_full_window_adds_nothing():
    assert stream("paci", 1, 2, 2, stop=4, step_at_stop=True) == stream("paci", 1, 2, 2, stop=4)


def test_empty_range_is_empty():
    assert stream("paci", 0, 3, 2, start=5, stop=5) == ""
    assert stream("1f1b_flush", 2, 3, 2, start=5, stop=5, step_at_stop=True) == ""


def test_action_string_round_trip():
    text = "0F0 1B12 2STEP3 10F7"
    assert format_actions(parse_actions(text)) == text
    assert parse_actions(" 1F3 ") == [Action(1, "F", 3)]
    assert Action.parse("2STEP0") == Action(2, "STEP", 0)


@given(st.integers(0, 99), st.sampled_from(["F", "B", "STEP"]), st.integers(0, 10_000))
def test_action_round_trip_property(stage, kind, index):
    action = Action(stage, kind, index)
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize("text", ["", "F3", "1X3", "1F", "-1F3", "1f3", "1F3.0", "1 F3"])
def test_parse_errors_name_the_text(text):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(text)


def test_parse_actions_rejects_a_bad_token():
    with pytest.raises(ValueError, match="'1Q2'"):
        parse_actions("0F0 1Q2")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "gpipe"}, "'gpipe'"),
        ({"num_stages": 0, "stage": 0}, "num_stages=0"),
        ({"stage": 3}, "stage=3"),
        ({"stage": -1}, "stage=-1"),
        ({"accumulate": 0}, "accumulate=0"),
        ({"start": -2}, "-2"),
        ({"start": 5, "stop": 3}, r"\[5, 3\)"),
    ],
)
def test_bad_arguments_raise_with_the_value(kwargs, match):
    args = {"schedule": "paci", "stage": 0, "num_stages": 3, "accumulate": 2, "start": 0, "stop": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        list(stage_actions(**args))


GRID = list(itertools.product(SCHEDULES, range(1, 6), range(1, 6)))  # schedule, S, N


def _finite(schedule, num_stages, accumulate, start, stop, step_at_stop=False):
    return {
        s: list(stage_actions(schedule, s, num_stages, accumulate, start, stop, step_at_stop))
        for s in range(num_stages)
    }


@pytest.mark.parametrize(("schedule", "num_stages", "accumulate"), GRID)
def test_stream_invariants(schedule, num_stages, accumulate):
    start, stop = 1, 1 + 3 * accumulate + num_stages  # starts mid-window when N > 1
    for s, actions in _finite(schedule, num_stages, accumulate, start, stop).items():
        assert all(a.stage == s for a in actions)
        # Each micro-batch: exactly one F, then exactly one B.
        forwards = [a.index for a in actions if a.kind == "F"]
        backwards = [a.index for a in actions if a.kind == "B"]
        assert forwards == backwards == list(range(start, stop))
        # In flight (forwards minus backwards) never exceeds S - s.
        in_flight = 0
        for a in actions:
            in_flight += {"F": 1, "B": -1, "STEP": 0}[a.kind]
            assert 0 <= in_flight <= num_stages - s
        # STEP k comes right after B((k+1)N - 1), and only there.
        for i, a in enumerate(actions):
            if a.kind == "STEP":
                assert actions[i - 1] == Action(s, "B", (a.index + 1) * accumulate - 1)
            if a.kind == "B" and (a.index + 1) % accumulate == 0:
                assert actions[i + 1] == Action(s, "STEP", a.index // accumulate)


@pytest.mark.parametrize(("schedule", "num_stages", "accumulate"), GRID)
def test_flush_empties_the_pipeline_before_each_step(schedule, num_stages, accumulate):
    for actions in _finite(schedule, num_stages, accumulate, 0, 3 * accumulate).values():
        in_flight = 0
        for a in actions:
            in_flight += {"F": 1, "B": -1, "STEP": 0}[a.kind]
            if a.kind == "STEP" and schedule == "1f1b_flush":
                assert in_flight == 0


@pytest.mark.parametrize(("schedule", "num_stages", "accumulate"), GRID)
@pytest.mark.parametrize("step_at_stop", [False, True])
def test_unbounded_and_finite_streams_agree_before_forward_of_stop(schedule, num_stages, accumulate, step_at_stop):
    # The runtime drains an open-ended pipeline at M by switching to the stream with stop=M; that
    # is only sound if both streams agree on everything this stage ran before F(M).
    for start in sorted({0, 1, accumulate // 2, accumulate + 1}):
        for stop in range(start, 13):
            for s in range(num_stages):
                open_ended = stage_actions(schedule, s, num_stages, accumulate, start)
                prefix = list(itertools.takewhile(Action(s, "F", stop).__ne__, open_ended))
                finite = list(stage_actions(schedule, s, num_stages, accumulate, start, stop, step_at_stop))
                assert finite[: len(prefix)] == prefix, (schedule, s, start, stop)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(
    ("stop", "step_at_stop", "steps"),
    [(5, False, "0 1"), (5, True, "0 1 2"), (6, False, "0 1 2"), (6, True, "0 1 2"), (7, True, "0 1 2 3")],
)
def test_step_at_stop_steps_a_partial_last_window(schedule, stop, step_at_stop, steps):
    # N=2 over [0, stop): full windows always step; an odd stop leaves a partial window that
    # steps only with step_at_stop, right after its last backward.
    for s in range(3):
        actions = list(stage_actions(schedule, s, 3, 2, 0, stop, step_at_stop))
        assert " ".join(str(a.index) for a in actions if a.kind == "STEP") == steps
        assert actions[-1].kind == ("STEP" if step_at_stop or stop % 2 == 0 else "B")


@pytest.mark.parametrize("accumulate", [1, 2, 3, 4])
def test_paci_forward_of_next_window_overlaps_current_window(accumulate):
    # What makes PACI bubble-free: stage 0 runs forwards of window 1 before it steps window 0
    # whenever the pipeline is deeper than the window (S - 1 >= N here).
    actions = [str(a) for a in stage_actions("paci", 0, 5, accumulate, 0, 3 * accumulate)]
    assert actions.index(f"0F{accumulate}") < actions.index("0STEP0")
