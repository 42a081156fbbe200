"""The memory plan: what each rank of a pipeline holds, and when, under PACI or 1F1B-flush.

This file owns the memory model of docs/DESIGN.md section 8: from what one micro-batch costs each stage
(`StageMeasure`, which `lit_efficient.tools.fake_memory` measures on fake tensors) and the schedule's
action streams (`lit_efficient.runtime.schedules`), the bytes every rank of stage s holds, its peak
and whether that fits a device. Pure arithmetic over those numbers; the CLI front end is
`lit_efficient.cli.plan`.

Per rank of stage s, with k_s the most micro-batches in flight there (counted from its action stream:
S-s under PACI, min(N, S-s) under 1F1B-flush, 1 on the last stage) and R data-parallel replicas:

- always: weights (parameters and buffers), gradients (kept from the first backward of a window to its
  step; the plan counts them throughout), optimizer state (with ``shard_optimizer_state`` the largest
  replica's chunk: 1/R of it, split by element as `lit_efficient.replicas.sharded_optimizer` does), and
  persistent extras: weight prediction's weight-sized stash, DiLoCo's anchor and outer momentum, a tied
  weight's delay line.
- activations: k_s x what a micro-batch keeps from its forward to its backward (saved tensors, the
  received input, the output sent); with ``recompute=True`` k_s - 1 stage inputs plus one micro-batch
  being recomputed (the last stage never recomputes).
- the peak adds the larger of two transients: one micro-batch's forward and backward beyond what it
  keeps (temporaries, the gradient received, the one sent), with k_s - 1 others in flight; or the largest
  of the local step's temporaries, which run one after another (the gradient all-reduce's flat buffer, or
  sharded the reduce-scatter's and the all-gather's flat buffers and chunks, the tied-weight exchange, the
  optimizer's own), with the micro-batches the schedule has in flight at a step (none under flush, k_s - 1
  under PACI).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from lit_efficient.runtime.schedules import SCHEDULES, ScheduleName, stage_actions
from lit_efficient.runtime.staleness import STASHES, delay_bound

Verdict = Literal["fits", "tight", "does not fit", "unknown"]
TIGHT = 0.10  # headroom under this fraction of the device: allocator fragmentation, CUDA context, NCCL buffers
_DECIMAL = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_UNITS = {**_DECIMAL, **_BINARY}


def in_flight(schedule: ScheduleName, stage: int, num_stages: int, accumulate: int) -> tuple[int, int]:
    """The most micro-batches in flight on ``stage`` (forwards run, backwards not yet), and the most at a step.

    Counted from the stage's own action stream over enough windows to reach the steady state: the number
    the runtime reaches (``StageStats.max_in_flight``), not a formula.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    stop = accumulate * (math.ceil(num_stages / accumulate) + 2)
    held = most = at_step = 0
    for action in stage_actions(schedule, stage, num_stages, accumulate, stop=stop):
        if action.kind == "F":
            held += 1
            most = max(most, held)
        elif action.kind == "B":
            held -= 1
        else:
            at_step = max(at_step, held)
    return most, at_step


def element_shares(per_parameter: Sequence[int], replicas: int) -> list[int]:
    """Optimizer-state bytes of each of ``replicas`` ranks when the state is split by element, as
    ``PACIStrategy(shard_optimizer_state=True)`` splits it: the parameters end to end, replica r holding the
    r-th of R equal chunks. Within a few bytes per replica of what it holds: a parameter that a chunk boundary
    cuts has a per-parameter scalar (Adam's step count) on both sides, counted here once."""
    if replicas < 1:
        raise ValueError(f"replicas={replicas} must be >= 1")
    total = sum(per_parameter)
    chunk = math.ceil(total / replicas)
    return [max(0, min(chunk, total - r * chunk)) for r in range(replicas)]


def replica_shares(per_parameter: Sequence[int], replicas: int) -> list[int]:
    """Optimizer-state bytes of each of ``replicas`` ranks when the state is sharded by whole parameters:
    largest first, each to the rank holding the least so far (``ZeroRedundancyOptimizer``'s partition). Not
    what PACIStrategy does (`element_shares`); benchmarks/optimizer_sharding.py prints both."""
    if replicas < 1:
        raise ValueError(f"replicas={replicas} must be >= 1")
    shares = [0] * replicas
    for nbytes in sorted(per_parameter, reverse=True):
        shares[shares.index(min(shares))] += nbytes
    return shares


