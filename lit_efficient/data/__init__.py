"""Data modules; `TextDataModule` serves byte-level text (embedded default corpus) or nanoGPT `.bin` tokens."""

from lit_efficient.data.text import TextDataModule

__all__ = ["TextDataModule"]
