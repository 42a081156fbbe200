"""The embedded default corpus and plain-file reading: real text that ships with Python itself.

One reader shared by `TextDataModule` and the pipeline demo, so both train on the same bytes. The
module uses no Lightning, which keeps the demo's own code pure PyTorch; importing it still runs the
package's ``__init__`` (which does import Lightning), like any ``lit_efficient`` module.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

# Files a folder contributes (a single file path is read whatever its suffix).
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
# Standard-library folders left out of the default corpus: installed packages are not stdlib, and the
# test suites are large, repetitive and full of deliberately odd encodings.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


def stdlib_files() -> list[Path]:
    """The default corpus' files: the interpreter's stdlib ``*.py``, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = (p for p in root.rglob("*.py") if not _STDLIB_SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def folder_files(folder: Path) -> list[Path]:
    """The files a folder contributes: ``TEXT_SUFFIXES`` files, recursively, hidden ones skipped, sorted."""
    files = (
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix.lower() in TEXT_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def concat_files(files: list[Path], max_bytes: int | None) -> bytes:
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


# Reading the stdlib takes ~1-2 s; every `setup` (fit, validate, test) of every TextDataModule in this
# process reuses it. Only the embedded corpus is cached: a user's file may change between runs in a
# notebook, and one TextDataModule reads its own source once anyway.
@functools.lru_cache(maxsize=2)
def embedded_corpus(max_bytes: int | None) -> bytes:
    """The default corpus: the stdlib sources joined by newlines, cut at `max_bytes`. Cached per process."""
    return concat_files(stdlib_files(), max_bytes)
