"""One pipeline stage: the forward and backward of a micro-batch, local accumulation, weight versions.

The stage owns its layers' compute and its optimizer; it never talks to the network (the runtime
moves tensors, `comm` issues the transfers). Each stage counts its own backwards and steps its
own optimizer when the runtime reaches a ``STEP`` action, so under PACI stages step at different
times, without a barrier.

Gradients are accumulated un-normalized: the last stage backpropagates ``loss * w`` where ``w``
is 1 per micro-batch (``normalize="mean"``) or the micro-batch's item count (``"tokens"``), the
weight travels upstream with the gradient, and at the step every stage divides its gradients by
the window's total weight. That is exact for windows of any size (a partial window at the end
of an epoch included) and needs no look-ahead, so it works asynchronously.

Two ways to run the backward of a micro-batch whose stage stepped after its forward:

- keep-graph (default): the autograd graph from forward is kept and the optimizer updates the
  parameters in place. Stock PyTorch refuses such a backward (the parameters' version counters
  moved), so `step` restores every parameter's version counter after updating it. The backward
  then uses the current weights for the input gradient: PACI's bounded drift, without stashing.
- recompute: the forward runs under ``no_grad``; the stage keeps only its input and the RNG state,
  and at backward recomputes the forward with the same RNG state (same dropout masks) and the
  current weights. About one extra forward of compute for much less activation memory.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from lit_efficient.runtime.clock import Clock, HostClock, Spans, clock_for
from lit_efficient.runtime.staleness import StalenessCorrection, gradients_nonfinite

Normalize = Literal["mean", "tokens"]
OnNonFinite = Literal["raise", "skip"]
# What crosses a stage boundary: a stage's inputs or outputs (None where a layer passes nothing along).
Payload = tuple[Tensor | None, ...]
LossFn = Callable[[Payload, Any], "Tensor | tuple[Tensor, Tensor | int]"]
_RECENT = 4096  # per-micro-batch version records kept for inspection (bounded: runs are long)


def run_layers(layers: Sequence[nn.Module], inputs: Payload, first_layer: int = 0) -> Payload:
    """Run ``layers`` in order; a tuple output is unpacked into the next layer's arguments.

    A layer that cannot consume its input fails with an error naming the layer and what it got, so a
    layer list that does not chain is caught at the first micro-batch with a readable message.
    """
    x = inputs
    for k, layer in enumerate(layers, start=first_layer):
        try:
            out = layer(*x)
        except (TypeError, RuntimeError, ValueError, IndexError) as err:
            if type(err) not in (TypeError, RuntimeError, ValueError, IndexError):
                raise  # a subclass (e.g. a comm error) carries its own message and constructor
            got = ", ".join(_described(t) for t in x)
            name = type(getattr(layer, "_orig_mod", layer)).__name__  # a compiled layer: its module's class
            raise type(err)(f"pipeline layer {k} ({name}) failed on input ({got}): {err}") from err
        x = out if isinstance(out, tuple) else (out,)
    return x


def _described(value: Any) -> str:
    """A layer input for an error message: its type and shape, and for integer ids (a token id at or above an
    embedding's vocabulary fails as a bare "index out of range in self") their range."""
    if not isinstance(value, Tensor):
        return type(value).__name__
    text = f"Tensor{tuple(value.shape)}"
    integer = not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool
    if integer and value.numel() and value.device.type == "cpu":  # on CUDA the failure poisoned the context
        text += f" {str(value.dtype).removeprefix('torch.')} in [{value.min().item()}, {value.max().item()}]"
    return text


@dataclass
class _InFlight:
    """What a stage keeps for a micro-batch between its forward and its backward."""

    version: int
    inputs: Payload
    outputs: Payload | None = None  # keep-graph: outputs with their graph; recompute: None
    loss: Tensor | None = None  # last stage: the scaled loss to backpropagate
    weight: Tensor | None = None  # last stage: this micro-batch's share of the window
    bad: Tensor | None = None  # last stage: 1.0 if the loss is NaN/Inf (checked on the device, no sync)
    rng: tuple[Tensor, Tensor | None] | None = None  # recompute: CPU and CUDA RNG states


@dataclass
class StageStats:
    """Measured accounting of one stage (not derived from formulas).

    Times are spans on the stage's clock (`lit_efficient.runtime.clock`): host time on CPU, CUDA events
    on a GPU. Reading a ``*_seconds`` property resolves the pending events, which on CUDA waits for the
    device: read them where results are read (the monitor's logging interval), not per action.
    """

    forwards: int = 0
    backwards: int = 0
    steps: int = 0
    max_in_flight: int = 0
    drift_sum: int = 0
    drift_max: int = 0
    # (micro-batch, version at forward, version at backward) of the most recent micro-batches.
    versions: list[tuple[int, int, int]] = field(default_factory=list)
    # Seconds per kind of action: "forward", "backward", "step", "evaluate".
    times: Spans = field(default_factory=lambda: Spans(HostClock()))

    @property
    def forward_seconds(self) -> float:
        """Time in forwards (the last stage's loss included)."""
        return self.times.total("forward")

    @property
    def backward_seconds(self) -> float:
        """Time in backwards."""
        return self.times.total("backward")

    @property
    def step_seconds(self) -> float:
        """Time in local optimizer steps (normalization, checks and hooks included)."""
        return self.times.total("step")

    @property
    def evaluate_seconds(self) -> float:
        """Time in evaluation forwards."""
        return self.times.total("evaluate")

    @property
    def busy_seconds(self) -> float:
        """Time in compute: forward, backward, optimizer step and evaluation forwards."""
        return sum(self.times.totals().values())


class NonFiniteError(FloatingPointError):
    """A NaN or Inf loss or gradient, reported with the stage, optimizer step and micro-batch."""


class PipelineStage:
    """The layers of one stage with their optimizer.

    Args:
        layers: This stage's layers, in order (a tuple output feeds the next layer unpacked).
        stage: Index of this stage, 0 first.
        num_stages: Pipeline depth.
        optimizer: Optimizer over this stage's parameters only.
        loss_fn: Last stage only: ``(outputs, batch) -> loss`` or ``(loss, num_items)``; the loss is
            the mean over the micro-batch's items.
        scheduler: LR scheduler stepped with every local optimizer step, or None.
        recompute: Recompute the forward at backward instead of keeping the graph.
        normalize: ``"mean"`` weighs micro-batches equally; ``"tokens"`` by their item counts.
        forward_context: Factory of the context every forward runs in (autocast for bf16).
        device: Where this stage computes.
        on_nonfinite: A NaN/Inf loss or gradient in a window: ``"raise"`` an error naming the stage, step
            and micro-batch, or ``"skip"`` the window's update (every stage skips the same window: the
            flag travels upstream with the gradients, and across replicas with the gradient reduction).
        first_layer: Index of this stage's first layer in the whole model (for error messages).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        stage: int,
        num_stages: int,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: LossFn | None = None,
        scheduler: Any | None = None,
        recompute: bool = False,
        normalize: Normalize = "mean",
        forward_context: Callable[[], AbstractContextManager] = nullcontext,
        device: torch.device | str = "cpu",
        on_nonfinite: OnNonFinite = "raise",
        first_layer: int = 0,
    ) -> None:
        if normalize not in ("mean", "tokens"):
            raise ValueError(f"normalize={normalize!r} is not one of 'mean', 'tokens'")
        if on_nonfinite not in get_args(OnNonFinite):
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is not one of 'raise', 'skip'")
        self.layers = list(layers)
        self._callables: list[Any] = list(self.layers)  # what runs: the layers, or their compiled forms
        self.stage = stage
        self.num_stages = num_stages
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        if self.is_last and loss_fn is None:
            raise ValueError("the last stage needs a loss_fn (the module's pipeline_loss)")
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        # The last stage runs its backward right after its forward, so it never recomputes.
        self.recompute = recompute and not self.is_last
        self.normalize = normalize
        self.forward_context = forward_context
        self.device = torch.device(device)
        self.on_nonfinite: OnNonFinite | Literal["step"] = on_nonfinite  # "step": one device's way, set for a run
        self.first_layer = first_layer
        self.version = 0
        # This stage's own random stream (dropout masks), forked from the process's at construction and
        # swapped in around every forward, backward and evaluation. Each process of a pipeline starts
        # from the same state, and data loading keeps drawing from the process's stream, so a stage's
        # masks do not depend on which other stages share its process: what makes a one-process
        # pipeline bit-identical to S processes. Cost: two ~5 KB state copies per action.
        self.rng = _capture_rng(self.device)
        # Host time on CPU, CUDA events on a GPU (host time around a GPU forward measures its launch).
        self.clock: Clock = clock_for(self.device)
        self.stats = StageStats(times=Spans(self.clock))
        self.skipped_windows = 0
        self._in_flight: dict[int, _InFlight] = {}
        self._output_grad_flags: dict[tuple, tuple[bool, ...]] = {}  # recompute: see _forward_without_graph
        # recompute: the buffers a forward updates in place (BatchNorm's running statistics and counter),
        # restored after each recompute (see _recompute). Learned from the first forward's values (a kernel
        # that updates a buffer in place, as batch_norm does its running statistics, leaves the buffer's
        # version counter alone) and from every forward's version counters.
        self._mutated_buffers: dict[int, Tensor] | None = None
        # Per window, on the device: [sum of micro-batch weights, number of non-finite losses seen
        # downstream, first such micro-batch or -1]. Reduced across replicas with the gradients.
        self._window: Tensor | None = None
        # Backwards accumulated in the window (a host count: a staleness correction reads the share of the window
        # accumulated at a stale forward, which the weight is not under normalize="tokens").
        self._window_microbatches = 0
        self._one = torch.ones((), dtype=torch.float64, device=self.device)
        # Hooks the runtime installs around the local step (data-parallel reduction, clipping,
        # replica averaging); each is optional.
        self.reduce_gradients: Callable[[list[Tensor], Tensor], Tensor] | None = None
        self.clip_gradients: Callable[[list[nn.Parameter]], None] | None = None
        self.after_step: Callable[[], None] | None = None
        # A look at a step's gradients as Lightning's on_before_optimizer_step has them: reduced over the replicas,
        # normalized, a tied weight's copies combined, not yet clipped (PipelineMonitor's gradient norm).
        self.measure_gradients: Callable[[list[nn.Parameter] | None], None] | None = None
        # Buffers this stage's layers share with another stage's, (name, buffer, stages) (`split.shared_buffers`).
        self.shared_buffers: list[tuple[str, Tensor, list[int]]] = []
        # Combines the gradient of a parameter tied with another stage (lit_efficient.runtime.tied)
        # after normalization, before the update; called on every applied update.
        self.exchange_tied: Callable[[], None] | None = None
        # PACI staleness correction (staleness.py): around stale forwards and the local step. None: off.
        self.correction: StalenessCorrection | None = None

    # -- compute ---------------------------------------------------------------------------------

    def forward(self, microbatch: int, inputs: Payload, batch: Any = None, pending_steps: int = 0) -> Payload | Tensor:
        """Forward of ``microbatch``; returns the outputs to send on, or the loss on the last stage.

        Args:
            pending_steps: Optimizer steps this stage takes before this micro-batch's backward (its drift,
                known from the schedule); only a staleness correction reads it.
        """
        start = self.clock.mark()
        correct = nullcontext()
        if self.correction is not None:
            weight, bad = (self._window[0], self._window[1]) if self._window is not None else (None, None)
            correct = self.correction.forward_context(
                list(self.parameters()), self.optimizer, pending_steps, window_weight=weight,
                window_microbatches=self._window_microbatches, window_bad=bad,
            )  # fmt: skip
        shared = _versions([b for _, b, _ in self.shared_buffers])
        with self.own_rng(), correct:
            result = self._forward(microbatch, inputs, batch)
        if shared:
            self.check_shared_buffers(shared)
        self.stats.forwards += 1
        self.stats.max_in_flight = max(self.stats.max_in_flight, len(self._in_flight))
        self.stats.times.add("forward", start, self.clock.mark())
        return result

    def compile_layers(self, compile_fn: Callable[[nn.Module], Any]) -> None:
        """From now on run each layer as ``compile_fn(layer)`` (``torch.compile`` or the dynamo context of a
        ``torch.compile``-d LightningModule). The compiled callables share the layers' parameters, buffers
        and state dicts; everything else (recompute, RNG, checkpointing of layers) is unchanged."""
        self._callables = [compile_fn(_own_frame(layer)) for layer in self.layers]

    def _forward(self, microbatch: int, inputs: Payload, batch: Any) -> Payload | Tensor:
        if not self.is_first:
            inputs = tuple(_as_leaf(t) for t in inputs)
        record = _InFlight(version=self.version, inputs=inputs)
        kept = _versions(inputs) if self.recompute else None  # what the backward's recompute reruns on
        if self.recompute:
            record.rng = _capture_rng(self.device)
            record.inputs = tuple(None if t is None else t.detach().requires_grad_(t.requires_grad) for t in inputs)
            outputs = self._forward_without_graph(inputs)
        else:
            with self.forward_context():
                outputs = run_layers(self._callables, inputs, self.first_layer)
            record.outputs = outputs
        if kept is not None:
            self._check_inputs_unchanged(inputs, kept)
        result: Payload | Tensor = outputs
        if self.is_last:
            loss, weight = self._loss(outputs, batch)
            record.outputs, record.loss, record.weight = None, loss, weight
            bad = ~torch.isfinite(loss.detach())
            if self.normalize == "tokens":  # a micro-batch of no items weighs 0: its mean loss (NaN over 0 targets)
                bad = bad & (weight > 0)  # counts for nothing, as on one device, where its gradient is 0 * ...
            record.bad = bad.to(torch.float64)
            result = loss.detach()
        else:
            result = self._to_send(outputs)
        self._in_flight[microbatch] = record
        return result

    def backward(self, microbatch: int, grads: Payload | None = None) -> Payload:
        """Backward of ``microbatch``; returns the input gradients followed by its aux tensor.

        Args:
            microbatch: The micro-batch, whose forward ran on this stage.
            grads: From the next stage: gradients of this stage's outputs followed by the aux tensor
                ``[weight, non-finite flag]`` of the micro-batch; None on the last stage.
        """
        start = self.clock.mark()
        record = self._in_flight.pop(microbatch)
        with self.own_rng():
            aux = self._backward(record, grads)
        self._accumulate(microbatch, aux)
        input_grads = tuple(t.grad if isinstance(t, Tensor) and t.requires_grad else None for t in record.inputs)
        self._account(microbatch, record.version)
        self.stats.times.add("backward", start, self.clock.mark())
        return (*input_grads, aux.detach())

    def _backward(self, record: _InFlight, grads: Payload | None) -> Tensor:
        if self.is_last:
            assert record.loss is not None and record.weight is not None and record.bad is not None
            aux = torch.stack([record.weight, record.bad])
            # Sum of item losses (tokens) or the micro-batch mean (mean); normalized at the step. A micro-batch of
            # no items adds nothing: selected away, not multiplied (NaN * 0 is NaN).
            scaled = record.loss
            if self.normalize == "tokens":
                scaled = torch.where(record.weight > 0, record.loss * record.weight, torch.zeros_like(record.loss))
            scaled.backward()
        else:
            assert grads is not None
            *output_grads, aux = grads
            if record.outputs is not None:
                outputs, updated = record.outputs, []
            else:
                outputs, updated = self._recompute(record)
            pairs = [(o, g) for o, g in zip(outputs, output_grads, strict=True) if g is not None and o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            with torch.no_grad():  # after the backward: batch_norm saves the running statistics it was given
                for buffer, value in updated:
                    buffer.copy_(value)
        return aux

    def step(self, window: int = -1) -> None:
        """Normalize the accumulated gradients by the window's weight and step optimizer and scheduler.

        Args:
            window: The optimizer step's number (for error messages).
        """
        start = self.clock.mark()
        params = self._stepped_parameters()
        totals = self._window if self._window is not None else torch.stack([self._one, 0 * self._one, -self._one])
        if self.reduce_gradients is not None:
            # Replicas must reduce the same list of tensors: materialize grads of unused parameters. Not of frozen
            # ones (requires_grad=False alike on every replica): given a zero gradient, the optimizer would step
            # them (AdamW's weight decay moved frozen weights on replicas alone).
            for p in params:
                if p.grad is None and p.requires_grad:
                    p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        if self.reduce_gradients is not None:
            totals = self.reduce_gradients(grads, totals)
        # A window of no items at all ("tokens": every label masked) has zero gradients: left as they are, as one
        # device's GradientAccumulation does (0 / 0 made them NaN).
        divide_by_count(grads, torch.where(totals[0] > 0, totals[0], torch.ones_like(totals[0])))
        update = self._check_finite(grads, totals, window)
        if update and self.exchange_tied is not None:
            self.exchange_tied()  # a weight shared with another stage: combine the copies' gradients
        if self.measure_gradients is not None:
            self.measure_gradients(params if update else None)  # None: a window skipped as non-finite
        if not update:
            for p in params:
                p.grad = None
        elif self.clip_gradients is not None:
            self.clip_gradients(params)
        with _preserve_versions(list(self.parameters())):  # every one: an averager's sync writes them all
            if update and self.optimizer is not None:
                with self.correction.step_context(self.optimizer, self.version) if self.correction else nullcontext():
                    self.optimizer.step()
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            if update and self.scheduler is not None:
                self.scheduler.step()
            if self.after_step is not None:
                self.after_step()  # also on a skipped window: replicas must keep syncing in step
        self.version += 1
        self._window = None
        self._window_microbatches = 0
        self.stats.steps += 1
        self.stats.times.add("step", start, self.clock.mark())

    def _check_finite(self, grads: list[Tensor], totals: Tensor, window: int) -> bool:
        """Whether to apply the update; raises or skips on NaN/Inf as configured."""
        own = gradients_nonfinite(grads) if grads else 0 * self._one
        # The one host sync of an optimizer step (none per micro-batch: every flag up to here stays on the
        # device), and it is required. Whether to apply the update is a host decision: raising needs the
        # host, and skipping must skip the optimizer's and the scheduler's step, calls no generic optimizer
        # can make conditional on a device flag (fused Adam's found_inf can, for Adam alone). Deciding later,
        # without waiting, would apply a NaN update before raising, and a skipped window's update could not
        # be taken back. What it costs on a GPU: the step's kernels are launched only once the window's last
        # backward has finished, so the device idles for one optimizer launch (well under a millisecond)
        # per N micro-batches of compute.
        downstream_bad, own_bad, first_bad = torch.stack([totals[1], own, totals[2]]).tolist()
        if (not downstream_bad and not own_bad) or self.on_nonfinite == "step":  # "step": Lightning's LR finder's run
            return True
        where = f"stage {self.stage} (layers from {self.first_layer}), optimizer step {window}"
        if downstream_bad:
            message = f"non-finite loss at micro-batch {int(first_bad)} seen by {where}"
        else:
            message = f"non-finite gradients of the parameters of {where}"
        if self.on_nonfinite == "skip" and downstream_bad:
            self.skipped_windows += 1
            return False
        if downstream_bad:
            hint = " Set on_nonfinite='skip' to skip such windows on every stage, or lower the learning rate."
        else:  # "skip" acts on a non-finite loss, which every stage learns of with the window's gradients
            hint = (
                " It arose in this stage's own gradients while the loss was finite (or its micro-batch had no items, "
                "under normalize='tokens'), so other stages may already have stepped: on_nonfinite='skip' cannot "
                "skip it consistently. Lower the learning rate, clip gradients (gradient_clip_val), find the layer "
                "(torch.autograd.set_detect_anomaly), or give a loss of no items a finite gradient (a sum divided "
                "by count.clamp_min(1), not by the count)."
            )
        raise NonFiniteError(message + "." + hint)

    def evaluate(self, inputs: Payload) -> Payload:
        """Forward without gradients (validation, test, predict)."""
        start = self.clock.mark()
        shared = _versions([b for _, b, _ in self.shared_buffers])
        with self.own_rng(), torch.no_grad(), self.forward_context():
            outputs = run_layers(self._callables, inputs, self.first_layer)
        if shared:
            self.check_shared_buffers(shared)
        if not self.is_last:
            outputs = self._to_send(outputs)
        self.stats.times.add("evaluate", start, self.clock.mark())
        return outputs

    def _to_send(self, outputs: Payload) -> Payload:
        """``outputs`` as they cross to the next stage. Tensors (or None) only: the next stage may be another
        process, and both transports carry tensors only (a Python value failed deep in a transport, "'int' object
        has no attribute 'dtype'", while plain Lightning trained it). A buffer of this stage's own (a table a layer
        hands the next one) crosses as a copy, as between processes: in one process the next stage held the buffer
        itself, and a change it made in place changed this stage's state there only."""
        self._check_crossing(outputs)
        if all(t is None or t.requires_grad for t in outputs):  # a buffer never requires grad: nothing to look up
            return outputs
        own = {b.untyped_storage().data_ptr() for layer in self.layers for b in layer.buffers()}
        if not own:
            return outputs
        return tuple(
            t.clone() if t is not None and not t.requires_grad and t.untyped_storage().data_ptr() in own else t
            for t in outputs
        )

    def check_shared_buffers(self, versions: list[int | None]) -> None:
        """Refuse a change to a buffer that layers on other stages register too: on processes each stage keeps its
        own copy, so the change (a running count) reached the other stages in one process only, and a run on
        processes ended elsewhere, silently. A constant one (a table) is fine."""
        for (name, buffer, stages), version in zip(self.shared_buffers, versions, strict=True):
            if buffer._version != version:
                raise ValueError(
                    f"buffer '{name}' is registered by pipeline layers on stages {stages}, and stage {self.stage}'s "
                    "forward changed it: on processes each stage keeps its own copy, so the change does not reach "
                    "the others (in one process they share it). Keep state a layer changes in one layer (pass it "
                    "along as an output if the next stage reads it), or choose balance= so that the layers sharing "
                    "it sit on one stage."
                )

    def _check_crossing(self, outputs: Payload) -> None:
        for i, value in enumerate(outputs):
            if value is not None and not isinstance(value, Tensor):
                k, layer = self.first_layer + len(self.layers) - 1, self.layers[-1]
                container = isinstance(value, (dict, list, tuple))
                fix = (
                    "Return its tensors as a tuple instead (unpacked into the next layer's arguments)"
                    if container
                    else "Return it as a tensor (e.g. torch.tensor(value)), keep a constant on the module that needs it"
                )
                shown = (
                    f"keys {list(value)[:6]}" if isinstance(value, dict)
                    else f"{len(value)} items" if container else f"{value!r:.60}"
                )  # fmt: skip
                raise TypeError(
                    f"pipeline layer {k} ({type(layer).__name__}), the last of stage {self.stage}, returned a value "
                    f"of type {type(value).__name__}, not a tensor, at position {i} of its output ({shown}): "
                    f"only tensors (or None) cross a stage boundary. {fix}, or move the boundary with "
                    "PACIStrategy(balance=...)."
                )

    def _check_inputs_unchanged(self, inputs: Payload, versions: list[int | None]) -> None:
        """With ``recompute=True`` the backward reruns the stage's forward on the input it kept: a layer that changed
        that input in place (``x.mul_(2)``) had the rerun start from the changed values, and its gradients were
        wrong, silently. A version counter read per input, no copy. (Without recompute an in-place change of an
        activation that needs no gradient is as harmless as on one device: an in-place ReLU at a stage's start.)"""
        for i, (t, v) in enumerate(zip(inputs, versions, strict=True)):
            if v is not None and t._version != v:
                first, last = self.first_layer, self.first_layer + len(self.layers) - 1
                layers = f"pipeline layer {first}" if first == last else f"pipeline layers {first}-{last}"
                source = "pipeline_input's" if self.is_first else f"stage {self.stage - 1}'s"
                raise ValueError(
                    f"{layers} (stage {self.stage}) changed input {i} in place ({_described(t)}, {source} output) "
                    "under PACIStrategy(recompute=True), whose backward reruns the forward on that input: the rerun "
                    "would start from the changed values. Change a copy (`x = x.clone()` first, or the out-of-place "
                    "form: `x = x * 2` for `x.mul_(2)`, `relu(x)` for an in-place ReLU), or use recompute=False."
                )

    def reset_stats(self) -> None:
        """Start this stage's accounting afresh (counters, drift, times), on its own clock."""
        self.stats = StageStats(times=Spans(self.clock))

    # -- state -----------------------------------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """This stage's parameters, each once."""
        seen: set[int] = set()
        for layer in self.layers:
            for p in layer.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def _stepped_parameters(self) -> list[nn.Parameter]:
        """What a step normalizes, checks, clips and reduces: the optimizer's parameters, as Lightning's clipping
        reads only ``main_params(optimizer)``. A parameter left out of the optimizer ("frozen by omission", its
        ``requires_grad`` still True) keeps gathering gradients as on one device (their raw sum: not normalized
        by the window's weight, nor reduced over replicas), and is not counted in the clipped norm (it was, and
        clipped the others by a norm one device never sees)."""
        if self.optimizer is None:
            return list(self.parameters())
        seen: set[int] = set()
        stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
        return [p for p in stepped if id(p) not in seen and not seen.add(id(p))]

    @property
    def oldest_in_flight(self) -> int | None:
        """The earliest micro-batch whose forward ran here and whose backward has not (None if none)."""
        return min(self._in_flight, default=None)

    @property
    def in_flight(self) -> int:
        """Micro-batches whose forward ran here and whose backward has not."""
        return len(self._in_flight)

    @property
    def window_weight(self) -> Tensor | None:
        """Weight accumulated since the last step (None when nothing was accumulated)."""
        return None if self._window is None else self._window[0]

    def drop_window(self) -> None:
        """Forget the window accumulated since the last step, its gradients and weight, without a step: what one
        device's next ``zero_grad`` does to a window Lightning never stepped (an epoch cut short inside it)."""
        if self._in_flight:
            raise RuntimeError(f"stage {self.stage}: drop_window() with micro-batches in flight: drain first")
        for p in self.parameters():
            p.grad = None
        self._window = None
        self._window_microbatches = 0

    def accumulation_state(self, window: bool = True) -> dict[str, Any]:
        """What a checkpoint needs besides weights and optimizer: the version, the stage's random stream,
        and (``window``) the gradients and weight accumulated in a window not yet stepped, with what its
        staleness correction counted of it."""
        state: dict[str, Any] = {"version": self.version, "rng": self.rng}
        if window and self._window is not None:
            state.update(
                window=self._window, grads=[p.grad for p in self.parameters()], microbatches=self._window_microbatches
            )
            if self.correction is not None and (correction := self.correction.state_dict()):
                state["correction"] = correction
        return state

    def load_accumulation_state(self, state: dict[str, Any]) -> None:
        """Inverse of `accumulation_state`."""
        self.version = state.get("version", self.version)
        if "rng" in state:
            self.rng = state["rng"]
        if self.correction is not None:
            self.correction.load_state_dict(state.get("correction", {}))
        if "window" not in state:
            self._window = None
            self._window_microbatches = 0
            return
        self._window = state["window"].to(self.device)
        # A checkpoint from before the count: under normalize="mean" the window's weight is its micro-batches (read
        # only then: reading a device tensor on the host is a sync, and a meta one has no value).
        count = state.get("microbatches")
        self._window_microbatches = int(count) if count is not None else round(float(self._window[0]))
        for p, g in zip(self.parameters(), state["grads"], strict=True):
            p.grad = None if g is None else g.to(p.device)

    # -- internals -------------------------------------------------------------------------------

    def _loss(self, outputs: Payload, batch: Any) -> tuple[Tensor, Tensor]:
        assert self.loss_fn is not None
        with self.forward_context():
            out = self.loss_fn(outputs[0] if len(outputs) == 1 else outputs, batch)
        loss, items = out if isinstance(out, tuple) else (out, None)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            raise TypeError(
                f"pipeline_loss must return a scalar tensor (or (loss, num_items)); got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else "")
            )
        if self.normalize == "mean":
            return loss, self._one
        if items is None:
            raise ValueError(
                "GradientAccumulation(normalize='tokens') needs pipeline_loss to return (loss, num_items); "
                "it returned only the loss. Return the item count too, or use normalize='mean'."
            )
        return loss, item_count(items, self.device, torch.float64)

    def _forward_without_graph(self, inputs: Payload) -> Payload:
        """Recompute mode's forward: no graph kept, but each output still says whether it will need a
        gradient (the next stage sends one back only for those). That is structural, so it is learned once
        per input pattern from a forward with autograd on (its graph freed at once) and reused."""
        key = tuple(None if t is None else t.requires_grad for t in inputs)
        flags = self._output_grad_flags.get(key)
        buffers = [b for layer in self.layers for b in layer.buffers()]
        versions = [b._version for b in buffers]
        first = self._mutated_buffers is None
        before = [b.clone() for b in buffers] if first else []  # once per stage: a copy of its buffers
        with torch.set_grad_enabled(flags is None), self.forward_context():
            outputs = run_layers(self._callables, inputs, self.first_layer)
        mutated = self._mutated_buffers if self._mutated_buffers is not None else {}
        for i, (b, v) in enumerate(zip(buffers, versions, strict=True)):
            if b._version != v or (first and not torch.equal(b, before[i])):
                mutated[id(b)] = b
        self._mutated_buffers = mutated
        if flags is None:
            flags = tuple(isinstance(t, Tensor) and t.requires_grad for t in outputs)
            self._output_grad_flags[key] = flags
        elif len(flags) != len(outputs):  # a new output pattern for a known input one: assume every float needs one
            flags = tuple(isinstance(t, Tensor) and differentiable(t) for t in outputs)
        return tuple(
            t.detach().requires_grad_(f) if isinstance(t, Tensor) and differentiable(t) else t
            for t, f in zip(outputs, flags, strict=True)
        )

    @contextmanager
    def own_rng(self) -> Iterator[None]:
        """Run with this stage's random stream in place of the process's (see ``self.rng``): its forwards, backwards
        and evaluations, and on the first stage the module's ``pipeline_input`` in training (the interpreter's)."""
        outer = _capture_rng(self.device)
        _restore_rng(self.rng, self.device)
        try:
            yield
        finally:
            self.rng = _capture_rng(self.device)
            _restore_rng(outer, self.device)

    def _recompute(self, record: _InFlight) -> tuple[Payload, list[tuple[Tensor, Tensor]]]:
        """The forward again, with the micro-batch's RNG state; also the buffers it updated, with the values
        to put back once the backward is done."""
        assert record.rng is not None
        devices = [self.device] if self.device.type == "cuda" else []
        # The micro-batch's first forward already updated BatchNorm's running statistics (and the like): the
        # recompute, in training mode too, must not update them a second time. Only the buffers a forward
        # was seen to change are saved (a few small tensors), not every buffer of the stage.
        saved = [(b, b.detach().clone()) for b in (self._mutated_buffers or {}).values()]
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(record.rng[0])
            if record.rng[1] is not None:
                torch.cuda.set_rng_state(record.rng[1], self.device)
            inputs = tuple(_as_leaf(t) for t in record.inputs) if not self.is_first else record.inputs
            record.inputs = inputs
            with self.forward_context():
                outputs = run_layers(self._callables, inputs, self.first_layer)
        return outputs, saved

    def _accumulate(self, microbatch: int, aux: Tensor) -> None:
        weight, bad = aux[0], aux[1]
        first = torch.where(bad > 0, torch.full_like(weight, microbatch), -self._one)
        self._window_microbatches += 1
        if self._window is None:
            self._window = torch.stack([weight, bad, first]).detach().clone()
            return
        w = self._window
        # Keep the first non-finite micro-batch of the window: max() over -1 and indices would take
        # the last, so only fill while still -1. All on the device: no sync per micro-batch.
        first = torch.where(w[2] >= 0, w[2], first)
        self._window = torch.stack([w[0] + weight, w[1] + bad, first])

    def _account(self, microbatch: int, forward_version: int) -> None:
        drift = self.version - forward_version
        s = self.stats
        s.backwards += 1
        s.drift_sum += drift
        s.drift_max = max(s.drift_max, drift)
        s.versions.append((microbatch, forward_version, self.version))
        if len(s.versions) > 2 * _RECENT:
            del s.versions[:-_RECENT]


