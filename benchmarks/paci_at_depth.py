"""PACI at the paper's depth (S=4, 8) on one CPU, through the in-process pipeline: convergence, corrections,
simulated time-to-accuracy, and what the in-process pipeline itself costs.

What is measured, and how:

- Convergence grid: ``Trainer(devices=1, strategy=PACIStrategy(pipeline_stages=S))`` (the whole
  pipeline in one process, bit-identical to S processes: tests/strategy/test_one_process.py) trains the same
  `GPT` (same seed, init and data order: `TextDataModule()`'s embedded standard-library text) with
  1F1B-flush, plain PACI (``staleness_correction=None, sync_start_steps=0``), ``paci_default`` (PACIStrategy's
  defaults: the in-place first-step weight prediction and the synchronous start) and the candidate corrections
  (``RUNS``), for every S, N, learning
  rate and seed asked. The paper's recipe scaled down: AdamW betas (0.9, 0.95), weight decay 0.1,
  1% linear warmup, cosine to 10% of the peak, per-stage schedulers stepping with their stage.
  Equal tokens: every run sees ``--micro-batches`` micro-batches, so ``steps = micro_batches / N``.
  Validation loss on the same ``--val-batches`` batches at ~10 points. Final validation loss, gap
  against flush, measured drift per stage.
- Time to accuracy at S=8 (simulated time from measured costs): every pipeline layer's forward and
  backward time on this CPU at the benchmark's size (median of repeats), summed per stage, fed to
  `lit_efficient.tools.simulate` for the time per optimizer step of each schedule (steady state);
  times the optimizer steps each run needs to reach four targets: three of flush's curve (its final loss and
  the 80% / 95% points of its descent) and the paper's own, the lowest loss both runs reach ("both": the
  arrows of its time-to-accuracy figure), interpolated between evaluations. Ratio flush / PACI, next to
  the paper's 1.69x (N=8) and 1.41x (N=16). Simulated, not measured: one CPU cannot time 8 devices.
- In-process cost: optimizer steps per second of ``devices=1, pipeline_stages=S`` against the unsplit
  model under Lightning's single-device strategy, same model, data and N, in one run, one after the other;
  and of the same pipeline with the default's weight prediction (no synchronous start) against plain PACI (its
  time cost).
- Weight prediction's cost: its extra buffer (the bytes of the largest stage's parameters); its time,
  side by side in the in-process cost step above.

    python -m benchmarks.paci_at_depth            # the grid in BENCHMARKS.md ("PACI at depth")
    python -m benchmarks.paci_at_depth --quick    # smoke run: S=4, a few steps (tests/benchmarks/)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import PLOTS, envelope, machine, pyplot, save_figure, write_json

_PLAIN = {"staleness_correction": None, "sync_start_steps": 0}  # the runs measured before the default existed
RUNS: dict[str, dict[str, Any]] = {  # name -> PACIStrategy's options (beyond S; balance="uniform")
    "flush": {"schedule": "1f1b_flush", **_PLAIN},
    "paci": {"schedule": "paci", **_PLAIN},
    **{
        f"paci+{c}": {"schedule": "paci", **_PLAIN, "staleness_correction": c}
        for c in (
            "lr_scale",
            "weight_prediction",
            "weight_prediction_damped",
            "weight_prediction_shrunk",
            "weight_prediction_momentum",
            "weight_prediction_first_step",
            "weight_prediction_first_step_shrunk",
            "weight_prediction_first_step_inplace",
            "delay_compensation",
        )
    },  # fmt: skip
    "paci+sync_start": {"schedule": "paci", **_PLAIN, "sync_start_steps": "auto"},
    "paci_default": {"schedule": "paci"},  # PACIStrategy(schedule="paci") as a user writes it
    "paci_default_sync20": {"schedule": "paci", "sync_start_steps": 20},  # a synchronous start half as long
    "paci_default_sync40": {"schedule": "paci", "sync_start_steps": 40},  # "auto"'s 40 at any beta2
    # The defaults as on CUDA ("auto" there: the prediction in compiled passes; on CPU it is asked for by name).
    "paci_default_compiled": {"schedule": "paci", "staleness_correction": "weight_prediction_first_step_compiled"},
    # The defaults with the pending step's gradient estimated as the window's accumulated share plus the momentum for
    # the share still to come (issue 31's low-rate late gap: a young window's mean is noise along the curvature).
    "paci_default_shrunk": {"schedule": "paci", "staleness_correction": "weight_prediction_first_step_shrunk"},
    # Only the mean's square shrunk (towards v_hat): the young window's coherent undershoot without the lag of m_hat.
    "paci_default_square_shrunk": {
        "schedule": "paci",
        "staleness_correction": "weight_prediction_first_step_square_shrunk",
    },
    "paci_recompute": {"schedule": "paci", **_PLAIN},
    "paci_recompute+weight_prediction": {"schedule": "paci", **_PLAIN, "staleness_correction": "weight_prediction"},
}
RECOMPUTE = {"paci_recompute", "paci_recompute+weight_prediction"}  # runs with recompute=True
PAPER = {8: 1.69, 16: 1.41}  # PACI / flush time-to-accuracy, GPT-2 Medium, 8 stages (docs/DESIGN.md section 3)


def _model(config: dict[str, Any], lr: float, steps: int):
    from lit_efficient.models import GPT

    return GPT(
        vocab_size=config.get("vocab", 256), n_layer=config["layers"], n_head=config["heads"], n_embd=config["dim"],
        block_size=config["block"],
        dropout=0.0, learning_rate=lr, weight_decay=0.1, betas=(0.9, config.get("beta2", 0.95)),
        warmup_steps=max(1, round(config["warmup"] * steps)), max_steps=steps, min_lr_ratio=0.1,
    )  # fmt: skip


def _datamodule(config: dict[str, Any], seed: int):
    from lit_efficient.data import TextDataModule

    return TextDataModule(
        block_size=config["block"], batch_size=config["batch_size"], max_bytes=config["max_bytes"], seed=seed
    )


def fit_one(config: dict[str, Any], stages: int, accumulate: int, lr: float, seed: int, name: str) -> dict[str, Any]:
    """One training run of the grid; returns its validation curve, drift per stage and wall time."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lit_efficient import PACIStrategy
    from lit_efficient.runtime import staleness

    torch.set_num_threads(1)
    options = RUNS[name]
    steps = config["micro_batches"] // accumulate
    eval_every = max(1, steps // config["evals"])

    class Record(Callback):
        def __init__(self) -> None:
            self.val: list[tuple[int, float]] = []
            self.stats: list[dict[str, float]] = []
            self.sync_start = 0
            self.forms: list[str] = []

        def on_validation_end(self, trainer, pl_module) -> None:
            if "val_loss" in trainer.callback_metrics:
                self.val.append((trainer.global_step, trainer.callback_metrics["val_loss"].item()))

        def on_train_start(self, trainer, pl_module) -> None:
            self.sync_start = trainer.strategy.sync_start

        def on_train_end(self, trainer, pl_module) -> None:
            self.stats = trainer.strategy.runtime.stage_stats()
            # Which form of the correction each stage ran ("auto" picks by device; a failed compilation falls back)
            self.forms = [type(stage.correction).__name__ for stage in trainer.strategy.runtime.stages]

    L.seed_everything(seed, verbose=False)
    model = _model(config, lr, steps)
    record = Record()
    strategy = PACIStrategy(
        pipeline_stages=stages, balance="uniform", staleness_anneal_steps=max(1, steps // 10),
        recompute=name in RECOMPUTE, **options,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator=config.get("accelerator", "cpu"), devices=1, strategy=strategy, max_steps=steps,
        accumulate_grad_batches=accumulate, callbacks=[record], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=config["val_batches"],
        num_sanity_val_steps=config["val_batches"], val_check_interval=eval_every * accumulate,
        check_val_every_n_epoch=None,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(model, datamodule=_datamodule(config, seed))
    seconds = time.perf_counter() - start
    if not record.val or record.val[-1][0] != steps:  # make sure the curve ends at the last step
        record.val.append(
            (steps, trainer.validate(model, datamodule=_datamodule(config, seed), verbose=False)[0]["val_loss"])
        )
    curve, wide = list(record.val), {}
    if config.get("final_val_batches"):  # the final model on a larger share of the validation split (not a point
        # of the curve: that stays on the same --val-batches batches throughout)
        trainer.limit_val_batches = config["final_val_batches"] if config["final_val_batches"] > 0 else 1.0
        loss = trainer.validate(model, datamodule=_datamodule(config, seed), verbose=False)[0]["val_loss"]
        wide = {"final_val_loss_wide": loss, "final_val_batches": config["final_val_batches"]}
    return {
        "S": stages, "N": accumulate, "lr": lr, "seed": seed, "run": name, "steps": steps,
        "tokens_per_step": accumulate * config["batch_size"] * config["block"], "val": curve,
        "final_val_loss": curve[-1][1], "seconds": seconds, "sync_start_steps": record.sync_start,
        "drift": [{k: st[k] for k in ("stage", "drift_max", "drift_mean")} for st in record.stats],
        "loadavg": os.getloadavg(), "correction_forms": record.forms,
        "compiler_works": staleness._COMPILER_WORKS["ok"], "device": _device_name(trainer), **wide,
    }  # fmt: skip


def _device_name(trainer) -> str:
    device = trainer.strategy.root_device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _worker(job: tuple[dict[str, Any], int, int, float, int, str]) -> dict[str, Any]:
    return fit_one(*job)


def layer_costs(config: dict[str, Any], repeats: int = 5) -> dict[str, list[float]]:
    """Forward and backward seconds of every pipeline layer on one micro-batch of the benchmark's size, and
    ``predict``: one apply + undo of PACI's default prediction on the layer's weights, eager (the default on CPU),
    ``predict_compiled``: the same in compiled passes (the default on CUDA) (`prediction_timer`); on CUDA also
    ``predict_gpu`` and ``predict_compiled_gpu``: their kernels' time alone, the host ahead of the GPU (what a stage
    pays when its host keeps ahead, as one process per GPU does; the first two count the host's time). Medians of
    ``repeats`` rounds (after one untimed round, which compiles), each round timing every layer in turn: this VM's
    speed drifts by 1.5x between minutes, and rounds make the drift move every layer alike, so the stage balance
    the simulator reads stays true. ``config["cost_device"]`` "cuda": on the GPU, the forward under bf16 autocast
    (the weights and the optimizer state fp32, as under ``precision="bf16-mixed"``), every time taken between
    synchronizations."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(config.get("cost_device", "cpu"))
    model = _model(config, 1e-3, 100).to(device)
    layers = list(model.pipeline_layers())
    ids = torch.randint(0, config.get("vocab", 256), (config["batch_size"], config["block"]), device=device)
    inputs: list[tuple] = [(ids,)]
    with torch.no_grad(), _autocast(device):
        for layer in layers[:-1]:
            inputs.append((layer(*inputs[-1]),))
    timers = [prediction_timer(list(layer.parameters()), config) for layer in layers]
    keys = ("forward", "backward", "predict", "predict_compiled")
    if device.type == "cuda":  # also the prediction's kernel time alone, the host ahead of the GPU
        keys += ("predict_gpu", "predict_compiled_gpu")
    times: dict[str, list[list[float]]] = {k: [[] for _ in layers] for k in keys}
    for _ in range(repeats + 1):
        for i, layer in enumerate(layers):
            leaf = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs[i])
            _synchronize(device)
            t0 = time.perf_counter()
            with _autocast(device):
                out = layer(*leaf)
            _synchronize(device)
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            _synchronize(device)
            t2 = time.perf_counter()
            times["forward"][i].append(t1 - t0)
            times["backward"][i].append(t2 - t1)
            times["predict"][i].append(timers[i](False))
            times["predict_compiled"][i].append(timers[i](True))
            if device.type == "cuda":
                times["predict_gpu"][i].append(timers[i](False, kernels_only=True))
                times["predict_compiled_gpu"][i].append(timers[i](True, kernels_only=True))
    return {k: [statistics.median(t[1:]) for t in per_layer] for k, per_layer in times.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device) -> Any:
    """bf16 autocast on a GPU (the paper's precision), nothing on CPU (the grid's fp32)."""
    return torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")


def stale_optimizer(params: list[torch.nn.Parameter], config: dict[str, Any]) -> torch.optim.AdamW:
    """AdamW over ``params`` as at a stale forward: moments exist (one step taken, as after the first window) and
    each parameter holds a gradient, which stands for the window's so far."""
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, config.get("beta2", 0.95)), weight_decay=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    return optimizer


def prediction_contexts(params: list[torch.nn.Parameter], config: dict[str, Any]) -> Any:
    """``context(form)``: one stale forward's prediction on ``params`` as a context manager (applied on entry, undone
    on exit), with AdamW state and a window's gradient as at a stale forward; ``form`` "eager" (PACI's default on
    CPU, `InPlaceFirstStepWeightPrediction`), "compiled" (on CUDA, `CompiledFirstStepWeightPrediction`, compiled at
    its first use) or None (no prediction). One per set of parameters: the timers below and
    `exp31_table.stage_costs` share it."""
    from contextlib import nullcontext

    from lit_efficient.runtime.staleness import CompiledFirstStepWeightPrediction, InPlaceFirstStepWeightPrediction

    optimizer = stale_optimizer(params, config)
    # A young window (3 of N micro-batches backpropagated, N = 8: the cost is the same for any N > 3), where the
    # default shrinks the folded square by the window's share (every stale forward whose window has a gradient
    # yet): built with N, as "auto" builds it.
    forms = {"eager": InPlaceFirstStepWeightPrediction(8), "compiled": CompiledFirstStepWeightPrediction(8)}
    weight = torch.tensor(3.0, device=params[0].device)  # a stage's window weight lives on its device

    def context(form: str | None) -> Any:
        if form is None:
            return nullcontext()
        return forms[form].forward_context(params, optimizer, 1, window_weight=weight, window_microbatches=3)

    return context


def prediction_timer(params: list[torch.nn.Parameter], config: dict[str, Any]) -> Any:
    """A timer of one stale forward's prediction around an empty forward (apply, then undo) on ``params``
    (`prediction_contexts`): ``timer(compiled, kernels_only=False)`` returns the seconds of one, eager or compiled,
    on the parameters' device (a GPU's between synchronizations, or with ``kernels_only`` its kernels' time alone,
    `device_seconds`)."""
    if not params:
        return lambda compiled, kernels_only=False: 0.0
    context, device = prediction_contexts(params, config), params[0].device

    def predict(compiled: bool) -> None:
        with context("compiled" if compiled else "eager"):
            pass

    def timer(compiled: bool, kernels_only: bool = False) -> float:
        if kernels_only:
            return device_seconds(lambda: predict(compiled))
        _synchronize(device)
        t0 = time.perf_counter()
        predict(compiled)
        _synchronize(device)
        return time.perf_counter() - t0

    return timer


HOLD_CYCLES = 200_000_000  # ~0.1 s of a GPU at 1.98 GHz: far longer than the host takes to enqueue one prediction


def device_seconds(fn: Any) -> float:
    """The GPU time of the kernels ``fn`` enqueues, without the host's: the GPU is held busy (``torch.cuda._sleep``)
    while the host enqueues them, so the events around them time their execution alone. Raises if the host took
    nearly as long as the hold (the span would then count host time)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(HOLD_CYCLES)
    start.record()  # resolves when the GPU leaves the hold, the kernels below already queued
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    if host > 0.8 * HOLD_CYCLES / 2e9:
        raise RuntimeError(f"the host took {host * 1e3:.1f} ms to enqueue, near the GPU's hold: raise HOLD_CYCLES")
    return start.elapsed_time(end) / 1e3


def stale_forward_share(stages: int, accumulate: int) -> list[float]:
    """Per stage, the steady-state share of PACI's forwards that a step of the stage separates from their backward
    (the forwards a weight prediction runs on: (S-1-s)/N once N >= S-1), counted on the schedule's action streams:
    32 windows against 16, so the fill and the drain cancel."""
    from lit_efficient.tools.simulate import stage_actions

    def stale(stage: int, windows: int) -> int:
        steps, seen, count = 0, {}, 0
        for action in stage_actions("paci", stage, stages, accumulate, 0, windows * accumulate, True):
            if action.kind == "F":
                seen[action.index] = steps
            elif action.kind == "B":
                count += steps > seen[action.index]
            elif action.kind == "STEP":
                steps += 1
        return count

    return [(stale(s, 32) - stale(s, 16)) / (16 * accumulate) for s in range(stages)]


def prediction_cost(name: str) -> str | None:
    """The per-layer cost (`layer_costs` key) of the weight prediction run ``name`` makes at its stale forwards with
    the grid's AdamW on CPU: its correction as the strategy resolves it (`make_correction`, "auto" included) on stage 0
    of S=8 N=8; None if it predicts nothing."""
    from lit_efficient.runtime.staleness import CompiledFirstStepWeightPrediction, WeightPrediction, make_correction

    options = RUNS.get(name, {})
    if options.get("schedule") != "paci":
        return None
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    correction = make_correction(options.get("staleness_correction", "auto"), "paci", 0, 8, 8, 1, adamw)
    if isinstance(correction, CompiledFirstStepWeightPrediction):
        return "predict_compiled"
    return "predict" if isinstance(correction, WeightPrediction) else None


def simulated_step_seconds(
    costs: dict[str, list[float]],
    stages: int,
    accumulate: int,
    prediction: str | None = None,
    split: list[int] | None = None,
) -> dict[str, float]:
    """Steady-state seconds per optimizer step of each schedule, from per-layer costs (``split``: layers per stage;
    by default the uniform split). ``prediction`` (a cost key, `prediction_cost`): PACI's stale forwards also pay
    that measured apply + undo of the weight prediction, spread over each stage's forwards by
    `stale_forward_share`; flush has no stale forward."""
    from lit_efficient.runtime.partition import partition_uniform, stage_bounds
    from lit_efficient.tools.simulate import simulate

    bounds = stage_bounds(split or partition_uniform(len(costs["forward"]), stages))
    fwd = [sum(costs["forward"][lo:hi]) for lo, hi in bounds]
    bwd = [sum(costs["backward"][lo:hi]) for lo, hi in bounds]
    out = {}
    for schedule in ("1f1b_flush", "paci"):
        forward = fwd
        if schedule == "paci" and prediction:
            if prediction not in costs:
                raise ValueError(f"these layer costs have no {prediction!r} times: measure them again (layer_costs)")
            shares = stale_forward_share(stages, accumulate)
            extra = [share * sum(costs[prediction][lo:hi]) for share, (lo, hi) in zip(shares, bounds, strict=True)]
            forward = [f + e for f, e in zip(fwd, extra, strict=True)]
        short = simulate(schedule, stages, accumulate, 8 * accumulate, forward, bwd).makespan
        long = simulate(schedule, stages, accumulate, 16 * accumulate, forward, bwd).makespan
        out[schedule] = (long - short) / 8
    return out


def steps_to(val: list[list[float]], target: float) -> float:
    """Optimizer steps at which the loss first reaches ``target`` (interpolated); NaN if never."""
    for (s0, l0), (s1, l1) in itertools.pairwise(val):
        if l1 <= target:
            return float(s1) if l0 == l1 else s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return math.nan


def lowest_both_reach(flush_val: list[list[float]], run_val: list[list[float]]) -> float:
    """The paper's target (the arrows of ItayElam/PACI's README): the lowest validation loss both curves reach."""
    return max(min(loss for _, loss in flush_val), min(loss for _, loss in run_val))


def paci_seconds(steps: float, sync: int, flush_step: float, paci_step: float) -> float:
    """Simulated seconds of ``steps`` PACI steps whose first ``sync`` run in flush's order, at flush's pace."""
    return min(steps, sync) * flush_step + max(0.0, steps - sync) * paci_step


def time_to_accuracy(runs: list[dict[str, Any]], costs: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Per (S, N, lr, seed) with S=8: simulated seconds to flush's targets, and the ratio flush / each PACI run."""
    rows = []
    groups: dict[tuple, dict[str, dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["S"], run["N"], run["lr"], run["seed"]), {})[run["run"]] = run
    for (stages, accumulate, lr, seed), by_name in sorted(groups.items()):
        if stages != 8 or "flush" not in by_name:
            continue
        plain = simulated_step_seconds(costs, stages, accumulate)
        flush = by_name["flush"]["val"]
        initial, final = flush[0][1], flush[-1][1]
        flush_targets = {"80%": initial - 0.8 * (initial - final), "95%": initial - 0.95 * (initial - final)}
        for name, run in by_name.items():
            if name == "flush":
                continue
            # "both": the paper's arrows (ItayElam/PACI's README), the lowest loss that both runs reach; it is
            # flush's final loss wherever PACI reaches that, and otherwise PACI's own lowest.
            targets = {**flush_targets, "final": final, "both": lowest_both_reach(flush, run["val"])}
            row = {"S": stages, "N": accumulate, "lr": lr, "seed": seed, "run": name, "paper": PAPER.get(accumulate)}
            sync = run.get("sync_start_steps", 0)  # its first steps run in flush's order, at flush's pace
            # A weight prediction's apply + undo at each stale forward is PACI's time too (older cost files lack it).
            key = prediction_cost(name)
            costed = key is not None and key in costs
            per_step = simulated_step_seconds(costs, stages, accumulate, key) if costed else plain
            for label, target in targets.items():
                t_flush = steps_to(flush, target) * per_step["1f1b_flush"]
                steps = steps_to(run["val"], target)
                t_paci = paci_seconds(steps, sync, per_step["1f1b_flush"], per_step["paci"])
                row[label] = {"target": target, "flush_s": t_flush, "paci_s": t_paci, "ratio": t_flush / t_paci}
            row["throughput_ratio"] = per_step["1f1b_flush"] / per_step["paci"]
            row["prediction_costed"] = costed or key is None
            rows.append(row)
    return rows


def in_process_cost(
    config: dict[str, Any], stages: int, accumulate: int, steps: int, rounds: int = 1
) -> dict[str, Any]:  # fmt: skip
    """Steps/s of the in-process S-stage pipeline against the unsplit model on one device, and of the pipeline
    with the default's weight prediction against plain PACI: ``rounds`` rounds of one run each, in one process,
    the ratios the medians of each round's (this VM's speed drifts by 1.5x between minutes: a ratio of runs far
    apart in time measures the drift). Wall time and the process's CPU time both."""
    import lightning as L

    from lit_efficient import PACIStrategy

    torch.set_num_threads(1)
    names = ("unsplit", f"in-process S={stages}", f"in-process S={stages} weight_prediction")
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        # The default's prediction without its synchronous start (whose flush steps are the schedule's, not its cost).
        plain = PACIStrategy(pipeline_stages=stages, **_PLAIN)
        strategies = ("auto", plain, PACIStrategy(pipeline_stages=stages, sync_start_steps=0))
        for name, strategy in zip(names, strategies, strict=True):
            L.seed_everything(0, verbose=False)
            model = _model(config, 1e-3, steps)
            trainer = L.Trainer(
                accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, accumulate_grad_batches=accumulate,
                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                limit_val_batches=0, num_sanity_val_steps=0,
            )  # fmt: skip
            start, start_cpu = time.perf_counter(), time.process_time()
            trainer.fit(model, datamodule=_datamodule(config, 0))
            wall[name].append(steps / (time.perf_counter() - start))
            cpu[name].append(steps / (time.process_time() - start_cpu))

    def ratio(rates: dict[str, list[float]], a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=True))

    out: dict[str, Any] = {n: statistics.median(wall[n]) for n in names}
    out["ratio"] = ratio(wall, names[1], names[0])
    out["weight_prediction_ratio"] = ratio(wall, names[2], names[1])
    out["weight_prediction_ratio_cpu"] = ratio(cpu, names[2], names[1])
    out["rounds"] = rounds
    out["weight_prediction_ratios"] = [x / y for x, y in zip(wall[names[2]], wall[names[1]], strict=True)]
    return out


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (S, N, lr, seed): every run's final validation loss and its gap against flush."""
    groups: dict[tuple, dict[str, float]] = {}
    wide: dict[tuple, dict[str, float]] = {}  # the final model on --final-val-batches, where it was validated
    for run in runs:
        key = (run["S"], run["N"], run["lr"], run["seed"])
        groups.setdefault(key, {})[run["run"]] = run["final_val_loss"]
        if "final_val_loss_wide" in run:
            wide.setdefault(key, {})[run["run"]] = run["final_val_loss_wide"]
    rows = []
    for key, finals in sorted(groups.items()):
        stages, accumulate, lr, seed = key
        row = {"S": stages, "N": accumulate, "lr": lr, "seed": seed, "final": finals, "gap": _gaps(finals)}
        if key in wide:
            row.update(final_wide=wide[key], gap_wide=_gaps(wide[key]))
        rows.append(row)
    return rows


