"""recompute=True recomputes a stage's forward at backward: buffers that forward updates (BatchNorm's running
statistics and counter) must end as after one forward, as on one device, on processes and in one process."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

from lit_efficient import PACIStrategy
from tests.support.modules import BatchNormNet as _BatchNormNet

N = 4  # micro-batches per optimizer step


def _fit(strategy, devices: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)
    model = _BatchNormNet()
    Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, accumulate_grad_batches=N, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(model, data)  # fmt: skip
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    assert int(got["layers.0.1.num_batches_tracked"]) == 2 * N  # one update per micro-batch, not two
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)


def test_recompute_updates_running_statistics_once_in_one_process():
    reference = _fit("auto", 1)
    _assert_equal(_fit(PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", recompute=True), 1), reference)


@pytest.mark.multiproc
def test_recompute_updates_running_statistics_once_on_processes():
    reference = _fit("auto", 1)
    strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", recompute=True, start_method="forkserver")
    _assert_equal(_fit(strategy, 2), reference)
