"""Evaluation under PACIStrategy: validation/test/predict batches streamed through the stages.

Evaluation runs forward only, one batch after another through every stage, from a drained pipeline; the
last stage calls the module's own ``validation_step``/``test_step``/``predict_step`` with ``self(...)``
answered by the pipeline's output (`forward_answers`). The hooks are `PACIStrategy`'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import LightningModule


@contextmanager
def forward_answers(module: LightningModule, output: Any, hook: str) -> Iterator[None]:
    """While ``hook`` runs on the last stage, ``module(...)`` returns the pipeline's output."""
    calls = [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return output

    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.forward
    if calls[0] == 0:
        raise RuntimeError(
            f"{type(module).__name__}.{hook} never called self(...): under PACIStrategy the last stage answers the "
            f"module's forward with the pipeline's output, so {hook} must obtain its outputs with "
            "self(self.pipeline_input(batch))."
        )
