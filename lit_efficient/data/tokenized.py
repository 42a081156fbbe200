"""Text tokenized by the user's own Hugging Face tokenizer: the data for a real model's vocabulary.

`TokenizedDataModule` reads the same sources as `TextDataModule` (a text file, a folder of text files, or
the embedded standard-library corpus), tokenizes them once with a tokenizer saved locally (nothing
downloads) and writes the ids to a flat token file in a cache folder, as uint16 where the vocabulary fits
and uint32 where it does not (Llama 3's 128k, Qwen's 151k). Every later run, and every rank, memory-maps
that file; the blocks, splits and the resumable training loader are `TextDataModule`'s.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_efficient.checks import named_few
from lit_efficient.data.text import TextDataModule, read_token_file
from lit_efficient.tools.corpus import TEXT_SUFFIXES, folder_files, stdlib_files

# Text is tokenized in pieces of about this many bytes, cut at line ends: a whole corpus in one call would hold
# every token's Python object at once.
_PIECE_BYTES = 1 << 20
_FORMAT = 2  # bump when the token file's content for the same inputs changes


def default_cache_dir() -> Path:
    """``$LIT_EFFICIENT_CACHE``, else ``$XDG_CACHE_HOME/lit_efficient`` (``~/.cache/lit_efficient``)."""
    if os.environ.get("LIT_EFFICIENT_CACHE"):
        return Path(os.environ["LIT_EFFICIENT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "lit_efficient"


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object as given, or loaded from a local folder (``tokenizer.save_pretrained(folder)``, or a
    model folder that holds its tokenizer); never downloaded."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        if not callable(getattr(tokenizer, "convert_tokens_to_ids", None)):
            raise TypeError(
                f"TokenizedDataModule(tokenizer=...) takes a local tokenizer folder or a transformers tokenizer; got "
                f"{type(tokenizer).__name__}"
            )
        return tokenizer
    folder = Path(tokenizer).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"TokenizedDataModule(tokenizer={str(tokenizer)!r}): no such folder. Nothing is downloaded: save the "
            "tokenizer with tokenizer.save_pretrained(folder) (or download it yourself) and pass the folder."
        )
    saved = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt", "config.json")
    if not any((folder / name).exists() for name in saved) and not any(folder.glob("*.model")):
        raise ValueError(
            f"TokenizedDataModule(tokenizer={str(tokenizer)!r}) holds no saved tokenizer (none of {', '.join(saved)}): "
            "pass the folder tokenizer.save_pretrained(folder) wrote (a model's save_pretrained folder saved with "
            "its tokenizer has them too)."
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def tokenizer_definition(tokenizer: Any) -> str:
    """What makes a tokenizer's ids beyond its vocabulary, for the cache key: a fast tokenizer's whole pipeline
    (normalizer, pre-tokenizer, merges, post-processor, added tokens), else its plain constructor options
    (``do_lower_case``, ``add_prefix_space``, ...). A tokenizer saved again with another normalizer and the same
    vocabulary must not reuse the ids of the old one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and callable(getattr(backend, "to_str", None)):
        pipeline = json.loads(backend.to_str())
        for state in ("truncation", "padding"):  # a call's settings (tok(..., truncation=True)), not its ids here
            pipeline.pop(state, None)
        return json.dumps(pipeline, sort_keys=True)
    options = getattr(tokenizer, "init_kwargs", None) or {}
    plain = (str, int, float, bool, type(None))
    # Not where its files are (name_or_path, vocab_file, ...): a moved folder tokenizes alike.
    where = ("name_or_path", "_name_or_path")
    kept = [
        (str(k), v) for k, v in options.items() if isinstance(v, plain) and k not in where and not k.endswith("_file")
    ]
    return json.dumps(sorted(kept))


def documents(source: Path | None, max_bytes: int | None) -> Iterator[tuple[Path, bytes, bool]]:
    """The source's files' bytes, one document per file (with its path, and whether ``max_bytes`` cut it), in
    `TextDataModule`'s order, cut at ``max_bytes`` in all."""
    files = documents_files(source)
    if source is not None and source.is_dir() and not files:
        raise ValueError(
            f"TokenizedDataModule(path='{source}') holds no text file ({', '.join(TEXT_SUFFIXES)}); point path at a "
            "file or at a folder with such files."
        )
    left = max_bytes
    for path in files:
        if left is not None and left <= 0:
            return
        whole = path.read_bytes()
        data = whole if left is None else whole[:left]
        if left is not None:
            left -= len(whole)
        yield path, data, len(data) < len(whole)


def decoded(data: bytes, cut: bool) -> tuple[str, bool]:
    """A document's text and whether it was valid UTF-8: a byte-order mark dropped, a character that ``max_bytes``
    cut at the end (``cut``) dropped, any other invalid byte replaced by U+FFFD."""
    data = data.removeprefix(codecs.BOM_UTF8)  # first: an error's positions then count from the data's start
    ends = range(len(data), max(len(data) - 4, -1), -1) if cut else (len(data),)  # a cut character: 3 bytes at most
    for end in ends:
        try:
            return data[:end].decode("utf-8"), True
        except UnicodeDecodeError as error:
            if error.end < end:  # invalid before the end: not a cut character
                break
    return data.decode("utf-8", errors="replace"), False