# One code object per torch.nn class whose layers `_own_frame` wraps: dynamo keeps its compiled graphs per code object.
_FRAMES: dict[type, types.CodeType] = {}


def _own_frame(layer: nn.Module) -> nn.Module | Callable[..., Any]:
    """``layer`` itself, or for a layer whose forward is torch.nn's own (``nn.Linear``, ``nn.Sequential``,
    ``nn.TransformerEncoderLayer``) a function calling it, with one code object per such class. torch.compile of such
    a module wraps it in one function of torch's (``external_utils.wrap_inline``) whose code every torch.nn layer
    shares, and dynamo keeps at most ``recompile_limit`` (8) graphs per code object: a stage of Sequentials, a
    LayerNorm and a Linear filled it in its first fit and later variants (evaluation, a last partial batch) ran
    eager. A user's class has its own forward, and so its own graphs; layers of one class share theirs, as before."""
    forward = getattr(type(layer), "forward", None)
    if not getattr(forward, "__module__", "").startswith("torch."):
        return layer

    def call(*args: Any, **kwargs: Any) -> Any:
        return layer(*args, **kwargs)

    code = _FRAMES.setdefault(type(layer), call.__code__.replace())
    own = types.FunctionType(code, call.__globals__, f"{type(layer).__name__}_call", None, call.__closure__)
    own._orig_mod = layer  # type: ignore[attr-defined]  # what run_layers names in an error
    return own


