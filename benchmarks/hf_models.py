"""Hugging Face models through HFCausalLM: boundary traffic, tied embeddings under PACI, adapter overhead.

Three measurements, each a subcommand (``all`` runs them in turn):

- ``p2p``: backward point-to-point bytes per micro-batch of a 2-layer Llama split in 2 stages
  (SDPA and eager attention), before and after gradients are sent back only for boundary tensors
  that require grad on the sending side. "Before" is the same code with the receiver's leaf rule
  put back to the old one (every floating tensor collects a gradient), so only that rule differs.
  Measured: ``PointToPoint.bytes_sent`` of the last stage (it sends only gradients), runtime only.
- ``tied``: a tied GPT-2 (stock ``GPT2LMHeadModel``, random init) trained by the real Trainer with
  ``PACIStrategy(pipeline_stages=2)``, paci against 1f1b_flush at N=4 and N=8: validation loss at
  equal tokens (same seed, init and data order; one spawned pair of processes runs all fits).
- ``throughput``: training tokens/s of paci and flush at S=2, N=4 for `HFCausalLM` (Llama config)
  and for `GPT` of about the same size, all four fits in one pair of processes; the paci/flush
  ratio of each and their quotient (1.0 = the adapter adds nothing to what PACI gains). Timing
  starts after a warm-up of ``--warmup-steps`` optimizer steps, on rank 0 (the last stage).

    python -m benchmarks.hf_models all           # ~15 minutes on 2 shared cores
    python -m benchmarks.hf_models tied --quick  # smoke run
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.convergence import Recorder
from benchmarks.harness import envelope, machine, write_json
from benchmarks.trainer_vs_torch_pipelining import spawn_pair

# -- models ---------------------------------------------------------------------------------------


def llama_config(layers: int, dim: int, attn: str) -> dict[str, Any]:
    """A small Llama-architecture config (grouped-query attention, untied)."""
    return dict(model_type="llama", num_hidden_layers=layers, hidden_size=dim, intermediate_size=4 * dim,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                attn_implementation=attn, bos_token_id=0, eos_token_id=0)  # fmt: skip


def gpt2_config(layers: int, dim: int) -> dict[str, Any]:
    """A small GPT-2 config with the stock tie of the LM head to the token embedding, no dropout."""
    return dict(model_type="gpt2", n_layer=layers, n_embd=dim, n_head=4, vocab_size=256, n_positions=256,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip


# -- p2p: backward bytes per micro-batch -----------------------------------------------------------


def _old_as_leaf(t):
    """The receiver's rule before the change: every floating tensor collects a gradient."""
    if t is None:
        return None
    t = t.detach()
    return t.requires_grad_() if t.is_floating_point() else t


