"""GPU smoke run: everything one GPU can check, in one command, in under 5 minutes.

    python benchmarks/gpu_smoke.py --device cuda     # the one command a lent GPU runs
    python benchmarks/gpu_smoke.py --device cpu      # the same checks on CPU (runs here, ~1-2 minutes)
    python -m pytest -m gpu                          # the same checks as tests (tests/test_gpu.py)

Nothing in this repository had run on a GPU when this script was written. It prints a pass/fail table
and writes every number to ``benchmarks/results/gpu_smoke_<device>.json`` (``--out`` to change it); the
exit status is 1 when a check fails. Each check is a function ``check_<name>(device) -> Check``, which
tests/test_gpu.py calls too:

- ``flush_exact``: ``Trainer(devices=1, strategy=PACIStrategy(pipeline_stages=4, schedule="1f1b_flush"))``
  in bf16-mixed against plain Lightning on one device with ``accumulate_grad_batches=4``, same model and
  batches, deterministic algorithms on: weights after 3 steps within 1e-5 (the CPU suite's bound for
  flush against one device), and whether they are bitwise equal.
- ``memory``: ``torch.cuda.max_memory_allocated`` of an S=4 PACI run in bf16-mixed, against the project's
  only memory model (``partition_profiled``'s, fed by ``balance="profile"``'s layer profile: stage s holds
  its weights, gradients and AdamW state plus S - s micro-batches of its layers' outputs). In one process
  the stages share one device, so the peak is per run, compared with the stages' sum. It must hold at
  least the weights, gradients and optimizer state; the ratio to the estimate is reported, not judged (the
  estimate counts layer outputs, not every activation autograd saves). On CPU (no allocator peak): skip.
- ``activation_checkpointing``: with dropout 0.1, gradients of a GPT with its blocks checkpointed
  (``mode="full"`` and ``"selective"``, fp32 and bf16 autocast) against the same model without: bitwise on
  CPU; on CUDA within fp32 rounding (a recompute that drew other dropout masks is off by far more).
- ``checkpoint_round_trip``: fit the S=4 in-process pipeline, ``trainer.save_checkpoint``, then
  ``GPT.load_from_checkpoint`` on one device, without any strategy: the same weights, exactly.
- ``monitor_timings``: `PipelineMonitor` on an S=4 PACI run: its clocks are CUDA events on CUDA (host time
  on CPU); every stage's busy time is > 0 and <= its elapsed time; the stages, which take turns on one
  device, are together busy no longer than the span; the logged utilizations lie in (0, 1]; the timeline
  holds every stage's forwards, backwards and steps, each ending after it starts, within the fit's time.
- ``host_syncs``: the bare in-process pipeline (no Trainer, which adds its own) for 3 windows after one
  of warm-up: host syncs == the stages' optimizer steps (the NaN decision of each step, required) and none
  per micro-batch; events still pending until the stats are read. Counted on CUDA by
  ``torch.cuda.set_sync_debug_mode("warn")``; on CPU by counting the reads of tensor values into Python
  made from lit_efficient's code (the same calls, free there).

- ``weight_prediction``: PACI's default staleness correction on three blocks with fp32 weights and AdamW state,
  eager and compiled ("auto" on CUDA): the stale forward's weights moved, the real ones restored within 1e-5 after
  it, the forms equal up to rounding, no host sync in either (CUDA); their apply + undo times against the
  blocks' bf16 forward + backward of one micro-batch (GPT-2 Medium's width on CUDA), the eager form's operator
  calls, and the seconds the compiled form's first call spends compiling.

Not covered here: NCCL between processes needs two GPUs. The strict-order transport tests cover it on
CPU instead (a replay of the traced point-to-point operations under NCCL's ordering rules: per-communicator
FIFO for both directions, rendezvous above a size).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Deterministic cuBLAS for flush_exact; read when the first cuBLAS handle is created, so set before any
# CUDA work (tests/test_gpu.py sets it at import too).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lit_efficient import ActivationCheckpointing, PACIStrategy, PipelineMonitor  # noqa: E402
from lit_efficient.runtime.actions import Action  # noqa: E402
from lit_efficient.runtime.clock import CudaClock, HostClock  # noqa: E402
from lit_efficient.runtime.partition import partition_uniform, stage_bounds  # noqa: E402
from lit_efficient.runtime.profile import profile_layers  # noqa: E402
from lit_efficient.runtime.stage import PipelineStage  # noqa: E402
from lit_efficient.transport.local import local_pipeline  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STAGES, ACCUMULATE = 4, 4
# Small on CPU (2 shared cores); on a GPU big enough for kernels to outlast their launches, still seconds.
SIZES: dict[str, dict[str, int]] = {
    "cpu": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 4},
    "cuda": {"n_layer": 6, "n_head": 8, "n_embd": 512, "block_size": 256, "batch_size": 8},
}
VOCAB = 256


@dataclass
class Check:
    """One check's outcome: ``status`` is "pass", "fail" or "skip"; ``detail`` one line for the table."""

    name: str
    status: str
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


