"""A PACI run whose training loss blows up against its own trend gets one warning naming what to change.

PACI's stages step on weights up to ``ceil((S-1-s)/N)`` versions old; at a high learning rate, a short warmup
or a deep pipeline that staleness can make a run diverge where 1F1B-flush trains on (docs/DESIGN.md, "PACI at
depth"). A diverging run is a bug report to the user, not a number to find at the end: `LossTrend` watches the
loss of each optimizer step (the last stage's host copy, read once per step already: no extra sync) and says
once, with the numbers, when its smoothed value has climbed well above the best it had reached. A NaN or Inf
is `on_nonfinite`'s, not this module's.
"""

from __future__ import annotations

import math


class LossTrend:
    """Flags a sustained climb of the smoothed training loss above its best, once.

    The loss of every optimizer step is smoothed with an exponential moving average (``smoothing``, starting at
    the first loss, so the first steps' fast fall only lowers it gradually); the lowest smoothed value is the
    run's best. A climb is a smoothed loss above both ``best * ratio`` and ``best + margin`` nats for
    ``patience`` consecutive steps, counted from ``settle`` steps on: a plateau, noise and the usual warmup bump
    stay under it, a divergence does not.

    Args:
        smoothing: Weight of the newest step in the moving average.
        settle: Steps before a climb counts (the moving average still carries the initial loss before them).
        ratio: How far above the best, relatively, the smoothed loss must climb.
        margin: How far above the best, in nats, it must climb.
        patience: Consecutive steps above both bounds before the warning.
    """

    def __init__(
        self, smoothing: float = 0.1, settle: int = 20, ratio: float = 1.3, margin: float = 0.5, patience: int = 5
    ) -> None:
        self.smoothing, self.settle, self.ratio, self.margin, self.patience = smoothing, settle, ratio, margin, patience
        self.smoothed: float | None = None
        self.best = math.inf
        self.best_step = 0
        self.steps = 0
        self.above = 0
        self.warned = False

    def observe(self, step: int, loss: float) -> str | None:
        """Take one optimizer step's loss; the warning's text the first time the run climbs, else None."""
        if self.warned or not math.isfinite(loss):
            return None
        self.steps += 1
        self.smoothed = loss if self.smoothed is None else self.smoothed + self.smoothing * (loss - self.smoothed)
        if self.smoothed < self.best:
            self.best, self.best_step = self.smoothed, step
        if self.steps < self.settle:
            return None
        climbed = self.smoothed > self.best * self.ratio and self.smoothed > self.best + self.margin
        self.above = self.above + 1 if climbed else 0
        if self.above < self.patience:
            return None
        self.warned = True
        return (
            f"PACIStrategy: the training loss is diverging: its moving average is {self.smoothed:.3f} at step {step}, "
            f"up from {self.best:.3f} at step {self.best_step}. PACI's stages train on weights up to ceil((S-1)/N) "
            "steps old, and at a high learning rate or a short warmup that staleness can diverge where 1F1B-flush "
            "does not. "
            "Change one of: staleness_correction='auto' with AdamW or Adam (the default: predicts the stale "
            "weights; off with other optimizers and a sharded optimizer state), a lower "
            "learning rate or a longer warmup, a larger accumulation window N (less drift per step), or "
            "schedule='1f1b_flush' (no staleness, with its bubble). If flush diverges as well, the cause is not "
            "the pipeline."
        )
