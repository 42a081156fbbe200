"""``lit-efficient plan``: the memory plan of a training config, before any GPU is rented.

This file owns the front end of the memory plan (docs/DESIGN.md section 8): reading the same LightningCLI
YAML that ``fit`` takes, building what it names without allocating memory (the model on the meta device,
then fake tensors), choosing the split the strategy would choose, and printing the plan
(`lit_efficient.tools.memory_plan`) as a table or JSON.

    lit-efficient plan --config configs/gpt2_medium_8stage_paci.yaml --device-memory 80GiB
    lit-efficient plan --config configs/quickstart.yaml --config configs/checkpointing.yaml --json
    lit-efficient plan --config ... --trainer.strategy.init_args.recompute=true       # any fit override
    lit-efficient plan --config ... --replicas 8 --shard-optimizer-state               # 8 x 8 GPUs, ZeRO-1

From Python, `plan` takes a module, one micro-batch (real, meta or fake tensors) and a `PACIStrategy`.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lit_efficient.callbacks import activation_checkpointing as ac
from lit_efficient.nested import map_tensors
from lit_efficient.runtime.partition import partition_profiled
from lit_efficient.runtime.topology import Topology
from lit_efficient.strategy.config import (
    _PRECISIONS,
    _check_sharding,
    _sharding_applies,
    check_accumulate,
    unsupported_precision,
)
from lit_efficient.strategy.paci import CLASS_NAMES, PACIStrategy
from lit_efficient.tools.fake_memory import (
    MakeOptimizer,
    SavedBytes,
    answering_value_queries,
    fake_batch,
    fake_module,
    measure_stages,
)
from lit_efficient.tools.memory_plan import (
    PER_MICRO_BATCH,
    MemoryPlan,
    StageMeasure,
    format_bytes,
    measures_at,
    parse_bytes,
    plan_memory,
)
from lit_efficient.tools.window import WindowAdvice, advise_window, flush_bubble

_GPU = ("gpu", "cuda")


class PlanError(ValueError):
    """What the plan refuses in a config or in its arguments, as ``fit`` would refuse it: the message names the
    value, what is allowed and the fix. ``lit-efficient plan`` reports it as a usage error (exit 2), before
    measuring when it can; to a caller of `plan` it is a ValueError."""


def plan(
    module: nn.Module,
    batch: Any,
    strategy: PACIStrategy,
    accumulate: int = 1,
    precision: str = "32-true",
    activation_checkpointing: ac.ActivationCheckpointing | None = None,
    replicas: int = 1,
    shard_optimizer_state: bool | None = None,
    device_memory: int | str | None = None,
    accelerator: str = "gpu",
    max_steps: int = 1000,
    accumulate_schedule: Mapping[int, int] | None = None,
) -> MemoryPlan:
    """The memory plan of training ``module`` under ``strategy``; nothing is allocated and ``module`` is left
    as it was (build a large one on the meta device: ``with torch.device("meta"): module = ...``).

    Args:
        module: A LightningModule implementing the pipeline protocol, with its ``configure_optimizers``.
        batch: One micro-batch as the data loader yields it (its shapes and dtypes are what matter).
        strategy: The `PACIStrategy` whose stages, schedule, balance and recompute are planned.
        accumulate: Micro-batches per optimizer step N (of a schedule: its largest, the peak's).
        precision: ``"32-true"`` or ``"bf16-mixed"`` (fp32 weights, bf16 autocast), or a Lightning alias of them
            (``"32"``, ``32``, ``"bf16"``).
        activation_checkpointing: The callback as configured, or None.
        replicas: Data-parallel replicas of each stage (world size / pipeline stages).
        shard_optimizer_state: Optimizer state split by element over the replicas (ZeRO-1; None: the strategy's
            ``shard_optimizer_state``). Refused where ``PACIStrategy`` refuses it (``local_sgd_steps``,
            weight prediction).
        device_memory: Bytes (or ``"80GiB"``) of one device, for the verdict.
        accelerator: ``"gpu"`` plans the optimizer step as torch runs it on CUDA (foreach kernels, whose
            temporaries span the whole stage); ``"cpu"`` as on CPU. The kernels measured are the host's.
        max_steps: What ``trainer.estimated_stepping_batches`` answers while ``configure_optimizers`` runs.
        accumulate_schedule: GradientAccumulation's ``{epoch: N}`` schedule whose largest N ``accumulate`` is; noted
            in the plan's ``context`` (and by `describe`); its smallest N sizes PACI's tied-weight delay line.

    Raises:
        PlanError: What ``fit`` would refuse, checked before anything is measured (the split, once the layers are
            listed).
    """
    # The cheap refusals first: measuring a large model takes a while.
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise PlanError(f"replicas={replicas!r} must be an integer >= 1 (data-parallel replicas of each stage)")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise PlanError(f"accumulate={accumulate!r} must be an integer >= 1 (micro-batches per optimizer step N)")
    budget = None if device_memory is None else device_bytes(device_memory)
    precision = unified_precision(precision)
    if activation_checkpointing is not None and strategy.recompute:
        raise PlanError(
            "ActivationCheckpointing cannot be combined with PACIStrategy(recompute=True) (fit refuses it too): "
            "keep one of them"
        )
    if shard_optimizer_state is None:
        shard_optimizer_state = strategy.shard_optimizer_state
    try:  # as fit would
        _check_sharding(shard_optimizer_state, strategy.local_sgd_steps, strategy.staleness_correction)
    except ValueError as error:
        raise PlanError(str(error)) from error
    measures, context = measure(
        module, batch, strategy, accumulate, precision, activation_checkpointing, budget, accelerator, max_steps
    )
    if accumulate_schedule is not None:
        context["accumulate_schedule"] = dict(accumulate_schedule)
    if shard_optimizer_state:  # what fit says of this layout: tied weights refused, one replica splits nothing
        topology = Topology.for_world(len(measures) * replicas, len(measures))
        shard_optimizer_state = _sharding_applies(topology, in_process=False, tied=any(m.tied for m in measures))
    settings = dict(
        recompute=strategy.recompute, replicas=replicas, shard_optimizer_state=shard_optimizer_state,
        staleness_correction=strategy.staleness_correction, local_sgd_steps=strategy.local_sgd_steps,
        outer_optimizer=strategy.outer_optimizer, device_memory=budget,
        smallest_accumulate=min(accumulate_schedule.values()) if accumulate_schedule else None,
    )  # fmt: skip
    result = plan_memory(measures, strategy.schedule, accumulate, context=context, **settings)
    size = _micro_batch_size(batch)
    if size is None:
        return result
    # The other cuts of the same global batch (the window advice's candidates), each planned at its own N: its
    # in-flight counts are the schedule's at that N, its stages measured again at micro-batch 1 and at the whole
    # global batch, each cut's on the chord between the measured sizes around it (`measures_at`: exact at the
    # configured cut and at both ends, above the plan of that cut between them, never below).
    total = accumulate * size
    measured = {size: measures}
    for other in sorted({1, total} - {size}):
        try:
            per_micro_batch, _ = measure(
                module, _resized(batch, size, other), strategy, accumulate, precision, activation_checkpointing,
                budget, accelerator, max_steps, sizes=context["sizes"], optimizer=False,
            )  # fmt: skip
        except Exception as error:  # noqa: BLE001 - the user's forward at another size: the plan stands without it
            warnings.warn(
                f"lit-efficient plan: the window's other cuts are not estimated: the model did not run at micro-batch "
                f"{other} ({type(error).__name__}: {error}). The plan of the configured cut is unaffected.",
                UserWarning,
                stacklevel=2,
            )
            return result
        # The state as measured with the optimizer (the same at every size), what a micro-batch costs at this one.
        measured[other] = [
            replace(m, **{f: getattr(o, f) for f in PER_MICRO_BATCH})
            for m, o in zip(measures, per_micro_batch, strict=True)
        ]
    peaks = {
        total // n: plan_memory(measures_at(measured, total // n), strategy.schedule, n, **settings).peak
        for n in range(1, total + 1)
        if total % n == 0
    }
    return replace(result, peaks_by_micro_batch=peaks)


def measure(
    module: nn.Module,
    batch: Any,
    strategy: PACIStrategy,
    accumulate: int = 1,
    precision: str = "32-true",
    activation_checkpointing: ac.ActivationCheckpointing | None = None,
    device_memory: int | str | None = None,
    accelerator: str = "gpu",
    max_steps: int = 1000,
    sizes: Sequence[int] | None = None,
    optimizer: bool = True,
) -> tuple[list[StageMeasure], dict[str, Any]]:
    """What `plan` measures, stage by stage, and what was planned (the plan's ``context``): everything that
    does not depend on the schedule, ``recompute``, the replicas or sharding, so one measurement serves every
    plan of a layout (`lit_efficient.tools.memory_plan.plan_memory`). Arguments as `plan`'s; ``sizes``: the
    split to measure (None: the one the strategy would choose); ``optimizer=False`` skips the optimizer's step
    (its state, 0 then, does not depend on the micro-batch)."""
    precision = unified_precision(precision)
    forward_context = MixedPrecision("bf16-mixed", "cpu").forward_context if precision == "bf16-mixed" else nullcontext
    wrapped = activation_checkpointing.wrap(module) if activation_checkpointing is not None else []
    try:
        with fake_module(module) as mode, _transformers_take_real_paths():
            with answering_value_queries():  # HFCausalLM's split check compares logits
                layers = list(module.pipeline_layers())
            fake = fake_batch(batch, mode)
            if sizes is None:  # refusals: PlanError
                sizes = _stage_sizes(strategy, module, layers, fake, forward_context, device_memory)
            make_optimizer = None
            if optimizer:
                with _stand_in_trainer(module, max_steps, accumulate):
                    make_optimizer = optimizer_factory(module, foreach=accelerator in _GPU)
            measures = measure_stages(
                layers, sizes, fake, module.pipeline_input, module.pipeline_loss, forward_context, make_optimizer,
                saved_scope=_selective_cache if activation_checkpointing is not None else None,
            )  # fmt: skip
    finally:
        if activation_checkpointing is not None:
            activation_checkpointing.unwrap()
    context = {
        # The module's own count: a weight tied across stages has a copy on each, and counts once here.
        "model": type(module).__name__, "parameters": sum(p.numel() for p in module.parameters()),
        "micro_batch": [list(t.shape) for t in _tensors(batch)], "precision": precision,
        "pipeline_stages": strategy.pipeline_stages, "balance": strategy.balance, "sizes": list(sizes),
        "accelerator": accelerator,
        "activation_checkpointing": None if activation_checkpointing is None else {
            "mode": activation_checkpointing.mode, "modules": len(wrapped)},
    }  # fmt: skip
    return measures, context


def optimizer_factory(module: Any, foreach: bool) -> MakeOptimizer:
    """The module's own optimizer (``configure_optimizers``) restricted to one stage's parameters: its class,
    groups and hyper-parameters, each group keeping the stage's members (what the strategy builds on a split
    module). ``foreach``: run the step with torch's foreach kernels, as it does by default on CUDA."""
    template = _optimizer_of(module.configure_optimizers())

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer | None:
        if template is None:
            return None
        mine = {id(p) for p in params}
        groups = []
        for group in template.param_groups:
            members = [p for p in group["params"] if id(p) in mine]
            if members:
                settings = {k: v for k, v in group.items() if k != "params"}
                if foreach and settings.get("foreach") is None and not settings.get("fused"):
                    settings["foreach"] = True
                groups.append({**settings, "params": members})
        return type(template)(groups) if groups else None

    return make


def unified_precision(precision: Any) -> str:
    """``precision`` as the Trainer reads it, Lightning's aliases resolved (``"bf16"`` is ``"bf16-mixed"``, ``"32"``
    and ``32`` are ``"32-true"``), refused unless PACIStrategy trains in it."""
    try:
        name = _convert_precision_to_unified_args(precision)
    except ValueError as error:
        raise PlanError(str(error)) from error
    if name not in _PRECISIONS:
        raise PlanError(unsupported_precision(name))
    return name


def device_bytes(device_memory: int | str) -> int:
    """The bytes of ``device_memory`` (``"80GiB"``, ``"80GB"``, a number), refused unless it reads as a size > 0."""
    try:
        size = parse_bytes(device_memory)
    except ValueError as error:
        raise PlanError(str(error)) from error
    if size <= 0:
        raise PlanError(f"{device_memory!r} is no device memory: it must be more than 0 bytes, e.g. 80GiB or 24GB")
    if size < 2**20 and str(device_memory).strip().isdigit():  # "80" meant as 80GiB read as 80 bytes: every row "no"
        raise PlanError(
            f"{device_memory!r} reads as {size} bytes, no device's memory: give the unit, e.g. {device_memory}GiB"
        )
    return size


def plan_config(argv: Sequence[str], **overrides: Any) -> MemoryPlan:
    """The plan of the config ``fit`` would run with these arguments (``--config ...`` and any overrides).

    Args:
        argv: LightningCLI arguments, without the subcommand.
        **overrides: `plan` arguments that win over the config's (``replicas``, ``shard_optimizer_state``,
            ``device_memory``).
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    arguments = load_config(argv, replicas_given="replicas" in given)
    arguments.update(given)
    return plan(**arguments)


def load_config(argv: Sequence[str], replicas_given: bool = False) -> dict[str, Any]:
    """`plan`'s arguments for the config ``fit`` would run with ``argv``: the model built on the meta device
    (nothing allocated), a meta micro-batch of the data's shape, the strategy, N, the precision, the
    ActivationCheckpointing callback, the replicas (world size / S) and the accelerator.

    Everything named is built by its own constructor, with its own checks; what ``fit`` would refuse (a layout
    whose world size S does not divide, N < 1, a precision PACIStrategy does not train in) is a `PlanError`,
    before any measuring."""
    from lit_efficient.cli.app import LitEfficientCLI  # here: LightningCLI loads only when a config is read

    class _Resolve(LitEfficientCLI):
        def before_instantiate_classes(self) -> None:
            pass

        def instantiate_classes(self) -> None:
            pass

    with warnings.catch_warnings():  # LightningCLI warns when sys.argv holds more: it holds `plan`'s own flags
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        config = _Resolve(args=list(argv), run=False).config
    trainer = config.trainer
    strategy = _strategy(trainer.strategy)
    replicas = 1 if replicas_given else _replicas(trainer, strategy)  # --replicas plans another world than the config's
    precision = unified_precision(trainer.precision or "32-true")
    data = _init_args(config.data)
    batch_size, block_size = int(data.get("batch_size", 16)), int(data.get("block_size", 256))
    for key, value in (("batch_size", batch_size), ("block_size", block_size)):
        if value < 1:  # as the data module's constructor refuses it (not built here: it may read its data)
            raise PlanError(f"--data.init_args.{key}={value}: {key} must be an integer >= 1")
    vocab = data.get("vocab_size") or _data_vocab(config.data.class_path, data)
    callbacks = {f"trainer.callbacks[{i}]": c for i, c in enumerate(trainer.callbacks or []) if not isinstance(c, str)}
    accumulate, schedule = _accumulate(trainer, callbacks)
    checkpointing = next(
        (_build(c, key) for key, c in callbacks.items() if _class_name(c) == "ActivationCheckpointing"), None
    )
    init = {**_init_args(config.model), "vocab_size": vocab, "block_size": block_size}
    with torch.device("meta"):  # the weights are never materialized: an 8B model costs nothing here
        module = _build(config.model, "model", init)
    # What a TextDataModule batch is: (inputs, next tokens), int64 (B, T). Meta tensors: no memory.
    batch = tuple(torch.zeros(batch_size, block_size, dtype=torch.long, device="meta") for _ in range(2))
    return {
        "module": module, "batch": batch, "strategy": strategy, "accumulate": accumulate, "precision": precision,
        "activation_checkpointing": checkpointing, "replicas": replicas,
        "accelerator": str(trainer.accelerator or "cpu"),
        "max_steps": trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else 1000,
        "accumulate_schedule": schedule,
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """``lit-efficient plan``: print the plan (a table, or JSON with ``--json``); 0 unless it failed to plan."""
    parser = argparse.ArgumentParser(
        prog="lit-efficient plan",
        allow_abbrev=False,  # --replica is not --replicas: an abbreviation would be taken silently (as in app.py)
        description="Per-stage memory of a training config (weights, gradients, optimizer state, activations in "
        "flight, peak) and whether it fits a device; measured on fake tensors, nothing is allocated. Every "
        "other argument (--config, --trainer.*, --model.*, --data.*) is read as `lit-efficient fit` reads it.",
    )
    parser.add_argument(
        "--device-memory", type=_device_memory_argument,
        help="memory of one device, e.g. 80GiB, 80GB (10^9 bytes), 24GiB",
    )  # fmt: skip
    # Spelt as fit's flags are (--trainer.max_steps): taken too, not sent on to fit's parser as an unknown flag.
    parser.add_argument("--device_memory", dest="device_memory", type=_device_memory_argument, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (for scripts)")
    parser.add_argument(
        "--replicas", type=_replicas_argument, help="data-parallel replicas per stage (default: world size / S)"
    )
    parser.add_argument(
        "--shard-optimizer-state", action=argparse.BooleanOptionalAction, default=None,
        help="optimizer state split over each stage's replicas (ZeRO-1); default: the strategy's setting",
    )  # fmt: skip
    own, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    for arg in rest:  # fit's parser would answer a misspelt plan option with fit's usage and no suggestion
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and "." not in flag:
            close = difflib.get_close_matches(flag, [a for o in parser._actions for a in o.option_strings], 1, 0.8)
            if close:
                parser.error(f"unrecognized argument {flag}; did you mean {close[0]}?")
    try:
        result = plan_config(
            rest, device_memory=own.device_memory, shard_optimizer_state=own.shard_optimizer_state,
            replicas=own.replicas,
        )  # fmt: skip
    except PlanError as error:  # a value fit would refuse too: a usage error, not a traceback
        parser.error(str(error))
    if own.json:
        window = window_advice(result).to_dict()
        print(json.dumps({**result.to_dict(), "window": window}, indent=2))
    else:
        print(describe(result))
    return 0


def describe(result: MemoryPlan) -> str:
    """The plan as a user reads it: what was planned, the table, the verdict."""
    c = result.context
    ac_text = "" if not c.get("activation_checkpointing") else (
        f", ActivationCheckpointing({c['activation_checkpointing']['mode']}) on "
        f"{c['activation_checkpointing']['modules']} modules")  # fmt: skip
    schedule = c.get("accumulate_schedule")
    of_schedule = f" (the largest of GradientAccumulation's schedule {schedule})" if schedule else ""
    head = (
        f"{c.get('model')} ({c.get('parameters', 0) / 1e6:,.1f}M parameters), micro-batch {c.get('micro_batch')}, "
        f"{c.get('precision')}; {result.schedule}, S={len(result.stages)} as {c.get('sizes')} "
        f"(balance={c.get('balance')!r}), N={result.accumulate}{of_schedule}, recompute={result.recompute}, "
        f"R={result.replicas} replicas{', optimizer state sharded' if result.shard_optimizer_state else ''}{ac_text}"
    )
    note = (
        "Bytes per rank of each stage. activations: what the micro-batches in flight keep; transient: the larger "
        "of one micro-batch's forward/backward temporaries and the local step's. Not counted: the CUDA context, "
        "NCCL buffers, kernel workspaces and allocator fragmentation."
    )
    return f"{head}\n\n{result.table()}\n\n{note}\n\n{window_text(result)}"


def window_text(result: MemoryPlan) -> str:
    """The accumulation-window advice for the plan's layout (`lit_efficient.tools.window`), with each candidate
    cut of the same global batch: its micro-batch, drift bound, flush's bubble and estimated peak."""
    advice = window_advice(result)
    if result.schedule != "paci":
        bubble = flush_bubble(len(result.stages), result.accumulate)
        return (
            f"Accumulation window: 1F1B-flush has no drift; its bubble is {bubble:.0%} of each window at N="
            f"{result.accumulate}. PACI has none; under it N={advice.recommended} would have drift bound 1."
        )
    rows = ["N | micro-batch | drift bound | flush bubble | peak (estimate) | fits", "---|---|---|---|---|---"]
    for c in advice.choices:
        peak = "-" if c.peak is None else format_bytes(c.peak)
        fits = "-" if c.fits is None else ("yes" if c.fits else "no")
        mark = " (configured)" if c.accumulate == result.accumulate else ""
        rows.append(
            f"{c.accumulate}{mark} | {c.micro_batch} | {c.drift_bound} | {c.flush_bubble:.0%} | {peak} | {fits}"
        )
    note = (
        "Each cut is planned at its own N from its stages measured at micro-batch 1, the configured one and the "
        "whole global batch: exact there, at most a little above in between (plan again with that --data.batch_size "
        "to measure one)."
    )
    return "\n".join([advice.text(), "", *rows, "", note])


def window_advice(result: MemoryPlan) -> WindowAdvice:
    """`advise_window` for a plan: the cuts of the global batch of its micro-batch and N, with the peaks `plan`
    planned for them."""
    shapes = result.context.get("micro_batch") or []
    measured = shapes[0][0] if shapes and shapes[0] else None
    peaks = result.peaks_by_micro_batch
    return advise_window(
        len(result.stages), result.accumulate, measured, peaks.get if peaks else None, result.device_memory,
        result.replicas,
    )  # fmt: skip


# -- internals -------------------------------------------------------------------------------------


def _stage_sizes(
    strategy: PACIStrategy, module: Any, layers: list, batch: Any, forward_context: Any, device_memory: Any
) -> list[int]:
    """The split ``strategy`` would choose. ``balance="profile"`` times layers on the GPU at launch; here each
    layer's forward FLOPs stand in for its time, with the same memory terms and budget (partition.py)."""
    if strategy.balance != "profile":
        try:
            return strategy._stage_sizes(module, layers, None)  # the strategy's own choice, from parameter counts
        except ValueError as error:  # its refusal of the split: more stages than layers, a balance that does not add
            raise PlanError(str(error)) from error
    flops, acts, params = [], [], []
    x = tuple(_as_tuple(module.pipeline_input(batch)))
    with torch.no_grad():
        for layer in layers:
            with FlopCounterMode(display=False) as counter, forward_context():
                out = _as_tuple(layer(*x))
            flops.append(float(counter.get_total_flops()))
            acts.append(sum(t.numel() * t.element_size() for t in _tensors(out)))
            params.append(4 * sum(p.numel() * p.element_size() for p in layer.parameters()))
            x = out
    budget = None if device_memory is None else parse_bytes(device_memory)
    try:
        return partition_profiled(flops, acts, params, strategy.pipeline_stages, memory_budget=budget)
    except ValueError as error:  # more stages than layers
        raise PlanError(str(error)) from error


@contextmanager
def _stand_in_trainer(module: Any, max_steps: int, accumulate: int) -> Iterator[None]:
    """``configure_optimizers`` may read the trainer (``estimated_stepping_batches`` for a schedule's length);
    while it runs here a stand-in answers. Only the optimizer it returns is used."""
    had = getattr(module, "_trainer", None)
    stand_in = SimpleNamespace(estimated_stepping_batches=max_steps, max_steps=max_steps, max_epochs=None,
                               accumulate_grad_batches=accumulate, num_devices=1, world_size=1)  # fmt: skip
    module._trainer = stand_in
    try:
        yield
    finally:
        module._trainer = had


@contextmanager
def _transformers_take_real_paths() -> Iterator[None]:
    """transformers treats a fake tensor as a traced one (``is_tracing``) and then takes the paths it takes under
    ``torch.export``: a materialized causal mask where on real tensors SDPA runs with ``is_causal`` and no mask.
    While planning it is told the tensors are real, so the bytes are those of training."""
    utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(utils, "is_fake_tensor", None)
    if original is None:
        yield
        return
    utils.is_fake_tensor = lambda x: False
    try:
        yield
    finally:
        utils.is_fake_tensor = original


@contextmanager
def _selective_cache(saved: SavedBytes) -> Iterator[None]:
    # Selective checkpointing keeps matmul outputs outside autograd's hooks and reports them to the active
    # SavedActivationMeter (activation_checkpointing.py); the plan's counter stands in for it.
    token = ac._ACTIVE_METER.set(saved)  # type: ignore[arg-type]
    try:
        yield
    finally:
        ac._ACTIVE_METER.reset(token)


def _optimizer_of(config: Any) -> torch.optim.Optimizer | None:
    """The (first) optimizer of what ``configure_optimizers`` may return (Lightning's accepted forms)."""
    if isinstance(config, torch.optim.Optimizer) or config is None:
        return config
    if isinstance(config, dict):
        return _optimizer_of(config.get("optimizer"))
    if isinstance(config, (list, tuple)) and config:
        return _optimizer_of(config[0])
    raise TypeError(f"configure_optimizers returned {type(config).__name__}; the plan needs an optimizer")


def _strategy(value: Any) -> PACIStrategy:
    if isinstance(value, str):
        if value.lower() in ("paci", "1f1b_flush"):
            return PACIStrategy(schedule=value.lower())
        if value.lower() in CLASS_NAMES:  # the class's registered names: its defaults
            return PACIStrategy()
        raise PlanError(f"trainer.strategy={value!r}: the plan covers PACIStrategy (strategy 'paci' or '1f1b_flush')")
    if _class_name(value) != "PACIStrategy":
        raise PlanError(f"trainer.strategy is {value.class_path}: the plan covers lit_efficient.PACIStrategy")
    return _build(value, "trainer.strategy")


def _replicas(trainer: Any, strategy: PACIStrategy) -> int:
    """World size / S, refused as the strategy refuses it when S does not divide the world size (one process runs
    every stage of a world of one)."""
    world = _world(trainer)
    if world == 1:
        return 1
    try:
        return Topology.for_world(world, strategy.pipeline_stages).num_replicas
    except ValueError as error:
        raise PlanError(
            f"{error} (trainer.devices={trainer.devices} x trainer.num_nodes={trainer.num_nodes or 1}; fit refuses "
            "it too)"
        ) from error


def _accumulate(trainer: Any, callbacks: dict[str, Any]) -> tuple[int, dict[int, int] | None]:
    """N, and the ``{epoch: N}`` schedule it is the largest N of (None without one), as fit would set it: from
    GradientAccumulation (built, so its own checks apply) when it sets steps, else the Trainer's."""
    n = trainer.accumulate_grad_batches
    try:  # as fit refuses it
        check_accumulate(n, "trainer.accumulate_grad_batches={!r}:")
    except ValueError as error:
        raise PlanError(str(error)) from error
    for key, c in callbacks.items():
        if _class_name(c) != "GradientAccumulation":
            continue
        callback = _build(c, key)
        if callback.steps is None:
            continue  # it only normalizes: N is the Trainer's
        try:  # Trainer(accumulate_grad_batches) set to another N: refused before launch
            callback.check_accumulation_source(SimpleNamespace(accumulate_grad_batches=n, callbacks=[callback]))
        except ValueError as error:
            raise PlanError(str(error)) from error
        steps = callback.steps
        schedule = dict(steps) if isinstance(steps, Mapping) and len(set(steps.values())) > 1 else None
        return callback.max_accumulate_grad_batches, schedule
    return n, None


def _world(trainer: Any) -> int:
    """Devices x nodes as the Trainer counts them: ``devices`` a count, a list of indices or, from the command line,
    either written as a string (``"3"``, ``"0,1"``); ``"auto"`` or -1 (every device there) counts as 1."""
    devices = trainer.devices
    if isinstance(devices, str):
        parts = [p for p in devices.split(",") if p.strip()]
        devices = int(devices) if devices.strip().lstrip("-").isdigit() else parts if "," in devices else 1
    count = len(devices) if isinstance(devices, (list, tuple)) else devices if isinstance(devices, int) else 1
    return max(1, count) * max(1, int(trainer.num_nodes or 1))


def _data_vocab(class_path: str, data: dict) -> int:
    from lit_efficient.data.tokenized import TokenizedDataModule, load_tokenizer

    if issubclass(_import(class_path), TokenizedDataModule):
        return len(load_tokenizer(data["tokenizer"]))  # the tokenizer only: the text is not read
    path = data.get("path")
    if path is not None and str(path).endswith(".bin"):
        raise PlanError(
            f"data.init_args.path={path!r} is a token file and data.init_args.vocab_size is not set: the plan does "
            "not read the data; set vocab_size (e.g. 50304 for GPT-2 tokens)"
        )
    return 256  # byte-level text


def _build(namespace: Any, key: str, init_args: dict[str, Any] | None = None) -> Any:
    """The class ``namespace`` names, built with its init_args (or ``init_args``); what its constructor refuses is a
    `PlanError` naming ``key``, the config's section, as ``fit`` names it."""
    cls = _import(namespace.class_path)
    try:
        return cls(**(_init_args(namespace) if init_args is None else init_args))
    except (ValueError, TypeError) as error:
        raise PlanError(f"{key} ({namespace.class_path}): {error}") from error


def _device_memory_argument(text: str) -> str:
    try:
        device_bytes(text)
    except PlanError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def _replicas_argument(text: str) -> int:
    try:
        replicas = int(text)
    except ValueError:
        replicas = 0
    if replicas < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of replicas: an integer >= 1, the data-parallel replicas of each stage "
            "(default: world size / pipeline_stages)"
        )
    return replicas


