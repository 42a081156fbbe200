"""examples/own_hf_model.py loaded as a module: its demo folder and its main() serve the tests of a user's day."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "own_hf_model.py"


@functools.cache
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_own_hf_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
