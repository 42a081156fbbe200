"""Models that implement the pipeline protocol: `GPT` (the CLI's and configs' default) and `HFCausalLM`
(any decoder-only Hugging Face causal LM; needs the ``hf`` extra)."""

from lit_efficient.models.gpt import GPT, Block
from lit_efficient.models.hf import HFCausalLM

__all__ = ["Block", "GPT", "HFCausalLM"]
