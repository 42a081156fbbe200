"""Lightning callbacks of lit_efficient."""

from lit_efficient.callbacks.activation_checkpointing import ActivationCheckpointing
from lit_efficient.callbacks.gradient_accumulation import GradientAccumulation
from lit_efficient.callbacks.pipeline_monitor import PipelineMonitor

__all__ = ["ActivationCheckpointing", "GradientAccumulation", "PipelineMonitor"]
