"""The `ActivationCheckpointing` callback: recompute chosen blocks' activations at backward.

This file owns choosing the modules to checkpoint (named classes, or the model's repeated blocks),
wrapping them with non-reentrant `torch.utils.checkpoint` (full or selective), the run-time toggle
and its checkpoint state, and measuring the activation bytes a micro-batch keeps for backward
(`SavedActivationMeter`).

Wrapping replaces a module *instance's* ``forward`` with a checkpointed call of the class's
``forward``; no wrapper module is inserted, so ``state_dict`` keys never change and checkpoints load
with or without the callback.
"""

from __future__ import annotations

import contextvars
import difflib
import functools
import sys
import types
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from typing_extensions import override

from lit_efficient.checks import check_flags, is_count

METRIC_KEY = "activation_checkpointing/saved_bytes"
_MODES = ("full", "selective")
# Attribute a wrapped module carries (a plain object, so it is neither a parameter nor a state_dict key).
_WRAP_ATTR = "_activation_checkpointing"


def _selective_save_ops() -> frozenset[Any]:
    """The aten ops whose outputs selective mode keeps: matmuls and fused attention, the expensive ones.

    Everything else (LayerNorm, GELU, dropout, adds, views) is recomputed: cheap in FLOPs, costly in bytes.
    Looked up by name because the attention kernels differ by torch version and device; on CPU,
    `F.scaled_dot_product_attention` without dropout dispatches to `_scaled_dot_product_flash_attention_for_cpu`
    and with dropout to the math path, i.e. `bmm` (both saved). A call that draws random numbers (fused
    attention with dropout, on CUDA) is recomputed nonetheless: see `_draws_random_numbers`.
    """
    names = (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    packets = (getattr(torch.ops.aten, name, None) for name in names)
    return frozenset(p.default for p in packets if p is not None)


SELECTIVE_SAVE_OPS = _selective_save_ops()


# ----------------------------------------------------------------- measuring saved activations

_ACTIVE_METER: contextvars.ContextVar[SavedActivationMeter | None] = contextvars.ContextVar(
    "lit_efficient_saved_activation_meter", default=None
)


class SavedActivationMeter:
    """Counts the bytes of activations kept for backward while it is active (unique storages).

    It sees what autograd saves through `torch.autograd.graph.saved_tensors_hooks` (a checkpointed
    region's inputs included: non-reentrant checkpoint saves them outside its own hooks) plus the
    outputs selective mode caches, which bypass autograd's saving. Parameters and buffers of `exclude`
    are not activations and are left out. Views share their base's storage and count once.

    Args:
        exclude: Modules whose parameters and buffers are not counted (usually the model).
    """

    def __init__(self, exclude: Iterable[nn.Module] = ()) -> None:
        # Storage addresses already counted; seeded with the excluded tensors' so they never count.
        self._seen: set[int] = {t.untyped_storage().data_ptr() for m in exclude for t in _tensors_of(m)}
        self.bytes = 0
        self._hooks: saved_tensors_hooks | None = None
        self._token: contextvars.Token | None = None

    def add(self, tensor: Tensor) -> None:
        """Count `tensor`'s storage unless it was counted already (or belongs to an excluded module). Nothing while
        torch.compile traces: its tensors are stand-ins (a symbolic size under ``dynamic=True`` broke the trace), and
        the compiled graph's saved tensors pass the saved-tensor hooks when it runs, where they count."""
        if torch.compiler.is_compiling():
            return
        try:
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
            key, nbytes = -id(tensor), tensor.numel() * tensor.element_size()
        if nbytes and key not in self._seen:
            self._seen.add(key)
            self.bytes += nbytes

    def _pack(self, tensor: Tensor) -> Tensor:
        self.add(tensor)
        return tensor

    def start(self) -> SavedActivationMeter:
        """Begin counting (nests like a context manager: stop in reverse order)."""
        if self._hooks is not None:
            raise RuntimeError("SavedActivationMeter is already running.")
        self._hooks = saved_tensors_hooks(self._pack, _identity)
        self._hooks.__enter__()
        self._token = _ACTIVE_METER.set(self)
        return self

    def stop(self) -> int:
        """Stop counting; returns the bytes counted. A no-op when not running."""
        if self._hooks is not None:
            _ACTIVE_METER.reset(self._token)
            self._hooks.__exit__(None, None, None)
            self._hooks = self._token = None
        return self.bytes

    @property
    def running(self) -> bool:
        """Whether the meter is counting."""
        return self._hooks is not None

    def __enter__(self) -> SavedActivationMeter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _identity(tensor: Tensor) -> Tensor:
    return tensor


def _tensors_of(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _draws_random_numbers(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call draws from the random stream: ops tagged so do, except the fused attention
    kernels called with ``dropout_p=0`` (they draw their dropout mask only when there is dropout).

    Such a call must be recomputed, never kept. Checkpointing restores the RNG state before the
    recompute and relies on the recompute drawing what the forward drew, in the same order. A kept call
    is not run again, so it does not draw: on CUDA the Philox offset then stays behind, and every random
    op after it in the block (residual and MLP dropout) draws a different mask than in the forward, so
    the gradients are those of another function. CPU never shows it: its attention kernels refuse dropout
    and it runs as separate ops (`bmm`, dropout), each recomputed or kept on its own. Cost, with attention
    dropout on CUDA only: one attention forward more per checkpointed block at backward.
    """
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    for i, argument in enumerate(op._schema.arguments):
        if argument.name == "dropout_p":
            value = args[i] if i < len(args) else kwargs.get("dropout_p", argument.default_value)
            return bool(value)
    return True


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # Decided by the call's arguments alone, so the forward and the recompute decide alike.
    if op not in SELECTIVE_SAVE_OPS or _draws_random_numbers(op, args, kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE
    meter = _ACTIVE_METER.get()
    # `op_output` exists from torch 2.6 on; without it selective mode's cache goes uncounted (an undercount).
    output = getattr(ctx, "op_output", None)
    if meter is not None and output is not None and not ctx.is_recompute:
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, Tensor):
                meter.add(t)
    return CheckpointPolicy.MUST_SAVE


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_selective_policy)


# ----------------------------------------------------------------- wrapping


class _Switch:
    """State shared by the callback and the modules it wrapped, read on every forward (the real toggle)."""

    def __init__(self, enabled: bool, mode: str) -> None:
        self.enabled = enabled
        self.mode = mode


class _WrapState:
    def __init__(self, switch: _Switch, previous_forward: Any, norms: list[nn.Module]) -> None:
        self.switch = switch
        self.previous_forward = previous_forward  # an instance-level forward someone set before us, or None
        self.norms = norms  # the block's norms that keep running statistics (BatchNorm), found at wrapping


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward a wrapped module gets: checkpointed when enabled and autograd is recording."""
    state: _WrapState = self.__dict__[_WRAP_ATTR]
    original = state.previous_forward or functools.partial(type(self).forward, self)
    # Under no_grad (validation, test, predict, PACI's recompute-mode forward) nothing is saved, so
    # checkpointing would only add overhead.
    if not state.switch.enabled or not torch.is_grad_enabled():
        return original(*args, **kwargs)
    fn = functools.partial(original, **kwargs) if kwargs else original  # kwargs never clash with checkpoint's own
    if state.norms:
        fn = _statistics_updated_once(fn, state.norms)
    if state.switch.mode == "selective":
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_selective_contexts)
    # Full mode passes no context_fn at all: torch.compile refuses one that is not a pair of dispatch modes.
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)


def _statistics_updated_once(fn: Any, norms: list[nn.Module]) -> Any:
    """``fn`` whose second call, the recompute at backward, leaves the norms' running statistics as the forward left
    them: in training mode it updated them again (BatchNorm's running mean and variance moved twice per step, its
    batch count counted twice). The recompute runs with momentum 0 (the statistics are written unchanged, so the
    values its backward saved stay current) and without the batch count (not counted); its outputs and gradients
    use the batch's own statistics, as the forward's did. Attributes only, no tensor operation: selective
    checkpointing replays the forward's operations and refuses others. As the pipeline's own recompute keeps them
    (runtime/stage.py)."""
    calls = 0

    def run(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*args)
        kept = [(m, m.momentum, m.num_batches_tracked) for m in norms]
        for m in norms:
            m.momentum, m.num_batches_tracked = 0.0, None
        try:
            return fn(*args)
        finally:
            for m, momentum, tracked in kept:
                m.momentum, m.num_batches_tracked = momentum, tracked

    return run


# A pickled bound method is restored as ``getattr(module, __name__)``; named "forward", that yields the
# class's plain forward on unpickling, so a pickled wrapped module loads (unwrapped) instead of failing.
_checkpointed_forward.__name__ = "forward"


def _wrap(module: nn.Module, switch: _Switch) -> None:
    if _WRAP_ATTR in module.__dict__:
        _unwrap(module)
    previous = module.__dict__.get("forward")
    norms = [m for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats]
    module.__dict__[_WRAP_ATTR] = _WrapState(switch, previous, norms)
    # A bound method (not a closure): deepcopy rebinds it to the copy instead of running the original.
    module.__dict__["forward"] = types.MethodType(_checkpointed_forward, module)


def _unwrap(module: nn.Module) -> None:
    state = module.__dict__.pop(_WRAP_ATTR, None)
    if state is None:
        return
    if state.previous_forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = state.previous_forward


def is_wrapped(module: nn.Module) -> bool:
    """Whether `module`'s forward is currently wrapped by an `ActivationCheckpointing` callback."""
    # After unpickling, "forward" is the class's bound forward again, so check the method, not the state.
    return getattr(module.__dict__.get("forward"), "__func__", None) is _checkpointed_forward


# ----------------------------------------------------------------- choosing the modules


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _resolved(entry: str) -> type | None:
    """The class a dotted entry of ``modules`` names as the user writes it (``torch.nn.Linear``, a package's
    re-export), else None: a class's own path (``torch.nn.modules.linear.Linear``) alone matched. Looked up in the
    modules already imported, never imported here: a class in the model was imported with its package, and an
    import would run a module's code (``train.Block`` re-running the user's script)."""
    module_name, _, attr = entry.rpartition(".")
    module = sys.modules.get(module_name) if module_name else None
    try:
        found = getattr(module, attr, None)  # a lazy package (transformers) may import on attribute access
    except Exception:  # noqa: BLE001 - whatever a lazy module raises, the entry matches by name only
        return None
    return found if isinstance(found, type) else None


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def repeated_blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks as ``(qualified name, module)`` in model order.

    Candidates are the same-class children of one `nn.ModuleList` / `nn.Sequential` (the usual home
    of transformer blocks) that hold parameters, so a pipeline stage's parameter-free placeholders
    never count. Groups of two or more beat singletons; then the group covering the most parameters
    wins (blocks, not the Linears inside them, nor a per-block list of experts). Empty when none.
    """
    best: tuple[tuple[bool, int], list[tuple[str, nn.Module]]] | None = None
    for prefix, container in root.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        groups: dict[type, list[tuple[str, nn.Module]]] = {}
        for name, child in container.named_children():
            if _has_params(child):
                groups.setdefault(type(child), []).append((f"{prefix}.{name}" if prefix else name, child))
        for members in groups.values():
            size = sum(p.numel() for _, m in members for p in m.parameters())
            key = (len(members) >= 2, size)
            if best is None or key > best[0]:
                best = (key, members)
    return [] if best is None else best[1]


def named_matches(root: nn.Module, names: Iterable[str]) -> list[tuple[str, nn.Module]]:
    """Submodules whose class name or dotted class path is in `names`, outermost only, in model order.

    A match nested inside another match is skipped: checkpointing inside a checkpointed region only
    recomputes the inner part a second time.
    """
    wanted = set(names)
    classes = {cls for cls in map(_resolved, wanted) if cls is not None}
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        cls = type(module)
        if module is root or not ({cls.__name__, _class_path(cls)} & wanted or cls in classes):
            continue
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        found.append((name, module))
    return found


def plan_line(root: nn.Module, chosen: list[tuple[str, nn.Module]], mode: str, picked: bool) -> str:
    """What setup says it wraps; for blocks it picked itself, also the blocks of other classes beside them (a hybrid
    model's attention layers between its Mamba layers, say), which the same-class rule leaves as they are."""
    counts = Counter(type(module).__name__ for _, module in chosen)
    line = (
        f"ActivationCheckpointing: {mode} recomputation of {len(chosen)} blocks ("
        + ", ".join(f"{name} x{n}" for name, n in counts.items())
        + f"; {chosen[0][0]}, ...)"
    )
    if not picked:
        return line
    modules = dict(root.named_modules())
    classes = {type(module) for _, module in chosen}
    beside: Counter[str] = Counter()
    for parent in {name.rpartition(".")[0] for name, _ in chosen}:
        children = [child for child in modules[parent].children() if _has_params(child)]
        wrapped = [i for i, child in enumerate(children) if any(child is module for _, module in chosen)]
        # A class with a member between two wrapped blocks is a block (not the embedding before, the head after).
        between = {type(child) for i, child in enumerate(children) if min(wrapped) < i < max(wrapped)}
        for child in children:
            if type(child) not in classes and type(child) in between:
                beside[type(child).__name__] += 1
    if beside:
        left = ", ".join(f"{name} x{n}" for name, n in beside.items())
        line += f"; beside them, not wrapped: {left} (name every class to wrap in modules=[...])"
    return line


def candidate_classes(root: nn.Module) -> list[str]:
    """``ClassName (xcount)`` for each class of submodule holding parameters, most frequent first."""
    # ModuleList/ModuleDict have no forward of their own: nothing to checkpoint.
    containers = (nn.ModuleList, nn.ModuleDict)
    counts = Counter(
        type(m).__name__ for m in root.modules() if m is not root and not isinstance(m, containers) and _has_params(m)
    )
    return [f"{name} (x{n})" for name, n in counts.most_common()]


# ----------------------------------------------------------------- the callback


class ActivationCheckpointing(Callback):
    """Recompute the activations of chosen blocks during backward instead of keeping them.

    Uses non-reentrant `torch.utils.checkpoint` with the RNG state preserved, so dropout masks and gradients are the
    same as without it, under `1F1B-flush` and in PACI's synchronous start. Under PACI a stale micro-batch's block
    is recomputed at backward on the stage's current weights (its forward ran on older or predicted ones: nothing is
    stashed), so the run moves away from one without checkpointing by as much as staleness moves it (docs/DESIGN.md,
    "recompute"). Full mode keeps only each block's input (about one extra forward of compute); selective mode also
    keeps matmul and attention outputs and recomputes only the cheap ops (LayerNorm, GELU, dropout, adds) in
    between; a fused attention kernel that draws a dropout mask (attention dropout on CUDA) is recomputed too, so
    that every mask is the forward's.

    The callback wraps in `on_fit_start`, after the strategy has set up (and, under `PACIStrategy`, split) the
    model, and unwraps in `teardown`. `validate`/`test`/`predict` run without autograd, where checkpointing saves
    nothing, so they are left alone. At the first micro-batch of every window whose `train_loss` Lightning logs
    (every `trainer.log_every_n_steps`-th optimizer step) it measures the bytes one micro-batch keeps for backward
    and logs them as ``activation_checkpointing/saved_bytes`` on that row's step (at a fit's first batch and the
    first after a toggle it measures them into ``saved_bytes`` too, logged if the window is): on the stages of the
    process that logs (under `PACIStrategy` on processes, global rank 0's, the last stage; in one process, every
    stage, so the two differ: no collective is spent on a metric). A strategy that already recomputes
    (``PACIStrategy(recompute=True)``) is refused: blocks would be recomputed twice.

    Args:
        modules: Class names (``"Block"``) or dotted class paths (``"lit_efficient.models.gpt.Block"``)
            of the modules to checkpoint, as defined or as imported (``"torch.nn.Linear"``). None picks the
            model's repeated blocks: the same-class children of a ModuleList/Sequential covering the most
            parameters (e.g. transformer blocks).
        mode: ``"full"`` recomputes the whole block; ``"selective"`` keeps matmul and attention outputs
            and recomputes the rest (less memory saved, less compute added).
        every_n: Checkpoint every n-th matching block (the n-th, 2n-th, ...); 1 checkpoints all of them.
        enabled: Whether checkpointing starts on. Toggle with `enable()` / `disable()` at run time; the
            flag is saved in checkpoints and restored on resume.
    """

    def __init__(
        self,
        modules: list[str] | None = None,
        mode: Literal["full", "selective"] = "full",
        every_n: int = 1,
        enabled: bool = True,
    ) -> None:
        check_flags("ActivationCheckpointing", enabled=enabled)
        if isinstance(modules, str):
            raise ValueError(f"ActivationCheckpointing(modules={modules!r}) must be a list; use modules=[{modules!r}].")
        if modules is not None:
            if not isinstance(modules, (list, tuple, set, frozenset)):
                raise ValueError(
                    f"ActivationCheckpointing(modules={modules!r}) must be a list of class names such as ['Block'], "
                    "or None to checkpoint the model's repeated blocks."
                )
            modules = list(modules)
            if not modules:
                raise ValueError(
                    "ActivationCheckpointing(modules=[]) names no module; list class names such as ['Block'], "
                    "or pass modules=None to checkpoint the model's repeated blocks."
                )
            if not all(isinstance(m, str) and m for m in modules):
                raise ValueError(f"ActivationCheckpointing(modules={modules!r}) must hold non-empty class names.")
        if mode not in _MODES:
            raise ValueError(f"ActivationCheckpointing(mode={mode!r}) is unknown; use 'full' or 'selective'.")
        if not is_count(every_n):
            raise ValueError(
                f"ActivationCheckpointing(every_n={every_n!r}) must be an integer >= 1; 1 checkpoints every block."
            )
        self.modules = modules
        self.every_n = every_n
        self._switch = _Switch(enabled, mode)
        self._wrapped: list[nn.Module] = []
        self._finders: list[LearningRateFinder] = []  # whose lr_find wraps first (`_wrap_before_finders`)
        self._plan: list[tuple[str, type]] = []  # made on the unsplit model in setup()
        self._meter: SavedActivationMeter | None = None
        self._window: int | None = None  # the optimizer step (window) the last training batch belonged to
        self._log_measured = False  # whether the running measurement is logged (a window Lightning logs)
        self._measure_next = True
        self.saved_bytes: int | None = None  # the last measurement

    # ------------------------------------------------------------- queries and toggle

    @property
    def mode(self) -> str:
        """``"full"`` or ``"selective"``."""
        return self._switch.mode

    @property
    def enabled(self) -> bool:
        """Whether wrapped modules recompute (read on every forward)."""
        return self._switch.enabled

    def enable(self) -> None:
        """Turn checkpointing on from the next forward; the next training batch is measured."""
        self._switch.enabled = True
        self._measure_next = True

    def disable(self) -> None:
        """Turn checkpointing off from the next forward (modules stay wrapped, at no cost); measured next batch."""
        self._switch.enabled = False
        self._measure_next = True

    @property
    def wrapped_modules(self) -> list[nn.Module]:
        """The modules this callback currently wraps."""
        return list(self._wrapped)

    def select(self, root: nn.Module, found: list[tuple[str, nn.Module]] | None = None) -> list[tuple[str, nn.Module]]:
        """The ``(name, module)`` pairs this configuration would checkpoint in `root`, `every_n` applied to its
        matches (``found``: `matches`, where the caller has them)."""
        found = self.matches(root) if found is None else found
        return [pair for i, pair in enumerate(found) if (i + 1) % self.every_n == 0]

    def matches(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        """The modules of `root` this configuration names (or the repeated blocks), before `every_n`."""
        return repeated_blocks(root) if self.modules is None else named_matches(root, self.modules)

    def wrap(self, root: nn.Module) -> list[str]:
        """Wrap the modules `select` picks in `root` (outside a Trainer: tests, benchmarks); returns their names."""
        chosen = self.select(root)
        for _, module in chosen:
            _wrap(module, self._switch)
            self._wrapped.append(module)
        return [name for name, _ in chosen]

    def unwrap(self) -> None:
        """Restore every wrapped module's own forward."""
        for module in self._wrapped:
            _unwrap(module)
        self._wrapped.clear()

    # ------------------------------------------------------------- Lightning hooks

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _refuse_double_recompute(trainer)  # before the strategy builds anything
        # Lightning calls callback setup before strategy.setup: this is the whole model, so `every_n`
        # counts global block indices and a pipeline rank later wraps exactly its share of the plan.
        found = self.matches(pl_module)
        chosen = self.select(pl_module, found)
        self._plan = [(name, type(module)) for name, module in chosen]
        self._check_plan(pl_module, found, chosen)
        if chosen:
            rank_zero_info(plan_line(pl_module, chosen, self.mode, picked=self.modules is None))
        self._wrap_before_finders(trainer)

    def _wrap_before_finders(self, trainer: Trainer) -> None:
        """Wrap the blocks before a learning-rate finder's training run, not after: Lightning moves the finder to the
        front of the callbacks, so its run (in its `on_fit_start`) came before this callback's `on_fit_start`
        and trained without activation checkpointing, which a model that fits only with it cannot. Each finder's
        ``lr_find`` wraps first (`on_fit_start` is idempotent); `teardown` gives the finder its own back."""
        for finder in (c for c in trainer.callbacks if isinstance(c, LearningRateFinder)):  # type: ignore[attr-defined]
            if "lr_find" in finder.__dict__:
                continue  # already preceded by this (or another) ActivationCheckpointing

            def lr_find(trainer: Trainer, pl_module: LightningModule, _finder: Any = finder) -> None:
                self.on_fit_start(trainer, pl_module)
                type(_finder).lr_find(_finder, trainer, pl_module)

            finder.__dict__["lr_find"] = lr_find
            self._finders.append(finder)

    def check_before_launch(self, trainer: Trainer, layers_may_come_later: bool) -> None:
        """`setup`'s and `on_fit_start`'s refusals on the whole model, in the launching process: PACIStrategy calls
        it before any rank starts (on processes they came after the launch, in every rank's traceback, each naming
        only its own stage's classes). ``layers_may_come_later``: the module builds layers in its own setup or
        configure_model, so a name that matches nothing yet is left to `on_fit_start`. Fit only: the callback acts
        in fit alone (validate, test and predict run the model as it is)."""
        if trainer.state.fn != "fit":
            return
        _refuse_double_recompute(trainer)
        pl_module = trainer.lightning_module
        found = self.matches(pl_module)
        self._check_plan(pl_module, found, self.select(pl_module, found))
        if not found and self.modules is not None and not layers_may_come_later:
            raise ValueError(self._matches_nothing(pl_module))

    def _matches_nothing(self, pl_module: LightningModule) -> str:
        found = ", ".join(candidate_classes(pl_module)) or "none"
        return (
            f"ActivationCheckpointing(modules={self.modules}) matches no module of {type(pl_module).__name__}; "
            f"classes with parameters found: {found}. Use one of these names (or a dotted class path such as "
            "'torch.nn.Linear'), or modules=None to pick the repeated blocks."
        )

    def _check_plan(
        self, pl_module: LightningModule, found: list[tuple[str, nn.Module]], chosen: list[tuple[str, nn.Module]]
    ) -> None:
        """Refuse a configuration that would silently checkpoint less than it names: an entry of ``modules`` that
        matches nothing beside ones that do (a misspelling), or an ``every_n`` past the last match. (Where nothing
        matches yet, the model may build its layers in configure_model: `on_fit_start` says so then.)"""
        if not found:
            return
        if self.modules is not None:
            classes = {type(m).__name__ for m in pl_module.modules()}
            present = classes | {_class_path(type(m)) for m in pl_module.modules()}
            for name in self.modules:
                # A misspelling is close to a class present; another architecture's name (a list shared by configs
                # of several models) is not, and is let be. A dotted path as imported (torch.nn.LayerNrom) by its
                # class name: the whole string is close to no class's own path.
                last = name.rpartition(".")[2]
                close = difflib.get_close_matches(name, sorted(present), n=1, cutoff=0.85) or (
                    difflib.get_close_matches(last, sorted(classes), n=1, cutoff=0.85) if last != name else []
                )
                if name not in present and close and _resolved(name) is None:
                    raise ValueError(
                        f"ActivationCheckpointing(modules={self.modules}): {name!r} matches no module of "
                        f"{type(pl_module).__name__}; did you mean {close[0]!r}? Classes with parameters: "
                        f"{', '.join(candidate_classes(pl_module)) or 'none'}."
                    )
        if not chosen:
            raise ValueError(
                f"ActivationCheckpointing(every_n={self.every_n}) is past the {len(found)} matching modules of "
                f"{type(pl_module).__name__}: nothing would be checkpointed. Use every_n <= {len(found)}."
            )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The first hook after strategy.setup (the pipeline split), and it runs for fit only.
        _refuse_double_recompute(trainer)
        self.unwrap()
        local = dict(pl_module.named_modules())
        # A planned module replaced by a stage placeholder (another class) belongs to another rank.
        chosen = [(n, local[n]) for n, cls in self._plan if n in local and type(local[n]) is cls]
        if not self._plan:
            # Nothing seen in setup: the model may build its layers in configure_model.
            chosen = self.select(pl_module)
        if not self._plan and not chosen:
            found = ", ".join(candidate_classes(pl_module)) or "none"
            if self.modules is not None:
                raise ValueError(self._matches_nothing(pl_module))
            rank_zero_warn(
                f"ActivationCheckpointing found no repeated blocks in {type(pl_module).__name__} and checkpoints "
                f"nothing; pass modules=[...] with one of: {found}."
            )
        for _, module in chosen:
            _wrap(module, self._switch)
            self._wrapped.append(module)
        self._window = None
        self._measure_next = True

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # Once per window that Lightning logs (its train_loss row: (step + 1) % log_every_n_steps == 0), at its first
        # micro-batch, and at that row's step: global_step before the window is counted.
        step = trainer.global_step
        due = step != self._window and (step + 1) % max(1, trainer.log_every_n_steps) == 0
        self._window = step
        if (due or self._measure_next) and self._meter is None:
            self._measure_next, self._log_measured = False, due  # a toggle's measurement: saved_bytes, not a row
            # A Python hook per saved tensor for one forward; the count is storage metadata, no device sync.
            self._meter = SavedActivationMeter(exclude=[pl_module]).start()

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        # Everything this micro-batch keeps for backward is saved by now; stop before backward's own work.
        if self._meter is not None and self._meter.running:
            self._meter.stop()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._meter is None:
            return
        self.saved_bytes = self._meter.stop()
        self._meter = None
        if not self._log_measured:
            return
        # Straight to the loggers (as LearningRateMonitor does): a host int, on the window's train_loss row; loggers
        # write from rank zero only.
        for logger in trainer.loggers:
            logger.log_metrics({METRIC_KEY: float(self.saved_bytes)}, step=self._window)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # A meter left running would keep its saved-tensor hooks on this thread after the failed fit.
        self._stop_meter()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_meter()
        if stage == "fit":
            self.unwrap()
            for finder in self._finders:
                finder.__dict__.pop("lr_find", None)
            self._finders.clear()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Only the run-time toggle is state; modules/mode/every_n come from the current configuration.
        if "enabled" in state_dict:
            self._switch.enabled = bool(state_dict["enabled"])
            self._measure_next = True

    def _stop_meter(self) -> None:
        if self._meter is not None:
            self._meter.stop()
            self._meter = None


def _refuse_double_recompute(trainer: Trainer) -> None:
    strategy = trainer.strategy
    if getattr(strategy, "recompute", False) is True:
        raise ValueError(
            f"ActivationCheckpointing cannot be combined with {type(strategy).__name__}(recompute=True): "
            f"recompute mode already reruns each stage's forward at backward, and checkpointed blocks inside "
            f"it would be recomputed a second time (three forwards per micro-batch) to save memory that "
            f"recompute mode has mostly freed already. Use one: {type(strategy).__name__}(recompute=False) "
            f"with ActivationCheckpointing(), or remove ActivationCheckpointing from the callbacks."
        )