def _gaps(finals: dict[str, float]) -> dict[str, float]:
    """Every run's loss against flush's, relative; empty without a flush run."""
    flush = finals.get("flush")
    return {k: (v - flush) / flush for k, v in finals.items() if flush and k != "flush"}


def table(rows: list[dict[str, Any]]) -> str:
    names = [n for n in RUNS if n != "flush"]

    def cells(finals: dict[str, float], gaps: dict[str, float]) -> str:
        """Flush's loss, then every other run's with its gap, "-" where it did not run."""
        shown = [
            f"{finals[n]:.4f}" + (f" ({gaps[n]:+.2%})" if n in gaps else "") if n in finals else "-" for n in names
        ]
        return f"{finals.get('flush', math.nan):.4f} | " + " | ".join(shown) + " |"

    lines = ["| S | N | lr | warmup | seed | flush | " + " | ".join(names) + " |", "|" + "---|" * (6 + len(names))]
    for r in rows:
        warmup = f"{r['warmup']:.0%}" if "warmup" in r else "-"
        lines.append(f"| {r['S']} | {r['N']} | {r['lr']:g} | {warmup} | {r['seed']} | " + cells(r["final"], r["gap"]))
    wide = [r for r in rows if "final_wide" in r]
    if wide:
        lines += ["", "The final models on the wider validation (--final-val-batches):", ""]
        lines += ["| S | N | lr | seed | flush | " + " | ".join(names) + " |", "|" + "---|" * (5 + len(names))]
        for r in wide:
            lines.append(
                f"| {r['S']} | {r['N']} | {r['lr']:g} | {r['seed']} | " + cells(r["final_wide"], r["gap_wide"])
            )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    """One panel per (S, N, lr, warmup), the lowest seed's curves."""
    plt = pyplot()
    seed = min(x["seed"] for x in runs)

    def panel(r: dict[str, Any]) -> tuple:
        return r["S"], r["N"], r["lr"], r.get("warmup", 0.01)

    panels = sorted({panel(r) for r in runs if r["seed"] == seed})
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, panels, strict=False):
        for run in runs:
            if panel(run) == key and run["seed"] == seed:
                steps, losses = zip(*run["val"][1:], strict=True)  # the first point is the untrained model
                ax.plot([s * run["tokens_per_step"] / 1e3 for s in steps], losses, marker=".", label=run["run"])
        stages, accumulate, lr, warmup = key
        ax.set_title(f"S={stages}, N={accumulate}, lr={lr:g}, warmup {warmup:.0%}", fontsize=9)
        ax.set_xlabel("training tokens (thousands)")
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path, 100)


