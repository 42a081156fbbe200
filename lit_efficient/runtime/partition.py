"""Layers -> contiguous pipeline stages: uniform, balanced by weight, and profiled under a memory budget.

Pure arithmetic over integers and floats. Every function returns stage sizes, a list of S
positive layer counts summing to the number of layers; `stage_bounds` turns them into index
ranges. The strategy picks the function from its ``balance`` option: ``"uniform"`` ->
`partition_uniform`, ``"parameters"`` -> `partition_balanced` over parameter counts, ``"profile"`` ->
`partition_profiled` over measured times, activation and parameter bytes; an explicit list of
sizes goes through `check_sizes`.

Where several splits are optimal we give the later stages more layers: under 1F1B stage s holds
S-s micro-batches in flight, so a layer costs the least activation memory on the last stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lit_efficient.checks import is_count
from lit_efficient.runtime.schedules import SCHEDULES, ScheduleName

# fits(stage, begin, end): may layers [begin, end) form that stage?
_Fits = Callable[[int, int, int], bool]


def partition_uniform(num_layers: int, num_stages: int) -> list[int]:
    """Equal layer counts; the ``num_layers % num_stages`` extra layers go to the middle stages.

    Not to stage 0, which holds the most micro-batches in flight (S) and usually the embedding,
    nor preferably to the last stage, which usually holds the head and the loss. When the extras
    cannot be centred exactly they lean towards the back, where activations are cheaper.
    Example: 10 layers on 4 stages -> [2, 3, 3, 2]; 9 on 4 -> [2, 2, 3, 2].
    """
    _check_counts(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    first = (num_stages - extra + 1) // 2
    return [base + (first <= s < first + extra) for s in range(num_stages)]


def planned_sizes(balance: str | Sequence[int], num_stages: int, counts: Sequence[int]) -> list[int] | None:
    """Layers per stage for a ``balance`` decided without running the model (module docstring), given each layer's
    parameter count; None for ``"profile"``, which measures."""
    if not isinstance(balance, str):
        return [int(n) for n in balance]
    if balance == "uniform":
        return partition_uniform(len(counts), num_stages)
    if balance == "parameters":
        return partition_balanced([max(c, 1) for c in counts], num_stages)
    return None


def partition_balanced(weights: Sequence[float], num_stages: int) -> list[int]:
    """The contiguous split minimizing the heaviest stage's total weight (exact).

    ``weights`` are per-layer costs: parameter counts for ``balance="parameters"``, measured times
    for ``"profile"``. Among optimal splits, later stages get as many layers as they can take.
    Cost O(L^2 log L) for L layers (one greedy check per candidate bound in a binary search).
    """
    values = _check_weights("weights", weights)
    _check_counts(len(values), num_stages)
    prefix = _prefix(values)

    def fits_under(bound: float) -> _Fits:
        return lambda _stage, begin, end: prefix[end] - prefix[begin] <= bound

    bound = _smallest(_segment_sums(prefix), lambda b: _fill_from_back(len(values), num_stages, fits_under(b)))
    sizes = _fill_from_back(len(values), num_stages, fits_under(bound))
    assert sizes is not None  # the total weight is a candidate and always fits
    return sizes


def partition_profiled(
    times: Sequence[float],
    activation_bytes: Sequence[float],
    param_bytes: Sequence[float],
    num_stages: int,
    memory_budget: float | None = None,
) -> list[int]:
    """The split minimizing the slowest stage's time, with every stage within ``memory_budget``.

    Stage s's memory is its parameter bytes plus (S - s) times its activation bytes: under 1F1B
    (both schedules) stage s holds up to S - s micro-batches in flight. Optimizer state and
    gradients scale with parameters: fold them into ``param_bytes``.

    Args:
        times: Per layer, forward + backward time of one micro-batch.
        activation_bytes: Per layer, bytes kept from forward to backward for one micro-batch.
        param_bytes: Per layer, bytes of parameters (plus gradients and optimizer state).
        num_stages: Pipeline depth S.
        memory_budget: Bytes one stage may use, or None for no limit.

    Raises:
        ValueError: when no split fits the budget, with the smallest budget that would.
    """
    time = _check_weights("times", times)
    act = _check_weights("activation_bytes", activation_bytes)
    params = _check_weights("param_bytes", param_bytes)
    if not len(time) == len(act) == len(params):
        raise ValueError(
            f"times, activation_bytes and param_bytes have {len(time)}, {len(act)} and {len(params)} entries: "
            "give one per layer in each"
        )
    num_layers = len(time)
    _check_counts(num_layers, num_stages)
    time_prefix, act_prefix, param_prefix = _prefix(time), _prefix(act), _prefix(params)

    def memory(stage: int, begin: int, end: int) -> float:
        in_flight = num_stages - stage
        return param_prefix[end] - param_prefix[begin] + in_flight * (act_prefix[end] - act_prefix[begin])

    def fits_memory(stage: int, begin: int, end: int) -> bool:
        return memory_budget is None or memory(stage, begin, end) <= memory_budget

    if _fill_from_back(num_layers, num_stages, fits_memory) is None:
        needed = _smallest(
            [
                memory(s, b, e)
                for s in range(num_stages)
                for b in range(num_layers)
                for e in range(b + 1, num_layers + 1)
            ],
            lambda m: _fill_from_back(num_layers, num_stages, lambda s, b, e: memory(s, b, e) <= m),
        )
        raise ValueError(
            f"no split of {num_layers} layers into {num_stages} stages fits memory_budget={memory_budget} bytes "
            f"(stage s needs its parameter bytes + (S - s) x its activation bytes); the best split needs {needed}. "
            "Raise the budget, use more pipeline stages, or recompute activations (recompute=True or "
            "ActivationCheckpointing) to shrink activation bytes."
        )

    def fits_under(bound: float) -> _Fits:
        return lambda s, b, e: time_prefix[e] - time_prefix[b] <= bound and fits_memory(s, b, e)

    bound = _smallest(_segment_sums(time_prefix), lambda t: _fill_from_back(num_layers, num_stages, fits_under(t)))
    sizes = _fill_from_back(num_layers, num_stages, fits_under(bound))
    assert sizes is not None  # with the total time as bound only memory binds, and it fits
    return sizes


def check_sizes(sizes: Sequence[int], num_layers: int, num_stages: int, name: str = "sizes") -> list[int]:
    """Validate an explicit split (one positive layer count per stage, summing to ``num_layers``); messages name it
    ``name`` (the option the user wrote, e.g. ``balance``)."""
    _check_counts(num_layers, num_stages)
    sizes = list(sizes)
    if len(sizes) != num_stages:
        raise ValueError(
            f"{name}={sizes} has {len(sizes)} entries for {num_stages} pipeline stages: give one layer count per stage"
        )
    if not all(is_count(n) for n in sizes):
        raise ValueError(f"{name}={sizes} has a stage with no layers: every stage needs an integer count >= 1")
    if sum(sizes) != num_layers:
        raise ValueError(
            f"{name}={sizes} sums to {sum(sizes)} but the model has {num_layers} pipeline layers: "
            f"make the counts add up to {num_layers}"
        )
    return [int(n) for n in sizes]


def stage_bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Half-open layer ranges of each stage: ``[2, 3, 1] -> [(0, 2), (2, 5), (5, 6)]``."""
    bounds = []
    begin = 0
    for n in sizes:
        bounds.append((begin, begin + n))
        begin += n
    return bounds