# ------------------------------------------------------------------------ shared pieces


def _device(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda needs a CUDA device; torch sees none")
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def _model(device: str, **overrides: Any):
    from lit_efficient.models import GPT

    size = SIZES[device]
    L.seed_everything(0, verbose=False)
    args = dict(
        vocab_size=VOCAB, block_size=size["block_size"], n_layer=size["n_layer"], n_head=size["n_head"],
        n_embd=size["n_embd"], warmup_steps=2, max_steps=20, learning_rate=3e-3,
    )  # fmt: skip
    return GPT(**{**args, **overrides})


def _loader(device: str, micro_batches: int) -> DataLoader:
    size = SIZES[device]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (micro_batches * size["batch_size"], size["block_size"] + 1), generator=g)
    return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=size["batch_size"], shuffle=False)


def _trainer(device: str, strategy: Any, steps: int, root: str | None = None, **kw: Any) -> L.Trainer:
    args = dict(
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, strategy=strategy, max_steps=steps,
        accumulate_grad_batches=ACCUMULATE, precision="bf16-mixed", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        default_root_dir=root,
    )  # fmt: skip
    return L.Trainer(**{**args, **kw})


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].double().cpu() - sb[k].double().cpu()).abs().max().item() for k in sa)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # benchmark plumbing: the host's timing of a whole run


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


