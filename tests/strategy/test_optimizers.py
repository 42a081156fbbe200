"""configure_optimizers under the pipeline: one optimizer per stage; anything else is the package's message,
in one process as on processes (torch's "optimizer got an empty parameter list" was what one process said)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from lit_efficient import PACIStrategy
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT
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


class _FrozenEmbeddingsAndFirstBlock(GPT):
    """A fine-tuner's model: the embeddings and first block frozen (all of stage 0 at balance [2, 2])."""

    def __init__(self, trainable_only: bool, **kw) -> None:
        super().__init__(**kw)
        self.trainable_only = trainable_only
        for layer in list(self.pipeline_layers())[:2]:
            layer.requires_grad_(False)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad or not self.trainable_only]
        return torch.optim.AdamW(params, lr=1e-2)


def _frozen_fit(strategy, trainable_only: bool) -> dict:
    torch.manual_seed(0)
    model = _FrozenEmbeddingsAndFirstBlock(trainable_only, n_layer=2, n_head=2, n_embd=32, block_size=32)
    Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=2, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    ).fit(model, datamodule=TextDataModule(block_size=32, batch_size=4, max_bytes=60_000))  # fmt: skip
    return model.state_dict()


def test_a_stage_of_frozen_layers_is_told_to_give_the_optimizer_every_parameter():
    """``filter(lambda p: p.requires_grad, ...)`` leaves a frozen stage's optimizer empty: the message said the
    optimizer was built over other stages' modules and to put all parameters into one optimizer, which the user had
    done. It names the stage and the fix, and the fix trains as one device does."""
    flush = lambda: PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", balance=[2, 2])  # noqa: E731
    with pytest.raises(ValueError, match=r"Stage 0 of 2 \(layers 0 to 1 of pipeline_layers\(\)\) has only frozen"):
        _frozen_fit(flush(), trainable_only=True)
    got, want = _frozen_fit(flush(), trainable_only=False), _frozen_fit("auto", trainable_only=True)
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6


class _GroupsByModuleType(GPT):
    """minGPT's rule without its special case for the tied head: Linear weights decayed, Embedding weights not."""

    def configure_optimizers(self):
        decay, rest = [], []
        for module in self.modules():
            for name, p in module.named_parameters(recurse=False):
                (decay if isinstance(module, torch.nn.Linear) and name == "weight" else rest).append(p)
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])


def _two_stages() -> Trainer:
    return Trainer(
        accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=2), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip


def _fit_tied(trainer: Trainer, cls: type[GPT]) -> None:
    """``cls`` with its token table tied to its LM head (the first and the last stage), fitted by ``trainer``."""
    torch.manual_seed(0)
    model = cls(n_layer=2, n_head=2, n_embd=32, block_size=32, tie_weights=True)
    trainer.fit(model, datamodule=TextDataModule(block_size=32, batch_size=4, max_bytes=60_000))


def test_a_tied_weight_whose_copies_get_other_settings_is_refused():
    """On one device the tied token table is one parameter in one group (``named_parameters`` names it once). Each
    stage's configure_optimizers sees its own copy: on the last stage the LM head's ``nn.Linear`` weight, which this
    rule decays. The copies drifted apart silently (4e-2 from one device after four steps, in one process and on
    two alike); now the fit is refused before training, naming both copies and the settings each got."""
    trainer = _two_stages()
    with pytest.raises(ValueError, match="tied across stages") as err:
        _fit_tied(trainer, _GroupsByModuleType)
    assert "weight_decay=0.0 for embed.wte.weight on stage 0, 0.1 for head.lm_head.weight on stage 1" in str(err.value)
    assert trainer.global_step == 0


class _NamedOneGroup(GPT):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.named_parameters(), lr=1e-3, weight_decay=0.0)


def test_a_tied_weight_in_named_parameter_groups_is_not_told_apart_by_the_names():
    """``AdamW(self.named_parameters())``: torch keeps each group's parameter names, which differ from stage to stage
    by nature; the tied-settings check compared them too and refused every such model."""
    trainer = _two_stages()
    _fit_tied(trainer, _NamedOneGroup)
    assert trainer.global_step == 2
