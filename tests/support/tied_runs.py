"""Layers with a weight tied between the first and the last, and the tied-weight rule emulated in one process."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lit_efficient.runtime.partition import partition_uniform, stage_bounds
from lit_efficient.runtime.tied import tie_delay
from lit_efficient.tools.demo import build_layers
from tests.support.emulation import backward_from_inputs, run
from tests.support.runtime_runs import MODEL
from tests.support.runtime_runs import forward_version as _forward_version

TIED_LR = 0.05


def tied_layers() -> list[nn.Module]:
    """The demo model with its head tied to the token embedding (both 256 x dim)."""
    layers = build_layers(**MODEL)
    layers[-1].out.weight = layers[0].tok.weight
    return layers


def unique_layers(layers):
    seen: dict[int, nn.Parameter] = {}
    for layer in layers:
        for p in layer.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def tied_sgd(params):
    return torch.optim.SGD(params, lr=TIED_LR, momentum=0.9)


def emulate_tied(data, stages: int, accumulate: int, schedule: str) -> list[list[nn.Module]]:
    """The rule as documented, in one process: every stage holds its own copy of the tied weight; PACI
    forwards on the weights of `_forward_version` and backpropagates through the current ones (recompute);
    at update k both copies step with G_k = g_last_k + g_first_{k-d} (paci, d = ceil(S/N)) or
    g_first_k + g_last_k (flush)."""
    bounds = stage_bounds(partition_uniform(len(tied_layers()), stages))
    full = tied_layers()
    stage_layers = [copy.deepcopy(full[lo:hi]) for lo, hi in bounds]  # separate copies: the tie is cut
    first_copy, last_copy = stage_layers[0][0].tok.weight, stage_layers[-1][-1].out.weight
    opts = [tied_sgd(unique_layers(mine)) for mine in stage_layers]
    versions = [[copy.deepcopy(mine)] for mine in stage_layers]
    delay = tie_delay(stages, accumulate)
    pending: list[torch.Tensor] = []

    for j, batch in enumerate(data):
        inputs, x = [], batch[0]
        with torch.no_grad():
            for s in range(stages):
                inputs.append(x)
                v = _forward_version(s, stages, j, accumulate) if schedule == "paci" else len(versions[s]) - 1
                x = run(versions[s][v], x)
        backward_from_inputs(stage_layers, inputs, batch, accumulate)
        if (j + 1) % accumulate == 0:
            g_first, g_last = first_copy.grad.clone(), last_copy.grad.clone()
            if schedule == "paci":
                pending.append(g_first)
                combined = g_last + (pending.pop(0) if len(pending) > delay else 0)
            else:
                combined = g_first + g_last
            first_copy.grad.copy_(combined)
            last_copy.grad.copy_(combined)
            for s in range(stages):
                opts[s].step()
                opts[s].zero_grad()
                versions[s].append(copy.deepcopy(stage_layers[s]))
    return stage_layers
