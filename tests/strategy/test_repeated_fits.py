"""A notebook's long-lived process on 2 ranks (torchrun's environment: every rank keeps its stage between fits).

A fit that failed left rank 0's model split for good: the strategy remembered the failure in every later run, and
their teardowns skipped gathering the whole model there (``model(x)`` then refused, 14 of 29 keys missing).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lit_efficient import PACIStrategy
from tests.support.gpt_runs import gpt_model, gpt_trainer, ordered_data
from tests.support.multiproc import spawn, values

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("one_thread")]


class _FailOnce(Callback):
    def __init__(self) -> None:
        self.armed = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.armed and batch_idx == 3:
            self.armed = False
            raise RuntimeError("the user's callback failed")


def _fail_then_fit_again(rank: int, world: int) -> dict:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    model = gpt_model()
    trainer = gpt_trainer(PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"), world, 3, callbacks=[_FailOnce()])
    with pytest.raises(RuntimeError, match="the user's callback failed"):
        trainer.fit(model, datamodule=ordered_data())
    trainer.fit(model, datamodule=ordered_data())
    missing = sorted(set(gpt_model().state_dict()) - set(model.state_dict()))
    works = rank != 0 or model(torch.zeros(1, 4, dtype=torch.long)).shape[-1] == model.hparams.vocab_size
    return {"missing": missing, "works": works}


def test_a_fit_after_a_failed_one_gives_rank_zero_the_whole_model():
    ranks = values(spawn(_fail_then_fit_again, 2, timeout=240, torchrun_env=True))
    assert ranks[0] == {"missing": [], "works": True}, ranks[0]  # rank 0 holds the whole model after fit