_CHUNK = 1 << 22  # elements of a low-precision gradient divided in float32 at a time (a 16 MiB temporary)


def divide_by_count(grads: Sequence[Tensor], count: Tensor) -> None:
    """``g /= count`` in place, by the exact count (a 0-dim float64 or float32 tensor on the gradients' device) in
    every gradient dtype. A bf16/fp16 gradient is divided in float32 and rounded once, a chunk at a time (a whole
    float32 copy of a large embedding's gradient was GBs at the step, memory's peak): a CUDA kernel reads a device
    0-dim divisor in the gradient's dtype (507 tokens as 508 in bf16, 2^-9 off; CPU's reads it exactly)."""
    for g in grads:
        if g.dtype not in (torch.float16, torch.bfloat16):
            g.div_(count)
            continue
        flat = g.view(-1) if g.is_contiguous() else None
        for piece in flat.split(_CHUNK) if flat is not None else (g,):
            piece.copy_(piece.float().div_(count))


def item_count(items: Tensor | int | float, device: torch.device, dtype: torch.dtype) -> Tensor:
    """A micro-batch's item count as a 0-d ``dtype`` tensor on ``device``, without a host sync per
    micro-batch: a Python number is filled on the device (`torch.as_tensor` would copy it from the host
    and wait for the device's queue), a tensor is cast and moved without blocking."""
    if isinstance(items, Tensor):
        return items.to(device=device, dtype=dtype, non_blocking=True).reshape(())
    return torch.full((), float(items), dtype=dtype, device=device)


