"""Pure tests of layer-to-stage partitioning: fixtures, errors, and optimality against brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_efficient.runtime.partition import (
    check_sizes,
    partition_balanced,
    partition_profiled,
    partition_uniform,
    predicted_utilization,
    stage_bounds,
)
from lit_efficient.tools.simulate import flush_utilization, simulate


def all_splits(num_layers, num_stages):
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        edges = (0, *cuts, num_layers)
        yield [b - a for a, b in itertools.pairwise(edges)]


def stage_sums(values, sizes):
    return [sum(values[a:b]) for a, b in stage_bounds(sizes)]


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "expected"),
    [
        (8, 4, [2, 2, 2, 2]),
        (9, 4, [2, 2, 3, 2]),
        (10, 4, [2, 3, 3, 2]),
        (11, 4, [2, 3, 3, 3]),  # stage 0 (embedding, S micro-batches in flight) stays light
        (5, 5, [1, 1, 1, 1, 1]),
        (7, 1, [7]),
        (26, 8, [3, 3, 3, 4, 4, 3, 3, 3]),
    ],
)
def test_uniform(num_layers, num_stages, expected):
    assert partition_uniform(num_layers, num_stages) == expected


@pytest.mark.parametrize(
    ("weights", "num_stages", "expected"),
    [
        ([1, 1, 1, 1, 4], 2, [4, 1]),
        ([3, 1, 1, 1, 1, 1], 3, [1, 2, 3]),  # ties resolved towards later stages
        ([5, 1, 1, 1, 1, 1, 1, 1, 1, 5], 4, [1, 3, 5, 1]),  # heavy ends; the tie goes to stage 2
        ([0, 0, 0, 0], 2, [1, 3]),
        ([2.5, 0.5, 1.0, 2.0], 4, [1, 1, 1, 1]),
    ],
)
def test_balanced_fixtures(weights, num_stages, expected):
    assert partition_balanced(weights, num_stages) == expected


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=8), st.data())
def test_balanced_is_optimal_against_brute_force(weights, data):
    num_stages = data.draw(st.integers(1, len(weights)))
    sizes = partition_balanced(weights, num_stages)
    assert check_sizes(sizes, len(weights), num_stages) == sizes
    best = min(max(stage_sums(weights, s)) for s in all_splits(len(weights), num_stages))
    assert max(stage_sums(weights, sizes)) == best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 10.0, allow_subnormal=False), min_size=1, max_size=7), st.data())
def test_balanced_is_optimal_on_float_weights(weights, data):
    num_stages = data.draw(st.integers(1, len(weights)))
    sizes = partition_balanced(weights, num_stages)
    best = min(max(stage_sums(weights, s)) for s in all_splits(len(weights), num_stages))
    assert max(stage_sums(weights, sizes)) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_profiled_without_budget_is_balanced_time():
    times = [4.0, 1.0, 1.0, 1.0, 1.0, 3.0]
    assert partition_profiled(times, [1] * 6, [1] * 6, 3) == partition_balanced(times, 3) == [1, 3, 2]


def test_profiled_budget_moves_layers_off_the_first_stage():
    # Stage 0 keeps 2 micro-batches of activations, stage 1 one: a budget of 30 allows 1 + 3 layers.
    times, act, params = [1.0] * 4, [10.0] * 4, [0.0] * 4
    assert partition_profiled(times, act, params, 2) == [2, 2]
    assert partition_profiled(times, act, params, 2, memory_budget=40) == [2, 2]
    assert partition_profiled(times, act, params, 2, memory_budget=30) == [1, 3]


def test_profiled_budget_counts_parameters_once():
    times, act, params = [1.0] * 4, [0.0] * 4, [10.0, 10.0, 10.0, 30.0]
    assert partition_profiled(times, act, params, 2, memory_budget=30) == [3, 1]


def test_profiled_error_states_the_smallest_budget_that_fits():
    with pytest.raises(ValueError, match=r"memory_budget=25 .* the best split needs 30\.0") as info:
        partition_profiled([1.0] * 4, [10.0] * 4, [0.0] * 4, 2, memory_budget=25)
    assert "more pipeline stages" in str(info.value)


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=7),
    st.data(),
)
def test_profiled_is_optimal_against_brute_force(layers, data):
    times, act, params = (list(column) for column in zip(*layers, strict=True))
    num_stages = data.draw(st.integers(1, len(layers)))
    budget = data.draw(st.integers(0, 60))

    def memory(sizes):
        return [
            p + (num_stages - s) * a
            for s, (p, a) in enumerate(zip(stage_sums(params, sizes), stage_sums(act, sizes), strict=True))
        ]

    fitting = [s for s in all_splits(len(layers), num_stages) if max(memory(s)) <= budget]
    if not fitting:
        needed = min(max(memory(s)) for s in all_splits(len(layers), num_stages))
        with pytest.raises(ValueError, match=f"needs {float(needed)}"):
            partition_profiled(times, act, params, num_stages, memory_budget=budget)
        return
    sizes = partition_profiled(times, act, params, num_stages, memory_budget=budget)
    assert max(memory(sizes)) <= budget
    assert max(stage_sums(times, sizes)) == min(max(stage_sums(times, s)) for s in fitting)


def test_stage_bounds():
    assert stage_bounds([2, 3, 1]) == [(0, 2), (2, 5), (5, 6)]
    assert stage_bounds([]) == []


def test_check_sizes_accepts_a_valid_split():
    assert check_sizes((1, 2, 3), 6, 3) == [1, 2, 3]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: partition_uniform(3, 5), r"num_stages=5 is more than the 3 pipeline layers.*pipeline_stages <= 3"),
        (lambda: partition_uniform(3, 0), r"num_stages=0 must be >= 1"),
        (lambda: partition_uniform(3, -2), r"num_stages=-2"),
        (lambda: partition_balanced([1, 2], 3), r"num_stages=3 is more than the 2"),
        (lambda: partition_balanced([1, -2, 3], 2), r"weights contains -2.0: .* >= 0"),
        (lambda: partition_balanced([1, float("nan")], 1), r"weights contains nan"),
        (lambda: partition_balanced([], 1), r"num_stages=1 is more than the 0"),
        (lambda: check_sizes([2, 2], 5, 2), r"sizes=\[2, 2\] sums to 4 .* 5 pipeline layers.*add up to 5"),
        (lambda: check_sizes([5, 0], 5, 2), r"sizes=\[5, 0\] has a stage with no layers"),
        (lambda: check_sizes([6, -1], 5, 2), r"sizes=\[6, -1\]"),
        (lambda: check_sizes([1.5, 3.5], 5, 2), r"integer count >= 1"),
        (lambda: check_sizes([2, 3], 5, 3), r"sizes=\[2, 3\] has 2 entries for 3 pipeline stages"),
        (lambda: check_sizes([1, 2], 5, 2, name="balance"), r"^balance=\[1, 2\] sums to 3"),  # the user's option
        (lambda: check_sizes([1, 1], 1, 2), r"num_stages=2 is more than the 1"),
        (lambda: partition_profiled([1, 1], [1], [1, 1], 1), r"have 2, 1 and 2 entries"),
        (lambda: predicted_utilization([0.0, 0.0], 4), r"at least one positive time"),
        (lambda: predicted_utilization([1.0], 0), r"accumulate=0"),
        (lambda: predicted_utilization([1.0], 2, "gpipe"), r"'gpipe'"),
    ],
)
def test_bad_input_says_value_and_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(("num_stages", "accumulate"), [(2, 1), (4, 4), (8, 8), (8, 16)])
def test_predicted_flush_utilization_balanced_is_the_closed_form(num_stages, accumulate):
    predicted = predicted_utilization([3.0] * num_stages, accumulate, "1f1b_flush")
    assert predicted == pytest.approx(flush_utilization(num_stages, accumulate))
    assert predicted_utilization([3.0] * num_stages, accumulate, "paci") == 1.0


def test_predicted_paci_utilization_matches_the_simulator():
    forward = [1.0, 2.0, 1.5]
    times = [3 * f for f in forward]  # backward = 2 x forward
    result = simulate("paci", 3, 4, 48, forward=forward, backward=[2 * f for f in forward])
    simulated = sum(result.steady_utilization) / 3
    assert simulated == pytest.approx(predicted_utilization(times, 4), abs=0.01)