def _import(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _init_args(namespace: Any) -> dict[str, Any]:
    init = getattr(namespace, "init_args", None)
    if init is None:
        return {}
    return dict(init.as_dict() if hasattr(init, "as_dict") else init)


def _class_name(namespace: Any) -> str:
    return str(getattr(namespace, "class_path", "")).rpartition(".")[2]


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _micro_batch_size(batch: Any) -> int | None:
    """The micro-batch size: the first tensor's first dimension (None for a batch without one)."""
    tensors = _tensors(batch)
    return tensors[0].shape[0] if tensors and tensors[0].dim() else None


def _resized(batch: Any, size: int, new_size: int) -> Any:
    """``batch`` with ``new_size`` samples: every tensor whose first dimension is the micro-batch ``size``, as a
    meta tensor (the measurement reads shapes and dtypes only)."""

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[0] == size:
            return torch.empty((new_size, *t.shape[1:]), dtype=t.dtype, device="meta")
        return t

    return map_tensors(batch, resize)


def _tensors(values: Any) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, dict):
        values = list(values.values())
    return [t for t in values if isinstance(t, torch.Tensor)] if isinstance(values, (list, tuple)) else []


__all__ = [
    "PlanError", "describe", "device_bytes", "load_config", "main", "measure", "optimizer_factory", "plan",
    "plan_config", "unified_precision",
]  # fmt: skip
