"""A module whose forward does something between its pipeline layers is a model the pipeline does not train.

The pipeline runs ``pipeline_layers()`` one after another and never calls ``forward``: a residual across two layers
in forward was dropped silently (an audit's CNN: the pipeline trained ``head(block2(block1(x)))``, equal to plain
Lightning's run of that composition, 0.72 in the weights from the user's own model). A trace of forward on fake
tensors at the fit's first batch says so, on processes as in one process.
"""

from __future__ import annotations

import logging
import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_efficient import PACIStrategy
from tests.support.multiproc import spawn, values

pytestmark = pytest.mark.usefixtures("one_thread")


class _Blocks(L.LightningModule):
    """Three layers, a residual around the second in forward when ``residual``."""

    def __init__(self, residual: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.residual = residual
        self.first, self.second = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.first(x)
        h = h + self.second(h) if self.residual else self.second(h)
        return self.head(h)

    def pipeline_layers(self):
        return [self.first, self.second, self.head]

    def pipeline_input(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return nn.functional.cross_entropy(output, batch[1])

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(self.pipeline_input(batch)), batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)), 4)


def _said(devices: int, residual: bool, model: L.LightningModule | None = None, datamodule=None) -> list[str]:
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"),
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model or _Blocks(residual), datamodule=datamodule)
    return [str(w.message) for w in caught if "forward is not its pipeline_layers()" in str(w.message)]


def _said_on_rank(rank: int, world: int, residual: bool) -> list[str]:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # a rank's own process: not the test's loggers
    return _said(world, residual)


def test_a_residual_in_forward_is_said_in_one_process():
    said = _said(1, residual=True)
    assert len(said) == 1 and "layer 2 (Linear) is given something other than layer 1's output" in said[0], said
    assert _said(1, residual=False) == []  # forward chains the layers: nothing said


@pytest.mark.multiproc
def test_a_residual_in_forward_is_said_on_processes():
    # Rank 0 hosts the last stage: the other stage's layers are traced as their structure, without weights.
    said = values(spawn(_said_on_rank, 2, True, timeout=180, torchrun_env=True))[0]
    assert len(said) == 1 and "layer 2 (Linear) is given something other than layer 1's output" in said[0], said


def test_a_hugging_face_model_is_not_said():
    """A foreign model's forward runs its own blocks, not the package's adapters (the pipeline's layers): nothing to
    follow, so nothing is said (and across tests/models, the Hugging Face zoo included, nothing was)."""
    transformers = pytest.importorskip("transformers")
    from lit_efficient.data import TextDataModule
    from lit_efficient.models import HFCausalLM

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=16)
    model = HFCausalLM(transformers.GPT2LMHeadModel(config))
    assert _said(1, False, model, TextDataModule(block_size=16, batch_size=2, max_bytes=20_000)) == []
