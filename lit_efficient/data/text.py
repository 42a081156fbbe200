"""Byte-level language-modelling data: the embedded default corpus and user-supplied paths.

This file owns turning a corpus into one flat token array (bytes 0..255 for text, uint16 ids for a
nanoGPT `.bin`, uint32 ids for a ``.uint32.bin``; finding and concatenating the files is `corpus.py`'s),
the contiguous train/validation split, the fixed-block datasets and the `TextDataModule` that serves them.
Nothing here downloads: the default corpus is the Python standard library source of the running
interpreter, which every machine that runs this has.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lit_efficient.checks import is_count, named_few
from lit_efficient.data.loading import EpochShuffle, ResumableLoader
from lit_efficient.tools.corpus import TEXT_SUFFIXES, concat_files, embedded_corpus, folder_files, skipped_files

# Files of records, not text: read as bytes, their markup would be trained on (warned).
_RECORD_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow")


def _say_skipped(owner: str, path: Any, folder: Path) -> None:
    """Warn, naming them, about the files of ``folder`` that are not read: a user's .jsonl among .txt files was
    dropped without a word."""
    skipped = skipped_files(folder)
    if not skipped:
        return
    named = named_few([p.relative_to(folder).as_posix() for p in skipped])
    rank_zero_warn(
        f"{owner}(path={path!r}) reads only {', '.join(TEXT_SUFFIXES)} files: {len(skipped):,} other file(s) are not "
        f"read ({named}). Rename text files to one of those suffixes; for records (.jsonl, .csv) write each "
        "record's text to a .txt file, or give the Trainer a LightningDataModule of your own."
    )


def read_text(source: Path, max_bytes: int | None) -> bytes:
    """Bytes of a text file, or of a folder's text files joined by newlines, cut at `max_bytes`."""
    if source.is_dir():
        files = folder_files(source)
        if not files:
            raise ValueError(
                f"TextDataModule(path='{source}') holds no text file ({', '.join(TEXT_SUFFIXES)}); "
                f"point path at a file or at a folder with such files."
            )
        return concat_files(files, max_bytes)
    with source.open("rb") as f:
        return f.read() if max_bytes is None else f.read(max_bytes)


# A token file's ids by its name: ``<name>.uint32.bin`` (TokenizedDataModule's caches for vocabularies above 65,536
# ids), ``<name>.uint16.bin``, and nanoGPT's plain ``.bin``, uint16.
_UINT16 = np.dtype("<u2")
_UINT32 = np.dtype("<u4")


def token_dtype(path: Path) -> np.dtype:
    """The ids' dtype of a token file, by its suffixes: ``.uint32.bin`` is uint32; ``.uint16.bin`` and a plain
    ``.bin`` (nanoGPT's) are uint16."""
    return _UINT32 if path.name.endswith(".uint32.bin") else _UINT16


def read_token_file(path: Path) -> np.ndarray:
    """A token file (flat little-endian ids, uint16 or uint32 by `token_dtype`), memory-mapped, not read into RAM."""
    dtype = token_dtype(path)
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(
            f"{path} has {size} bytes, not a whole number of {dtype.name} tokens; a .bin must be a flat {dtype.name} "
            f"array (nanoGPT's format is uint16; name a uint32 one <name>.uint32.bin). Rename it if it is text."
        )
    if size == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap refuses empty files
    return np.memmap(path, dtype=dtype, mode="r")


