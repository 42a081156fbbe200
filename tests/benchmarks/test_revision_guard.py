"""The revision guard (benchmarks/revision_guard.py): the pinned revision loads beside the working tree.

The guard itself is a benchmark (minutes, timing); what can break silently is the part that makes it run at
all: extracting the pinned revision from git history, renaming its package so both load into one process, and
pairing the worker's records into rounds. Those are checked here.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from benchmarks import revision_guard


def _has_revision(revision: str) -> bool:
    done = subprocess.run(["git", "cat-file", "-e", f"{revision}^{{commit}}"], cwd=revision_guard.ROOT,
                          capture_output=True)  # fmt: skip
    return done.returncode == 0


def test_the_pinned_revision_loads_beside_the_tree():
    if not _has_revision(revision_guard.BASELINE):
        pytest.skip(f"this clone's history lacks the pinned revision {revision_guard.BASELINE[:12]} (a shallow clone)")
    name, folder = revision_guard.package_of(revision_guard.BASELINE)
    assert name == f"le_{revision_guard.BASELINE[:10]}"
    sources = list((folder / name).rglob("*.py"))
    assert len(sources) > 20
    left = [p for p in sources if re.search(r"\blit_efficient\b", p.read_text())]
    assert left == [], f"imports of the tree's package left in the pinned revision: {left[:3]}"
    # In a fresh interpreter: loading it here would leave a second PACIStrategy among the Strategy subclasses
    # that LightningCLI lists for the rest of the session.
    check = (
        "import importlib, sys; sys.path.insert(0, sys.argv[1]); "
        "old = importlib.import_module(sys.argv[2]); import lit_efficient; "
        "assert old.PACIStrategy is not lit_efficient.PACIStrategy; "
        "assert old.PACIStrategy.__module__.startswith(sys.argv[2]); "
        "assert importlib.import_module(sys.argv[2] + '.models').GPT.__module__.startswith(sys.argv[2]); "
        "from benchmarks.revision_worker import steady_state; "
        "assert steady_state(old, 'off') == {'staleness_correction': None}; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", check, str(folder), name], capture_output=True, text=True,
                          cwd=revision_guard.ROOT)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_records_pair_into_rounds_with_ratios_of_baseline_over_candidate():
    def record(segment: int, package: str, window: float) -> dict:
        return {"segment": segment, "package": package, "window": window, "wall": 8 * window,
                "cpu_per_microbatch": window / 4}  # fmt: skip

    records = [record(0, "old", 0.5), record(0, "new", 0.4), record(1, "new", 0.5), record(1, "old", 0.5)]
    rounds = revision_guard.pair_rounds(records, "old", "new")
    assert [r["first"] for r in rounds] == ["baseline", "candidate"]
    assert [r["window_ratio"] for r in rounds] == pytest.approx([1.25, 1.0])
    assert rounds[0]["wall_ratio"] == pytest.approx(1.25)
    assert revision_guard.spread([1.25, 1.0, 0.9]) == {"median": 1.0, "min": 0.9, "max": 1.25}


def test_the_tree_times_the_steady_state_the_pinned_revision_runs():
    """The pinned revision has no synchronous start and its staleness correction is off by default (its option
    set to its default above): the tree runs without both (the shared path), or with its own correction where asked
    (its cost then shows in the ratio)."""
    import lit_efficient
    from benchmarks.revision_worker import steady_state

    assert steady_state(lit_efficient, "off") == {"sync_start_steps": 0, "staleness_correction": None}
    assert steady_state(lit_efficient, "defaults") == {"sync_start_steps": 0}