class _Metrics(Logger):
    """Keeps what the monitor logs, in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "gpu_smoke"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


# ------------------------------------------------------------------------ the checks


def check_flush_exact(device: str) -> Check:
    """In-process S=4 1F1B-flush in bf16-mixed against plain Lightning with accumulate_grad_batches=4."""
    steps = 3
    with _deterministic():
        single, piped = _model(device), _model(device)
        start = copy.deepcopy(single)
        _trainer(device, "auto", steps).fit(single, _loader(device, steps * ACCUMULATE))
        strategy = PACIStrategy(pipeline_stages=STAGES, schedule="1f1b_flush")
        _trainer(device, strategy, steps).fit(piped, _loader(device, steps * ACCUMULATE))
    moved, diff = _max_diff(single, start), _max_diff(piped, single)
    numbers = {"max_abs_diff": diff, "moved_from_init": moved, "steps": steps, "bitwise": diff == 0.0}
    ok = moved > 1e-3 and diff <= 1e-5
    exact = "bitwise equal" if diff == 0.0 else f"max |dw| {diff:.2e} (not bitwise)"
    return Check("flush_exact", "pass" if ok else "fail",
                 f"S=4 flush bf16-mixed vs one device, {steps} steps: {exact}; training moved weights {moved:.2e}",
                 numbers)  # fmt: skip


class _Peak(Callback):
    """The device's allocator peak over the fit (reset at its start), and the stages' sizes (the split is gone
    after a fit: the whole model is back on the user's object)."""

    def __init__(self) -> None:
        self.peak = 0
        self.sizes: list[int] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sizes = trainer.strategy.layout()["sizes"]
        if trainer.strategy.root_device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(trainer.strategy.root_device)


def check_memory(device: str) -> Check:
    """Peak device memory of an S=4 PACI run in bf16-mixed against the project's per-stage estimate."""
    dev = _device(device)
    model, peak, steps = _model(device), _Peak(), 2
    strategy = PACIStrategy(pipeline_stages=STAGES, schedule="paci")
    _trainer(device, strategy, steps, callbacks=[peak]).fit(model, _loader(device, steps * ACCUMULATE))
    sizes = peak.sizes
    # The estimate partition_profiled budgets with (partition.py): stage s holds its parameter bytes (weights,
    # gradients, AdamW state: 4x the weights) plus S - s micro-batches of its layers' output bytes.
    probe = copy.deepcopy(model).to(dev)
    batch = next(iter(_loader(device, 1)))
    autocast = lambda: torch.autocast(dev.type, dtype=torch.bfloat16)  # noqa: E731 - bf16-mixed's forward
    profile = profile_layers(probe, list(probe.pipeline_layers()), batch, dev, autocast, repeats=1)
    del probe
    estimate, first = [], 0
    for s, n in enumerate(sizes):
        layers = range(first, first + n)
        first += n
        activations = sum(profile.activation_bytes[k] for k in layers)
        estimate.append(sum(profile.param_bytes[k] for k in layers) + (STAGES - s) * activations)
    static = sum(profile.param_bytes)
    numbers: dict[str, Any] = {
        "sizes": sizes, "estimate_bytes_per_stage": estimate, "estimate_bytes": sum(estimate),
        "weights_grads_adam_bytes": static,
    }  # fmt: skip
    mib = 2**20
    if dev.type != "cuda":
        return Check("memory", "skip",
                     f"no allocator peak on CPU; estimate {sum(estimate) / mib:.2f} MiB over stages "
                     f"{[round(e / mib, 2) for e in estimate]}", numbers)  # fmt: skip
    numbers.update(peak_bytes=peak.peak, peak_over_estimate=peak.peak / sum(estimate))
    ok = peak.peak >= static
    return Check("memory", "pass" if ok else "fail",
                 f"peak {peak.peak / mib:.1f} MiB (one device, all 4 stages) = {peak.peak / sum(estimate):.2f}x the "
                 f"estimate {sum(estimate) / mib:.1f} MiB; >= weights+grads+AdamW {static / mib:.1f} MiB",
                 numbers)  # fmt: skip


def check_activation_checkpointing(device: str) -> Check:
    """Gradients with checkpointed blocks (dropout 0.1) against the same model without checkpointing."""
    dev = _device(device)
    size = SIZES[device]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (size["batch_size"], size["block_size"] + 1), generator=g).to(dev)
    batch = tokens[:, :-1], tokens[:, 1:]
    worst: dict[str, float] = {}
    failures = []
    for precision in ("fp32", "bf16"):
        for mode in ("full", "selective"):
            grads = []
            for wrap in (False, True):
                model = _model(device, dropout=0.1).to(dev).train()
                if wrap:
                    ActivationCheckpointing(mode=mode).wrap(model)
                torch.manual_seed(123)  # the same dropout masks in forward; the recompute must draw them again
                context = (
                    torch.autocast(dev.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
                )
                with context:
                    loss, _ = model.pipeline_loss(model(batch[0]), batch)
                loss.backward()
                grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
            key = f"{mode}_{precision}"
            worst[key] = max((grads[1][k] - grads[0][k]).abs().max().item() for k in grads[0])
            for name in grads[0]:
                # CPU: the same ops on the same inputs with the same RNG, bitwise. CUDA: some backward kernels
                # accumulate with atomics, so allow fp32 rounding; a different dropout mask is off by far more.
                tolerance = {"rtol": 0.0, "atol": 0.0} if dev.type == "cpu" else {"rtol": 1e-4, "atol": 1e-5}
                try:
                    torch.testing.assert_close(grads[1][name], grads[0][name], **tolerance)
                except AssertionError:
                    failures.append(f"{key}:{name}")
    detail = "dropout 0.1, max |dgrad| " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    if failures:
        detail += f"; differ: {failures[:4]}{'...' if len(failures) > 4 else ''}"
    return Check("activation_checkpointing", "fail" if failures else "pass", detail,
                 {"max_abs_diff": worst, "differing": failures})  # fmt: skip


class _SaveAtEnd(Callback):
    """``trainer.save_checkpoint`` at the end of fit, while the strategy still holds its stages."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def check_checkpoint_round_trip(device: str) -> Check:
    """Fit the S=4 in-process pipeline, save_checkpoint, load_from_checkpoint on one device: same weights.

    The file is written from ``on_train_end``: the in-process strategy cannot save once ``fit`` has
    returned (its stages are torn down); that is tried too and reported, not judged here."""
    from lit_efficient.models import GPT

    dev = _device(device)
    steps = 2
    model = _model(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "smoke.ckpt")
        trainer = _trainer(device, PACIStrategy(pipeline_stages=STAGES, schedule="paci"), steps,
                           callbacks=[_SaveAtEnd(path)])  # fmt: skip
        trainer.fit(model, _loader(device, steps * ACCUMULATE))
        loaded = GPT.load_from_checkpoint(path, map_location=dev)  # Lightning's loader, no strategy
        saved = torch.load(path, map_location="cpu", weights_only=True)
        try:
            trainer.save_checkpoint(Path(tmp, "after_fit.ckpt"))
            after_fit = "saved"
        except Exception as err:  # noqa: BLE001 - reported in the result
            after_fit = f"{type(err).__name__}: {err}"
    diff = _max_diff(loaded, model)
    layout = saved.get("pipeline", {}).get("layout", {})
    on_device = all(p.device == dev for p in loaded.parameters())
    ok = diff == 0.0 and saved["global_step"] == steps and layout.get("num_stages") == STAGES and on_device
    numbers = {"max_abs_diff": diff, "global_step": saved["global_step"], "layout": layout,
               "save_checkpoint_after_fit": after_fit}  # fmt: skip
    return Check("checkpoint_round_trip", "pass" if ok else "fail",
                 f"one file from S=4 at step {saved['global_step']}, loaded on {dev} without a strategy: "
                 f"max |dw| {diff:g}; save_checkpoint after fit returned: {after_fit}", numbers)  # fmt: skip


class _StageStats(Callback):
    """Every stage's stats at the window ends the monitor logs, read just before it (it comes later in
    the callback list) logs them and resets them: the last logged interval's numbers."""

    def __init__(self, interval: int) -> None:
        self.interval, self.last_step = interval, 0
        self.stats: list[dict[str, float]] = []
        self.clocks: list[str] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step != self.last_step and step % self.interval == 0:
            runtime = trainer.strategy.runtime
            self.stats = runtime.stage_stats()
            self.clocks = [type(rt.stage.clock).__name__ for rt in runtime.runtimes]
        self.last_step = step