def _p2p_worker(rank: int, world: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    import lightning as L

    import lit_efficient.runtime.stage as stage_module
    from lit_efficient.models import HFCausalLM
    from lit_efficient.runtime.interpreter import PipelineRuntime
    from lit_efficient.runtime.topology import Topology
    from lit_efficient.tools.corpus import embedded_corpus
    from lit_efficient.tools.demo import batches
    from lit_efficient.transport.process import PointToPoint

    new_as_leaf = stage_module._as_leaf
    topo = Topology.for_world(world, world)
    s = topo.stage_of(rank)
    rows = []
    for attn, rule in itertools.product(("sdpa", "eager"), ("before", "after")):
        stage_module._as_leaf = _old_as_leaf if rule == "before" else new_as_leaf
        L.seed_everything(0, verbose=False)
        module = HFCausalLM(llama_config(2, config["dim"], attn))
        layers = module.pipeline_layers()  # [embed, layer 0 | layer 1, head]
        mine = layers[:2] if s == 0 else layers[2:]
        params = [p for layer in mine for p in layer.parameters()]
        stage = stage_module.PipelineStage(mine, s, world, torch.optim.SGD(params, lr=1e-3), module.pipeline_loss)
        comm = PointToPoint(s, topo.stage_of, torch.device("cpu"), 120.0)
        runtime = PipelineRuntime(stage, "paci", 4, module.pipeline_input, comm, *topo.neighbours(rank))
        data = batches(embedded_corpus(400_000), config["block"], config["batch_size"], 0)
        n = config["microbatches"]
        for j, batch in enumerate(itertools.islice(data, n)):
            runtime.feed(batch, j)
        runtime.drain()
        rows.append({"attn": attn, "rule": rule, "stage": s, "bytes_per_microbatch": comm.bytes_sent / n})
    stage_module._as_leaf = new_as_leaf
    return rows


def run_p2p(args: argparse.Namespace) -> dict[str, Any]:
    config = {"dim": args.dim, "block": args.block, "batch_size": args.batch_size, "microbatches": 8}
    per_rank = spawn_pair(_p2p_worker, config, timeout=900)
    last = [r for r in per_rank[0]]  # rank 0 is the last stage: it sends gradients only
    first = [r for r in per_rank[1]]  # rank 1 is stage 0: activations only
    out = {}
    for attn in ("sdpa", "eager"):
        back = {r["rule"]: r["bytes_per_microbatch"] for r in last if r["attn"] == attn}
        fwd = {r["rule"]: r["bytes_per_microbatch"] for r in first if r["attn"] == attn}
        out[attn] = {
            "backward_bytes_before": back["before"], "backward_bytes_after": back["after"],
            "backward_saved_fraction": 1 - back["after"] / back["before"], "forward_bytes": fwd["after"],
        }  # fmt: skip
    return {"config": config, "results": out}


# -- tied GPT-2: paci against flush ----------------------------------------------------------------


def _fit(config: dict[str, Any], model_kind: str, schedule: str, accumulate: int, steps: int, callbacks: list) -> float:
    import lightning as L

    from lit_efficient import PACIStrategy
    from lit_efficient.data import TextDataModule
    from lit_efficient.models import GPT, HFCausalLM

    L.seed_everything(config["seed"], verbose=False)
    hp = dict(learning_rate=config["lr"], warmup_steps=config["warmup"], max_steps=steps, min_lr_ratio=0.1)
    if model_kind == "gpt":
        model = GPT(n_layer=config["layers"], n_head=4, n_embd=config["dim"], block_size=config["block"], **hp)
    elif model_kind.startswith("hf_gpt2"):
        tie = {"tie_word_embeddings": model_kind == "hf_gpt2"}
        model = HFCausalLM(dict(gpt2_config(config["layers"], config["dim"]), **tie), **hp)
    else:
        model = HFCausalLM(llama_config(config["layers"], config["dim"], "sdpa"), **hp)
    data = TextDataModule(block_size=config["block"], batch_size=config["batch_size"], max_bytes=config["max_bytes"],
                          seed=config["seed"])  # fmt: skip
    evaluate = config.get("eval_every")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=steps, accumulate_grad_batches=accumulate,
        strategy=PACIStrategy(pipeline_stages=2, schedule=schedule), callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=config["val_batches"] if evaluate else 0,
        num_sanity_val_steps=config["val_batches"] if evaluate else 0,
        val_check_interval=(evaluate or 1) * accumulate, check_val_every_n_epoch=None,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    torch.set_num_threads(1)
    return time.perf_counter() - start


def _tied_worker(rank: int, world: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    # The untied run at N=4 separates what PACI's staleness costs anyway from what the tied rule adds.
    variants = [*((n, "hf_gpt2") for n in config["accumulate"]), (4, "hf_gpt2_untied")]
    for (accumulate, kind), schedule in itertools.product(variants, ("1f1b_flush", "paci")):
        recorder = Recorder()
        # Equal tokens at both N: the optimizer steps scale with 1/N.
        steps = config["tokens_steps"] // accumulate
        seconds = _fit(dict(config, eval_every=max(1, steps // 6)), kind, schedule, accumulate, steps, [recorder])
        out.append({"accumulate": accumulate, "model": kind, "schedule": schedule, "steps": steps,
                    "val": recorder.val, "fit_seconds": seconds, "loadavg": os.getloadavg()})  # fmt: skip
    return out


def run_tied(args: argparse.Namespace) -> dict[str, Any]:
    config = dict(vars(args), accumulate=[4, 8], tokens_steps=args.steps * 4)
    runs = spawn_pair(_tied_worker, config, timeout=3600)[0]
    summary = {}
    for accumulate, kind in [*((n, "hf_gpt2") for n in config["accumulate"]), (4, "hf_gpt2_untied")]:
        final = {r["schedule"]: r["val"][-1][2] for r in runs if (r["accumulate"], r["model"]) == (accumulate, kind)}
        summary[f"{'tied' if kind == 'hf_gpt2' else 'untied'} N={accumulate}"] = {
            "final_val_loss": final, "relative_difference": (final["paci"] - final["1f1b_flush"]) / final["1f1b_flush"],
            "tokens": config["tokens_steps"] * args.batch_size * args.block,
        }  # fmt: skip
    return {"config": config, "runs": runs, "summary": summary}


# -- throughput: HFCausalLM against GPT ------------------------------------------------------------


class Throughput(Callback):
    """Rank 0: training seconds from the end of optimizer step ``warmup`` to the end of training."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.steps_at_start = 0
        self.seconds = 0.0
        self.steps = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: D102
        if self.start is None and trainer.global_step >= self.warmup:
            self.start, self.steps_at_start = time.perf_counter(), trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: D102
        trainer.strategy.runtime.drain()  # count the drain: a run's last window ends when every stage stepped
        if self.start is not None:
            self.seconds = time.perf_counter() - self.start
            self.steps = trainer.global_step - self.steps_at_start


def _throughput_worker(rank: int, world: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for model_kind, schedule in itertools.product(("gpt", "hf_llama"), ("1f1b_flush", "paci")):
        meter = Throughput(config["warmup_steps"])
        _fit(config, model_kind, schedule, 4, config["steps"], [meter])
        tokens = meter.steps * 4 * config["batch_size"] * config["block"]
        out.append({"model": model_kind, "schedule": schedule, "tokens_per_second": tokens / max(meter.seconds, 1e-9),
                    "timed_steps": meter.steps, "loadavg": os.getloadavg()})  # fmt: skip
    return out


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    config = dict(vars(args), warmup_steps=args.warmup_steps)
    runs = spawn_pair(_throughput_worker, config, timeout=3600)[0]
    rate = {(r["model"], r["schedule"]): r["tokens_per_second"] for r in runs}
    ratio = {m: rate[(m, "paci")] / rate[(m, "1f1b_flush")] for m in ("gpt", "hf_llama")}
    return {"config": config, "runs": runs, "paci_over_flush": ratio,
            "hf_over_gpt_of_ratios": ratio["hf_llama"] / ratio["gpt"]}  # fmt: skip


# -- entry point ------------------------------------------------------------------------------------

PARTS = {"p2p": run_p2p, "tied": run_tied, "throughput": run_throughput}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", choices=[*PARTS, "all"])
    p.add_argument("--quick", action="store_true", help="smoke run: few steps")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps at N=4 (tied: same tokens at N=8)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20, help="LR warmup steps")
    p.add_argument("--warmup-steps", type=int, default=10, help="throughput: optimizer steps before timing")
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--suffix", default="", help="appended to the result's file name (e.g. _lr5e-4)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.val_batches, args.warmup, args.warmup_steps = 24, 2, 4, 4
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    results = {}
    for part in PARTS if args.part == "all" else [args.part]:
        start, before = time.perf_counter(), machine()
        payload = PARTS[part](args)
        name = f"hf_{part}{args.suffix}" + ("_quick" if args.quick else "")
        result = envelope("hf_models", args.quick, before, payload.pop("config"), start, part=part, **payload)
        result["command"] = "python -m benchmarks.hf_models " + " ".join(argv if argv is not None else sys.argv[1:])
        write_json(f"{name}.json", result)
        results[part] = result
        print(part, {k: v for k, v in result.items() if k not in ("runs", "machine", "config")})
    return results


if __name__ == "__main__":
    main()
