"""The Lightning hooks PACIStrategy changes or never calls, between two training batches.

docs/DESIGN.md section 7 is the table this module implements: the one hook that must see a drained
pipeline before it runs (`drain_before`), the epoch-end hooks that read what the last stage's steps
collected (`epoch_ends_where_the_steps_ran`), and the hooks the stages replace by their own work, which
a user who overrides them is told about once (`warn_uncalled_hooks`) instead of finding their code
silently dead.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_efficient.runtime.split import LayerNotHereError

# Called by Lightning's automatic-optimization loop or precision plugin; under PACIStrategy the
# stages run forward, backward, clipping and their local steps themselves, so none of these runs.
MODULE_HOOKS_NOT_CALLED = (
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "optimizer_step",
    "optimizer_zero_grad",
    "configure_gradient_clipping",
)
CALLBACK_HOOKS_NOT_CALLED = MODULE_HOOKS_NOT_CALLED[:4]  # the callback spellings of the first four
# What the strategy logs itself from the last stage, so a training_step logging only this loses nothing.
STRATEGY_LOGGED = frozenset({"train_loss"})
_LOG_CALL = re.compile(r"self\.log(_dict)?\(\s*(?:f?[\"']([^\"']+)[\"'])?")


def drain_before(module: LightningModule, hook: str, drain: Callable[[], None]) -> None:
    """Make ``module.<hook>`` drain the pipeline first, until `give_back`.

    Lightning calls ``on_validation_model_zero_grad`` (default: ``zero_grad()``) between two training
    batches, on every rank, when a validation is due at a window end, before the validation loop (and
    its ``on_validation_start``) begins. Under PACI the earlier stages still hold micro-batches of that
    window in flight there, and their accumulated gradients would be wiped. Draining first finishes
    and steps the window, so the zero-grad then finds nothing, as it does on one device.
    """
    original = getattr(module, hook)

    def drained_hook(*args: Any, **kwargs: Any) -> Any:
        drain()
        return original(*args, **kwargs)

    setattr(module, hook, drained_hook)


def give_back(module: LightningModule, *names: str) -> None:
    """Give the module its own methods back: what `drain_before`, `watch_own_train_loss` and
    `epoch_ends_where_the_steps_ran` set are instance attributes shadowing the class's."""
    for name in names:
        module.__dict__.pop(name, None)


# The module's evaluation epoch-end hooks: they read what its evaluation steps collected (a list of outputs, a
# torchmetrics state), and only the ranks hosting a last stage run those steps.
EVALUATION_EPOCH_ENDS = ("on_validation_epoch_end", "on_test_epoch_end", "on_predict_epoch_end")


def epoch_ends_where_the_steps_ran(
    module: LightningModule, hosts_last_stage: bool, here: str, share_metrics: Callable[[], None] | None
) -> None:
    """Run the module's epoch-end hooks as Lightning's documented patterns need them, until `undo_epoch_ends`.

    Lightning calls them on every rank; under PACIStrategy the evaluation steps and ``pipeline_loss`` run on the
    ranks hosting a last stage only, so elsewhere what a step collected is empty: ``torch.stack`` of the outputs
    list raised, a torchmetrics ``compute()`` gathered over the last stage's group, which this rank is not in.

    - On a rank that hosts no last stage the evaluation epoch-end hooks are not called: their steps never ran
      there, and the last stage's ranks log their results.
    - ``on_train_epoch_end`` is called on every rank (a change of the model there must reach every stage); on a
      rank without a last stage an exception from it says why and how to guard it. After it, with
      ``share_metrics`` (processes), every rank takes global rank 0's callback metrics: Lightning runs
      ``ModelCheckpoint`` and ``EarlyStopping`` next, and what the hook logged on the last stage must steer them
      alike on every rank (a save is collective).

    Args:
        module: The LightningModule.
        hosts_last_stage: Whether this process hosts a last stage (in one process: always).
        here: This rank, for messages (``"stage 0 (rank 1)"``).
        share_metrics: Makes the callback metrics global rank 0's on every rank (a collective); None in one process.
    """
    undo_epoch_ends(module)  # a setup without the previous teardown: wrapped once
    overridden = [h for h in EVALUATION_EPOCH_ENDS if getattr(type(module), h) is not getattr(LightningModule, h)]
    if overridden and share_metrics is not None:  # on processes: where its code runs, once (rank zero)
        rank_zero_info(
            f"PACIStrategy: {', '.join(f'{type(module).__name__}.{h}' for h in overridden)} run only on the ranks "
            "hosting the last stage, where the evaluation steps run (what they collected is there); a change of the "
            "model or the data made there would not reach the other stages: make it in on_train_epoch_end or a "
            "callback."
        )
    if not hosts_last_stage:
        for hook in EVALUATION_EPOCH_ENDS:
            setattr(module, hook, _not_here)
    if hosts_last_stage and share_metrics is None:
        return
    original = module.on_train_epoch_end

    def on_train_epoch_end(*args: Any, **kwargs: Any) -> Any:
        try:
            out = original(*args, **kwargs)
        except Exception as err:
            if hosts_last_stage or isinstance(err, LayerNotHereError):  # the layer's own message says what ran
                raise
            raise RuntimeError(
                f"{type(module).__name__}.on_train_epoch_end raised on {here}, which hosts no last stage and so runs "
                f"no pipeline_loss: what pipeline_loss collected (an outputs list, a torchmetrics state) is empty "
                f"here ({type(err).__name__}: {err}). Guard the code that reads it with `if "
                "self.trainer.strategy.is_last_stage:`; what the last stage logs there reaches every rank."
            ) from err
        if share_metrics is not None:
            share_metrics()
        return out

    module.on_train_epoch_end = on_train_epoch_end  # type: ignore[method-assign]


