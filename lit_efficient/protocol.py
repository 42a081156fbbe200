"""The pipeline protocol: what a LightningModule implements to be split into stages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

PIPELINE_METHODS = ("pipeline_layers", "pipeline_input", "pipeline_loss")


@runtime_checkable
class PipelineModule(Protocol):
    """A module that can be split into pipeline stages.

    The same module still trains under a single device or DDP through its ordinary
    ``training_step``. Under `PACIStrategy`, training uses these three methods; evaluation
    (``validation_step``, ``test_step``, ``predict_step``) runs on the last stage, where the
    module's forward call ``self(...)`` returns the pipeline's output, so an evaluation step must
    obtain its model output by calling ``self(self.pipeline_input(batch))`` once.
    """

    def pipeline_layers(self) -> Sequence[nn.Module]:
        """Ordered layers, each a submodule of this module; layer k consumes layer k-1's output
        (a tuple output is unpacked into the next layer's arguments). Every parameter must belong
        to exactly one layer."""
        ...

    def pipeline_input(self, batch: Any) -> Tensor | tuple[Tensor, ...]:
        """What layer 0 consumes, taken from a dataloader batch (one micro-batch)."""
        ...

    def pipeline_loss(self, output: Any, batch: Any) -> Tensor | tuple[Tensor, Tensor | int]:
        """Mean loss of the micro-batch from the last layer's output, optionally with the number of
        items (tokens) it averaged over, used by ``GradientAccumulation(normalize="tokens")``."""
        ...


def missing_pipeline_methods(module: object) -> list[str]:
    """Names of the protocol methods ``module`` lacks (empty when it is pipelineable)."""
    return [name for name in PIPELINE_METHODS if not callable(getattr(module, name, None))]
