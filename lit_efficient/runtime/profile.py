"""Timing every pipeline layer on the target device, for ``balance="profile"``.

The slowest stage sets the pace of the whole pipeline, so the split is chosen from measured
forward+backward times of each layer on a real micro-batch, not from parameter counts (an
embedding has many parameters and little compute; attention the opposite). Activation memory is
counted too: stage s keeps up to S-s micro-batches in flight.

Profiling leaves no trace: on S processes only rank 0 profiles, so a random number it drew (dropout
in the timed forwards, the loader's shuffle when fetching the batch) would part its random stream from
the other ranks' (the last stage would read other batches than the first), and the timed forwards would
update BatchNorm's running statistics on one rank only. Streams and buffers are restored, and each layer
goes back where it was (rank 0 never holds the whole model on its device).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lit_efficient.nested import map_tensors
from lit_efficient.runtime.partition import partition_profiled
from lit_efficient.runtime.stage import differentiable, run_layers


@dataclass(frozen=True)
class LayerProfile:
    """Measured cost of each layer for one micro-batch."""

    times: list[float]  # forward + backward seconds
    activation_bytes: list[int]  # bytes of the layer's output (what a stage keeps per micro-batch, roughly)
    param_bytes: list[int]  # weights + gradients + Adam state (4x the weights)
    memory_budget: int | None  # device memory, None on CPU

    def partition(self, num_stages: int) -> list[int]:
        """Split minimizing the slowest stage within the device's memory."""
        return partition_profiled(
            self.times, self.activation_bytes, self.param_bytes, num_stages, memory_budget=self.memory_budget
        )

    def stage_times(self, sizes: Sequence[int]) -> list[float]:
        """Per-stage time of one micro-batch under ``sizes``."""
        out, start = [], 0
        for n in sizes:
            out.append(sum(self.times[start : start + n]))
            start += n
        return out


def profile_layers(
    module: nn.Module,
    layers: Sequence[nn.Module],
    batch: Any,
    device: torch.device,
    forward_context: Callable[[], AbstractContextManager],
    repeats: int = 3,
) -> LayerProfile:
    """Time each layer's forward and backward on ``device`` with ``batch``, median of ``repeats``.

    The process's random streams (CPU, and ``device``'s), the layers' buffers and their placement are
    as before the call; the layers' gradients are None.
    """
    with _random_streams_kept(device), _buffers_kept(layers):
        return _profile(module, layers, batch, device, forward_context, repeats)


def first_batch(loader: Any) -> Any:
    """The first batch of ``loader``, leaving its random streams as they were: the process's CPU stream
    (a sampler or loader without a generator draws from it) and the generators of the loader and its
    samplers, so that the epoch that follows shuffles as if this batch had never been drawn."""
    generators = _generators(loader)
    states = [g.get_state() for g in generators]
    with torch.random.fork_rng(devices=[]):
        batch = next(iter(loader))
    for g, state in zip(generators, states, strict=True):
        g.set_state(state)
    return batch


def _profile(
    module: nn.Module,
    layers: Sequence[nn.Module],
    batch: Any,
    device: torch.device,
    forward_context: Callable[[], AbstractContextManager],
    repeats: int,
) -> LayerProfile:
    inputs = module.pipeline_input(map_tensors(batch, lambda t: t.to(device)))  # type: ignore[attr-defined]
    x = inputs if isinstance(inputs, tuple) else (inputs,)
    times, acts, params = [], [], []
    for layer in layers:
        home = _device_of(layer)
        layer.to(device)
        samples = []
        for _ in range(repeats + 1):  # the first run warms up kernels and allocators
            leaf = tuple(t.detach().requires_grad_() if differentiable(t) else t for t in x)
            _sync(device)
            start = time.perf_counter()
            with forward_context():
                out = run_layers([layer], leaf)
            grads = [torch.ones_like(o) for o in out if o.requires_grad]
            torch.autograd.backward([o for o in out if o.requires_grad], grads)
            _sync(device)
            samples.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        times.append(statistics.median(samples[1:]))
        acts.append(sum(o.numel() * o.element_size() for o in out))
        params.append(4 * sum(p.numel() * p.element_size() for p in layer.parameters()))
        x = tuple(o.detach() for o in out)
        # Back where it was: one layer at a time on the device, not the whole model on rank 0's.
        layer.to(home)
    budget = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return LayerProfile(times, acts, params, budget)


@contextmanager
def _random_streams_kept(device: torch.device) -> Iterator[None]:
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield


@contextmanager
def _buffers_kept(layers: Sequence[nn.Module]) -> Iterator[None]:
    # BatchNorm's running statistics and counters: what a training-mode forward changes besides RNG.
    buffers = [b for layer in layers for b in layer.buffers()]
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in zip(buffers, saved, strict=True):
                b.copy_(value)


def _generators(loader: Any) -> list[torch.Generator]:
    """The torch generators a DataLoader iterator or its samplers draw from (each once)."""
    found: dict[int, torch.Generator] = {}
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader, sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator):
            found.setdefault(id(g), g)
    return list(found.values())


def _device_of(layer: nn.Module) -> torch.device:
    for t in (*layer.parameters(), *layer.buffers()):
        return t.device
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # timing needs the kernels finished
