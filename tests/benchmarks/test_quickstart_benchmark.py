"""benchmarks/quickstart.py's bookkeeping, without its minutes of training: the commands it runs, the round-by-round
ratio, the loss it reads off a rich progress bar, and a failed run reported rather than recorded.

The real command is ``python -m benchmarks.quickstart`` (results in BENCHMARKS.md); its ``--quick`` form trains for
~35 s, so here ``subprocess.run`` and the clock are replaced by a fake that answers as the console script does."""

from __future__ import annotations

import json
import subprocess
import types

import pytest

from benchmarks import harness, quickstart

# A rich progress bar's last frames (carriage returns between redraws), as ``lit-efficient fit`` prints them.
_BAR = "Epoch 0/0 ... val_loss: 2.514\rEpoch 0/0 ... 250/250 0:01:12 • 0:00:00 3.45it/s v_num: 0 val_loss: {loss}\n"


class _FakeRuns:
    """``subprocess.run`` for the console script: a fit of ``seconds[name]`` on a fake clock, ending on ``loss``."""

    def __init__(self, seconds: dict[str, list[float]], losses: dict[str, str], fail: str | None = None) -> None:
        self.now, self.seconds, self.losses, self.fail, self.calls = 0.0, seconds, losses, fail, []

    def perf_counter(self) -> float:
        return self.now

    def run(self, argv, cwd, capture_output, text, check):  # noqa: ANN001 - subprocess.run's signature
        name = "flush" if any(a.endswith("flush.yaml") for a in argv) else "paci"
        self.calls.append((name, list(argv), cwd))
        self.now += self.seconds[name].pop(0)
        if name == self.fail:
            return subprocess.CompletedProcess(argv, 2, "", "Traceback ...\nValueError: no such option")
        return subprocess.CompletedProcess(argv, 0, "", _BAR.format(loss=self.losses[name]))


def _install(monkeypatch, tmp_path, fake: _FakeRuns) -> None:
    monkeypatch.setattr(quickstart, "subprocess", types.SimpleNamespace(run=fake.run))
    monkeypatch.setattr(quickstart, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    monkeypatch.setattr(harness, "RESULTS", tmp_path)


def test_rounds_alternate_and_the_ratio_is_taken_round_by_round(tmp_path, monkeypatch):
    fake = _FakeRuns({"paci": [80.0, 100.0], "flush": [88.0, 120.0]}, {"paci": "1.961", "flush": "1.960"})
    _install(monkeypatch, tmp_path, fake)
    quickstart.main(["--rounds", "2", "--out", "q.json"])

    # PACI then its flush overlay, alternating, each in a fresh folder, the console script as a user types it
    assert [name for name, _, _ in fake.calls] == ["paci", "flush", "paci", "flush"]
    assert len({cwd for _, _, cwd in fake.calls}) == 4
    for name, argv, _ in fake.calls:
        assert argv[:4] == ["lit-efficient", "fit", "--config", str(quickstart.CONFIGS / "quickstart.yaml")]
        assert argv[4:] == ([] if name == "paci" else ["--config", str(quickstart.CONFIGS / "flush.yaml")])

    summary = json.loads((tmp_path / "q.json").read_text())["summary"]
    # per round 88/80 = 1.10 and 120/100 = 1.20: the median of the ratios, not the ratio of the medians (1.1556)
    assert summary["flush_over_paci"] == pytest.approx({"median": 1.15, "min": 1.1, "max": 1.2})
    assert summary["seconds"] == {"paci": 90.0, "flush": 104.0}
    assert summary["val_loss"] == {"paci": 1.961, "flush": 1.96}  # the bar's last value, after the carriage returns


def test_quick_runs_four_steps_and_a_failed_fit_is_reported_not_recorded(tmp_path, monkeypatch):
    fake = _FakeRuns({"paci": [5.0], "flush": [6.0]}, {"paci": "3.1", "flush": "3.0"}, fail="flush")
    _install(monkeypatch, tmp_path, fake)
    with pytest.raises(SystemExit, match=r"(?s)flush\.yaml --trainer\.max_steps 4 .* failed \(2\):\n.*no such option"):
        quickstart.main(["--rounds", "1", "--quick", "--out", "q.json"])
    assert "--trainer.max_steps" in fake.calls[0][1]
    assert not (tmp_path / "q.json").exists()