def undo_epoch_ends(module: LightningModule) -> None:
    """Give the module its own epoch-end hooks back."""
    give_back(module, *EVALUATION_EPOCH_ENDS, "on_train_epoch_end")


def undo_module_hooks(module: LightningModule) -> None:
    """Give the module back every method the strategy shadowed on it: `drain_before`'s zero-grad hook,
    `watch_own_train_loss`'s ``log`` and the epoch ends."""
    give_back(module, "on_validation_model_zero_grad", "log")
    undo_epoch_ends(module)


def _not_here(*args: Any, **kwargs: Any) -> None:
    """An evaluation epoch-end hook on a rank whose evaluation steps never run."""


def uncalled_hooks(module: LightningModule, callbacks: Iterable[Callback]) -> list[str]:
    """The overridden hooks that will not run under PACIStrategy, as ``Owner.hook`` names.

    The package's own callbacks are left out: they know the strategy and act through it.
    """
    found = [
        f"{type(module).__name__}.{hook}"
        for hook in MODULE_HOOKS_NOT_CALLED
        if getattr(type(module), hook, None) is not getattr(LightningModule, hook)
    ]
    for callback in callbacks:
        if type(callback).__module__.startswith("lit_efficient."):
            continue
        found += [
            f"{type(callback).__name__}.{hook}"
            for hook in CALLBACK_HOOKS_NOT_CALLED
            # On the instance too: Lightning's LambdaCallback sets the hooks it is given as instance attributes.
            if getattr(type(callback), hook, None) is not getattr(Callback, hook) or hook in vars(callback)
        ]
    return found


def _log_calls(function: Any) -> list[tuple[str | None, str]]:
    """``(key, call text)`` of each ``self.log``/``self.log_dict`` call in ``function``'s source: the key named
    literally (None for a computed one; "log_dict(...)" for a dict) and the call's first line or two."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):  # no source (a REPL, a compiled module): nothing to tell
        return []
    calls = []
    for match in _LOG_CALL.finditer(source):
        text = source[match.start() : source.find(")\n", match.start()) + 1]
        calls.append(("log_dict(...)" if match.group(1) else match.group(2), text))
    return calls


def watch_own_train_loss(module: LightningModule, seen: Callable[[], None]) -> None:
    """Make ``module.log`` call ``seen`` when the module logs ``train_loss`` while training (from ``pipeline_loss``,
    by ``log`` or ``log_dict``), until `give_back`: the strategy then logs none of its own, which
    Lightning would refuse (one key logged twice in a step with other arguments). The strategy's own call goes to
    the class's ``log``, past this. At run time, not from the source: an inherited ``pipeline_loss``, a computed
    name or a ``log_dict`` count, a comment does not."""
    give_back(module, "log")  # a setup without the previous teardown: watched once
    original = module.log

    def log(*args: Any, **kwargs: Any) -> None:
        name = kwargs["name"] if "name" in kwargs else (args[0] if args else None)
        if name in STRATEGY_LOGGED and module._trainer is not None and module.trainer.training:
            seen()
        original(*args, **kwargs)

    module.log = log  # type: ignore[method-assign]


def training_step_logs(module: LightningModule) -> list[str]:
    """What the module's ``training_step`` passes to ``self.log``/``self.log_dict`` beyond what the strategy
    logs itself: the keys it names literally, or ``log_dict(...)`` / ``log(<computed name>)`` otherwise; and
    ``train_loss`` where it is logged per epoch (the strategy logs it per step only)."""
    logged = []
    for key, text in _log_calls(type(module).training_step):
        if key is None:
            logged.append("log(<computed name>)")
        elif key not in STRATEGY_LOGGED:
            logged.append(key)
        elif re.search(r"on_epoch\s*=\s*True|on_step\s*=\s*False", text):
            logged.append(f"{key} per epoch (the strategy logs it per step; log it from pipeline_loss instead)")
    return logged


def warn_uncalled_hooks(module: LightningModule, callbacks: Iterable[Callback]) -> None:
    """One warning (rank zero) naming every override and training-step metric PACIStrategy will not run."""
    hooks = uncalled_hooks(module, callbacks)
    logged = training_step_logs(module)
    if not hooks and not logged:
        return
    parts = []
    if hooks:
        parts.append(
            f"these overridden hooks never run under PACIStrategy: {', '.join(hooks)} (the pipeline stages run "
            "forward, backward, gradient clipping from Trainer(gradient_clip_val=...) and their own optimizer steps)"
            + (
                "; PipelineMonitor(grad_norm=True) logs the gradient norm before clipping"
                if any(h.endswith(".on_before_optimizer_step") for h in hooks)
                else ""
            )
        )
    if logged:
        parts.append(
            f"{type(module).__name__}.training_step is never called under PACIStrategy (the loss comes from "
            f"pipeline_loss), so what it logs is not logged: {', '.join(logged)}. Log per-micro-batch training "
            "metrics with self.log inside pipeline_loss, which runs on the last stage (global rank 0) during the "
            "training step; the strategy logs train_loss itself"
        )
    rank_zero_warn("; ".join(parts) + ". See docs/DESIGN.md section 7.")
