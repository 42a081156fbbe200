"""One rank of the revision guard: timed fits of two revisions of the package, alternating in the same processes.

Launched by ``benchmarks/revision_guard.py`` under ``torchrun --nproc_per_node S``. Each revision is importable
under its own name (the pinned one's source with its imports renamed, the working tree as ``lit_efficient``), so
one pair of processes runs fits of both in turn, A B B A A B ..., a few seconds apart. Two separate processes
of one revision differ by up to 15% on a shared 2-core VM (where the allocator put things, which neighbour ran);
adjacent fits in one process share all of that, and their ratio is what the guard reports.

Only the package's public API is used (``PACIStrategy``, ``models.GPT``, ``models.HFCausalLM``), as it was at
the pinned revision, so both run the very same measurement: the Lightning Trainer with its defaults (logger,
progress bar, checkpointing), S processes over gloo, one intra-op thread per rank. The last rank (stage 0's, in
every revision's topology) writes one JSON line per timed fit to ``--out``: the time of each optimizer-step window
(stage 0 feeds every window: in steady state its window is the pipeline's pace), its
CPU time (all threads), and the stage's own busy / wait accounting.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import os
import resource
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch


def build_model(package: Any, kind: str, args: argparse.Namespace) -> Any:
    """A fresh model of ``kind`` from ``package``, seeded: SGD (the optimizer costs little next to the pipeline)
    or, with ``--optimizer module``, the model's own ``configure_optimizers`` (AdamW and its schedule)."""
    import lightning as L

    models = importlib.import_module(f"{package.__name__}.models")
    L.seed_everything(args.seed, verbose=False)
    base = models.HFCausalLM if kind == "hf_gpt2" else models.GPT

    def configure_optimizers(self):
        if args.optimizer == "module":
            return base.configure_optimizers(self)
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    cls = type(f"Timed{base.__name__}", (base,), {"configure_optimizers": configure_optimizers})
    if kind in ("gpt", "gpt_tied"):
        return cls(n_layer=args.layers, n_head=4, n_embd=args.dim, block_size=args.block, vocab_size=256, dropout=0.0,
                   **({"tie_weights": True} if kind == "gpt_tied" else {}))  # fmt: skip
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=256, n_positions=args.block, n_embd=args.dim, n_layer=args.layers, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return cls(GPT2LMHeadModel(config))


