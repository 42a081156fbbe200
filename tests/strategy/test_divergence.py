"""A PACI run whose loss blows up against its own trend is told so once, with what to change (issue 31, item 5)."""

from __future__ import annotations

import math
import random
import re
import warnings

import lightning as L
import pytest

from lit_efficient import PACIStrategy
from lit_efficient.strategy.divergence import LossTrend
from tests.support.gpt_runs import gpt_model, text_data


def _warnings(losses: list[float]) -> list[tuple[int, str]]:
    trend = LossTrend()
    return [(step, text) for step, loss in enumerate(losses, 1) if (text := trend.observe(step, loss))]


def test_a_training_run_that_falls_plateaus_or_bumps_is_not_flagged():
    rng = random.Random(0)
    falling = [5.5 * math.exp(-step / 40) + 2.0 + rng.gauss(0, 0.3) for step in range(300)]
    assert _warnings(falling) == []
    plateau = [3.0 + rng.gauss(0, 0.4) + (2.5 if step % 37 == 0 else 0.0) for step in range(300)]  # lone spikes
    assert _warnings(plateau) == []
    bump = [4.0 - step * 0.02 for step in range(60)] + [3.2] * 8 + [2.9 - step * 0.01 for step in range(60)]
    assert _warnings(bump) == []  # +15% for a few steps (a warmup's end): under the bounds


def test_a_climb_is_flagged_once_with_the_numbers_and_the_options():
    losses = [5.0 - 0.1 * step for step in range(25)] + [2.5 + 0.5 * step for step in range(40)]
    flagged = _warnings([math.nan, *losses])  # a NaN is on_nonfinite's: ignored here
    assert len(flagged) == 1
    step, text = flagged[0]
    assert 28 < step < 45  # a few steps into the climb: the moving average lags the raw loss
    assert re.search(rf"moving average is [\d.]+ at step {step}, up from [\d.]+ at step \d+", text), text
    assert "staleness_correction='auto'" in text and "schedule='1f1b_flush'" in text


def _fit(schedule: str) -> list[str]:
    model = gpt_model(learning_rate=3.0, warmup_steps=40, max_steps=30)  # the rate climbs past what trains
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=2, schedule=schedule), max_steps=30,
        accumulate_grad_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=text_data())
    return [str(w.message) for w in caught if "the training loss is diverging" in str(w.message)]


@pytest.mark.usefixtures("one_thread")
def test_a_diverging_paci_fit_warns_once_and_flush_is_not_watched():
    paci = _fit("paci")
    assert len(paci) == 1 and "PACIStrategy: the training loss is diverging" in paci[0]
    assert _fit("1f1b_flush") == []  # flush has no staleness: a diverging flush run is the learning rate's
