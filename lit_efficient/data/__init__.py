"""Data modules: `TextDataModule` serves byte-level text (embedded default corpus) or nanoGPT `.bin` tokens;
`TokenizedDataModule` the same text in a Hugging Face tokenizer's ids (a local tokenizer folder). For a data module
of your own: `ResumableLoader` (a DataLoader that Lightning resumes mid-epoch exactly) with `EpochShuffle` (a
shuffle that is a function of the seed and the epoch), which both use."""

from lit_efficient.data.loading import EpochShuffle, ResumableLoader
from lit_efficient.data.text import TextDataModule
from lit_efficient.data.tokenized import TokenizedDataModule

__all__ = ["EpochShuffle", "ResumableLoader", "TextDataModule", "TokenizedDataModule"]
