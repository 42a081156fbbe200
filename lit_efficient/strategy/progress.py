"""Progress bars whose training total counts dataloader batches, not optimizer steps.

Lightning's bars bound an epoch's total by ``max_steps - global_step`` when ``max_steps`` ends the
run, and count it as batches: with N micro-batches per step the bar shows ``12/3`` and the Rich bar's
epoch label reads ``Epoch 0/-2``. Under pipelining N is the rule, so `PACIStrategy` swaps Lightning's
stock bars for these subclasses in ``setup``; they are ordinary callbacks for any other strategy too.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from typing_extensions import override


class _BatchTotal:
    trainer: Any
    _epoch_starting = False  # class defaults: `swap_stock_progress_bar` swaps the class of a built bar

    @override
    def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
        # The epoch loop resets its batch count after this hook: the bars read the total here, with the count of
        # the epoch before (a later epoch's bar ended at 3/10 where max_steps stopped it).
        self._epoch_starting = True
        try:
            super().on_train_epoch_start(trainer, *args)  # type: ignore[misc]
        finally:
            self._epoch_starting = False

    @property
    def total_train_batches(self) -> int | float:
        """Dataloader batches left in this epoch: ``max_steps`` counts windows of N batches."""
        trainer = self.trainer
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            loop = trainer.fit_loop.epoch_loop
            # Batches finished in this epoch: none at its start, the restored count on a mid-epoch resume (read at
            # the first batch). Not `ready`, which counts the batch starting (a resumed Rich bar showed 16/17).
            # A restarting epoch loop keeps its restored count after this hook (a run resumed from a checkpoint
            # written at the end of a max_steps run: the next epoch's batches count on from the saved one's).
            done = 0 if self._epoch_starting and not loop.restarting else loop.batch_progress.current.completed
            remaining = (trainer.max_steps - trainer.global_step) * max(1, trainer.accumulate_grad_batches)
            return min(trainer.num_training_batches, done + remaining)
        return trainer.num_training_batches


class StepAwareTQDMProgressBar(_BatchTotal, TQDMProgressBar):
    """Lightning's `TQDMProgressBar` with the training total in batches under gradient accumulation, also on a
    mid-epoch resume: Lightning skips ``on_train_epoch_start`` there, where its bar takes its total (``16/?``),
    and counts the batches already done only once the epoch loop starts, so the first batch sets it."""

    _total_at_first_batch = False  # a class default: `swap_stock_progress_bar` swaps the class of a built bar

    @override
    def on_train_start(self, trainer: Any, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self._total_at_first_batch = trainer.fit_loop.epoch_loop.batch_progress.current.ready > 0  # restored

    @override
    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        super().on_train_batch_start(trainer, *args)
        if self._total_at_first_batch:
            self._total_at_first_batch = False
            bar = self.train_progress_bar
            bar.reset()
            bar.total = convert_inf(self.total_train_batches)
            bar.set_description(f"Epoch {trainer.current_epoch}")


class StepAwareRichProgressBar(_BatchTotal, RichProgressBar):
    """Lightning's `RichProgressBar` with the training total in batches, and no ``/-2`` after the epoch
    when ``max_steps`` (not ``max_epochs``) ends the run."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        if self.trainer.max_epochs == -1:
            description = description.replace("/-2", "")
        return description


def swap_stock_progress_bar(trainer: Any) -> None:
    """Give the trainer's progress bar, if it is one of Lightning's two stock bars, its subclass here.
    The object, its settings and its place among the callbacks stay; only the total changes."""
    bar = trainer.progress_bar_callback
    swaps = {TQDMProgressBar: StepAwareTQDMProgressBar, RichProgressBar: StepAwareRichProgressBar}
    if bar is not None and type(bar) in swaps:
        bar.__class__ = swaps[type(bar)]
