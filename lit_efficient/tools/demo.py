"""Runtime demo: a small byte-level transformer trained on real text by a pipeline of processes.

    torchrun --nproc-per-node 2 -m lit_efficient.tools.demo --schedule paci

or, without torchrun (spawns the processes itself, as notebooks and tests do):

    python -m lit_efficient.tools.demo --stages 2 --schedule 1f1b_flush

Every rank builds the same model from the same seed, keeps only its stage's layers and feeds
the same micro-batch stream into the runtime; the last stage (global rank 0) prints the loss and
every stage prints its measured utilization and weight-version drift at the end. Pure PyTorch:
this is the runtime without Lightning.
"""

from __future__ import annotations

import argparse
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lit_efficient.runtime.interpreter import PipelineRuntime
from lit_efficient.runtime.partition import partition_uniform, stage_bounds
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.topology import Topology
from lit_efficient.tools.corpus import embedded_corpus
from lit_efficient.transport.process import PointToPoint


class Embed(nn.Module):
    """Token and position embeddings."""

    def __init__(self, vocab: int, block: int, dim: int, dropout: float) -> None:
        super().__init__()
        self.tok, self.pos, self.drop = nn.Embedding(vocab, dim), nn.Embedding(block, dim), nn.Dropout(dropout)

    def forward(self, idx: Tensor) -> Tensor:
        return self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention and MLP."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the byte logits."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.ln(x))


def build_layers(
    n_layer: int = 4, dim: int = 64, heads: int = 4, block: int = 64, dropout: float = 0.0, seed: int = 0
) -> list[nn.Module]:
    """The demo model as pipeline layers: embedding, ``n_layer`` blocks, head (seeded: same on every rank)."""
    torch.manual_seed(seed)
    return [Embed(256, block, dim, dropout), *(Block(dim, heads, dropout) for _ in range(n_layer)), Head(dim, 256)]


def lm_loss(logits: Tensor, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Mean next-byte cross-entropy and the number of bytes it averaged over."""
    target = batch[1]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
    return loss, torch.tensor(target.numel())


def batches(data: bytes, block: int, batch_size: int, seed: int):
    """Endless random (x, y) windows of ``block`` bytes, the same sequence on every rank."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - block - 1, (batch_size,), generator=gen)
        x = torch.stack([tokens[s : s + block] for s in starts])
        y = torch.stack([tokens[s + 1 : s + block + 1] for s in starts])
        yield x, y


def train(args: argparse.Namespace) -> None:
    """One rank's share of the demo run."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # one thread per stage: the demo machine may have as many cores as stages
    topo = Topology.for_world(world, args.stages)
    stage_idx = topo.stage_of(rank)
    layers = build_layers(args.layers, args.dim, 4, args.block, args.dropout, args.seed)
    lo, hi = stage_bounds(partition_uniform(len(layers), args.stages))[stage_idx]
    mine = layers[lo:hi]
    params = [p for layer in mine for p in layer.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    stage = PipelineStage(mine, stage_idx, args.stages, optimizer, loss_fn=lm_loss, recompute=args.recompute)
    prev_rank, next_rank = topo.neighbours(rank)
    comm = PointToPoint(stage_idx, topo.stage_of, torch.device("cpu"), args.timeout) if args.stages > 1 else None
    runtime = PipelineRuntime(stage, args.schedule, args.accumulate, lambda b: b[0], comm, prev_rank, next_rank)
    stream = batches(embedded_corpus(2_000_000), args.block, args.batch_size, args.seed)
    window_losses: list[Tensor] = []
    for j in range(args.steps * args.accumulate):
        loss = runtime.feed(next(stream), j)
        if loss is not None:
            window_losses.append(loss)
        if stage.is_last and (j + 1) % args.accumulate == 0:
            mean = torch.stack(window_losses).mean().item()  # host sync once per step, for printing
            window_losses.clear()
            if (j + 1) // args.accumulate % args.log_every == 0:
                print(f"step {(j + 1) // args.accumulate:4d}  loss {mean:.4f}  (uniform bytes: {math.log(256):.3f})")
    runtime.drain()
    stats = runtime.stats()
    print(
        f"[rank {rank}] stage {stage_idx}: utilization {stats['utilization']:.1%}, wait {stats['wait_seconds']:.1f}s, "
        f"max in flight {stats['max_in_flight']}, drift max {stats['drift_max']} mean {stats['drift_mean']:.2f}",
        flush=True,
    )


def _worker(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedule", choices=["paci", "1f1b_flush"], default="paci")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (only without torchrun)")
    p.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step (N)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--recompute", action="store_true", help="recompute forwards at backward (less memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a peer stage")
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # launched by torchrun: one process per stage already
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        args.stages = dist.get_world_size()
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        return
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, args=(args.stages, f"file://{tmp}/rendezvous", args), nprocs=args.stages, start_method="spawn"
        )


if __name__ == "__main__":
    main()
