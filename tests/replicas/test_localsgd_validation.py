"""Validation inside fit under LocalSGD/DiLoCo scores one model, the first replica's: the one a checkpoint holds.

Between syncs the replicas' weights differ. Each replica scored its own on its share of the validation set, and
the logged ``val_loss`` (``sync_dist=True``, the replicas' mean) was a blend of two models, by which ModelCheckpoint
ranked and named the first replica's model it saved: ``validate(ckpt_path="best")`` then gave 4.0952 for a file
named 2.9632 (a user audit). Now every replica scores the first replica's weights, and gets its own back before
any other callback's ``on_validation_end``: training goes on from each replica's own weights, as without validation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_efficient import PACIStrategy
from tests.support.gpt_runs import gpt_model, gpt_trainer, text_data
from tests.support.multiproc import spawn, values

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("one_thread")]


def _fits(rank: int, world: int, root: str) -> dict:
    result = {}
    for outer in ("average", "nesterov"):  # LocalSGD, DiLoCo; no sync before the end: every validation between syncs
        weights = []
        for validating in (True, False):
            model = gpt_model(learning_rate=3e-2)
            strategy = PACIStrategy(pipeline_stages=1, local_sgd_steps=16, outer_optimizer=outer)
            best = ModelCheckpoint(dirpath=Path(root, outer), monitor="val_loss", filename="{step}-{val_loss:.6f}")
            trainer = gpt_trainer(
                strategy, world, 8, accumulate_grad_batches=2, val_check_interval=4, num_sanity_val_steps=0,
                limit_val_batches=2 if validating else 0, callbacks=[best] if validating else [],
                enable_checkpointing=validating,
            )  # fmt: skip
            trainer.fit(model, datamodule=text_data())
            weights.append({k: v.clone() for k, v in model.state_dict().items()})  # this replica's own
            if validating:  # the best checkpoint's score, as fit ranked it and as its model gives it
                scored = trainer.validate(model, ckpt_path="best", datamodule=text_data(), verbose=False)
                result[outer] = (best.best_model_score.item(), scored[0]["val_loss"], best.best_model_path)
        result[f"{outer} moved"] = max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0])
    return result


def test_validation_inside_fit_scores_the_first_replicas_model_and_training_goes_on_from_each_ones_own(tmp_path):
    for rank, got in enumerate(values(spawn(_fits, 2, str(tmp_path), timeout=300, torchrun_env=True))):
        for outer in ("average", "nesterov"):
            ranked, scored, path = got[outer]
            assert ranked == pytest.approx(scored, abs=1e-6), (rank, outer, path)
            assert got[f"{outer} moved"] == 0.0, (rank, outer)  # validating changed no replica's training
