"""Small LightningModules and data sets that several tests train."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import TensorDataset

from lit_efficient.models import GPT


class TwoOptimizers(GPT):
    """One optimizer for the embedding, one for the head: each is empty on the other stage."""

    def configure_optimizers(self):
        return [torch.optim.SGD(self.embed.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)]


def token_dataset(num_samples: int, block: int, vocab: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (num_samples, block), generator=g)
    return TensorDataset(x, torch.roll(x, -1, dims=1))


class LayerList(LightningModule):
    """``self.layers`` run one after another, through the pipeline protocol (the input is the batch's first item);
    a subclass builds the layers and gives the loss and the optimizer."""

    layers: nn.ModuleList

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_input(self, batch):
        return batch[0]

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)


class BatchNormNet(LayerList):
    """A pipelineable MLP with a BatchNorm on each side of the cut (stage 0 recomputes under recompute=True)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([
            nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh()),
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh()),
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh()),
            nn.Linear(16, 1),
        ])  # fmt: skip

    def pipeline_loss(self, output, batch):
        return nn.functional.mse_loss(output, batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
