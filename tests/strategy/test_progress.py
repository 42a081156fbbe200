"""The progress bars' training total counts dataloader batches when max_steps counts windows of N."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from lit_efficient.strategy.progress import StepAwareRichProgressBar, StepAwareTQDMProgressBar, swap_stock_progress_bar


def _trainer(max_steps, global_step, accumulate, batches=1000, done=0, max_epochs=-1):
    progress = SimpleNamespace(current=SimpleNamespace(ready=done))
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress))
    return SimpleNamespace(max_epochs=max_epochs, max_steps=max_steps, global_step=global_step,
                           accumulate_grad_batches=accumulate, num_training_batches=batches, fit_loop=loop)  # fmt: skip


def test_total_is_the_batches_left_not_the_steps_left():
    bar = StepAwareTQDMProgressBar()
    bar._trainer = _trainer(max_steps=3, global_step=0, accumulate=4)
    assert bar.total_train_batches == 12  # Lightning's own bar says 3
    bar._trainer = _trainer(max_steps=300, global_step=100, accumulate=4)
    assert bar.total_train_batches == 800
    bar._trainer = _trainer(max_steps=300, global_step=0, accumulate=4, batches=500)
    assert bar.total_train_batches == 500  # the epoch ends first
    bar._trainer = _trainer(max_steps=-1, global_step=0, accumulate=4, batches=500, max_epochs=3)
    assert bar.total_train_batches == 500


def test_stock_bars_are_swapped_in_place_and_others_left_alone():
    for stock, ours in (
        (TQDMProgressBar(refresh_rate=7), StepAwareTQDMProgressBar),
        (RichProgressBar(), StepAwareRichProgressBar),
    ):
        trainer = SimpleNamespace(progress_bar_callback=stock)
        swap_stock_progress_bar(trainer)
        assert type(stock) is ours
    custom = type("MyBar", (TQDMProgressBar,), {})()
    swap_stock_progress_bar(SimpleNamespace(progress_bar_callback=custom))
    assert type(custom).__name__ == "MyBar"
    rich = StepAwareRichProgressBar()
    rich._trainer = _trainer(max_steps=3, global_step=0, accumulate=4)
    assert rich._get_train_description(0).strip() == "Epoch 0"


def _summarized(rank: int, world: int, frozen: bool) -> dict:
    import warnings

    from lightning.pytorch.callbacks import ModelSummary

    from lit_efficient import PACIStrategy
    from tests.support.gpt_runs import gpt_model, gpt_trainer, text_data

    warnings.filterwarnings("ignore")
    model = gpt_model(tie_weights=True)
    if frozen:
        model.embed.wpe.weight.requires_grad_(False)
    trainer = gpt_trainer(PACIStrategy(pipeline_stages=2), 2, 1, enable_model_summary=True)
    trainer.fit(model, datamodule=text_data())
    (callback,) = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
    summary = callback._summary(trainer, model)
    table = {k: v for k, v in summary._get_summary_data() if k in _COLUMNS}
    return {"total": summary.total_parameters, "trainable": summary.trainable_parameters, "mb": summary.model_size,
            "table": table, "modes": summary.total_training_modes}  # fmt: skip


_COLUMNS = ("Name", "Type", "Params", "Mode")


@pytest.mark.multiproc
def test_the_model_summary_on_processes_is_the_unsplit_models():
    """Under PACI on processes Lightning's summary showed rank 0's stage as "Total params" (90.7K of a 164.9K model),
    and rows that did not add up to the totals: the layers of the other stage as an empty ``LayerOnOtherStage``.
    Every rank now shows plain Lightning's table of the unsplit model (names, types, parameters per row, modes),
    the whole model's totals, a tied embedding once, a frozen table as non-trainable."""
    from lightning.pytorch.utilities.model_summary import summarize

    from tests.support.gpt_runs import gpt_model
    from tests.support.multiproc import spawn, values

    whole = gpt_model(tie_weights=True)
    plain = summarize(whole, max_depth=1)
    table = {k: v for k, v in plain._get_summary_data() if k in _COLUMNS}
    total = sum(p.numel() for p in whole.parameters())
    frozen = whole.embed.wpe.weight.numel()
    for freeze in (False, True):
        for got in values(spawn(_summarized, 2, freeze, torchrun_env=True)):
            assert got["total"] == total and got["trainable"] == total - (frozen if freeze else 0), got
            assert abs(got["mb"] - total * 4 / 1e6) < 1e-9
            assert got["table"] == table and got["modes"] == plain.total_training_modes, (got, table)
