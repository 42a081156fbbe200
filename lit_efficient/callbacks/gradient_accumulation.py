"""The `GradientAccumulation` callback: the one knob for N, micro-batches per optimizer step.

This file owns the value of ``trainer.accumulate_grad_batches`` (a constant or a per-epoch
schedule), its consistency with ``Trainer(accumulate_grad_batches=...)``, and exact gradient
normalization under Lightning's automatic optimization (single device, DDP): ``"mean"`` weighs
every micro-batch alike, ``"tokens"`` makes the step's gradient the item-weighted mean over the
whole window, across data-parallel replicas too, and a partial last window of an epoch is
normalized by its real size (Lightning divides it by N anyway: Lightning issue #19987).

Under `PACIStrategy` the pipeline stages normalize (see ``runtime/stage.py``); the strategy reads
N and `normalize` from this callback and the gradient hooks here stand aside.

How the exact normalization works without look-ahead (single device / DDP):

- ``mean``: Lightning already scales each micro-batch loss by 1/N. At the step, a window that held
  n != N micro-batches is rescaled by N/n; a full window is left untouched (bitwise Lightning).
- ``tokens``: a hook on each micro-batch's loss multiplies its gradient by ``N * num_items`` (undoing
  Lightning's 1/N, weighing by the items), so the parameters accumulate the item-weighted *sum*; at
  the step, gradients are divided by the window's item total, summed over ranks with one scalar
  all-reduce and divided by the world size, because DDP averages (not sums) the gradients.

``num_items`` comes from ``training_step``'s returned ``{"loss", "num_items"}``. Lightning hands that
dict to callbacks only in ``on_train_batch_end``, after backward, so the callback reads it where
Lightning itself turns the dict into the closure result: the automatic-optimization loop builds it
through its ``output_result_cls`` attribute (the loop's designed extension point, as the manual loop
uses ``ManualResult``). The callback plugs in a subclass of Lightning's ``ClosureResult`` that notes
``num_items`` before the closure runs backward, and restores the original class in ``teardown``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_args

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lit_efficient.checks import is_count, named_few
from lit_efficient.runtime.stage import Normalize, divide_by_count, item_count
from lit_efficient.strategy.paci import PACIStrategy

_NORMALIZE = get_args(Normalize)


class GradientAccumulation(Callback):
    """N micro-batches (dataloader batches) per optimizer step, normalized exactly.

    Sets ``trainer.accumulate_grad_batches`` (which Lightning and `PACIStrategy` read) in ``setup``
    and, for a schedule, at every epoch start. ``Trainer(accumulate_grad_batches=N)`` is accepted as
    an equivalent spelling of the same N; two different values are an error. Effective batch =
    batch_size x N x data-parallel replicas.

    Args:
        steps: Micro-batches per optimizer step: an integer N >= 1, or a schedule ``{epoch: N}``
            (0-indexed epochs; each N holds from its epoch on, epochs before the first key use 1), or
            None: N is ``Trainer(accumulate_grad_batches)`` and this callback only normalizes (the
            shipped configs do this, so ``--trainer.accumulate_grad_batches 8`` sets N on the command line).
        normalize: ``"mean"``: every micro-batch weighs 1 (the step's gradient is the mean of the
            micro-batch mean-loss gradients). ``"tokens"``: the gradient is the item-weighted mean over
            the whole window and all data-parallel replicas, exact when micro-batches hold different
            numbers of items (e.g. padded tokens); needs ``training_step`` to return
            ``{"loss": mean_loss, "num_items": count}`` and, under `PACIStrategy`, ``pipeline_loss``
            to return ``(mean_loss, count)``.
    """

    def __init__(self, steps: int | dict[int, int] | None = None, normalize: Normalize = "mean") -> None:
        super().__init__()
        self.steps = steps
        self.normalize: Normalize = normalize
        # None: the Trainer's value, read in setup (1 until then).
        self._schedule = {0: 1} if steps is None else _check_steps(steps)
        if normalize not in _NORMALIZE:
            raise ValueError(
                f"normalize={normalize!r} is not one of 'mean', 'tokens': use 'mean' to weigh micro-batches "
                "equally or 'tokens' to weigh them by the item count training_step returns as 'num_items'"
            )
        self._applied: int | None = None  # the value this callback last wrote into the Trainer
        self._warned_batchnorm = False
        self._strategy_normalizes = False  # PACIStrategy: the pipeline stages normalize
        self._trainer: Trainer | None = None  # the fit's, for the checkpoint state (`state_dict` takes no trainer)
        self._saved_window: dict[str, Any] | None = None  # an unfinished window read from a checkpoint
        self._loop: Any = None
        self._original_result_cls: type[ClosureResult] | None = None
        self._reset_window()

    # -- the pure query ----------------------------------------------------------------------------

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        """Micro-batches per optimizer step during ``epoch`` (0-indexed)."""
        value = 1
        for start in sorted(self._schedule):
            if epoch >= start:
                value = self._schedule[start]
        return value

    @property
    def max_accumulate_grad_batches(self) -> int:
        """The largest N of the schedule."""
        return max(self._schedule.values())

    @property
    def min_accumulate_grad_batches(self) -> int:
        """The smallest N of the schedule (PACI's tied-weight delay is built for it)."""
        return min(self._schedule.values())

    # -- lifecycle ---------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.check_accumulation_source(trainer)
        self._trainer = trainer
        self._strategy_normalizes = isinstance(trainer.strategy, PACIStrategy)
        # Before strategy.setup: PACIStrategy, configure_optimizers and estimated_stepping_batches read it.
        self._apply(trainer, trainer.current_epoch)
        self._warn_batchnorm(pl_module)
        if self.normalize == "tokens" and not self._strategy_normalizes:
            self._capture_num_items(trainer)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Again now that Lightning restored the loops: a run resumed mid-epoch is in the checkpoint's epoch, not in
        # the epoch 0 setup saw, and Lightning skips on_train_epoch_start for the epoch it restarts in.
        self._apply(trainer, trainer.current_epoch)
        if self._strategy_normalizes:
            self._resume_window(trainer, pl_module)  # a one-device checkpoint's window: said, dropped
            return  # PACIStrategy runs the module under manual optimization itself, and normalizes
        strategy = type(trainer.strategy).__name__
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                f"GradientAccumulation needs automatic optimization, but {type(pl_module).__name__} sets "
                f"automatic_optimization=False (strategy {strategy}). Remove the callback and accumulate in your "
                "training_step, or switch to automatic optimization with configure_optimizers."
            )
        if trainer.strategy.handles_gradient_accumulation:
            raise RuntimeError(
                f"{strategy} accumulates gradients itself, so GradientAccumulation cannot normalize them. Configure "
                f"accumulation in {strategy} and remove the callback."
            )
        self._resume_window(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._apply(trainer, trainer.current_epoch)
        self._reset_window()  # Lightning aligns windows to the epoch and always steps an epoch's last one

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release_loop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release_loop()  # Lightning skips callbacks' teardown after an exception

    # -- normalization (single device / DDP) -------------------------------------------------------

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        if self._strategy_normalizes or not loss.requires_grad:
            return
        self._micro_batches += 1
        if self.normalize == "mean":
            return  # Lightning's 1/N is right unless the window ends short: fixed at the step
        items = self._pending_items
        self._pending_items = None
        if items is None:
            raise RuntimeError(
                "GradientAccumulation(normalize='tokens') saw a backward without a training_step result; "
                "it supports Lightning's automatic optimization only"
            )
        weight = item_count(items, loss.device, _weight_dtype(loss.device))
        self._weight = weight if self._weight is None else self._weight + weight
        # Undo Lightning's 1/N and weigh by the items: the parameters accumulate sum_i(items_i * grad_i).
        factor = weight * trainer.accumulate_grad_batches
        # The product in the count's dtype, rounded once to the loss's: factor.to(bf16) rounded the count first
        # (507 * 4 tokens as 2032), a gradient scale off by up to 2^-9 where the pipeline's is exact.
        loss.register_hook(lambda grad: (grad.to(factor.dtype) * factor).to(grad.dtype))

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._strategy_normalizes:
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self.normalize == "mean":
            expected = trainer.accumulate_grad_batches
            if 0 < self._micro_batches != expected:
                # Partial window (end of an epoch): Lightning scaled each loss by 1/N, the mean needs 1/n.
                for g in grads:
                    g.mul_(expected / self._micro_batches)
        else:
            # Every rank joins the reduction below, even one that accumulated nothing (no hang).
            device = trainer.strategy.root_device
            total = (
                self._weight
                if self._weight is not None
                else torch.zeros((), dtype=_weight_dtype(device), device=device)
            )
            world = trainer.world_size
            if world > 1:
                # Collective once per optimizer step (not per micro-batch): the window's item total over
                # all replicas. DDP averaged the gradients over `world` ranks, so divide by total / world.
                total = trainer.strategy.reduce(total.clone(), reduce_op="sum") / world
            # No host sync: a zero total (every item masked) means zero gradients, left as they are.
            total = torch.where(total > 0, total, torch.ones_like(total))
            divide_by_count(grads, total)  # by the exact count, as the pipeline's stages (total.to(bf16): 507 as 508)
        self._reset_window()

    # -- checkpoint state --------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"steps": self.steps, "normalize": self.normalize}
        trainer = self._trainer
        if self._micro_batches and trainer is not None and not self._strategy_normalizes:
            # A checkpoint written inside a window (a validation's ModelCheckpoint at val_check_interval, a
            # preemption): Lightning keeps no partial gradients, so the window's micro-batches would be lost. One
            # plain process keeps them here (on the CPU: no device copy at save); DDP's ranks hold different ones
            # and Lightning saves rank 0's state only, a sharding strategy holds them elsewhere.
            window: dict[str, Any] = {
                "micro_batches": self._micro_batches, "of": trainer.accumulate_grad_batches, "normalize": self.normalize
            }  # fmt: skip
            if _keeps_whole_gradients(trainer):
                params = trainer.lightning_module.named_parameters()
                window["grads"] = {n: p.grad.to("cpu", copy=True) for n, p in params if p.grad is not None}
                window["weight"] = None if self._weight is None else self._weight.to("cpu", copy=True)
            state["window"] = window
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The run's own arguments win; a different schedule on resume is allowed but worth a warning.
        saved = (state_dict.get("steps"), state_dict.get("normalize"))
        self._saved_window = state_dict.get("window")
        if saved != (self.steps, self.normalize):
            window = (
                " A window the checkpoint left unfinished is finished first: its micro-batches join the first window "
                "of the resumed run, whose step averages them with that window's; the windows after it have the new "
                "size."
                if self._strategy_normalizes
                else ""  # one device's unfinished window: `_resume_window` says what becomes of it
            )
            rank_zero_warn(
                f"The checkpoint was trained with GradientAccumulation(steps={saved[0]!r}, normalize={saved[1]!r}); "
                f"this run continues with steps={self.steps!r}, normalize={self.normalize!r}.{window}"
            )

    def _resume_window(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Put back the unfinished window a checkpoint kept (`state_dict`): its gradients and count, now that
        Lightning restored the weights and moved them to the device, where one device's run would hold them, so
        that the window's step is the uninterrupted run's. Said and dropped where that cannot be exact."""
        window, self._saved_window = self._saved_window, None
        if not window:
            return
        count, of = window["micro_batches"], window["of"]
        grads = window.get("grads")
        names = {name for name, _ in pl_module.named_parameters()}
        why = None
        if self._strategy_normalizes:
            why = "this run's PACIStrategy holds a window's gradients in its own checkpoint state, not this callback's"
        elif grads is None or not _keeps_whole_gradients(trainer):
            why = "Lightning's checkpoint holds no partial gradients here (several processes, each with its own, or a "
            why += "strategy that shards them)"
        elif of != trainer.accumulate_grad_batches or window.get("normalize") != self.normalize:
            why = f"it accumulated {of} micro-batches per step with normalize={window.get('normalize')!r}, and this "
            why += f"run {trainer.accumulate_grad_batches} with normalize={self.normalize!r}"
        elif not set(grads) <= names:
            missing = sorted(set(grads) - names)
            why = f"the model has no parameter {named_few(missing, 3)}"
        if why is not None:
            rank_zero_warn(
                f"GradientAccumulation: the checkpoint was written {count} micro-batch(es) into a window; {why}, so "
                "those micro-batches are dropped and the resumed window's step averages the rest of it. Resume from "
                "a checkpoint written at a window's end (ModelCheckpoint's every_n_train_steps) to lose none."
            )
            return
        for name, param in pl_module.named_parameters():
            grad = grads.get(name)
            param.grad = None if grad is None else grad.to(device=param.device, dtype=param.dtype)
        self._micro_batches = count
        weight = window.get("weight")
        self._weight = None if weight is None else weight.to(trainer.strategy.root_device)

    # -- internals ---------------------------------------------------------------------------------

    def _apply(self, trainer: Trainer, epoch: int) -> None:
        """The one place this callback changes trainer state."""
        if self.steps is None:
            self._schedule = {0: trainer.accumulate_grad_batches}  # the Trainer owns N: nothing to write
        self._applied = self.get_accumulate_grad_batches(epoch)
        trainer.accumulate_grad_batches = self._applied

    def _reset_window(self) -> None:
        self._micro_batches = 0
        self._weight: Tensor | None = None
        self._pending_items: Any = None

    def check_accumulation_source(self, trainer: Trainer) -> None:
        """Raise if N is also set elsewhere to another value (Trainer(accumulate_grad_batches), another
        accumulation callback). PACIStrategy calls it before launching processes, so the error is one."""
        current = trainer.accumulate_grad_batches
        user_set = self.steps is not None and current != 1 and current != self._applied
        if user_set and any(n != current for n in self._schedule.values()):
            raise ValueError(
                f"Trainer(accumulate_grad_batches={current}) and GradientAccumulation(steps={self.steps!r}) set "
                "different numbers of micro-batches per optimizer step. Set N in one place: remove "
                "accumulate_grad_batches from the Trainer (GradientAccumulation owns it), or make the two equal."
            )
        others = [
            type(cb).__name__
            for cb in trainer.callbacks
            if cb is not self and callable(getattr(cb, "get_accumulate_grad_batches", None))
        ]
        if others:
            raise ValueError(
                f"GradientAccumulation and {', '.join(others)} both set accumulate_grad_batches; keep one "
                "(GradientAccumulation(steps={epoch: N}) covers a schedule)."
            )

    def _warn_batchnorm(self, pl_module: LightningModule) -> None:
        if self._warned_batchnorm or self.max_accumulate_grad_batches == 1:
            return
        names = [name for name, m in pl_module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if names:
            self._warned_batchnorm = True
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            rank_zero_warn(
                f"{type(pl_module).__name__} has BatchNorm layers ({shown}) and accumulates up to "
                f"{self.max_accumulate_grad_batches} micro-batches per optimizer step: their statistics are "
                "computed per micro-batch, not per step, so accumulation is not equivalent to a larger batch. "
                "Consider GroupNorm or LayerNorm."
            )

    def _capture_num_items(self, trainer: Trainer) -> None:
        loop = getattr(trainer.fit_loop.epoch_loop, "automatic_optimization", None)
        if loop is None or not hasattr(loop, "output_result_cls"):
            raise RuntimeError(
                "GradientAccumulation(normalize='tokens') cannot find Lightning's automatic-optimization loop "
                "(trainer.fit_loop.epoch_loop.automatic_optimization.output_result_cls) in this Lightning version; "
                "use normalize='mean'."
            )
        self._release_loop()
        base = getattr(loop.output_result_cls, "_gradient_accumulation_base", loop.output_result_cls)
        self._loop, self._original_result_cls = loop, base
        loop.output_result_cls = _result_class_feeding(self, base)

    def _release_loop(self) -> None:
        if self._loop is not None:
            self._loop.output_result_cls = self._original_result_cls
            self._loop = self._original_result_cls = None


def _result_class_feeding(callback: GradientAccumulation, base: type[ClosureResult]) -> type[ClosureResult]:
    """A ``ClosureResult`` class that hands ``training_step``'s ``num_items`` to ``callback`` before backward."""

    class _ClosureResultWithItems(base):  # type: ignore[valid-type, misc]
        _gradient_accumulation_base = base  # what teardown restores, even after an interrupted fit

        @classmethod
        def from_training_step_output(cls, training_step_output: Any, normalize: int = 1) -> ClosureResult:
            callback._pending_items = _num_items(training_step_output)
            return super().from_training_step_output(training_step_output, normalize)

    return _ClosureResultWithItems


def _keeps_whole_gradients(trainer: Trainer) -> bool:
    """Whether this process holds the window's whole gradients on the module's own parameters: one process under a
    single-device or DDP strategy (not FSDP's flat parameters, not several ranks' partial sums)."""
    return trainer.world_size == 1 and isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy))


