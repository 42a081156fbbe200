"""Measuring what one micro-batch costs each pipeline stage, on fake tensors: no memory is allocated.

This file owns the measurement behind the memory plan (`lit_efficient.tools.memory_plan`,
docs/DESIGN.md section 8). Every parameter and buffer of the module is swapped for a
`torch._subclasses.FakeTensorMode` tensor of the same shape and dtype (ties kept), and each stage's
layers run one micro-batch of the real shape forward and backward exactly as `PipelineStage` runs
them (its ``run_layers``, the precision's forward context, the loss on the last stage), then its
optimizer steps once. Three instruments watch:

- the tensors autograd saves (``saved_tensors_hooks``; parameters and buffers excluded, a storage
  counted once however many views of it are saved; what selective checkpointing caches is added by
  the caller's ``saved_scope``),
- every storage an operation creates and when it dies (a dispatch mode with a weak reference per
  storage, as torch's ``MemTracker`` does): the live bytes and their peak,
- the optimizer's state tensors after its first step, and the peak of its step's temporaries.

What it cannot see: kernels' private workspaces (cuBLAS, flash attention's), the allocator's rounding
and fragmentation, and anything a model computes from tensor values (a forward that branches on data
fails here with the op's name). The kernels that run are the host's: on a CPU-only machine, CPU
kernels, whose saved tensors match CUDA's for the ops transformers use (matmuls, flash-style
attention saving output and log-sum-exp), under CPU autocast's op lists.

Cost: a fake op costs microseconds, so GPT-2 Medium's 26 layers at 16 x 1024 tokens are measured in
a few seconds on one CPU core, and a Llama-3-8B stage as fast as its op count allows.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lit_efficient.runtime.partition import stage_bounds
from lit_efficient.runtime.stage import run_layers
from lit_efficient.tools.memory_plan import StageMeasure

Payload = tuple[Any, ...]
MakeOptimizer = Callable[[list[nn.Parameter]], "torch.optim.Optimizer | None"]
# The state torch.get_rng_state() returns (mt19937 + its bookkeeping): what a recompute stage keeps per
# micro-batch in flight besides its input (stage.py `_capture_rng`). On CUDA, 16 more bytes of Philox state.
CPU_RNG_STATE_BYTES = 5056


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of the storages operations create while it is active, each storage once.

    A storage is counted from the operation that created it until its last reference dies (a weak
    reference per storage tells). Storages that exist before (parameters, gradients, optimizer
    state) are never counted; `adopt` counts one explicitly (a received input).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        self._ignored: set[int] = set()

    def ignore(self, tensors: Iterator[Tensor] | Sequence[Tensor]) -> None:
        """Never count these tensors' storages (they are accounted elsewhere)."""
        self._ignored.update(_key(t) for t in tensors)

    def adopt(self, t: Tensor) -> None:
        """Count ``t``'s storage from now on, unless it is counted or ignored already."""
        storage = t.untyped_storage()
        key = StorageWeakRef(storage).cdata
        if key in self._refs or key in self._ignored:
            return
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)

        def release(_: object, key: int = key, nbytes: int = nbytes) -> None:
            self.live -= nbytes
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, release)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self.adopt(t)
        return out


class SavedBytes:
    """The distinct storages autograd saves while active (parameters and buffers excluded), by key and size.

    ``add`` counts a tensor saved some other way (what selective checkpointing caches). It keeps no tensor:
    every saved variable references the pack hook, and through it this object, until the backward is done,
    so a tensor held here would outlive the step of the backward that frees it in training.
    """

    def __init__(self, exclude: Sequence[Tensor]) -> None:
        self._exclude = {_key(t) for t in exclude}
        self.storages: dict[int, int] = {}  # storage key -> bytes

    @property
    def bytes(self) -> int:
        """The bytes of the storages saved so far."""
        return sum(self.storages.values())

    def add(self, t: Tensor) -> None:
        """Count ``t``'s storage once."""
        key = _key(t)
        if key not in self._exclude:
            self.storages[key] = _nbytes(t)

    def _pack(self, t: Tensor) -> Tensor:
        self.add(t)
        return t

    def hooks(self) -> AbstractContextManager:
        """The ``saved_tensors_hooks`` that count while active."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)


class answering_value_queries(TorchDispatchMode):  # noqa: N801 - used as a context manager, reads like one
    """Answers the ops that read tensor values, which fake tensors do not have.

    A yes/no question about values answers yes: a model's own set-up checks pass (``torch.allclose``:
    HFCausalLM compares its split's logits with the model's), and the checks transformers makes on the way
    (no padding in the mask, no packed sequences in the position ids) find what a batch of full rows gives.
    With ``numbers=True`` a number read from a tensor (``.item()``) is 1: an optimizer's step count. Over a
    forward and backward numbers stay off, so a model whose shapes follow its data fails, naming the op,
    instead of being planned with a made-up value.
    """

    _YES = ("allclose", "equal", "is_nonzero")

    def __init__(self, numbers: bool = True) -> None:
        super().__init__()
        self.numbers = numbers

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in self._YES:
            return True
        if name == "_local_scalar_dense" and (self.numbers or args[0].dtype == torch.bool):
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        return func(*args, **(kwargs or {}))


@contextmanager
def fake_module(module: nn.Module) -> Iterator[FakeTensorMode]:
    """Within the block, every parameter and buffer of ``module`` is a fake CPU tensor of its shape and dtype,
    a tensor shared by two modules stays shared, and the fake mode is active. Afterwards the module holds its
    own tensors again, the same objects: a real model is left as it was, a meta one stays on meta."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped: list[tuple[dict, str, Any]] = []
    made: dict[int, Tensor] = {}
    with mode:
        for m in module.modules():
            for table in (m._parameters, m._buffers):
                for name, t in table.items():
                    if t is None:
                        continue
                    if id(t) not in made:
                        made[id(t)] = _fake_like(t)
                    swapped.append((table, name, t))
                    table[name] = made[id(t)]
    try:
        with mode:
            yield mode
    finally:
        for table, name, t in swapped:
            table[name] = t


