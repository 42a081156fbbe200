"""Example models that implement the pipeline protocol; `GPT` is the one the CLI and configs use."""

from lit_efficient.models.gpt import GPT, Block

__all__ = ["Block", "GPT"]
