"""Lightning callbacks of lit_efficient."""

from lit_efficient.callbacks.activation_checkpointing import ActivationCheckpointing

__all__ = ["ActivationCheckpointing"]