def fake_batch(batch: Any, mode: FakeTensorMode) -> Any:
    """``batch`` with every tensor a fake CPU tensor of its shape and dtype (real, meta or fake input)."""
    with mode:
        return tree_map(lambda t: _fake_like(t) if isinstance(t, Tensor) else t, batch)


def measure_stages(
    layers: Sequence[nn.Module],
    sizes: Sequence[int],
    batch: Any,
    input_fn: Callable[[Any], Any],
    loss_fn: Callable[[Any, Any], Any],
    forward_context: Callable[[], AbstractContextManager] = nullcontext,
    make_optimizer: MakeOptimizer | None = None,
    saved_scope: Callable[[SavedBytes], AbstractContextManager] | None = None,
) -> list[StageMeasure]:
    """Measure every stage of ``layers`` split as ``sizes``; call inside `fake_module`.

    Args:
        layers: The module's ``pipeline_layers()``, on fake tensors.
        sizes: Layers per stage (the strategy's partition).
        batch: One micro-batch (`fake_batch`).
        input_fn: ``pipeline_input``: the batch -> what layer 0 consumes.
        loss_fn: ``pipeline_loss``: (last layer's output, batch) -> loss or (loss, count).
        forward_context: The precision's forward context (autocast for bf16-mixed).
        make_optimizer: The stage's parameters -> its optimizer (None: no optimizer state).
        saved_scope: A context entered around each forward with the stage's `SavedBytes`, for saved
            tensors that bypass autograd's hooks (selective activation checkpointing's cache).
    """
    bounds = stage_bounds(sizes)
    owners: dict[int, set[int]] = {}
    for s, (first, last) in enumerate(bounds):
        for layer in layers[first:last]:
            for p in layer.parameters():
                owners.setdefault(id(p), set()).add(s)
    results = []
    incoming: Payload = tuple(_as_tuple(input_fn(batch)))
    for s, (first, last) in enumerate(bounds):
        is_last = s == len(bounds) - 1
        stage_layers = list(layers[first:last])
        try:
            with answering_value_queries(numbers=False):
                result, outputs = _measure_stage(
                    s, (first, last), stage_layers, incoming, s == 0, is_last, batch, loss_fn, forward_context,
                    make_optimizer, saved_scope, owners,
                )  # fmt: skip
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            raise ValueError(
                f"stage {s} (layers {first}..{last - 1}) reads tensor values in its forward or backward ({err}): "
                "what it computes depends on the data, which fake tensors do not have, so it cannot be planned"
            ) from err
        results.append(result)
        incoming = outputs
    return results