GRID_LINE = ["--block", "32", "--micro-batches", "1200", "--layers", "6", "--dim", "64"]  # the grid's model, run


def line_options(run: str | None = None) -> argparse.ArgumentParser:
    """The options of a script that studies one line of the grid (the exp31_* diagnosis scripts): S, N, lr, seed,
    the run (one of RUNS; None: the script names its own) and the output file; add the script's own to it."""
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    if run is not None:
        p.add_argument("--run", default=run)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--line-options",
        default="",
        help="this benchmark's options that change the line, after the grid's: e.g. '--layers 14 --micro-batches "
        "19200 --evals 40 --max-bytes 6000000 --val-batches 64 --final-val-batches -1' (the 2,400-step deep line)",
    )
    return p


def grid_line_config(args: argparse.Namespace | None = None) -> dict[str, Any]:
    """The configuration `fit_one` takes for a line of the grid, changed by ``args.line_options`` if given."""
    return vars(parse_args(GRID_LINE + shlex.split(getattr(args, "line_options", ""))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: S=4, N=4, 2 runs, a few steps")
    p.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    p.add_argument("--accumulate", type=int, nargs="+", default=[4, 8, 16], help="N values")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--warmup", type=float, default=0.01, help="linear warmup, fraction of the run's steps")
    p.add_argument("--beta2", type=float, default=0.95, help="AdamW's beta2 (torch's default: 0.999)")
    p.add_argument(
        "--report",
        nargs="+",
        metavar="JSON",
        help="print one table from these results/ files and exit (no runs); with --plot NAME, their curves too",
    )
    p.add_argument("--micro-batches", type=int, default=1600, help="per run (equal tokens for every N)")
    p.add_argument("--evals", type=int, default=10, help="validations per run")
    p.add_argument("--val-batches", type=int, default=8, help="batches of each validation along the curve")
    p.add_argument(
        "--final-val-batches",
        type=int,
        default=0,
        help="also validate the final model on this many batches (-1: the whole split; 0: no); the curve's "
        "--val-batches are few, and its final point moves by ~1%% between neighbouring models",
    )
    p.add_argument("--layers", type=int, default=6, help="GPT blocks: layers + 2 pipeline layers (>= max S)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch size")
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--vocab", type=int, default=256, help="token ids (256: the byte-level corpus; more: costs only)")
    p.add_argument(
        "--accelerator",
        default="cpu",
        choices=["cpu", "gpu"],
        help="where the grid's runs train (gpu: the same line in fp32 on one CUDA device, the S stages sharing it)",
    )
    p.add_argument("--cost-device", default="cpu", help="where per-layer costs are timed (cuda: bf16 autocast)")
    p.add_argument("--workers", type=int, default=2, help="runs in parallel, one thread each")
    p.add_argument("--cost-steps", type=int, default=40, help="optimizer steps of the in-process cost runs (0: skip)")
    p.add_argument("--cost-rounds", type=int, default=1, help="rounds of the in-process cost runs (ratios: medians)")
    p.add_argument("--out", default="paci_at_depth.json", help="file name under benchmarks/results/")
    p.add_argument("--plot", default="paci_at_depth.png", help="file name under benchmarks/plots/")
    args = p.parse_args(argv)
    if args.quick:
        args.stages, args.accumulate, args.lrs, args.seeds = [4], [4], [3e-3], [0]
        args.runs, args.micro_batches, args.evals, args.val_batches = ["flush", "paci"], 16, 2, 1
        args.layers, args.cost_steps, args.workers, args.dim, args.block = 2, 2, 1, 32, 32
        if args.out == "paci_at_depth.json":  # a smoke run never replaces the full result
            args.out, args.plot = "paci_at_depth_quick.json", "paci_at_depth_quick.png"
    if args.final_val_batches < -1:
        p.error(
            f"--final-val-batches {args.final_val_batches}: give a number of batches, -1 (the whole split) or 0 (none)"
        )
    if max(args.stages) > args.layers + 2:
        p.error(f"--layers {args.layers} gives {args.layers + 2} pipeline layers, fewer than S={max(args.stages)}")
    return args


def report(names: list[str], plot_path: Path | None = None) -> str:
    """One table from several result files, a row per (S, N, lr, warmup, seed). Runs are merged across
    files, a later file's run replacing an earlier one's of the same name: a rerun of one method after
    a change to it updates its column and leaves the others' runs as they were."""
    runs: dict[tuple, dict[str, Any]] = {}
    costs = None
    for name in names:
        payload = json.loads((Path(__file__).parent / "results" / name).read_text())
        costs = costs or payload.get("layer_costs")  # the first file's: one set of per-layer times for every row
        warmup = payload["config"].get("warmup", 0.01)
        for run in payload["runs"]:
            runs[(run["S"], run["N"], run["lr"], warmup, run["seed"], run["run"])] = {**run, "warmup": warmup}
    rows = []
    for warmup in sorted({key[3] for key in runs}):
        rows += [{**row, "warmup": warmup} for row in summarize([r for r in runs.values() if r["warmup"] == warmup])]
    rows.sort(key=lambda r: (r["S"], r["N"], r["lr"], r["warmup"], r["seed"]))
    if plot_path is not None:
        plot(list(runs.values()), plot_path, f"PACI at depth: {len(rows)} configurations (seed 0's curves)")
    lines = [
        table(rows),
        "",
        "| S | N | lr | warmup | seed | run | throughput | to 80% | to 95% | to final | to both's lowest |",
        "|" + "---|" * 11,
    ]
    for warmup in sorted({key[3] for key in runs}) if costs else []:
        for r in time_to_accuracy([x for x in runs.values() if x["warmup"] == warmup], costs):
            cells = [
                f"{r[k]['ratio']:.2f}" if r[k]["ratio"] == r[k]["ratio"] else "never"
                for k in ("80%", "95%", "final", "both")
            ]
            lines.append(f"| {r['S']} | {r['N']} | {r['lr']:g} | {warmup:.0%} | {r['seed']} | {r['run']} | "
                         f"{r['throughput_ratio']:.2f} | " + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.report:
        print(report(args.report, PLOTS / args.plot if args.plot != "paci_at_depth.png" else None))
        return {}
    config = vars(args)
    start, before = time.perf_counter(), machine()
    jobs = [
        (config, s, n, lr, seed, name)
        for s, n, lr, seed, name in itertools.product(args.stages, args.accumulate, args.lrs, args.seeds, args.runs)
    ]
    if args.workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(args.workers) as pool:
            runs = pool.map(_worker, jobs, chunksize=1)
    else:
        runs = [_worker(job) for job in jobs]
    costs = layer_costs(config)
    tta = time_to_accuracy(runs, costs)
    cost = (
        in_process_cost(config, max(args.stages), args.accumulate[0], args.cost_steps, args.cost_rounds)
        if args.cost_steps
        else {}
    )
    prediction = _prediction_cost(config)
    rows = [{**row, "warmup": args.warmup} for row in summarize(runs)]
    payload = envelope(
        "paci_at_depth", args.quick, before, config, start, summary=rows, time_to_accuracy=tta,
        in_process_cost=cost, weight_prediction_cost=prediction, layer_costs=costs, runs=runs,
    )  # fmt: skip
    path = write_json(args.out, payload)
    title = (
        f"GPT {args.layers}x{args.dim}, block {args.block}, micro-batch {args.batch_size}, "
        f"{args.micro_batches} micro-batches per run; in-process pipeline on 1 thread"
    )
    plot(runs, PLOTS / args.plot, title)
    print(table(rows))
    for row in tta:
        print("time-to-accuracy", json.dumps(row, default=float))
    print("in-process cost", cost, "weight prediction", prediction)
    print(f"wrote {path} in {payload['wall_seconds']:.0f} s")
    return payload


def _prediction_cost(config: dict[str, Any]) -> dict[str, Any]:
    """Weight prediction's buffer: the largest stage's parameter bytes. (Its time cost is measured side by
    side in `in_process_cost`; the grid's runs are not interleaved, so their wall times would carry the load.)"""
    from lit_efficient.runtime.partition import partition_uniform, stage_bounds

    model = _model(config, 1e-3, 100)
    layer_bytes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.pipeline_layers()]
    stage_bytes = {
        s: max(sum(layer_bytes[lo:hi]) for lo, hi in stage_bounds(partition_uniform(len(layer_bytes), s)))
        for s in config["stages"]
    }
    return {"extra_buffer_bytes_largest_stage": stage_bytes, "model_bytes": sum(layer_bytes)}


if __name__ == "__main__":
    main()