def differentiable(t: Tensor) -> bool:
    """Whether autograd can give ``t`` a gradient: floating point or complex (a complex activation's gradient crosses
    back as a real one's does; only floats counted, the stages before it never trained)."""
    return t.is_floating_point() or t.is_complex()


def _versions(inputs: Payload) -> list[int | None]:
    # An inference tensor (one a user's data made under inference_mode) keeps no version counter: not checked.
    return [None if t is None or t.is_inference() else t._version for t in inputs]


def _as_leaf(t: Tensor | None) -> Tensor | None:
    """A received tensor as an input leaf: one that required grad on the sending side (comm carries the
    flag) collects the gradient to send back; side inputs (masks, rotary tables) get none."""
    if t is None:
        return None
    needs_grad = t.requires_grad and differentiable(t)
    t = t.detach()
    return t.requires_grad_() if needs_grad else t


def _capture_rng(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _restore_rng(state: tuple[Tensor, Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class _preserve_versions:  # noqa: N801 - used as a context manager, reads like one
    """Restore parameters' autograd version counters after an in-place update.

    Graphs kept from earlier forwards saved these parameters; without the restore, their backward
    fails the version check. Restoring is what makes keep-graph PACI run on stock PyTorch: the
    backward then reads the updated values, which is the drift PACI bounds.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = tuple(params)

    def __enter__(self) -> None:
        self.versions = tuple(p._version for p in self.params)

    def __exit__(self, *exc: object) -> None:
        torch._C._autograd._unsafe_set_version_counter(self.params, self.versions)
