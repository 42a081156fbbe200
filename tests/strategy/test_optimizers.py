"""configure_optimizers under the pipeline: one optimizer per stage; anything else is the package's message,
in one process as on processes (torch's "optimizer got an empty parameter list" was what one process said)."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer

from lit_efficient import PACIStrategy
from lit_efficient.data import TextDataModule
from tests.support.modules import TwoOptimizers as _TwoOptimizers


def _fit(devices: int) -> None:
    Trainer(
        accelerator="cpu", devices=devices, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=PACIStrategy(pipeline_stages=2, start_method="forkserver"),
    ).fit(_TwoOptimizers(n_layer=2, n_head=2, n_embd=32, block_size=32),
          datamodule=TextDataModule(block_size=32, batch_size=4, max_bytes=60_000))  # fmt: skip


def test_two_optimizers_split_by_module_get_the_packages_message_in_one_process():
    with pytest.raises(ValueError, match="one optimizer per stage") as err:
        _fit(1)
    assert "all on other stages" in str(err.value) and "param groups are fine" in str(err.value)


@pytest.mark.multiproc
def test_two_optimizers_split_by_module_get_the_packages_message_on_processes():
    with pytest.raises(Exception, match="one optimizer per stage"):
        _fit(2)
