"""Pieces shared by the one-process emulations that pin the pipeline's asynchronous rules (PACI,
its staleness corrections, the tied-weight exchange): run layers, and backpropagate one micro-batch
through every stage from the inputs its forwards received."""

from __future__ import annotations

from lit_efficient.tools.demo import lm_loss


def run(layers, x):
    """``x`` through ``layers`` in order."""
    for layer in layers:
        x = layer(x)
    return x


def backward_from_inputs(stage_layers, inputs, batch, accumulate: int) -> None:
    """Recompute each stage on its current weights from the input it received (last stage first) and
    accumulate ``loss / N``'s gradients: the backward every emulation shares."""
    grad = None
    for s in reversed(range(len(stage_layers))):
        x = inputs[s].clone().requires_grad_(s > 0)
        out = run(stage_layers[s], x)
        if s == len(stage_layers) - 1:
            (lm_loss(out, batch)[0] / accumulate).backward()
        else:
            out.backward(grad)
        grad = x.grad