def _pieces(text: str) -> Iterator[str]:
    start = 0
    while start < len(text):
        end = text.find("\n", start + _PIECE_BYTES)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


class TokenizedDataModule(TextDataModule):
    """Language-modelling data in a Hugging Face tokenizer's ids, for `HFCausalLM` (or any model of that vocabulary).

    The text is `TextDataModule`'s (``path``: a text file, a folder of ``.txt``/``.md``/``.rst``/``.py`` files, or
    None for the embedded standard-library sources; ``max_bytes`` caps it), read one document per file, decoded
    as UTF-8 and tokenized without special tokens; the tokenizer's end-of-sequence token, where it has one,
    separates documents. The ids are written once to ``<cache_dir>/tokens-<key>.uint16.bin`` (``.uint32.bin``
    for a vocabulary above 65,536), where the key hashes the tokenizer (its vocabulary, special tokens and, for a
    fast tokenizer, its whole pipeline: normalizer, pre-tokenizer, merges), the files' names, sizes and
    modification times and ``max_bytes``: the same inputs reuse the file, a changed one writes another (a file
    rewritten with its old size and modification time kept, as ``cp -p`` can, is not seen: delete the token
    file). Lightning's ``prepare_data`` writes it on one process per node before any rank reads it; each rank
    memory-maps it (no copy in RAM).

    Splits, blocks and the training order are `TextDataModule`'s: the last ``val_fraction`` of the tokens
    validates; training batches are shuffled per epoch and resume exactly mid-epoch.

    Args:
        tokenizer: A folder saved by ``tokenizer.save_pretrained(folder)`` (a model folder holding its tokenizer
            works too), or a transformers tokenizer object. Nothing is downloaded.
        path: Text file or folder of text files; None tokenizes the embedded corpus.
        block_size: Tokens per training sequence (the model's context).
        batch_size: Sequences per batch, i.e. per micro-batch.
        num_workers: DataLoader worker processes.
        val_fraction: Fraction of the tokens, from the end, used for validation; in (0, 1).
        seed: Seed of the training shuffle.
        max_bytes: Cap on the text bytes read before tokenizing (8 MB by default, as `TextDataModule`'s: a few
            million tokens, far more than a CPU run consumes); None reads everything. A cap that cuts the text
            is said (a warning for your own ``path``, a log line for the embedded corpus) with how much it kept.
        cache_dir: Folder of the token files; None: ``$LIT_EFFICIENT_CACHE``, else ``~/.cache/lit_efficient``.
    """

    reads_token_files = False

    def __init__(
        self,
        tokenizer: str | Any,
        path: str | None = None,
        block_size: int = 256,
        batch_size: int = 16,
        num_workers: int = 0,
        val_fraction: float = 0.05,
        seed: int = 42,
        max_bytes: int | None = 8_000_000,
        cache_dir: str | None = None,
    ) -> None:
        if path is not None and Path(path).suffix == ".bin":
            raise ValueError(
                f"TokenizedDataModule(path={path!r}): a .bin is already token ids; read it with "
                "TextDataModule(path=..., vocab_size=<the tokenizer's vocabulary>) (uint32 ids: name it "
                "<name>.uint32.bin)."
            )
        super().__init__(path, block_size, batch_size, num_workers, val_fraction, seed, max_bytes)
        if not isinstance(tokenizer, (str, os.PathLike)):
            # A tokenizer object in the hyper-parameters would be pickled into every checkpoint, which torch.load's
            # weights_only default then refuses (and a 151k vocabulary adds megabytes): keep the folder form only.
            self.save_hyperparameters(ignore=["tokenizer"])
        self._paths_as_str()
        self.tokenizer = load_tokenizer(tokenizer)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        # The vocabulary the model must embed: added tokens included (len(), not .vocab_size).
        self._vocab_size = len(self.tokenizer)

    @functools.cached_property
    def token_file(self) -> Path:
        """Where the ids are (to be) written for these inputs: hashed once per module (a 151k-entry vocabulary and
        the standard library's ~800 files are no per-call read; ``prepare_data`` and ``tokens`` both ask)."""
        tok = self.tokenizer
        files = self._files
        key = json.dumps({
            "format": _FORMAT, "tokenizer": type(tok).__name__, "definition": tokenizer_definition(tok),
            "vocab": sorted(tok.get_vocab().items()),
            "special": sorted(map(str, tok.all_special_tokens)), "eos": tok.eos_token_id, "max_bytes": self.max_bytes,
            "files": [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        })  # fmt: skip
        digest = hashlib.sha256(key.encode()).hexdigest()[:20]
        return self.cache_dir / f"tokens-{digest}.{self._dtype.name}.bin"

    @functools.cached_property
    def _files(self) -> list[Path]:
        """The files `documents` reads (listed once: the cache key and the max_bytes notice both need them)."""
        return documents_files(self._source)

    @property
    def _dtype(self) -> np.dtype:
        return np.dtype("<u2") if self._vocab_size <= 1 << 16 else np.dtype("<u4")

    @override
    def prepare_data(self) -> None:
        """Tokenize the text into the token file, unless these inputs were tokenized before (one process per node)."""
        target = self.token_file
        if target.exists():
            return
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            count, invalid = self._write_tokens(partial)
            # Beside the token file, so that every run reading it says so (`_say_if_invalid`); replaced whole, as
            # the token file, for a second run writing the same inputs at the same time.
            listed = _invalid_file(target)
            if invalid:
                listed_partial = listed.with_name(f"{listed.name}.{os.getpid()}.partial")
                listed_partial.write_text(json.dumps([str(p) for p in invalid]))
                listed_partial.replace(listed)
            else:
                listed.unlink(missing_ok=True)
            partial.replace(target)  # whole or absent: a rank never maps a half-written file
        except BaseException as error:
            with contextlib.suppress(OSError):  # a cache_dir that is a file has no partial file to remove
                partial.unlink(missing_ok=True)  # a full disk or a Ctrl-C leaves no partial file to fill the disk
            if isinstance(error, OSError):
                message = (
                    f"TokenizedDataModule could not write its token file {target} ({error.strerror or error}). "
                    "Free space there, or point cache_dir (--data.init_args.cache_dir) or $LIT_EFFICIENT_CACHE at a "
                    "writable folder with room"
                )
                # numpy's short write ("27000 requested and 8192 written") has no errno: the message alone.
                raise (OSError(message) if error.errno is None else OSError(error.errno, message)) from error
            raise
        rank_zero_info(f"TokenizedDataModule: {count:,} tokens written to {target}")

    def _write_tokens(self, out_path: Path) -> tuple[int, list[Path]]:
        """Tokenize the text into ``out_path``: the token count and the files that were not UTF-8."""
        eos = self.tokenizer.eos_token_id
        count = 0
        invalid = []
        with out_path.open("wb") as out:
            for path, doc, cut in documents(self._source, self.max_bytes):
                text, valid = decoded(doc, cut)
                if not valid:
                    invalid.append(path)
                for piece in _pieces(text):
                    ids = self.tokenizer(piece, add_special_tokens=False)["input_ids"]
                    np.asarray(ids, dtype=self._dtype).tofile(out)
                    count += len(ids)
                if eos is not None:
                    np.asarray([eos], dtype=self._dtype).tofile(out)
                    count += 1
        return count, invalid

    @property
    @override
    def tokens(self) -> np.ndarray:
        """The token file, memory-mapped (written first when ``prepare_data`` has not run, e.g. outside a Trainer)."""
        if self._tokens is None:
            target = self.token_file
            if not target.exists():
                self.prepare_data()
            size = target.stat().st_size
            if size == 0:
                source = f"path={self.path!r}" if self.path is not None else "the embedded corpus"
                raise ValueError(f"TokenizedDataModule: {source} gave no tokens; give a path with some text in it.")
            self._tokens = read_token_file(target)  # named .uint16.bin / .uint32.bin: its dtype is in its name
            self._say_if_capped()
            self._say_if_invalid(target)
        return self._tokens

    @override
    def _unit(self) -> str:
        return "tokens"

    def _token_file_read(self) -> Path | None:
        return self.token_file

    def _say_if_capped(self) -> None:
        """Say when ``max_bytes`` cut the text (from the files' sizes: nothing is read again), on every run that
        reads a token file, written now or before: the rest of the user's text is never trained on."""
        total = sum(p.stat().st_size for p in self._files)
        if self.max_bytes is None or total <= self.max_bytes:
            return
        message = (
            f"TokenizedDataModule: text capped at max_bytes={self.max_bytes:,} bytes of {total:,} "
            f"({self.max_bytes / total:.1%}); the rest is not tokenized. Set max_bytes=None "
            "(--data.init_args.max_bytes null) to read it all, or a larger cap."
        )
        if self._source is None:  # the embedded corpus, cut by design
            rank_zero_info(message)
        else:
            rank_zero_warn(message)

    def _say_if_invalid(self, target: Path) -> None:
        """Say on every run that reads the token file, written now or before, which of its files were not UTF-8:
        their replacement characters are in the training data."""
        listed = _invalid_file(target)
        if not listed.exists():
            return
        invalid = json.loads(listed.read_text())
        named = named_few(invalid)
        rank_zero_warn(
            f"TokenizedDataModule: {len(invalid)} file(s) are not UTF-8 text ({named}): their invalid bytes were "
            "tokenized as U+FFFD replacement characters. Convert them to UTF-8 (iconv -f latin1 -t utf-8), or move "
            f"them out of the folder, and delete the token file to tokenize again: {target}."
        )


def _invalid_file(token_file: Path) -> Path:
    """The list of a token file's sources that were not UTF-8, kept beside it."""
    return token_file.with_name(f"{token_file.name}.not-utf8.json")


def documents_files(source: Path | None) -> list[Path]:
    """The files `documents` reads, for the cache key."""
    if source is None:
        return stdlib_files()
    return folder_files(source) if source.is_dir() else [source]
