"""The progress bars' training total counts dataloader batches when max_steps counts windows of N."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar

from lit_efficient.strategy.progress import StepAwareRichProgressBar, StepAwareTQDMProgressBar, swap_stock_progress_bar


def _trainer(max_steps, global_step, accumulate, batches=1000, done=0, max_epochs=-1):
    progress = SimpleNamespace(current=SimpleNamespace(completed=done))
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


class _BarAtTheEnd(Callback):
    """The training bar's count and total when training ends: what the user saw last."""

    def on_train_end(self, trainer, pl_module) -> None:
        bar = trainer.progress_bar_callback
        if isinstance(bar, TQDMProgressBar):
            self.seen = (bar.train_progress_bar.n, bar.train_progress_bar.total)
        else:
            task = bar.progress.tasks[bar.train_progress_bar_id]
            self.seen = (task.completed, task.total)


@pytest.mark.parametrize("bar", [TQDMProgressBar, RichProgressBar], ids=["tqdm", "rich"])
def test_a_mid_epoch_resume_shows_the_batches_of_its_epoch_out_of_their_total(tmp_path, bar):
    """Resumed at step 2 of 4 (8 of 16 micro-batches in the epoch): Lightning skips on_train_epoch_start, where the
    TQDM bar takes its total (it showed ``16/?``), and the Rich bar, which takes it at the first batch, showed
    ``16/17`` (its total counted that batch as done)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_efficient import PACIStrategy
    from tests.support.gpt_runs import gpt_model, gpt_trainer, text_data

    def fit(steps, ckpt_path=None):
        end = _BarAtTheEnd()
        saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="step2")
        trainer = gpt_trainer(PACIStrategy(pipeline_stages=2), 1, steps, tmp_path, enable_progress_bar=True,
                              callbacks=[bar(), end, saver], enable_checkpointing=True, limit_train_batches=40,
                              max_epochs=-1, accumulate_grad_batches=4)  # fmt: skip
        trainer.fit(gpt_model(), datamodule=text_data(), ckpt_path=ckpt_path)
        return end.seen

    assert fit(2) == (8, 8)
    assert fit(4, tmp_path / "step2.ckpt") == (16, 16)


@pytest.mark.parametrize("bar", [TQDMProgressBar, RichProgressBar], ids=["tqdm", "rich"])
def test_a_resume_from_the_last_checkpoint_of_a_max_steps_run_counts_on_out_of_its_total(tmp_path, bar):
    """ "Train 2 more steps" from the last.ckpt a max_steps run wrote at its end (the quickstart's ModelCheckpoint:
    a monitor, no validation yet): Lightning starts the next epoch with the saved epoch's batch count going on (8
    to 16), and the Rich bar showed ``16/8`` (the CLI's quickstart, 10 then 20 steps: ``80/40``)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_efficient import PACIStrategy
    from tests.support.gpt_runs import gpt_model, gpt_trainer, text_data

    def fit(steps, ckpt_path=None):
        end, saver = _BarAtTheEnd(), ModelCheckpoint(dirpath=tmp_path, save_last=True, monitor="val_loss")
        trainer = gpt_trainer(PACIStrategy(pipeline_stages=2), 1, steps, tmp_path, enable_progress_bar=True,
                              callbacks=[bar(), end, saver],
                              enable_checkpointing=True, limit_train_batches=40, max_epochs=-1,
                              accumulate_grad_batches=4)  # fmt: skip
        trainer.fit(gpt_model(), datamodule=text_data(), ckpt_path=ckpt_path)
        return end.seen

    assert fit(2) == (8, 8)
    assert fit(4, tmp_path / "last.ckpt") == (16, 16)


@pytest.mark.parametrize("bar", [StepAwareTQDMProgressBar, StepAwareRichProgressBar], ids=["tqdm", "rich"])
def test_a_later_epoch_that_max_steps_ends_counts_its_own_batches(tmp_path, bar):
    """The bars read their total in on_train_epoch_start, before the epoch loop resets its batch count: the second
    epoch of 10 batches, which max_steps=7 windows of 2 ends after 4, showed 4/10."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    end = _BarAtTheEnd()
    trainer = Trainer(max_steps=7, max_epochs=-1, limit_train_batches=10, limit_val_batches=0,
                      accumulate_grad_batches=2, logger=False, enable_checkpointing=False, enable_model_summary=False,
                      callbacks=[bar(), end], default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(BoringModel())
    assert end.seen == (4, 4)  # the second epoch's 4 batches


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
    import torch

    model = gpt_model(tie_weights=True)
    model.example_input_array = torch.zeros(2, 32, dtype=torch.long)  # its forward raised on a rank: sizes are "?"
    if frozen:
        model.embed.wpe.weight.requires_grad_(False)
    trainer = gpt_trainer(PACIStrategy(pipeline_stages=2), 2, 1, enable_model_summary=True)
    trainer.fit(model, datamodule=text_data())
    (callback,) = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
    summary = callback._summary(trainer, model)
    callback._max_depth = -1  # every module a row, those of the other stage's layers too
    return {"total": summary.total_parameters, "trainable": summary.trainable_parameters, "mb": summary.model_size,
            "table": _table(summary), "modes": summary.total_training_modes,
            "deep": _table(callback._summary(trainer, model))}  # fmt: skip


def _table(summary) -> dict[str, list[str]]:
    return {k: v for k, v in summary._get_summary_data() if k in ("Name", "Type", "Params", "Mode")}


@pytest.mark.multiproc
def test_the_model_summary_on_processes_is_the_unsplit_models():
    """Under PACI on processes Lightning's summary showed rank 0's stage as "Total params" (90.7K of a 164.9K model),
    and rows that did not add up to the totals: the layers of the other stage as an empty ``LayerOnOtherStage``.
    Every rank now shows plain Lightning's table of the unsplit model (names, types, parameters per row, modes),
    the whole model's totals, a tied embedding once, a frozen table as non-trainable. With an ``example_input_array``
    Lightning's summary forwarded it through the split module, which raised on every rank."""
    from lightning.pytorch.utilities.model_summary import summarize

    from tests.support.gpt_runs import gpt_model
    from tests.support.multiproc import spawn, values

    whole = gpt_model(tie_weights=True)
    plain, deep = summarize(whole, max_depth=1), _table(summarize(whole, max_depth=-1))
    table = _table(plain)
    total = sum(p.numel() for p in whole.parameters())
    frozen = whole.embed.wpe.weight.numel()
    for freeze in (False, True):
        for got in values(spawn(_summarized, 2, freeze, torchrun_env=True)):
            assert got["total"] == total and got["trainable"] == total - (frozen if freeze else 0), got
            assert abs(got["mb"] - total * 4 / 1e6) < 1e-9
            assert got["table"] == table and got["modes"] == plain.total_training_modes, (got, table)
            assert got["deep"] == deep, (got["deep"], deep)


def test_the_model_summary_in_one_process_counts_a_tied_weight_once_in_the_row_that_holds_both_copies():
    """One process holds both stages, the last with its own copy of a tied weight: a Hugging Face model is one row
    (``model``) holding the embedding and the head, which counted the weight twice, as two parameters."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelSummary
    from lightning.pytorch.utilities.model_summary import summarize
    from transformers import GPT2Config, GPT2LMHeadModel

    from lit_efficient import PACIStrategy
    from lit_efficient.models import HFCausalLM
    from tests.support.gpt_runs import gpt_trainer, text_data

    def tied_gpt2() -> HFCausalLM:
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=32, tie_word_embeddings=True)
        torch.manual_seed(0)
        return HFCausalLM(GPT2LMHeadModel(config), warmup_steps=0, max_steps=1)

    class AsPrinted(L.Callback):  # the summary of on_fit_start, while the copies are apart (fit ties them again)
        def on_fit_start(self, trainer, pl_module):
            (callback,) = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
            summary = callback._summary(trainer, pl_module)
            self.table, self.total = _table(summary), summary.total_parameters

    printed = AsPrinted()
    trainer = gpt_trainer(PACIStrategy(pipeline_stages=2), 1, 1, enable_model_summary=True, callbacks=[printed])
    trainer.fit(tied_gpt2(), datamodule=text_data())
    plain = summarize(tied_gpt2(), max_depth=1)
    assert (printed.table, printed.total) == (_table(plain), plain.total_parameters)