def _weight_dtype(device: torch.device) -> torch.dtype:
    # float64: token totals stay exact integers (MPS has no float64; float32 is exact up to 2**24).
    return torch.float32 if device.type == "mps" else torch.float64


def _num_items(output: Any) -> Any:
    if output is None:
        return None  # a skipped step: no backward follows
    if not isinstance(output, Mapping) or "num_items" not in output:
        got = f"a dict with keys {sorted(output)}" if isinstance(output, Mapping) else type(output).__name__
        raise ValueError(
            "GradientAccumulation(normalize='tokens') needs training_step to return "
            f"{{'loss': mean_loss, 'num_items': count}}; it returned {got}. Return the item count the loss "
            "averaged over (e.g. the number of non-padding tokens), or use normalize='mean'."
        )
    items = output["num_items"]
    return items.detach() if isinstance(items, Tensor) else items


def _check_steps(steps: Any) -> dict[int, int]:
    """The schedule ``{epoch: N}`` of ``steps``; ValueError with the value and the fix."""

    def positive(n: Any) -> bool:
        return is_count(n)

    if isinstance(steps, Mapping):
        if not steps:
            raise ValueError("steps={} is empty: give N (an integer >= 1) or a schedule like {0: 1, 4: 2}")
        bad_keys = [k for k in steps if not is_count(k, 0)]
        if bad_keys:
            raise ValueError(f"steps={steps!r}: epochs {bad_keys} must be integers >= 0 (0-indexed epochs)")
        bad = {k: v for k, v in steps.items() if not positive(v)}
        if bad:
            raise ValueError(f"steps={steps!r}: {bad} must map epochs to integers >= 1 (micro-batches per step)")
        return dict(steps)
    if not positive(steps):
        raise ValueError(
            f"steps={steps!r} must be an integer >= 1 (micro-batches per optimizer step) or a schedule {{epoch: N}}"
        )
    return {0: steps}
