"""The embedded default corpus and plain-file reading: real text that ships with Python itself.

One reader shared by `TextDataModule` and the pipeline demo, so both train on the same bytes. The
module uses no Lightning, which keeps the demo's own code pure PyTorch; importing it still runs the
package's ``__init__`` (which does import Lightning), like any ``lit_efficient`` module.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

# Files a folder contributes (a single file path is read whatever its suffix).
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
# Standard-library folders left out of the default corpus: installed packages are not stdlib, and the
# test suites are large, repetitive and full of deliberately odd encodings.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


def stdlib_files() -> list[Path]:
    """The default corpus' files: the interpreter's stdlib ``*.py``, sorted by relative path."""
    return list(_stdlib_in_order())


def _stdlib_in_order() -> Iterator[Path]:
    """`stdlib_files`, one at a time, walked in its order: a directory's entries sorted by their name, a folder's
    with a ``/`` after it (as in a relative path: ``a-b/``, then ``a.py``, then ``a/``). The corpus' first bytes
    then read a few files and list a few folders, not all ~1,000 of them first (a second per rank of every run)."""
    root = Path(sysconfig.get_paths()["stdlib"])

    def walk(folder: Path) -> Iterator[Path]:
        with os.scandir(folder) as listing:
            entries = [(e.name + "/" if e.is_dir(follow_symlinks=False) else e.name, e) for e in listing]
        for key, entry in sorted(entries, key=lambda pair: pair[0]):
            if key.endswith("/"):
                if entry.name not in _STDLIB_SKIP_DIRS:
                    yield from walk(Path(entry.path))
            elif entry.name.endswith(".py"):
                yield Path(entry.path)

    return walk(root)


def folder_files(folder: Path) -> list[Path]:
    """The files a folder contributes: ``TEXT_SUFFIXES`` files, recursively, hidden ones skipped, sorted."""
    return [p for p in _visible_files(folder) if p.suffix.lower() in TEXT_SUFFIXES]


def skipped_files(folder: Path) -> list[Path]:
    """The visible files of a folder that `folder_files` leaves out (another suffix), sorted: a user's ``.jsonl``
    or ``.html`` among them is not read, which is worth saying."""
    return [p for p in _visible_files(folder) if p.suffix.lower() not in TEXT_SUFFIXES]


def _visible_files(folder: Path) -> list[Path]:
    files = (
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def concat_files(files: Iterable[Path], max_bytes: int | None) -> bytes:
    """The files' bytes joined by a newline, cut at `max_bytes`; stops reading once the cap is reached."""
    parts: list[bytes] = []
    total = 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        data = path.read_bytes() + b"\n"
        parts.append(data)
        total += len(data)
    corpus = b"".join(parts)
    return corpus if max_bytes is None else corpus[:max_bytes]


# Reading the whole stdlib takes ~1-2 s (its first bytes, a few ms); every `setup` (fit, validate, test) of every
# TextDataModule in this process reuses them. Only the embedded corpus is cached: a user's file may change between
# runs in a notebook, and one TextDataModule reads its own source once anyway.
@functools.lru_cache(maxsize=2)
def embedded_corpus(max_bytes: int | None) -> bytes:
    """The default corpus: the stdlib sources joined by newlines, cut at `max_bytes`. Cached per process."""
    return concat_files(_stdlib_in_order(), max_bytes)