class TokenBlocks(Dataset):
    """Non-overlapping blocks of ``block_size + 1`` tokens from offset 0; item i is ``(x, y)`` int64.

    ``x = block[:-1]``, ``y = block[1:]``. A tail shorter than a block is dropped. Deterministic and
    finite, so an epoch is well defined; the order comes from the DataLoader's sampler.

    Args:
        tokens: Flat token array (uint8 bytes, uint16 or uint32 ids; a memmap is fine).
        block_size: Tokens per input sequence.
        vocab_size: Every id must be below it; each block read is checked (its max: a few hundred values), so an
            id out of range is an error naming it here, not an IndexError (or a device-side assert) in the
            embedding. None checks nothing.
        source: What the tokens were read from, for that error.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, vocab_size: int | None = None, source: str = "") -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.source = source

    def __len__(self) -> int:
        return len(self.tokens) // (self.block_size + 1)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} out of range for {len(self)} blocks")
        start = index * (self.block_size + 1)
        ids = np.asarray(self.tokens[start : start + self.block_size + 1], dtype=np.int64)
        if self.vocab_size is not None and int(ids.max()) >= self.vocab_size:
            where = int(ids.argmax())
            raise ValueError(
                f"token id {int(ids[where])} (block {index}, position {where}) of {self.source or 'the tokens'} is "
                f"not below vocab_size={self.vocab_size}. Pass the vocabulary the ids come from (vocab_size at least "
                f"{int(ids[where]) + 1}, or None to scan the file for it) and a model that large; if the file holds "
                "uint32 ids, name it <name>.uint32.bin (a plain .bin is read as uint16)."
            )
        block = torch.from_numpy(ids)
        return block[:-1], block[1:]


class TextDataModule(LightningDataModule):
    """Byte-level language-modelling data for `GPT`, with a real-text default that needs no download.

    Sources, by `path`:

    - None: the running interpreter's standard-library sources (``*.py`` under
      ``sysconfig.get_paths()["stdlib"]``, without ``site-packages`` and ``test``/``tests`` folders),
      sorted by path and joined by newlines. Real text on every machine; it differs between Python
      versions but is fixed for one interpreter.
    - a text file (any suffix but ``.bin``): its bytes.
    - a folder: its ``.txt``, ``.md``, ``.rst`` and ``.py`` files, recursively, sorted by path,
      hidden files skipped, joined by newlines.
    - a ``.bin`` file: flat token ids, memory-mapped: uint16 (nanoGPT's ``prepare.py`` format) for a plain
      ``.bin`` or a ``.uint16.bin``, uint32 for a ``.uint32.bin`` (`TokenizedDataModule`'s token files for a
      vocabulary above 65,536 ids). A plain ``.bin`` with a ``vocab_size`` above 65,536 is refused: its ids
      cannot be told from uint32 ones, so name it by its dtype.

    Text is byte-level: token = byte, vocabulary 256. The last `val_fraction` of the tokens is the
    validation split (also served by `test_dataloader` and `predict_dataloader`: there is no third
    split); the rest is training. Both are cut into non-overlapping blocks of ``block_size + 1``.
    Training batches are shuffled, epoch ``e`` by a generator seeded with ``seed + e``, and the last
    incomplete batch is dropped, so every micro-batch has the same shape (pipeline stages exchange
    fixed-shape activations, and a short batch would weigh its tokens more under mean accumulation).
    The training loader is resumable (`lit_efficient.data.loading`): a run resumed from a checkpoint
    taken in the middle of an epoch reads the batches the uninterrupted run reads. Under several
    replicas Lightning wraps the sampler in its distributed one, which keeps both properties.

    `prepare_data` is Lightning's no-op: nothing is downloaded. The corpus is read in `setup` and cached
    per process.

    Args:
        path: Text file, folder of text files, or token file (``.bin``/``.uint16.bin``: uint16 ids,
            ``.uint32.bin``: uint32 ids); None uses the embedded standard-library corpus.
        block_size: Tokens per training sequence (the model's context; match `GPT(block_size=...)`).
        batch_size: Sequences per batch, i.e. per micro-batch.
        num_workers: DataLoader worker processes (0 loads in the main process; enough for this data).
        val_fraction: Fraction of the tokens, taken from the end, used for validation; in (0, 1).
        seed: Seed of the training shuffle.
        max_bytes: Cap on the bytes read from text sources (the default corpus, files, folders); None
            reads everything. The 8 MB default keeps loading to about a second and the corpus to a few
            MB of memory on a laptop, which is already far more text than a CPU run consumes. ``.bin``
            files are memory-mapped and never capped.
        vocab_size: Token ids are below this. None: 256 for text; for ``.bin`` the largest id + 1, which
            scans the file once (pass it, e.g. 50257 for GPT-2 tokens, to skip the scan; each block read is
            then checked against it).
    """

    reads_token_files = True  # a .bin path is token ids (TokenizedDataModule tokenizes text only)

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 256,
        batch_size: int = 16,
        num_workers: int = 0,
        val_fraction: float = 0.05,
        seed: int = 42,
        max_bytes: int | None = 8_000_000,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        if path is not None and not (isinstance(path, (str, os.PathLike)) and os.fspath(path)):
            raise ValueError(
                f"{type(self).__name__}(path={path!r}) must be the path of a text file, folder"
                f"{' or .bin' if self.reads_token_files else ''}, or None for the embedded corpus."
            )
        source = None if path is None else Path(path).expanduser()
        if source is not None and not source.exists():
            raise ValueError(
                f"{type(self).__name__}(path={path!r}): no such file or folder; give an existing text file, folder"
                f"{' or .bin' if self.reads_token_files else ''}, or path=None for the embedded corpus."
            )
        if source is not None and source.is_dir():
            _say_skipped(type(self).__name__, path, source)
        if source is not None and source.is_file() and source.suffix.lower() in _RECORD_SUFFIXES:
            # Read as plain text, a record file trains on its markup (keys, quotes, commas) around the text.
            rank_zero_warn(
                f"{type(self).__name__}(path={path!r}) is read as plain text, its {source.suffix} markup (or binary "
                "bytes) included: this module does not parse records. Write each record's text to a .txt file of a "
                "folder (one document per file) and pass the folder, or give the Trainer a LightningDataModule of "
                "your own."
            )
        for name, value in (("block_size", block_size), ("batch_size", batch_size)):
            if not is_count(value):
                raise ValueError(f"{type(self).__name__}({name}={value!r}) must be an integer >= 1.")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"{type(self).__name__}(seed={seed!r}) must be an integer.")
        if not isinstance(val_fraction, numbers.Real) or isinstance(val_fraction, bool):
            raise ValueError(
                f"{type(self).__name__}(val_fraction={val_fraction!r}) must be a number in (0, 1), e.g. 0.05."
            )
        if not is_count(num_workers, minimum=0):
            raise ValueError(
                f"{type(self).__name__}(num_workers={num_workers!r}) must be an integer >= 0 (0: main process)."
            )
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(
                f"{type(self).__name__}(val_fraction={val_fraction}) must be in (0, 1), e.g. 0.05; to skip "
                f"validation set Trainer(limit_val_batches=0)."
            )
        if max_bytes is not None and not is_count(max_bytes):
            raise ValueError(
                f"{type(self).__name__}(max_bytes={max_bytes!r}) must be an integer >= 1, or None for no cap."
            )
        self.is_token_file = source is not None and source.is_file() and source.suffix == ".bin"
        if vocab_size is not None and not is_count(vocab_size):
            raise ValueError(
                f"{type(self).__name__}(vocab_size={vocab_size!r}) must be an integer >= 1, or None to derive it."
            )
        if vocab_size is not None and vocab_size < (1 if self.is_token_file else 256):
            raise ValueError(
                f"TextDataModule(vocab_size={vocab_size}) is too small: text is byte-level and needs 256; "
                f"a .bin needs its largest token id + 1 (or None to compute it)."
            )
        plain = self.is_token_file and not source.name.endswith((".uint16.bin", ".uint32.bin"))
        if plain and vocab_size is not None and vocab_size > 1 << 16:
            raise ValueError(
                f"TextDataModule(path={path!r}, vocab_size={vocab_size}): a plain .bin is read as nanoGPT's uint16 "
                f"ids, which stop at 65,535, and a vocabulary of {vocab_size:,} ids needs uint32 ones (as "
                f"TokenizedDataModule's tokens-....uint32.bin). Name the file by its dtype: "
                f"{source.stem}.uint32.bin if it holds uint32 ids, {source.stem}.uint16.bin if uint16."
            )
        # Loggers merge the module's and the data module's hparams and refuse keys whose values differ:
        # a None vocab_size ("derive it") would clash with the model's 256, so save it only when given.
        self.save_hyperparameters(ignore=["vocab_size"] if vocab_size is None else None)
        self._paths_as_str()
        self.path = path
        self._source = source
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.seed = seed
        self.max_bytes = max_bytes
        self._vocab_size = vocab_size
        self._tokens: np.ndarray | None = None
        self.train_set: TokenBlocks | None = None
        self.val_set: TokenBlocks | None = None

    def _paths_as_str(self) -> None:
        """Every path among the hyper-parameters (``path``, a subclass's ``tokenizer`` or ``cache_dir``) as a str: a
        ``pathlib.Path`` in a checkpoint is refused by torch.load's weights_only default (load_from_checkpoint after
        fit raised UnpicklingError)."""
        for key, value in self.hparams.items():
            if isinstance(value, os.PathLike):
                self.hparams[key] = os.fspath(value)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model must embed: 256 for text, max id + 1 (or the given value) for .bin."""
        if self._vocab_size is None:
            if not self.is_token_file:
                return 256
            tokens = self.tokens
            # One pass over the memmap; the only way to know the vocabulary of an arbitrary .bin.
            self._vocab_size = int(tokens.max()) + 1 if len(tokens) else 1
        return self._vocab_size

    @property
    def tokens(self) -> np.ndarray:
        """The whole corpus as a flat token array (uint8 for text, a uint16 or uint32 memmap for .bin); loaded once."""
        if self._tokens is None:
            if self.is_token_file:
                tokens = read_token_file(self._source)
            else:
                corpus = (
                    embedded_corpus(self.max_bytes) if self._source is None else read_text(self._source, self.max_bytes)
                )
                tokens = np.frombuffer(corpus, dtype=np.uint8)
                self._say_if_capped(len(corpus))
            if len(tokens) == 0:
                source = f"path={self.path!r}" if self.path is not None else "the embedded corpus"
                raise ValueError(f"TextDataModule: {source} is empty; give a path with some text in it.")
            self._tokens = tokens
        return self._tokens

    def _say_if_capped(self, read: int) -> None:
        """Say when ``max_bytes`` cut the text: a user's own, with a warning and how much (the rest is never trained
        on); the embedded corpus (far larger than the default cap, by design), in a line."""
        if self.max_bytes is None or read < self.max_bytes:
            return
        if self._source is None:
            rank_zero_info(f"TextDataModule: the embedded corpus capped at max_bytes={self.max_bytes:,} bytes.")
            return
        files = folder_files(self._source) if self._source.is_dir() else [self._source]
        total = sum(p.stat().st_size + (1 if self._source.is_dir() else 0) for p in files)  # a newline after each
        if total > self.max_bytes:
            rank_zero_warn(
                f"TextDataModule: text capped at max_bytes={self.max_bytes:,} bytes of {total:,} "
                f"({self.max_bytes / total:.1%}); the rest is not trained on. Set max_bytes=None (or larger) to use "
                "all of it."
            )

    def split_sizes(self) -> tuple[int, int]:
        """(train, validation) token counts: the last ``floor(n * val_fraction)`` tokens validate."""
        n = len(self.tokens)
        n_val = int(n * self.val_fraction)
        return n - n_val, n_val

    def _unit(self) -> str:
        """What the data's sequence counts, for messages: bytes of text, or tokens of a token file."""
        return "tokens" if self.is_token_file else "bytes"

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        tokens = self.tokens
        n_train, n_val = self.split_sizes()
        need = self.block_size + 1
        unit, owner = self._unit(), type(self).__name__
        for name, size in (("training", n_train), ("validation", n_val)):
            if size < need:
                raise ValueError(
                    f"{owner}: the {name} split has {size:,} {unit} (of {len(tokens):,}, "
                    f"val_fraction={self.val_fraction}), fewer than block_size + 1 = {need}; lower block_size, "
                    f"adjust val_fraction, or give more text (max_bytes={self.max_bytes})."
                )
        # Token ids are checked against the vocabulary given (or the tokenizer's); a scanned one holds them all.
        token_file = self._token_file_read()
        check = (None, "") if token_file is None else (self._vocab_size, str(token_file))
        train_set = TokenBlocks(tokens[:n_train], self.block_size, *check)
        if len(train_set) < self.batch_size:
            raise ValueError(
                f"{owner}: the training split holds {len(train_set)} blocks of {need} {unit}, fewer than "
                f"batch_size={self.batch_size}, and incomplete training batches are dropped; lower batch_size "
                f"or block_size, or give more text."
            )
        self.train_set = train_set
        self.val_set = TokenBlocks(tokens[n_train:], self.block_size, *check)

    def _token_file_read(self) -> Path | None:
        """The token file the ids are read from (a .bin path; `TokenizedDataModule`: its cache file), None for text."""
        return self._source if self.is_token_file else None

    @override
    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            raise RuntimeError("TextDataModule: call setup() (the Trainer does) before asking for a dataloader.")
        return self._loader(self.train_set, ResumableLoader, sampler=EpochShuffle(len(self.train_set), self.seed),
                            drop_last=True)  # fmt: skip

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, DataLoader)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, DataLoader)

    @override
    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, DataLoader)

    def _loader(self, dataset: TokenBlocks | None, kind: type[DataLoader], **kwargs: Any) -> DataLoader:
        if dataset is None:
            raise RuntimeError("TextDataModule: call setup() (the Trainer does) before asking for a dataloader.")
        return kind(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            **kwargs,
        )