def _measure_stage(
    s: int,
    bounds: tuple[int, int],
    layers: list[nn.Module],
    incoming: Payload,
    is_first: bool,
    is_last: bool,
    batch: Any,
    loss_fn: Callable[[Any, Any], Any],
    forward_context: Callable[[], AbstractContextManager],
    make_optimizer: MakeOptimizer | None,
    saved_scope: Callable[[SavedBytes], AbstractContextManager] | None,
    owners: dict[int, set[int]],
) -> tuple[StageMeasure, Payload]:
    params = _unique(p for layer in layers for p in layer.parameters())
    buffers = _unique(b for layer in layers for b in layer.buffers())
    trained = [p for p in params if p.requires_grad]
    # Gradients exist before the micro-batch, as in every micro-batch of a window but its first: the
    # backward accumulates into them in place, and what it allocates on the way is transient.
    with torch.no_grad():
        for p in trained:
            p.grad = torch.zeros_like(p)
    live = LiveBytes()
    live.ignore([*params, *buffers, *(p.grad for p in trained)])
    saved = SavedBytes([*params, *buffers])
    with live:
        # What arrives over the wire is a buffer of its own on this stage's device. The first stage's
        # input is the batch's own tensors (the data loader's, shared with the batch).
        inputs = incoming if is_first else tuple(_received(t) for t in incoming)
        for t in inputs:
            if isinstance(t, Tensor):
                live.adopt(t)
        with ExitStack() as scope:
            scope.enter_context(saved.hooks())
            if saved_scope is not None:
                scope.enter_context(saved_scope(saved))
            with forward_context():
                outputs = run_layers(layers, inputs, bounds[0])
            if is_last:
                with forward_context():
                    out = loss_fn(outputs[0] if len(outputs) == 1 else outputs, batch)
                loss = out[0] if isinstance(out, tuple) else out
        kept = (loss,) if is_last else outputs  # stage.py: the last stage keeps the loss, not the logits
        kept_storages = {_key(t): _nbytes(t) for t in [*_tensors(inputs), *_tensors(kept)]}
        held = sum({**saved.storages, **kept_storages}.values())
        saved_bytes = saved.bytes
        if is_last:
            del outputs  # the logits live on only where autograd saved them (stage.py keeps the loss)
            outputs = ()
            loss.backward()
        else:
            pairs = [(o, torch.ones_like(o)) for o in outputs if isinstance(o, Tensor) and o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            del pairs
        compute_peak = live.peak
    boundary = 0 if is_last else _union_bytes(_tensors(outputs), exclude=[])
    leaving = () if is_last else tuple(_leaving(t) for t in outputs)
    input_bytes = _union_bytes(_tensors(inputs), exclude=[])
    del outputs, kept, inputs
    optimizer, per_param, step_transient = _measure_optimizer(trained, make_optimizer)
    for p in trained:
        p.grad = None
    tied = sum(_nbytes(p) for p in params if len(owners.get(id(p), ())) > 1)
    measure = StageMeasure(
        stage=s,
        layers=bounds,
        parameters=sum(p.numel() for p in params),
        weights=_union_bytes([*params, *buffers], exclude=[]),
        parameter_bytes=_union_bytes(params, exclude=[]),
        gradients=_union_bytes([p for p in trained], exclude=[]),
        optimizer=optimizer,
        optimizer_per_parameter=per_param,
        step_transient=step_transient,
        tied=tied,
        saved=saved_bytes,
        held=held,
        inputs=input_bytes,
        rng=0 if is_last else CPU_RNG_STATE_BYTES,
        compute_peak=compute_peak,
        boundary=boundary,
    )
    return measure, leaving


def _measure_optimizer(trained: list[nn.Parameter], make_optimizer: MakeOptimizer | None) -> tuple[int, tuple, int]:
    """State bytes (total and per parameter) after one step, and the peak of the step's temporaries."""
    optimizer = make_optimizer(trained) if make_optimizer is not None and trained else None
    if optimizer is None:
        return 0, tuple(0 for _ in trained), 0
    live = LiveBytes()
    live.ignore([*trained, *(p.grad for p in trained if p.grad is not None)])
    with live, answering_value_queries(numbers=True), torch.no_grad():
        optimizer.step()
    order = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = []
    seen: set[int] = set()
    for p in order:
        state = optimizer.state.get(p, {})
        total = 0
        for t in state.values():
            if isinstance(t, Tensor) and _key(t) not in seen:
                seen.add(_key(t))
                total += t.untyped_storage().nbytes()
        per_param.append(total)
    state_bytes = sum(per_param)
    return state_bytes, tuple(per_param), max(0, live.peak - state_bytes)


def _received(t: Any) -> Any:
    """A tensor as the next stage receives it: a new buffer, a leaf that collects a gradient when the sender's
    tensor required one (stage.py `_as_leaf`)."""
    if not isinstance(t, Tensor):
        return t
    fresh = torch.empty_like(t)
    return fresh.requires_grad_() if t.requires_grad and t.is_floating_point() else fresh


def _leaving(t: Any) -> Any:
    """What the next stage is sent: shape, dtype and whether a gradient comes back; the data stay here."""
    if not isinstance(t, Tensor):
        return t
    return t.detach().requires_grad_(t.requires_grad and t.is_floating_point())


def _fake_like(t: Tensor) -> Tensor:
    fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake


def _key(t: Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def _nbytes(t: Tensor) -> int:
    return t.untyped_storage().nbytes()


def _union_bytes(tensors: Sequence[Tensor], exclude: Sequence[Tensor]) -> int:
    skip = {_key(t) for t in exclude}
    seen: dict[int, int] = {}
    for t in tensors:
        key = _key(t)
        if key not in skip:
            seen[key] = _nbytes(t)
    return sum(seen.values())


def _tensors(values: Sequence[Any]) -> list[Tensor]:
    return [t for t in values if isinstance(t, Tensor)]


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _unique(tensors: Iterator[Tensor]) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _identity(t: Tensor) -> Tensor:
    return t
