"""lit_efficient: pipeline-parallel training for PyTorch Lightning (PACI and 1F1B-flush)."""

from lightning.pytorch.strategies import StrategyRegistry

from lit_efficient.callbacks import ActivationCheckpointing, GradientAccumulation, PipelineMonitor
from lit_efficient.protocol import PipelineModule
from lit_efficient.strategies import PACIStrategy, consolidate_checkpoint

# Registered once, here: `Trainer(strategy="paci")` and YAML `strategy: paci` / `1f1b_flush`.
PACIStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "ActivationCheckpointing",
    "GradientAccumulation",
    "PACIStrategy",
    "PipelineModule",
    "PipelineMonitor",
    "consolidate_checkpoint",
]
__version__ = "0.1.0"