def predicted_utilization(stage_times: Sequence[float], accumulate: int, schedule: ScheduleName = "paci") -> float:
    """Mean stage utilization a split should reach, from each stage's time per micro-batch.

    ``stage_times`` are forward + backward per micro-batch. PACI in steady state runs at the pace
    of the slowest stage: mean / max. 1F1B-flush pays a fill and a drain per window, the usual
    estimate being a window lasting (N - 1) x max + sum: N x mean / ((N - 1) x max + sum), which
    is N / (N + S - 1) for balanced stages. Communication and steps are not modelled; use
    `lit_efficient.tools.simulate` for those.
    """
    times = _check_weights("stage_times", stage_times)
    if not times or max(times) <= 0:
        raise ValueError(f"stage_times={list(stage_times)} needs at least one positive time")
    if accumulate < 1:
        raise ValueError(f"accumulate={accumulate} must be >= 1 (micro-batches per optimizer step)")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    mean, slowest = sum(times) / len(times), max(times)
    if schedule == "paci":
        return mean / slowest
    return accumulate * mean / ((accumulate - 1) * slowest + sum(times))


def _fill_from_back(num_layers: int, num_stages: int, fits: _Fits) -> list[int] | None:
    """Give each stage, last first, as many layers as ``fits`` allows; None if no split fits.

    Exact when ``fits`` is monotone (a sub-range of a fitting range fits, and a range that fits a
    stage fits every later stage): then this fill's boundaries are never behind those of any
    fitting split, so it fails only when none exists. Each stage keeps one layer for each stage
    in front of it.
    """
    sizes = [0] * num_stages
    end = num_layers
    for s in range(num_stages - 1, 0, -1):
        begin = end - 1
        if not fits(s, begin, end):
            return None
        while begin > s and fits(s, begin - 1, end):
            begin -= 1
        sizes[s] = end - begin
        end = begin
    if not fits(0, 0, end):
        return None
    sizes[0] = end
    return sizes


def _smallest(candidates: Sequence[float], feasible: Callable[[float], object]) -> float:
    """The smallest candidate for which ``feasible`` is truthy; feasibility is monotone in it."""
    ordered = sorted(set(candidates))
    low, high = 0, len(ordered) - 1
    if not feasible(ordered[high]):
        raise AssertionError("the largest candidate must be feasible")
    while low < high:
        mid = (low + high) // 2
        if feasible(ordered[mid]):
            high = mid
        else:
            low = mid + 1
    return ordered[low]


def _segment_sums(prefix: list[float]) -> list[float]:
    # The optimal bound is the weight of some stage, so these are the only values worth trying;
    # computed as prefix differences, exactly as the fill computes them, so floats compare equal.
    return [prefix[e] - prefix[b] for b in range(len(prefix)) for e in range(b + 1, len(prefix))]


def _prefix(values: Sequence[float]) -> list[float]:
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    return prefix


def _check_weights(name: str, weights: Sequence[float]) -> list[float]:
    values = [float(w) for w in weights]
    bad = [w for w in values if not 0 <= w < float("inf")]  # also rejects NaN
    if bad:
        raise ValueError(f"{name} contains {bad[0]}: every per-layer value must be finite and >= 0")
    return values


def _check_counts(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1: use pipeline_stages=1 or more")
    if num_layers < num_stages:
        raise ValueError(
            f"num_stages={num_stages} is more than the {num_layers} pipeline layers: every stage needs at least "
            f"one layer; use pipeline_stages <= {num_layers} or split the model into more pipeline_layers()"
        )
