"""The example scripts loaded as modules (without running them): their import guard is tested, and
examples/own_hf_model.py's demo folder and main() serve the tests of a user's day."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def own_hf_model() -> ModuleType:
    return load_example(EXAMPLES / "own_hf_model.py")
