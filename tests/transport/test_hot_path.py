"""What the Trainer path runs per micro-batch on processes: no blocking collective, one asynchronous one
per window (and once per fit, at its first batch, the stages' comparison of the batch they read).

The Lightning layer must cost at most a few percent against the bare runtime (benchmarks/lightning_overhead.py
measures it); a collective per micro-batch is the kind of cost that grows with short windows, and a blocking
one ties the stages together and undoes PACI's overlap. Counted here on two real ranks under the Trainer's
default arguments (progress bar, logger, checkpointing, validation inside fit): every collective call
while an epoch's training batches run: validation (it drains the pipeline by design) and the epoch's end
(where ModelCheckpoint saves) excluded.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lit_efficient import PACIStrategy
from tests.support.gpt_runs import gpt_model as _model
from tests.support.gpt_runs import ordered_data as _ordered
from tests.support.multiproc import spawn, values

pytestmark = pytest.mark.multiproc

COLLECTIVES = ("broadcast", "all_reduce", "barrier", "all_gather", "broadcast_object_list", "all_gather_object")


class _CountCollectives(Callback):
    """Counts calls of torch.distributed's collectives while training batches run (not in validation)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(COLLECTIVES, 0)
        self.on = False
        for name in COLLECTIVES:
            original = getattr(dist, name)

            @functools.wraps(original)
            def counted(*args, _name=name, _original=original, **kwargs):
                if self.on:
                    self.counts[_name] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    # On from each epoch's start; off in validation and after the epoch's last batch (the epoch's end syncs
    # callback metrics and ModelCheckpoint saves there: per epoch, not per micro-batch).
    def on_train_epoch_start(self, trainer, pl_module):
        self.on = True

    def on_validation_start(self, trainer, pl_module):
        self.paused, self.on = self.on, False

    def on_validation_end(self, trainer, pl_module):
        self.on = getattr(self, "paused", False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch or trainer.global_step >= trainer.max_steps:
            self.on = False


def _count(rank: int, world: int, tmp: str, accumulate: int, steps: int) -> dict:
    import lightning as L

    counter = _CountCollectives()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=PACIStrategy(pipeline_stages=2), max_steps=steps,
        accumulate_grad_batches=accumulate, callbacks=[counter], default_root_dir=tmp, limit_val_batches=2,
    )  # fmt: skip
    trainer.fit(_model(), datamodule=_ordered())
    return {"counts": counter.counts, "batches": trainer.fit_loop.epoch_loop.total_batch_idx + 1}


def test_one_asynchronous_collective_per_window_and_none_per_micro_batch(tmp_path):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    accumulate, steps = 4, 4
    results = values(spawn(_count, 2, str(tmp_path), accumulate, steps, timeout=240, torchrun_env=True))
    for rank, out in enumerate(results):
        assert out["batches"] == accumulate * steps, out
        # Lightning's SIGTERM flag broadcast, once per window instead of before every micro-batch.
        assert out["counts"]["broadcast"] == steps, (rank, out)
        # The stages' comparison of the first batch (trainer_glue.check_stages_read_alike): once per epoch, and the
        # 16 micro-batches are two epochs of 12.
        assert out["counts"]["all_gather_object"] == 2, (rank, out)
        others = {k: v for k, v in out["counts"].items() if k not in ("broadcast", "all_gather_object")}
        assert others == dict.fromkeys(COLLECTIVES[1:-1], 0)
