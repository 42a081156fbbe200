"""Pure-PyTorch pipeline runtime: schedules as data, a simulator, partitioning and the per-rank interpreter.

Nothing in this package imports Lightning; `lit_efficient.strategies` adapts it to the Trainer.
"""

from lit_efficient.pipeline.actions import Action, format_actions, parse_actions
from lit_efficient.pipeline.schedules import SCHEDULES, ScheduleName, stage_actions

__all__ = ["SCHEDULES", "Action", "ScheduleName", "format_actions", "parse_actions", "stage_actions"]
