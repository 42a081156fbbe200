"""The Lightning layer against the bare pipeline runtime: throughput ratio and where the time goes.

Issue: the design's target is a Lightning layer that costs at most 5% of throughput against the bare
runtime, at every N (short windows, N=2, are where a per-window cost weighs most).

What is measured, in one process (``--stages`` stages of a GPT, every stage here, so the whole
model's compute is serialized and every millisecond of host overhead shows):

- ``trainer``: ``Trainer(devices=1, strategy=PACIStrategy(pipeline_stages=S))`` with the user's
  defaults (progress bar, CSV logger at ``log_every_n_steps=50``, model summary), validation and
  checkpointing off (their cost is not per micro-batch), fed the same list of batches as the bare
  runtime (a ``DataLoader(batches, batch_size=None)``: no collation, so data loading is equal);
- ``bare``: the same runtime's ``feed`` called from a plain Python loop.

``--method interleaved`` (the default): ONE Trainer fit in which blocks driven by the Trainer (one warm-up
window, then windows holding ``--block-microbatches`` timed micro-batches) alternate with bare blocks of
the same size on the very same `StageHost` (the same runtime on each rank on processes: same stage objects,
layers, optimizer states), seconds apart: a callback drains the pipeline at the end of each Trainer block,
feeds the same batches to the runtime's own ``feed`` in a loop, drains again and lets the Trainer go on.
Each block is timed from its first window end (both pay the same warm-up after a drain) to its last; one
pair per round. Until this method, the variants were separate runs (``--method separate``: a Trainer fit
and a bare pipeline of its own per round, its LR schedule not stepped, order alternating), and their CPU
per micro-batch *inside the runtime* differed by up to 20% either way between rounds: different objects
built at different times on a VM whose speed depends on what ran before (the allocator's state, caches).
The interleaved pairs see the same objects under the same conditions, so what differs is what the
Trainer runs around ``feed`` and whatever that costs inside it.

For the Trainer the time spent inside the runtime (``feed``/``drain``) is also clocked, so *outside* = the
Lightning layer (loop, hooks, logging, progress bar, batch fetch), per micro-batch, in ms; the report
lists the Python functions that time is spent in (self time, the pipeline's compute left out) from a
cProfile of one more Trainer run.

    python -m benchmarks.lightning_overhead                 # S=4 in one process, ~2 minutes on 2 cores
    python -m benchmarks.lightning_overhead --devices 2 --stages 2 --layers 4 --dim 192 --block 128
                                                            # S=2 processes, trainer_vs_torch_pipelining's GPT
    python -m benchmarks.lightning_overhead --quick         # smoke run
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import statistics
import time
import warnings
from typing import Any

import torch

from benchmarks.harness import RESULTS, envelope, machine, write_json


def build_model(args: argparse.Namespace, max_steps: int) -> Any:
    import lightning as L

    from lit_efficient.models import GPT

    L.seed_everything(args.seed, verbose=False)
    return GPT(
        n_layer=args.layers, n_head=args.heads, n_embd=args.dim, block_size=args.block, dropout=0.0,
        learning_rate=3e-4, warmup_steps=2, max_steps=max(max_steps, 3),
    )  # fmt: skip


def build_batches(args: argparse.Namespace, count: int) -> list[Any]:
    from lit_efficient.data import TextDataModule

    data = TextDataModule(block_size=args.block, batch_size=args.batch_size, max_bytes=args.max_bytes, seed=args.seed)
    data.setup("fit")
    batches = []
    while len(batches) < count:
        batches.extend(iter(data.train_dataloader()))
    return batches[:count]


class _Clock:
    """Window-end times, and the seconds spent inside the runtime's calls (feed, drain): wall-clock and
    this thread's CPU time (which load on other cores barely changes: the figure to trust on a busy machine)."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.marks: list[tuple[float, float]] = []  # (wall, thread CPU) at each window end
        self.inside: list[tuple[float, float]] = []  # cumulative (wall, CPU) inside the runtime at each mark
        self._inside = (0.0, 0.0)

    def timed(self, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = self._inside
                self._inside = (wall + time.perf_counter() - t0, cpu + time.thread_time() - c0)

        return call

    def mark(self) -> None:
        self.marks.append((time.perf_counter(), time.thread_time()))
        self.inside.append(self._inside)


def run_trainer(
    args: argparse.Namespace, batches: list[Any], accumulate: int, profile: bool = False, one_device: bool = False
) -> dict[str, Any]:
    """A Trainer fit timed between window ends; ``one_device``: plain Lightning, no pipeline (the profile's
    reference: what Lightning's loop costs per batch without PACIStrategy)."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lit_efficient import PACIStrategy

    clock = _Clock(accumulate)
    profiler = cProfile.Profile() if profile else None

    class Clocked(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if not one_device:
                runtime = trainer.strategy.runtime
                runtime.feed, runtime.drain = clock.timed(runtime.feed), clock.timed(runtime.drain)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % accumulate == 0:
                clock.mark()
                if profiler is not None and len(clock.marks) == args.warm:
                    profiler.enable()

    steps = len(batches) // accumulate
    pipelined = {} if one_device else dict(strategy=PACIStrategy(pipeline_stages=args.stages, schedule=args.schedule))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulate, callbacks=[Clocked()],
        **pipelined,
        logger=L.pytorch.loggers.CSVLogger(str(RESULTS / "lightning_overhead_logs")), enable_checkpointing=False,
        limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(build_model(args, steps), train_dataloaders=DataLoader(batches, batch_size=None))
    if profiler is not None:
        profiler.disable()
    if profiler is None:
        return _segment(clock, args, accumulate)
    timed = (len(clock.marks) - args.warm) * accumulate
    return _segment(clock, args, accumulate) | {"profile": _top(profiler), "owners": _owners(profiler, timed)}


def run_bare(args: argparse.Namespace, batches: list[Any], accumulate: int) -> dict[str, Any]:
    from lit_efficient.cli.plan import _stand_in_trainer, optimizer_factory
    from lit_efficient.runtime.partition import stage_bounds
    from lit_efficient.runtime.stage import PipelineStage
    from lit_efficient.transport.local import local_pipeline

    model = build_model(args, len(batches) // accumulate)
    with _stand_in_trainer(model, len(batches) // accumulate, accumulate):
        make_optimizer = optimizer_factory(model, foreach=False)  # the module's own, as the strategy builds it
    layers = list(model.pipeline_layers())
    per, extra = divmod(len(layers), args.stages)
    sizes = [per + (1 if s < extra else 0) for s in range(args.stages)]
    stages = []
    for s, (lo, hi) in enumerate(stage_bounds(sizes)):
        own = layers[lo:hi]
        params = list(dict.fromkeys(p for layer in own for p in layer.parameters()))
        optimizer = make_optimizer(params)
        stages.append(PipelineStage(own, s, args.stages, optimizer, loss_fn=model.pipeline_loss, first_layer=lo))
    pipeline = local_pipeline(stages, args.schedule, accumulate, model.pipeline_input)
    clock = _Clock(accumulate)
    for index, batch in enumerate(batches):
        pipeline.feed(batch, index)
        if (index + 1) % accumulate == 0:
            clock.mark()
    pipeline.drain()
    return _segment(clock, args, accumulate)


def block_windows(args: argparse.Namespace, accumulate: int) -> int:
    """Windows per interleaved block: one to warm up after the drain, then enough for ``--block-microbatches``
    (at least 3 windows, so a block's time spans several steps)."""
    return 1 + max(3, -(-args.block_microbatches // accumulate))


def run_interleaved(args: argparse.Namespace, batches: list[Any], accumulate: int) -> list[dict[str, Any]]:
    """One Trainer fit whose blocks of `block_windows` windows alternate with bare blocks on the SAME
    runtime: at the end of each Trainer block a callback drains the pipeline and feeds the same batches to
    the runtime's own ``feed`` in a plain loop, then drains again and lets the Trainer go on.

    Separate runs (`run_trainer` against `run_bare`) compare different stage objects, built at different
    times, on a machine whose speed drifts between segments and depends on what ran before (the allocator's
    state, caches): in one process their CPU per micro-batch *inside the runtime* differed by up to 20% with
    the roles swapping between rounds. Here both variants run the same layers, optimizer states and
    runtime objects, seconds apart, so what differs is what the Trainer runs around ``feed``: the Lightning
    layer, and any slowdown it causes inside the runtime. Each block is timed from its first window end (the
    drain before it costs both the same warm-up) to its last; returns one {"trainer", "bare"} pair per block,
    the first pair (setup) dropped."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lit_efficient import PACIStrategy

    windows = block_windows(args, accumulate)
    block = windows * accumulate
    pairs: list[dict[str, Any]] = []

    class Interleave(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.runtime = trainer.strategy.runtime
            self.feed, self.drain = self.runtime.feed, self.runtime.drain  # the bare loop's calls
            self.clock = _Clock(accumulate)
            self.runtime.feed = lambda *a, **k: self.clock.timed(self.feed)(*a, **k)
            self.runtime.drain = lambda *a, **k: self.clock.timed(self.drain)(*a, **k)
            self.blocks = 0

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % accumulate:
                return
            self.clock.mark()
            if len(self.clock.marks) < windows:
                return
            timed = _segment(self.clock, args, accumulate, lo=0)
            self.drain()
            own = batches[batch_idx + 1 - block : batch_idx + 1]
            clock = _Clock(accumulate)
            start = (1 + self.blocks) * 10 * len(batches)  # indices no Trainer batch has, window-aligned
            for i, micro in enumerate(own):
                self.feed(micro, start + i)
                if (i + 1) % accumulate == 0:
                    clock.mark()
            self.drain()
            if self.blocks:  # the first Trainer block holds the fit's set-up
                pairs.append({"trainer": timed, "bare": _segment(clock, args, accumulate, lo=0)})
            self.blocks += 1
            self.clock = _Clock(accumulate)

    steps = len(batches) // accumulate
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=steps, accumulate_grad_batches=accumulate,
        strategy=PACIStrategy(pipeline_stages=args.stages, schedule=args.schedule), callbacks=[Interleave()],
        logger=L.pytorch.loggers.CSVLogger(str(RESULTS / "lightning_overhead_logs")), enable_checkpointing=False,
        limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    # The bare blocks step the optimizers too: a schedule twice as long keeps the learning rate in its range.
    trainer.fit(build_model(args, 2 * steps), train_dataloaders=DataLoader(batches, batch_size=None))
    return pairs


def _segment(
    clock: _Clock, args: argparse.Namespace, accumulate: int, lo: int | None = None, hi: int = -1
) -> dict[str, Any]:
    """Throughput and CPU between window-end marks ``lo`` and ``hi`` (default: after the warm windows, to
    the last)."""
    lo = args.warm - 1 if lo is None else lo
    hi = hi % len(clock.marks)
    (w1, c1), (w0, c0) = clock.marks[hi], clock.marks[lo]
    (iw1, ic1), (iw0, ic0) = clock.inside[hi], clock.inside[lo]
    microbatches = (hi - lo) * accumulate
    ms = 1e3 / microbatches
    timed_inside = iw1 > iw0  # the Trainer's runtime calls are clocked; the bare loop is all runtime
    return {
        "tokens_per_s": microbatches * args.batch_size * args.block / (w1 - w0),
        "ms_per_microbatch": ms * (w1 - w0),
        "cpu_ms_per_microbatch": ms * (c1 - c0),
        # The Lightning layer: what the Trainer path runs outside the runtime, per micro-batch.
        "outside_ms_per_microbatch": ms * ((w1 - w0) - (iw1 - iw0)) if timed_inside else 0.0,
        "outside_cpu_ms_per_microbatch": ms * ((c1 - c0) - (ic1 - ic0)) if timed_inside else 0.0,
        "microbatches": microbatches,
    }


def _top(profiler: cProfile.Profile, count: int = 25) -> list[str]:
    """The Python functions the Trainer path runs besides the pipeline, by their own (self) time: the model,
    the runtime, torch and C built-ins (the micro-batch's compute, the same in the bare loop) left out, so
    what remains is Lightning's loop, hooks, logging and progress bar, and the strategy's glue."""
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    rows = []
    for (path, line, name), (_, calls, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if path == "~" or any(part in path for part in ("lit_efficient/pipeline", "lit_efficient/models", "torch/")):
            continue
        rows.append((own, calls, f"{path.split('site-packages/')[-1]}:{line}:{name}"))
    return [f"{c * 1e3:8.1f} ms {n:6d} calls  {where}" for c, n, where in sorted(rows, reverse=True)[:count]]


# Who runs a function, by its file: the Lightning loop around a batch (and the libraries it calls), the
# strategy's own glue, or the micro-batch's compute (model, pipeline runtime, torch, C built-ins).
OWNERS = {
    "lightning": ("lightning/", "lightning_utilities/", "rich/", "tqdm/", "torchmetrics/"),
    "strategy": ("lit_efficient/strategies", "lit_efficient/callbacks", "lit_efficient/progress"),
    "compute": ("lit_efficient/pipeline", "lit_efficient/models", "torch/", "~"),
}


def _owners(profiler: cProfile.Profile, microbatches: int) -> dict[str, float]:
    """Self time per micro-batch (ms) by `OWNERS`; "python" is the standard library, whoever called it
    (inspect, contextlib, copy: mostly Lightning's hook plumbing). Inflated by the profiler: compare the
    pipeline's row with one device's, not with the clocks."""
    stats = pstats.Stats(profiler)
    owners = dict.fromkeys([*OWNERS, "python"], 0.0)
    for (path, _, _), (_, _, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        owner = next((o for o, parts in OWNERS.items() if any(part in path for part in parts)), "python")
        owners[owner] += own * 1e3 / microbatches
    return owners


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, N in {2, 4}")
    p.add_argument("--accumulate", type=int, nargs="+", default=[2, 4, 8], help="values of N")
    p.add_argument(
        "--method", default="interleaved", choices=["interleaved", "separate"],
        help="interleaved: Trainer and bare blocks alternate on the same runtime inside one fit (one pair per "
        "round); separate: a Trainer fit and a bare pipeline of their own per round, order alternating",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=5, help="pairs (interleaved) or rounds (separate) per N")
    p.add_argument(
        "--block-microbatches", type=int, default=24,
        help="interleaved: micro-batches timed per block (whole windows, at least 3), after one warm-up window",
    )  # fmt: skip
    p.add_argument("--stages", type=int, default=4)
    p.add_argument(
        "--devices", type=int, default=1,
        help="1: every stage in one process; S (= --stages): one process per stage, Lightning launching them "
        "(interleaved only: every rank runs its bare block at the same batch; rank 0, the last stage, reports)",
    )  # fmt: skip
    p.add_argument("--schedule", default="paci", choices=["paci", "1f1b_flush"])
    p.add_argument("--timed-microbatches", type=int, default=32)
    p.add_argument("--warm", type=int, default=3, help="windows before timing starts")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-bytes", type=int, default=400_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="lightning_overhead.json")
    args = p.parse_args(argv)
    if args.devices not in (1, args.stages) or (args.devices > 1 and args.method != "interleaved"):
        p.error(f"--devices {args.devices}: use 1, or --stages ({args.stages}) with --method interleaved")
    if args.quick:
        args.rounds, args.accumulate, args.timed_microbatches, args.block_microbatches = 1, [2, 4], 8, 8
        if args.out == "lightning_overhead.json":
            args.out = "lightning_overhead_quick.json"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    start, before = time.perf_counter(), machine()
    rows, raw = [], []
    for n in args.accumulate:
        segments: dict[str, list[dict[str, Any]]] = {"trainer": [], "bare": []}
        if args.method == "interleaved":
            batches = build_batches(args, (args.rounds + 1) * block_windows(args, n) * n)
            for pair in run_interleaved(args, batches, n):
                for variant in segments:
                    segments[variant].append(pair[variant])
        else:
            batches = build_batches(args, (args.warm + max(2, args.timed_microbatches // n)) * n)
            for r in range(args.rounds):
                order = ("trainer", "bare") if r % 2 == 0 else ("bare", "trainer")
                for variant in order:
                    run = run_trainer if variant == "trainer" else run_bare
                    segments[variant].append(run(args, batches, n))
        pairs = list(zip(segments["trainer"], segments["bare"], strict=True))
        ratios = [t["tokens_per_s"] / b["tokens_per_s"] for t, b in pairs]
        # The profile's Trainer runs in one process: on processes, the layer's functions are the same.
        profiled = run_trainer(args, batches, n, profile=True) if args.devices == 1 else {"profile": [], "owners": {}}
        profile = profiled["profile"]
        # The same under plain one-device Lightning: the floor any Lightning user pays per batch.
        floor = run_trainer(args, batches, n, profile=True, one_device=True)["owners"] if args.devices == 1 else {}
        # CPU time per micro-batch, bare over Trainer: the throughput ratio if the machine were quiet
        # (one thread does all the work here, so CPU time is the work, not the waiting).
        cpu_ratios = [b["cpu_ms_per_microbatch"] / t["cpu_ms_per_microbatch"] for t, b in pairs]
        # Within each Trainer block, the share of its CPU outside the runtime: the ratio the Trainer would reach
        # if the runtime ran as fast under it as in the bare block. Blocks seconds apart on this VM differ by up
        # to 20% in the speed of the same torch ops (the optimizer step included, which no Lightning code
        # touches), so this is the figure that survives the machine's drift; the inside ratio says whether the
        # runtime itself runs slower under the Trainer (1.0: no).
        layer_bounds = [1 - t["outside_cpu_ms_per_microbatch"] / t["cpu_ms_per_microbatch"] for t, _ in pairs]
        inside_ratios = [
            b["cpu_ms_per_microbatch"] / (t["cpu_ms_per_microbatch"] - t["outside_cpu_ms_per_microbatch"])
            for t, b in pairs
        ]

        def med(key: str, variant: str = "trainer", segments: dict = segments) -> float:
            return statistics.median(s[key] for s in segments[variant])

        rows.append({
            "N": n, "ratios": ratios, "ratio_median": statistics.median(ratios),
            "cpu_ratios": cpu_ratios, "cpu_ratio_median": statistics.median(cpu_ratios),
            "layer_bounds": layer_bounds, "layer_bound_median": statistics.median(layer_bounds),
            "inside_ratios": inside_ratios, "inside_ratio_median": statistics.median(inside_ratios),
            "trainer_ms": med("ms_per_microbatch"), "bare_ms": med("ms_per_microbatch", "bare"),
            "trainer_cpu_ms": med("cpu_ms_per_microbatch"), "bare_cpu_ms": med("cpu_ms_per_microbatch", "bare"),
            "outside_ms": med("outside_ms_per_microbatch"), "outside_cpu_ms": med("outside_cpu_ms_per_microbatch"),
            "profile": profile, "self_ms_per_microbatch": {"pipeline": profiled["owners"], "one_device": floor},
        })  # fmt: skip
        raw.append(segments)
        row = rows[-1]
        if os.environ.get("LOCAL_RANK", "0") != "0":
            continue  # a rank Lightning launched: rank 0 reports
        print(
            f"N={n}: Trainer/bare wall {row['ratio_median']:.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios)}), "
            f"CPU {row['cpu_ratio_median']:.3f} (rounds {', '.join(f'{x:.3f}' for x in cpu_ratios)}); "
            f"CPU ms/micro-batch Trainer {row['trainer_cpu_ms']:.1f}, bare {row['bare_cpu_ms']:.1f}, of which the "
            f"Lightning layer {row['outside_cpu_ms']:.2f} (wall {row['outside_ms']:.2f}); within the Trainer's blocks "
            f"1 - layer share {row['layer_bound_median']:.3f} "
            f"(rounds {min(layer_bounds):.3f}-{max(layer_bounds):.3f}), "
            f"bare / Trainer inside the runtime {row['inside_ratio_median']:.3f}",
            flush=True,
        )
        if floor:
            owned = ", ".join(f"{o} {profiled['owners'][o]:.2f} / {floor[o]:.2f}" for o in floor)
            print(f"  self ms per micro-batch under cProfile, pipeline / one device: {owned}", flush=True)
        print("\n".join(profile[:12]), flush=True)
    payload = envelope("lightning_overhead", args.quick, before, vars(args), start, rows=rows, raw=raw)
    if os.environ.get("LOCAL_RANK", "0") != "0":  # a rank Lightning launched: its pairs are not rank 0's
        return payload
    path = write_json(args.out, payload)
    print(f"wrote {path} in {payload['wall_seconds']:.0f} s; load {before['loadavg']} -> {payload['loadavg_end']}")
    return payload


if __name__ == "__main__":
    main()