def check_monitor_timings(device: str) -> Check:
    """PipelineMonitor on an S=4 PACI run: device clocks, busy <= elapsed, plausible timeline."""
    dev = _device(device)
    steps = 4
    logger, probe = _Metrics(), _StageStats(interval=2)
    monitor = PipelineMonitor(logging_interval=2, timeline=True)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(device, PACIStrategy(pipeline_stages=STAGES, schedule="paci"), steps, root=tmp,
                           logger=logger, callbacks=[probe, monitor])  # fmt: skip
        _sync(dev)
        start = time.perf_counter()
        trainer.fit(_model(device), _loader(device, steps * ACCUMULATE))
        _sync(dev)
        wall = time.perf_counter() - start
        trace = json.loads(Path(monitor.timeline_paths[1]).read_text()) if monitor.timeline_paths else {}
    want_clock = CudaClock.__name__ if dev.type == "cuda" else HostClock.__name__
    problems = []
    if probe.clocks != [want_clock] * STAGES:
        problems.append(f"clocks {probe.clocks}, want {want_clock}")
    stats = probe.stats
    busy = [st["busy_seconds"] for st in stats]
    elapsed = [st["elapsed_seconds"] for st in stats]
    if len(stats) != STAGES or not all(0 < b <= e * (1 + 1e-6) for b, e in zip(busy, elapsed, strict=True)):
        problems.append(f"busy {busy} against elapsed {elapsed}")
    # One device takes the stages in turn, so their busy spans cannot overlap: together within the span
    # (the longest stage span, which starts a little after the interval's first action: 5% slack).
    if stats and sum(busy) > max(elapsed) * 1.05:
        problems.append(f"stages busy {sum(busy):.4f}s in total within a span of {max(elapsed):.4f}s")
    logged = [m for _, m in logger.rows if "pipeline/utilization_stage0" in m]
    utilization = [m[f"pipeline/utilization_stage{s}"] for m in logged for s in range(STAGES)]
    if len(logged) != steps // 2 or not all(0 < u <= 1 for u in utilization):
        problems.append(f"{len(logged)} logged intervals, utilizations {utilization}")
    throughput = [m["throughput/tokens_per_sec"] for m in logged]
    if not all(t > 0 for t in throughput):
        problems.append(f"tokens/s {throughput}")
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kinds = {(e["tid"], Action.parse(e["name"]).kind) for e in spans}
    if kinds != {(s, k) for s in range(STAGES) for k in ("F", "B", "STEP")}:
        problems.append(f"timeline holds {sorted(kinds)}")
    span = (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) * 1e-6 if spans else 0.0
    if any(e["dur"] < 0 for e in spans) or not 0 < span <= wall:
        problems.append(f"timeline spans {span:.3f}s of a {wall:.3f}s fit")
    # Nor may two actions overlap on the timeline. Each stage's events reach the host axis through their
    # own anchor (CudaClock.host_seconds), which is off by its wake-up latency: 1 ms of slack.
    ordered = sorted(spans, key=lambda e: e["ts"])
    overlap = max((a["ts"] + a["dur"] - b["ts"] for a, b in itertools.pairwise(ordered)), default=0.0) * 1e-6
    if overlap > 1e-3:
        problems.append(f"two actions overlap by {overlap * 1e3:.2f} ms on the timeline")
    numbers = {"clock": want_clock, "busy_seconds": busy, "elapsed_seconds": elapsed, "utilization": utilization,
               "tokens_per_sec": throughput, "timeline_span_seconds": span, "timeline_overlap_seconds": overlap,
               "fit_seconds": wall}  # fmt: skip
    detail = (
        f"{probe.clocks[0] if probe.clocks else '?'}; busy/elapsed per stage "
        f"{[round(b / e, 3) if e else None for b, e in zip(busy, elapsed, strict=True)]}, "
        f"sum {sum(busy):.3f}s of {max(elapsed, default=0):.3f}s; timeline {span:.3f}s of a {wall:.2f}s fit"
    )
    if problems:
        detail += "; " + "; ".join(problems)
    return Check("monitor_timings", "fail" if problems else "pass", detail, numbers)


