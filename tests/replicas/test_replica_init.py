"""Data-parallel replicas of a stage start from the same weights, however each process built its model.

Under torchrun or SLURM every process constructs the model itself; a script that does not seed every
process alike (no ``seed_everything``, or one seed per rank) builds R different initializations. DDP
broadcasts rank 0's weights when it wraps the model; PACIStrategy broadcasts each stage's weights and
buffers from the stage's first replica at setup. Without that the replicas would average gradients of
different models and train R models, silently. Here: 2 stages x 2 replicas, each rank seeded
differently, under the Trainer's default arguments.
"""

from __future__ import annotations

import os

import pytest
import torch

from lit_efficient import PACIStrategy
from lit_efficient.models import GPT
from tests.support.gpt_runs import BLOCK
from tests.support.gpt_runs import text_data as _data
from tests.support.multiproc import spawn, values

pytestmark = pytest.mark.multiproc


def _fit(rank: int, world: int, tmp: str) -> dict:
    import lightning as L

    torch.manual_seed(1000 + rank)  # each process its own initialization, as an unseeded script gets
    model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, warmup_steps=2, max_steps=20, learning_rate=3e-3)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    seen: dict = {}

    class StageWeights(L.Callback):
        def on_train_end(self, trainer, pl_module):  # drained here (docs/DESIGN.md section 7)
            first, last = trainer.strategy._split.bounds_of(trainer.strategy.stage)
            mine = {id(p) for layer in list(pl_module.pipeline_layers())[first:last] for p in layer.parameters()}
            seen.update({k: p.detach().clone() for k, p in pl_module.named_parameters() if id(p) in mine})

    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"),
        max_steps=2, accumulate_grad_batches=2, default_root_dir=tmp, limit_val_batches=2, callbacks=[StageWeights()],
    )  # fmt: skip
    trainer.fit(model, datamodule=_data())
    strategy = trainer.strategy
    return {"stage": strategy.stage, "replica": strategy.replica, "trained": seen, "initial": initial}


def test_replicas_start_from_the_first_replicas_weights(tmp_path):
    os.environ["OMP_NUM_THREADS"] = "1"
    results = values(spawn(_fit, 4, str(tmp_path), timeout=300, torchrun_env=True))
    by_stage: dict[int, list[dict]] = {}
    for r in results:
        by_stage.setdefault(r["stage"], []).append(r)
    assert sorted(by_stage) == [0, 1] and all(len(v) == 2 for v in by_stage.values())
    for stage, (a, b) in by_stage.items():
        assert a["trained"].keys() == b["trained"].keys() and a["trained"], stage
        # The processes did build different models...
        assert any(not torch.equal(a["initial"][k], b["initial"][k]) for k in a["trained"]), stage
        # ...and the replicas still trained one: the same weights after two steps, bit for bit.
        for k in a["trained"]:
            assert torch.equal(a["trained"][k], b["trained"][k]), (stage, k)
