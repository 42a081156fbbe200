"""The Lightning layer's strategy: `PACIStrategy` and what it installs around the runtime.

Importing it registers the strategy names ``"paci"`` and ``"1f1b_flush"`` with Lightning (``Trainer(strategy=
"paci")``, YAML ``strategy: paci``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lit_efficient.strategy.paci import PACIStrategy

PACIStrategy.register_strategies(StrategyRegistry)

__all__ = ["PACIStrategy"]