@contextlib.contextmanager
def _count_host_syncs(device: torch.device) -> Iterator[list[str]]:
    """The host syncs in the block: on CUDA every synchronizing call torch's sync debug mode reports; on CPU
    (where nothing waits) the reads of tensor values into Python from lit_efficient's code, which are
    the calls that wait on CUDA."""
    found: list[str] = []
    if device.type == "cuda":
        before = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
            finally:
                torch.cuda.set_sync_debug_mode(before)
        # Only the syncs themselves: setting the mode also warns once that it is a prototype ("Synchronization debug
        # mode is a prototype feature..."), which the first GPU run counted as a 13th sync of 12 steps.
        found += [
            f"{Path(w.filename).name}:{w.lineno}"
            for w in caught
            if "called a synchronizing CUDA operation" in str(w.message)
        ]
        return
    originals = {}

    def counting(name: str) -> Callable[..., Any]:
        original = originals[name] = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith("lit_efficient"):
                found.append(f"{module}.{caller.f_code.co_name}")
            return original(self, *args, **kwargs)

        return wrapper

    names = ("tolist", "item", "__bool__", "__float__", "__int__", "__index__")
    for name in names:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield found
    finally:
        for name in names:
            setattr(torch.Tensor, name, originals[name])


def check_host_syncs(device: str) -> Check:
    """Host syncs of the bare in-process pipeline: one per optimizer step, none per micro-batch."""
    dev = _device(device)
    model = _model(device).to(dev)
    layers = list(model.pipeline_layers())
    stages = []
    for s, (lo, hi) in enumerate(stage_bounds(partition_uniform(len(layers), STAGES))):
        mine = layers[lo:hi]
        optimizer = torch.optim.AdamW([p for layer in mine for p in layer.parameters()], lr=1e-3)
        stages.append(PipelineStage(
            mine, s, STAGES, optimizer, loss_fn=model.pipeline_loss, device=dev, first_layer=lo,
            forward_context=lambda: torch.autocast(dev.type, dtype=torch.bfloat16),
        ))  # fmt: skip
    pipe = local_pipeline(stages, "1f1b_flush", ACCUMULATE, model.pipeline_input)
    windows = 3
    data = [tuple(t.to(dev) for t in b) for b in _loader(device, (windows + 1) * ACCUMULATE)]
    for j, batch in enumerate(data[:ACCUMULATE]):  # warm-up window: allocator, kernels, lazy inits
        pipe.feed(batch, j)
    pipe.drain()
    steps_before = sum(st.stats.steps for st in stages)
    with _count_host_syncs(dev) as syncs:
        for j, batch in enumerate(data[ACCUMULATE:], start=ACCUMULATE):
            pipe.feed(batch, j)
        pipe.drain()
    steps = sum(st.stats.steps for st in stages) - steps_before
    pending = [st.stats.times.pending for st in stages]  # CUDA: events recorded, not yet resolved
    stats = pipe.stage_stats()
    lazy = dev.type != "cuda" or all(p > 0 for p in pending)
    ok = len(syncs) == steps == STAGES * windows and lazy and all(st["busy_seconds"] > 0 for st in stats)
    numbers = {"syncs": len(syncs), "optimizer_steps": steps, "micro_batches": windows * ACCUMULATE,
               "where": sorted(set(syncs)), "pending_events_before_read": pending}  # fmt: skip
    return Check("host_syncs", "pass" if ok else "fail",
                 f"{len(syncs)} host syncs in {windows * ACCUMULATE} micro-batches and {steps} stage steps "
                 f"(want one per step) at {sorted(set(syncs))}; pending spans before the read {pending}",
                 numbers)  # fmt: skip


