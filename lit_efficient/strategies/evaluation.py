"""Evaluation under PACIStrategy: drains, and validation/test/predict batches streamed through the stages.

Evaluation runs forward only, one batch after another through every stage; the last stage calls the
module's own ``validation_step``/``test_step``/``predict_step`` with ``self(...)`` answered by the
pipeline's output (`_forward_answers`). Every evaluation starts from a drained pipeline.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from lightning.pytorch import LightningModule
from typing_extensions import override


class PipelineEvaluation:
    """PACIStrategy's evaluation hooks (a mixin: it reads the strategy's ``runtime`` and plugins)."""

    runtime: Any
    precision_plugin: Any
    lightning_module: Any
    _eval_index: int

    def drain(self) -> None:
        """Finish every micro-batch in flight on this rank's stage (call it on every rank alike).

        Afterwards the model is consistent: every stage has taken exactly the optimizer steps of the
        windows completed so far (``trainer.global_step`` at a window end), and an incomplete window's
        gradients stay accumulated for the next batches. Between batches, under ``schedule="paci"``,
        stage s has otherwise taken ``ceil((S-1-s)/N)`` steps fewer than the last stage. The strategy
        drains by itself before validation (and its zero-grad hook), checkpoints, an epoch's end and
        the end of training; a callback that needs a consistent model at another point calls this.
        It costs the pipeline's warm-up once more (S-1 slots) at the next batch.
        """
        if self.runtime is not None:
            self.runtime.drain()

    def _start_evaluation(self) -> None:
        self.drain()
        self._eval_index = 0

    @override
    def on_validation_start(self) -> None:
        self._start_evaluation()

    @override
    def on_test_start(self) -> None:
        self._start_evaluation()

    @override
    def on_predict_start(self) -> None:
        self._start_evaluation()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._evaluation_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._evaluation_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._evaluation_step("predict_step", *args, **kwargs)

    def _evaluation_step(self, hook: str, batch: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.runtime is not None
        outputs = self.runtime.evaluate(batch, self._eval_index)
        self._eval_index += 1
        if outputs is None:
            return None
        module = self.lightning_module
        with _forward_answers(module, outputs[0] if len(outputs) == 1 else outputs, hook):
            return getattr(module, hook)(batch, *args, **kwargs)


@contextmanager
def _forward_answers(module: LightningModule, output: Any, hook: str):
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
