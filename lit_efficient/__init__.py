"""lit_efficient: pipeline-parallel training for PyTorch Lightning (PACI and 1F1B-flush).

Public names resolve lazily (PEP 562), so importing a runtime, transport, checkpoint or tools module loads no
Lightning. Importing `lit_efficient.strategy` (which any of the names below does) registers the strategy names
``"paci"`` and ``"1f1b_flush"``; so does ``import lit_efficient`` when Lightning is already loaded.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "PACIStrategy": "lit_efficient.strategy",
    "ActivationCheckpointing": "lit_efficient.callbacks",
    "GradientAccumulation": "lit_efficient.callbacks",
    "PipelineMonitor": "lit_efficient.callbacks",
    "PipelineModule": "lit_efficient.protocol",
    "consolidate_checkpoint": "lit_efficient.checkpoint",
    "LayerNotHereError": "lit_efficient.runtime.split",
}
__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:  # what static checkers and IDEs see; at run time `__getattr__` below
    from lit_efficient.callbacks import ActivationCheckpointing as ActivationCheckpointing
    from lit_efficient.callbacks import GradientAccumulation as GradientAccumulation
    from lit_efficient.callbacks import PipelineMonitor as PipelineMonitor
    from lit_efficient.checkpoint import consolidate_checkpoint as consolidate_checkpoint
    from lit_efficient.protocol import PipelineModule as PipelineModule
    from lit_efficient.runtime.split import LayerNotHereError as LayerNotHereError
    from lit_efficient.strategy import PACIStrategy as PACIStrategy


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lit_efficient' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


if "lightning.pytorch" in sys.modules:  # `Trainer(strategy="paci")` after `import lit_efficient`: nothing to save
    importlib.import_module("lit_efficient.strategy")