def parse_bytes(text: str | int | float) -> int:
    """``"80GiB"``, ``"80 GB"`` (10^9), ``"512MiB"``, ``"1.5T"`` (2^40) or a number of bytes -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 80GiB, 80GB (10^9 bytes) or 512MiB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at or above 1 (``23.41 GiB``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class StageMeasure:
    """What one stage holds, measured on fake tensors (bytes unless said otherwise).

    Attributes:
        stage: The stage's index.
        layers: Its layers' ``[first, last)`` indices in ``pipeline_layers()``.
        parameters: Number of parameter elements.
        weights: Parameters and buffers.
        parameter_bytes: Parameters alone (what a weight-sized buffer holds).
        gradients: The parameters' gradients (their dtype; fp32 under bf16-mixed).
        optimizer: The optimizer's state after its first step (AdamW: two fp32 moments and a step).
        optimizer_per_parameter: The same, per parameter, in the optimizer's parameter order (for sharding).
        step_transient: The peak of the optimizer step's temporaries over its state.
        tied: Bytes of parameters this stage shares with another stage (a tied embedding's copy).
        saved: What autograd saves for one micro-batch (distinct storages; parameters excluded).
        held: What the stage keeps per micro-batch in flight with the graph kept: the saved tensors, the
            received inputs and the outputs it sent (the loss on the last stage), each storage once.
        inputs: The received inputs of one micro-batch (the first stage's: what ``pipeline_input`` returns).
        rng: The RNG state a stage under ``recompute=True`` keeps per micro-batch besides its inputs.
        compute_peak: The most bytes live at once over one micro-batch's forward and backward, beyond
            weights, gradients and optimizer state (``held`` plus temporaries, incoming and outgoing
            gradients).
        boundary: Bytes of the outputs sent to the next stage per micro-batch (0 on the last stage).
    """

    stage: int
    layers: tuple[int, int]
    parameters: int
    weights: int
    parameter_bytes: int
    gradients: int
    optimizer: int
    optimizer_per_parameter: tuple[int, ...]
    step_transient: int
    tied: int
    saved: int
    held: int
    inputs: int
    rng: int
    compute_peak: int
    boundary: int


# What a stage's measure holds per micro-batch. Every tensor a forward or backward makes has the micro-batch as a
# dimension, or none (a dense embedding gradient, the RNG state): sums of them are affine in the micro-batch size,
# and a peak over the forward and backward (compute_peak), the largest of such sums, is convex in it.
PER_MICRO_BATCH = ("saved", "held", "inputs", "rng", "compute_peak", "boundary")


def measures_at(measured: Mapping[int, Sequence[StageMeasure]], at: int) -> list[StageMeasure]:
    """What each stage would measure at micro-batch ``at``, from its measures at two or more sizes (size -> every
    stage's measure): each per-micro-batch quantity on the chord between the measured sizes nearest around ``at``
    (the nearest two, outside them), the state as measured. Exact where the quantity is affine; for a convex one,
    exact at the measured sizes and above it between them, so a plan from it errs on the side of not fitting."""
    if at in measured:
        return list(measured[at])
    sizes = sorted(measured)
    if len(sizes) < 2:
        raise ValueError(f"measures at two micro-batch sizes are needed for micro-batch {at}, got {sizes}")
    below, above = [s for s in sizes if s < at], [s for s in sizes if s > at]
    lo, hi = (below[-1], above[0]) if below and above else (sizes[:2] if not below else sizes[-2:])
    out = []
    for m, o in zip(measured[lo], measured[hi], strict=True):
        slope = {f: (getattr(o, f) - getattr(m, f)) / (hi - lo) for f in PER_MICRO_BATCH}
        out.append(replace(m, **{f: max(0, round(getattr(m, f) + slope[f] * (at - lo))) for f in PER_MICRO_BATCH}))
    return out


@dataclass(frozen=True)
class StagePlan:
    """What one rank of a stage holds (bytes); ``peak`` is the most at any moment of the schedule.

    Attributes:
        extra: Persistent buffers besides weights, gradients and optimizer state, by name.
        activations: What the micro-batches in flight keep at the worst moment, without temporaries: the
            number a run's saved-tensor meter measures (BENCHMARKS.md, "Memory plan").
        transient: The peak minus everything else: the larger of a micro-batch's forward/backward
            temporaries and the local step's.
        step_transient: The local step's temporaries, by name.
    """

    stage: int
    layers: tuple[int, int]
    parameters: int
    weights: int
    gradients: int
    optimizer: int
    extra: dict[str, int]
    in_flight: int
    activations: int
    transient: int
    peak: int
    held_per_microbatch: int
    saved_per_microbatch: int
    step_transient: dict[str, int] = field(default_factory=dict)

    @property
    def state(self) -> int:
        """Weights, gradients, optimizer state and persistent extras."""
        return self.weights + self.gradients + self.optimizer + sum(self.extra.values())


@dataclass(frozen=True)
class MemoryPlan:
    """Per-stage memory of one pipeline configuration, and whether its worst rank fits ``device_memory``."""

    stages: tuple[StagePlan, ...]
    schedule: ScheduleName
    accumulate: int
    recompute: bool
    replicas: int
    shard_optimizer_state: bool
    device_memory: int | None = None
    context: dict[str, Any] = field(default_factory=dict)  # what was planned: model, micro-batch, precision...
    # The peak at other cuts of the same global batch, by micro-batch size (N = global batch / size), each planned
    # at its own N from stages measured at a few sizes (`measures_at`: exact at those, above between); empty where
    # not planned.
    peaks_by_micro_batch: dict[int, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        """The largest rank's peak."""
        return max(s.peak for s in self.stages)

    @property
    def worst_stage(self) -> int:
        """The stage whose ranks peak highest."""
        return max(self.stages, key=lambda s: s.peak).stage

    @property
    def headroom(self) -> int | None:
        """Device memory minus the peak (negative: short by that much); None without a device size."""
        return None if self.device_memory is None else self.device_memory - self.peak

    @property
    def verdict(self) -> Verdict:
        """``"fits"``; ``"tight"`` (fits with under 10% of the device to spare, which the allocator's
        fragmentation, the CUDA context and NCCL's buffers may need); ``"does not fit"``; ``"unknown"``."""
        if self.headroom is None:
            return "unknown"
        if self.headroom < 0:
            return "does not fit"
        return "tight" if self.headroom < TIGHT * self.device_memory else "fits"

    @property
    def fits(self) -> bool | None:
        """Whether the worst rank's peak is within the device memory (None without a device size)."""
        return None if self.headroom is None else self.headroom >= 0

    def summary(self) -> str:
        """One line: the peak, where, and the verdict with its margin."""
        where = f"peak {format_bytes(self.peak)} on stage {self.worst_stage}"
        if self.headroom is None:
            return f"{where}; pass a device memory (--device-memory 80GiB) for a verdict"
        size = format_bytes(self.device_memory)
        if self.headroom < 0:
            return f"{where}: does NOT fit {size}, short by {format_bytes(-self.headroom)}"
        verdict = "fits, tight:" if self.verdict == "tight" else "fits"
        return f"{where}: {verdict} {size} with {format_bytes(self.headroom)} to spare"

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``: every field, per stage, plus the peak and the verdict."""
        return {
            "schedule": self.schedule, "accumulate": self.accumulate, "recompute": self.recompute,
            "replicas": self.replicas, "shard_optimizer_state": self.shard_optimizer_state,
            "device_memory": self.device_memory, "peak": self.peak, "worst_stage": self.worst_stage,
            "headroom": self.headroom, "fits": self.fits, "verdict": self.verdict, "context": self.context,
            "stages": [{**asdict(s), "layers": list(s.layers), "state": s.state} for s in self.stages],
        }  # fmt: skip

    def table(self) -> str:
        """A Markdown table, one row per stage, and the summary line."""
        lines = [
            "| stage | layers | weights | grads | optimizer | extra | in flight | activations | transient | peak |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in self.stages:
            cells = [s.weights, s.gradients, s.optimizer, sum(s.extra.values())]
            lines.append(
                f"| {s.stage} | {s.layers[0]}-{s.layers[1] - 1} | " + " | ".join(map(format_bytes, cells))
                + f" | {s.in_flight} | {format_bytes(s.activations)} | {format_bytes(s.transient)} "
                f"| **{format_bytes(s.peak)}** |"
            )  # fmt: skip
        return "\n".join(lines) + "\n\n" + self.summary()


def plan_memory(
    measures: Sequence[StageMeasure],
    schedule: ScheduleName,
    accumulate: int,
    recompute: bool = False,
    replicas: int = 1,
    shard_optimizer_state: bool = False,
    staleness_correction: str | None = None,
    local_sgd_steps: int | None = None,
    outer_optimizer: str = "average",
    device_memory: int | None = None,
    context: dict[str, Any] | None = None,
    smallest_accumulate: int | None = None,
) -> MemoryPlan:
    """The memory plan of one configuration, from the stages' measurements.

    Args:
        measures: One per stage, stage 0 first (`fake_memory.measure_stages`).
        schedule: ``"paci"`` or ``"1f1b_flush"``.
        accumulate: Micro-batches per optimizer step N.
        recompute: ``PACIStrategy(recompute=True)``: stages keep only their inputs between forward and backward.
        replicas: Data-parallel replicas R of every stage (world size / S).
        shard_optimizer_state: Each stage's optimizer state is split by element over its R replicas (ZeRO-1);
            gradients stay whole on every rank. Ignored with one replica and with ``local_sgd_steps`` (which
            ``PACIStrategy`` refuses with it).
        staleness_correction: ``"weight_prediction"`` adds a weight-sized stash on the stages it corrects.
        local_sgd_steps: LocalSGD/DiLoCo instead of a gradient all-reduce every step (None: all-reduce).
        outer_optimizer: ``"nesterov"`` (DiLoCo) keeps two fp32 copies of the parameters.
        device_memory: Bytes of one device, for the verdict; None for none.
        context: What was planned (model, micro-batch, precision), carried into the JSON.
        smallest_accumulate: The smallest N of a ``{epoch: N}`` schedule whose largest is ``accumulate`` (PACI's
            tied-weight delay line is built for it: ceil(S / N) gradients); None: ``accumulate``.
    """
    num_stages = len(measures)
    if accumulate < 1:
        raise ValueError(f"accumulate={accumulate} must be >= 1 (micro-batches per optimizer step)")
    if replicas < 1:
        raise ValueError(f"replicas={replicas} must be >= 1 (world size / pipeline stages)")
    stages = []
    for m in measures:
        s = m.stage
        last = s == num_stages - 1
        k, k_step = in_flight(schedule, s, num_stages, accumulate)
        rebuild = recompute and not last  # stage.py: the last stage runs its backward at once, never recomputes
        # Recompute keeps each micro-batch's input and RNG state; the one being recomputed also its graph.
        rng = m.rng if rebuild else 0
        per_mb = m.inputs + rng if rebuild else m.held
        activations = (k - 1) * per_mb + m.held + rng
        optimizer, step_opt = m.optimizer, m.step_transient
        sharded = shard_optimizer_state and replicas > 1 and local_sgd_steps is None
        if sharded and m.optimizer:
            optimizer = max(element_shares(m.optimizer_per_parameter, replicas))
            step_opt = math.ceil(m.step_transient * optimizer / m.optimizer)  # the step runs on its slice
        extra = _extras(m, schedule, s, num_stages, smallest_accumulate or accumulate, staleness_correction,
                        replicas, local_sgd_steps, outer_optimizer)  # fmt: skip
        step = {"optimizer": step_opt}
        if sharded:  # sharded_optimizer.py: one padded flat buffer and this replica's chunk of it, each phase
            step["gradient reduce-scatter"] = m.gradients + math.ceil(m.gradients / replicas)
            step["parameter all-gather"] = m.parameter_bytes + math.ceil(m.parameter_bytes / replicas)
        elif replicas > 1 and local_sgd_steps is None:
            step["gradient all-reduce"] = m.gradients  # all_reduce_flat packs the gradients into one buffer
        if replicas > 1 and local_sgd_steps is not None:
            step["replica averaging"] = m.parameter_bytes  # averaging.py: a transient copy of the parameters
        if m.tied and num_stages > 1:
            step["tied exchange"] = m.tied  # pipeline/tied.py: the gradient copy sent to the other stage
        compute = (k - 1) * per_mb + max(m.compute_peak, m.held) + rng
        at_step = k_step * per_mb + max(step.values())  # stage.step runs them one after another
        state = m.weights + m.gradients + optimizer + sum(extra.values())
        peak = state + max(compute, at_step)
        stages.append(
            StagePlan(
                stage=s,
                layers=m.layers,
                parameters=m.parameters,
                weights=m.weights,
                gradients=m.gradients,
                optimizer=optimizer,
                extra=extra,
                in_flight=k,
                activations=activations,
                transient=peak - state - activations,
                peak=peak,
                held_per_microbatch=per_mb,
                saved_per_microbatch=m.saved,
                step_transient=step,
            )  # fmt: skip
        )
    return MemoryPlan(
        tuple(stages), schedule, accumulate, recompute, replicas, shard_optimizer_state, device_memory,
        dict(context or {}),
    )  # fmt: skip


def _extras(
    m: StageMeasure,
    schedule: ScheduleName,
    stage: int,
    num_stages: int,
    accumulate: int,
    staleness_correction: str | None,
    replicas: int,
    local_sgd_steps: int | None,
    outer_optimizer: str,
) -> dict[str, int]:
    extra = {}
    if staleness_correction in STASHES and delay_bound(schedule, stage, num_stages, accumulate) > 0:
        extra["weight prediction stash"] = m.parameter_bytes  # staleness.py: empty_like of every predicted weight
    if local_sgd_steps is not None and replicas > 1 and outer_optimizer == "nesterov":
        extra["DiLoCo anchor + momentum"] = 2 * 4 * m.parameters  # averaging.py: two fp32 copies
    if m.tied and schedule == "paci" and stage == 0 and num_stages > 1:
        # runtime/tied.py: stage 0 keeps its last d = ceil(S/N) gradients of the tied weight.
        extra["tied gradient delay line"] = math.ceil(num_stages / accumulate) * m.tied
    return extra
