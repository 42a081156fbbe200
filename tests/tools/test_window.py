"""The accumulation-window advice (lit_efficient/tools/window.py): the rule, what `lit-efficient plan` prints
and the strategy's warning at setup, and the rule checked against the benchmark grid's measured losses."""

from __future__ import annotations

import json
import statistics
import warnings
from pathlib import Path

import lightning as L
import pytest

from lit_efficient import PACIStrategy
from lit_efficient.cli.plan import main as plan_main
from lit_efficient.tools.window import advise_window, drift_bound, flush_bubble
from tests.support.gpt_runs import gpt_model, text_data

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def test_the_smallest_window_with_drift_bound_one_is_recommended():
    assert [drift_bound(8, n) for n in (4, 7, 8, 16)] == [2, 1, 1, 1]
    assert flush_bubble(8, 8) == pytest.approx(7 / 15)
    assert advise_window(8, 4).recommended == 8 and advise_window(8, 4).too_stale
    assert advise_window(8, 16).recommended == 8 and not advise_window(8, 16).too_stale
    assert advise_window(8, 7).recommended == 7  # the configured N counts when it is the smallest with bound 1
    assert advise_window(4, 8).recommended == 4 and advise_window(2, 4).recommended == 1
    text = advise_window(8, 4).text()
    assert "up to 2 optimizer steps behind" in text and "accumulate_grad_batches=8" in text
    assert "N=8 also has drift bound 1 and takes 2x the optimizer steps per token" in advise_window(8, 16).text()
    with pytest.raises(ValueError, match="accumulate=0 must be >= 1"):
        advise_window(8, 0)


def _finals(pattern: str, run: str) -> dict[tuple[int, int], float]:
    """Median over seeds of the final validation loss of ``run`` per (S, N) at lr 2e-3 in the committed results."""
    by: dict[tuple[int, int], list[float]] = {}
    for path in sorted((REPO / "benchmarks" / "results").glob(pattern)):
        data = json.loads(path.read_text())
        for r in data.get("runs", data):
            if r["run"] == run and r["lr"] == 2e-3:
                by.setdefault((r["S"], r["N"]), []).append(r["final_val_loss"])
    return {k: statistics.median(v) for k, v in by.items()}


def test_the_recommendation_picks_within_5_percent_of_the_best_window_on_the_grid():
    """The grid (benchmarks/reports/paci-at-depth.md) at lr 2e-3, equal tokens, PACI with the first-step weight
    prediction (the default's rule): per S, the recommended N's final loss against the best N's."""
    finals = _finals("exp31_s*n*_lr2e-3_*.json", "paci+weight_prediction_first_step")
    for stages in (4, 8):
        measured = {n: loss for (s, n), loss in finals.items() if s == stages}
        assert len(measured) >= 2, measured
        pick = advise_window(stages, max(measured)).recommended
        assert measured[pick] <= 1.05 * min(measured.values()), (stages, pick, measured)


def test_plan_prints_the_window_advice(capsys):
    assert plan_main(["--config", str(QUICKSTART), "--trainer.accumulate_grad_batches=1"]) == 0
    text = capsys.readouterr().out
    assert "Accumulation window: N=1 with S=2" in text and "drift bound" in text
    assert plan_main(["--config", str(QUICKSTART), "--json"]) == 0
    window = json.loads(capsys.readouterr().out)["window"]
    assert window["num_stages"] == 2 and window["accumulate"] == 4 and window["too_stale"] is False


@pytest.mark.usefixtures("one_thread")
def test_a_paci_fit_whose_window_leaves_stage_0_two_steps_behind_is_warned_at_setup():
    def fit(accumulate: int) -> list[str]:
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=4), max_steps=2,
            accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0,
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(gpt_model(n_layer=2, max_steps=2), datamodule=text_data())
        return [str(w.message) for w in caught if "Accumulation window" in str(w.message)]

    stale = fit(1)
    assert len(stale) == 1 and "up to 3 optimizer steps behind" in stale[0] and "accumulate_grad_batches=4" in stale[0]
    assert fit(4) == []
