"""Pipeline checkpoints, pure PyTorch: every stage's share of Lightning's checkpoint dict, written as one
ordinary Lightning file (`single_file`) or as a sharded DCP folder (`sharded_write`, `sharded_read`),
optionally in the background (`async_write`), always atomically; and read back by parameter name on any
layout (`restore`). `merge` turns shares into the dict one device would have saved.
"""

from lit_efficient.checkpoint.consolidate import consolidate_checkpoint

__all__ = ["consolidate_checkpoint"]
