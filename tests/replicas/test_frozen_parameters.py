"""Frozen parameters (``requires_grad=False``) given to the optimizer stay as they are on data-parallel replicas, as
on one device: torch's optimizers step only parameters that received a gradient. The replicas' gradient reduce
materialized a zero gradient for every parameter it had none for, and AdamW's weight decay then moved the frozen
weights, with and without ``shard_optimizer_state``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_efficient import PACIStrategy
from lit_efficient.models import GPT
from tests.support.gpt_runs import gpt_trainer, ordered_data
from tests.support.multiproc import spawn, values

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("one_thread")]


class _FirstBlockFrozen(GPT):
    """A fine-tuner's model: the first block frozen, its optimizer GPT's own over every parameter."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        for p in self.blocks[0].parameters():
            p.requires_grad_(False)


def _model() -> GPT:
    torch.manual_seed(0)
    return _FirstBlockFrozen(n_layer=2, n_head=2, n_embd=32, block_size=32, warmup_steps=0, learning_rate=3e-3)


def _fits(rank: int, world: int, root: str) -> None:
    for shard in (False, True):
        model = _model()
        strategy = PACIStrategy(pipeline_stages=1, schedule="1f1b_flush", shard_optimizer_state=shard)
        gpt_trainer(strategy, world, 3).fit(model, datamodule=ordered_data())
        if rank == 0:
            torch.save(model.state_dict(), Path(root, f"shard={shard}.pt"))


def test_frozen_parameters_stay_frozen_on_replicas_sharded_or_not(tmp_path):
    values(spawn(_fits, 2, str(tmp_path), timeout=300, torchrun_env=True))
    start = _model().state_dict()
    plain, sharded = (torch.load(tmp_path / f"shard={s}.pt", weights_only=True) for s in (False, True))
    for name, value in start.items():
        if name.startswith("blocks.0."):
            assert torch.equal(plain[name], value) and torch.equal(sharded[name], value), name
    assert max((plain[k] - start[k]).abs().max().item() for k in start) > 1e-4  # the rest trained
    assert max((plain[k] - sharded[k]).abs().max().item() for k in start) <= 1e-6
