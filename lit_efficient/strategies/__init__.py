"""Lightning strategies of lit_efficient."""

from lit_efficient.strategies.checkpoint import consolidate_checkpoint
from lit_efficient.strategies.paci import PACIStrategy

__all__ = ["PACIStrategy", "consolidate_checkpoint"]