class Tokens(torch.utils.data.Dataset):
    """Random byte tokens with next-token targets: the same stream for every revision."""

    def __init__(self, count: int, block: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 256, (count, block + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i, :-1], self.data[i, 1:]


def steady_state(package: Any, corrections: str) -> dict[str, Any]:
    """Strategy options that make ``package`` time PACI's steady state from the first step, as the pinned revision
    runs it. A revision with a synchronous start (``sync_start_steps``, "auto": 40 flush-order steps with Adam or
    AdamW) would otherwise run every timed window of a 10-step fit in flush's order, against the baseline's PACI
    (its bubble: x0.78 measured with ``--optimizer module``, not a regression of the hot path); the start is a
    stated cost of the defaults, measured in the benchmark report. ``corrections="off"`` also turns off a
    staleness correction the baseline does not have (with AdamW the default weight prediction), so that both time
    the path every run shares; ``"defaults"`` keeps the revision's own (what a user with AdamW runs once the
    synchronous start is over: the prediction's cost shows in the ratio)."""
    accepted = inspect.signature(package.PACIStrategy.__init__).parameters
    options: dict[str, Any] = {"sync_start_steps": 0} if "sync_start_steps" in accepted else {}
    if corrections == "off" and "staleness_correction" in accepted:
        options["staleness_correction"] = None
    return options


def timed_fit(package: Any, args: argparse.Namespace, world: int) -> dict[str, Any]:
    """One fit with ``package``'s strategy; this rank's window times and accounting."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    marks: list[tuple[float, ...]] = []
    stats: dict[str, float] = {}

    class WindowClock(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if (batch_idx + 1) % args.accumulate == 0:
                if len(marks) + 1 == args.warm:  # the stage's own accounting over the timed windows only
                    trainer.strategy.runtime.reset_stats()
                stats.update(trainer.strategy.runtime.stats())
                use = resource.getrusage(resource.RUSAGE_SELF)
                marks.append((time.perf_counter(), time.process_time(), use.ru_minflt, use.ru_stime))

    steps = args.warm + args.steps
    data = torch.utils.data.DataLoader(Tokens(steps * args.accumulate * args.batch_size, args.block, args.seed),
                                       batch_size=args.batch_size)  # fmt: skip
    options = steady_state(package, args.corrections)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu", devices=world, max_steps=steps, accumulate_grad_batches=args.accumulate,
            strategy=package.PACIStrategy(pipeline_stages=world, schedule=args.schedule, **options),
            callbacks=[WindowClock()], limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root,
            enable_progress_bar=not args.bare_trainer, enable_model_summary=not args.bare_trainer,
            **(dict(logger=False, enable_checkpointing=False) if args.bare_trainer else {}),
        )  # fmt: skip
        model = build_model(package, args.model, args)
        ops = os.environ.get("REVISION_OPS")  # a folder: each aten op's count and self CPU time, per package and rank
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if ops else None
        if profiler is not None:
            profiler.__enter__()
        trainer.fit(model, train_dataloaders=data)
        if profiler is not None:
            profiler.__exit__(None, None, None)
            table = {e.key: [e.count, e.self_cpu_time_total] for e in profiler.key_averages()}
            with open(os.path.join(ops, f"{package.__name__}.rank{os.environ['RANK']}.json"), "w") as f:
                json.dump(table, f)
    timed = marks[args.warm - 1 :]
    micro = (len(timed) - 1) * args.accumulate
    return {
        "package": package.__name__, "wall": timed[-1][0] - timed[0][0],
        # The median window: a burst of another process's work stretches a few windows, not the median.
        "window": statistics.median(b[0] - a[0] for a, b in zip(timed, timed[1:], strict=False)),
        "cpu_per_microbatch": (timed[-1][1] - timed[0][1]) / micro,
        # Page faults and kernel time per micro-batch: memory the allocator returns and takes again shows here.
        "page_faults_per_microbatch": (timed[-1][2] - timed[0][2]) / micro,
        "system_per_microbatch": (timed[-1][3] - timed[0][3]) / micro,
        "utilization": stats.get("utilization"), "wait_seconds": stats.get("wait_seconds"),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--packages", nargs=2, required=True, help="the two packages' import names (baseline first)")
    p.add_argument("--segments", type=int, default=8, help="timed fits of each package")
    p.add_argument("--model", choices=["gpt", "gpt_tied", "hf_gpt2"], default="hf_gpt2")
    p.add_argument("--optimizer", choices=["sgd", "module"], default="sgd")
    p.add_argument("--schedule", default="paci")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--warm", type=int, default=2, help="optimizer steps not timed")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps timed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bare-trainer", action="store_true", help="no logger, progress bar, checkpoint or summary")
    p.add_argument("--corrections", choices=["off", "defaults"], default="off", help="see steady_state")
    args = p.parse_args()

    torch.set_num_threads(1)  # S real-compute stages on the machine's cores, one thread each
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    packages = [importlib.import_module(name) for name in args.packages]
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    for package in packages:  # discarded: the first fit of each pays its imports and the allocator's growth
        timed_fit(package, args, world)
    with open(f"{args.out}.{rank}", "w") as f:
        for segment in range(args.segments):
            order = packages if segment % 2 == 0 else packages[::-1]
            for package in order:
                record = timed_fit(package, args, world)
                f.write(json.dumps({"segment": segment, "rank": rank, **record}) + "\n")
                f.flush()


if __name__ == "__main__":
    main()
