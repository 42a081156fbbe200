"""Lightning's ModelPruning in one process (refused on processes): its checkpoints during fit hold the whole
model, as one device's, and resume as one device's do.

Its ``on_save_checkpoint`` puts torch's pruned ``X.weight`` in place of the live ``X.weight_orig`` and
``X.weight_mask``. The stages' views kept only keys a module tensor has, so from the first pruning on every file
held an empty ``state_dict``; once they kept it, the optimizer's state was still saved under ``X.weight_orig``,
which a resuming module (not pruned yet) does not have: "the checkpoint has no optimizer state for X.weight"."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning

from lit_efficient import PACIStrategy
from tests.support.gpt_runs import gpt_model, gpt_trainer, ordered_data

pytestmark = pytest.mark.usefixtures("one_thread")


def _fit(strategy, root, max_steps: int, max_epochs: int, ckpt=None) -> dict:
    callbacks = [
        ModelPruning("l1_unstructured", amount=0.3, use_global_unstructured=False),
        ModelCheckpoint(root, every_n_train_steps=1, save_top_k=-1, filename="{step}"),
    ]
    trainer = gpt_trainer(
        strategy, 1, max_steps, callbacks=callbacks, enable_checkpointing=True, max_epochs=max_epochs,
        accumulate_grad_batches=2,
    )  # fmt: skip
    trainer.fit(gpt_model(), datamodule=ordered_data(), ckpt_path=ckpt)
    return {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}


def test_a_pruned_runs_checkpoints_hold_the_model_and_resume_as_one_devices(tmp_path):
    flush = lambda: PACIStrategy(pipeline_stages=2, schedule="1f1b_flush")  # noqa: E731
    _fit("auto", tmp_path / "one", 8, 2)
    _fit(flush(), tmp_path / "piped", 8, 2)
    after = "step=7.ckpt"  # after the first epoch's pruning (epochs of 6 steps)
    one = torch.load(tmp_path / "one" / after, weights_only=True)["state_dict"]
    piped = torch.load(tmp_path / "piped" / after, weights_only=True)["state_dict"]
    assert piped.keys() == one.keys() and all(torch.equal(piped[k], one[k]) for k in one)
    want = _fit("auto", tmp_path / "again", 10, 3, ckpt=tmp_path / "one" / after)
    for strategy in ("auto", flush()):
        got = _fit(strategy, tmp_path / "resumed", 10, 3, ckpt=tmp_path / "piped" / after)
        assert got.keys() == want.keys() and max((got[k] - want[k]).abs().max().item() for k in want) == 0.0