def operator_calls(fn: Callable[[], Any]) -> int:
    """Operators ``fn`` dispatches that compute (each a kernel launch on a GPU): views and allocations not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not any(k in func.__name__ for k in ("view", "slice", "alias", "detach", "lift", "empty")):
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


def check_weight_prediction(device: str) -> Check:
    """PACI's default prediction on three blocks with fp32 weights and AdamW state (bf16-mixed's master weights), in
    both forms: eager (`InPlaceFirstStepWeightPrediction`, "auto" off CUDA) and compiled
    (`CompiledFirstStepWeightPrediction`, "auto" on CUDA; compiled before timing). Each: a stale forward's weights
    moved, the real ones restored up to rounding after it; the two forms predict the same weights up to rounding;
    their times (apply + undo) against the blocks' forward + backward of one bf16 micro-batch, and the eager form's
    operator calls (each a kernel launch). On CUDA at GPT-2 Medium's width (d=1024, 1,024 tokens x 8)."""
    from lit_efficient.models import GPT
    from lit_efficient.runtime.staleness import (
        CompiledFirstStepWeightPrediction,
        InPlaceFirstStepWeightPrediction,
        make_correction,
    )

    dev = _device(device)
    size = dict(n_embd=1024, n_head=16, block_size=1024, batch_size=8) if dev.type == "cuda" else SIZES["cpu"]
    torch.manual_seed(0)
    gpt = GPT(vocab_size=VOCAB, n_layer=3, n_head=size["n_head"], n_embd=size["n_embd"], block_size=size["block_size"])
    blocks = torch.nn.Sequential(*list(gpt.pipeline_layers())[1:4]).to(dev)
    params = list(blocks.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    x = torch.randn(size["batch_size"], size["block_size"], size["n_embd"], device=dev)

    def forward_backward() -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = blocks(x)
        out.float().square().mean().backward()

    forward_backward()
    optimizer.step()  # moments exist, as after the first window
    forward_backward()  # the window's gradient so far
    weight = torch.tensor(2.0, device=dev)
    forms = {"eager": InPlaceFirstStepWeightPrediction(), "compiled": CompiledFirstStepWeightPrediction()}

    def predict(form: str) -> Callable[[], None]:
        def run() -> None:
            with forms[form].forward_context(params, optimizer, 1, window_weight=weight):
                pass

        return run

    def timed(fn: Callable[[], None], repeats: int = 5) -> float:
        times = []
        for _ in range(repeats + 1):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - start)
        return sorted(times[1:])[repeats // 2]

    real = [p.detach().clone() for p in params]
    predicted, moved, restored, first_call = {}, {}, {}, {}
    for form, correction in forms.items():
        start = time.perf_counter()
        with correction.forward_context(params, optimizer, 1, window_weight=weight):  # compiles the compiled form
            predicted[form] = [p.detach().clone() for p in params]
        first_call[form] = time.perf_counter() - start  # compiled: the stage's one compilation, in a fresh process
        moved[form] = max((q - r).abs().max().item() for q, r in zip(predicted[form], real, strict=True))
        restored[form] = max((p - r).abs().max().item() for p, r in zip(params, real, strict=True))
    apart = max((a - b).abs().max().item() for a, b in zip(*predicted.values(), strict=True))
    calls = operator_calls(predict("eager"))
    syncs: list[str] = []
    if dev.type == "cuda":  # on CPU `_count_host_syncs` counts reads of CPU values (Adam's step), not waits
        with _count_host_syncs(dev) as syncs:
            for form in forms:
                predict(form)()
    seconds = {form: timed(predict(form)) for form in forms}
    compute = timed(forward_backward)
    elements = sum(p.numel() for p in params)
    default = type(make_correction("auto", "paci", 0, 8, 8, 1, optimizer)).__name__
    ok = (
        min(moved.values()) > 1e-6 and max(restored.values()) <= 1e-5 and apart <= 1e-3 * min(moved.values())
        and not syncs
    )  # fmt: skip
    numbers = {"elements": elements, "predict_seconds": seconds["eager"], "compiled_seconds": seconds["compiled"],
               "forward_backward_seconds": compute, "ratio": seconds["eager"] / compute,
               "compiled_ratio": seconds["compiled"] / compute, "operator_calls": calls, "moved": moved["eager"],
               "restored_error": restored["eager"], "compiled_restored_error": restored["compiled"],
               "forms_apart": apart, "default_here": default, "host_syncs": syncs,
               "compile_seconds": first_call["compiled"] - first_call["eager"],
               "tokens_per_micro_batch": size["batch_size"] * size["block_size"]}  # fmt: skip
    return Check("weight_prediction", "pass" if ok else "fail",
                 f"{elements:,} fp32 weights: moved {moved['eager']:.2e}, restored within "
                 f"{max(restored.values()):.1e}, forms {apart:.1e} apart; apply + undo eager "
                 f"{seconds['eager'] * 1e3:.2f} ms = {seconds['eager'] / compute:.2f}x, compiled "
                 f"{seconds['compiled'] * 1e3:.2f} ms = {seconds['compiled'] / compute:.2f}x a bf16 forward + "
                 f"backward of {numbers['tokens_per_micro_batch']} tokens; eager {calls} operator calls; "
                 f"host syncs {len(syncs) if dev.type == 'cuda' else 'n/a (CPU)'}; compiling "
                 f"{numbers['compile_seconds']:.1f} s; 'auto' here: {default}",
                 numbers)  # fmt: skip


CHECKS: dict[str, Callable[[str], Check]] = {
    "flush_exact": check_flush_exact,
    "memory": check_memory,
    "activation_checkpointing": check_activation_checkpointing,
    "checkpoint_round_trip": check_checkpoint_round_trip,
    "monitor_timings": check_monitor_timings,
    "host_syncs": check_host_syncs,
    "weight_prediction": check_weight_prediction,
}


def run(device: str, names: list[str]) -> list[Check]:
    """Run the named checks on ``device``; an exception fails its check (with the error) and the rest run."""
    results = []
    for name in names:
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", module="lightning")  # Lightning's advice on loaders and logging
                result = CHECKS[name](device)
        except Exception as err:  # noqa: BLE001 - a smoke run reports every failure and goes on
            result = Check(name, "fail", f"{type(err).__name__}: {err}".splitlines()[0][:300],
                           {"traceback": traceback.format_exc()})  # fmt: skip
        result.seconds = time.perf_counter() - start
        results.append(result)
        print(f"  {name}: {result.status} ({result.seconds:.1f}s)", file=sys.stderr, flush=True)
    return results


def table(results: list[Check]) -> str:
    """The pass/fail table."""
    width = max(len(r.name) for r in results)
    lines = [f"{'check':<{width}}  status  seconds  detail", "-" * (width + 40)]
    lines += [f"{r.name:<{width}}  {r.status.upper():<6}  {r.seconds:7.1f}  {r.detail}" for r in results]
    failed = sum(r.status == "fail" for r in results)
    lines.append(f"{len(results) - failed} of {len(results)} checks did not fail ({failed} failed)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status (1 if a check failed)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), required=True, help="where the checks run")
    p.add_argument("--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS), help="a subset to run")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON file (default benchmarks/results/gpu_smoke_<device>.json)"
    )
    args = p.parse_args(argv)
    start = time.perf_counter()
    _device(args.device)  # fail at once without CUDA
    results = run(args.device, args.checks)
    print(table(results))
    machine = {"torch": torch.__version__, "lightning": L.__version__, "python": platform.python_version(),
               "platform": platform.platform(), "cuda": torch.version.cuda,
               "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}  # fmt: skip
    out = args.out or RESULTS / f"gpu_smoke_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "gpu_smoke", "command": f"python benchmarks/gpu_smoke.py --device {args.device}",
               "machine": machine, "wall_seconds": time.perf_counter() - start,
               "checks": [asdict(r) for r in results]}  # fmt: skip
    out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"results: {out}")
    return 1 if any(r.status == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
