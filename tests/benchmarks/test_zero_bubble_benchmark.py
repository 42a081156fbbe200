"""The side-by-side benchmark against torch's schedules runs (``--quick``) and writes what the committed result has."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import zero_bubble

pytestmark = pytest.mark.multiproc
COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "zero_bubble.json"


def key_paths(value: Any, prefix: str = "") -> set[str]:
    """Every dict key as a path; list items share one path (``[]``), so lengths and values don't matter.

    Dicts keyed by data (rounds, ranks) are not used in the result: per-N and per-rank values are lists.
    """
    if isinstance(value, dict):
        out = set()
        for key, item in value.items():
            out |= {f"{prefix}/{key}"} | key_paths(item, f"{prefix}/{key}")
        return out
    if isinstance(value, list):
        return set().union(*(key_paths(item, f"{prefix}[]") for item in value)) if value else set()
    return set()


def test_quick_run_writes_every_key_of_the_committed_result(tmp_path):
    payload = zero_bubble.main(["--quick", "--out", str(tmp_path / "zero_bubble_quick.json")])
    written = json.loads((tmp_path / "zero_bubble_quick.json").read_text())
    committed = json.loads(COMMITTED.read_text())
    # raw holds per-rank segments whose keys depend on which variants ran; everything above it must match.
    ignore = ("/raw", "/config")
    missing = {k for k in key_paths(committed) - key_paths(written) if not k.startswith(ignore)}
    assert not missing, f"--quick did not write: {sorted(missing)}"
    row = payload["rows"][0]
    assert set(row["variants"]) == set(zero_bubble.VARIANTS)
    for name in ("trainer_paci", "bare_paci", "torch_1f1b", "torch_zbv"):
        assert row["variants"][name]["error"] is None, row["variants"][name]["error"]
        assert row["variants"][name]["tokens_per_s"] > 0
        assert all(b > 0 for b in row["variants"][name]["saved_peak_bytes_per_rank"])
