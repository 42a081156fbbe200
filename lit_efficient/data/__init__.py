"""Data modules: `TextDataModule` serves byte-level text (embedded default corpus) or nanoGPT `.bin` tokens;
`TokenizedDataModule` the same text in a Hugging Face tokenizer's ids (a local tokenizer folder)."""

from lit_efficient.data.text import TextDataModule
from lit_efficient.data.tokenized import TokenizedDataModule

__all__ = ["TextDataModule", "TokenizedDataModule"]
