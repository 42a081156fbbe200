"""The accumulation window N for PACI: what a user would otherwise tune by hand, chosen from the measured grid.

Under PACI stage s runs a micro-batch's forward on weights up to ``ceil((S-1-s)/N)`` optimizer steps older than
those its gradient is applied to (its drift bound; stage 0's is the pipeline's). What the benchmark grid
(BENCHMARKS.md, "PACI at depth": a GPT trained to equal tokens, S = 4 and 8, N = 4, 8 and 16, lr up to 2e-3,
three seeds) measured with the default correction (``staleness_correction="auto"``):

- drift bound 1 (N >= S - 1) trains within about 1% of 1F1B-flush's final loss: the weight prediction predicts
  the one pending step from the optimizer's own moments;
- drift bound 2 (S=8, N=4) ends 16% above flush at lr 2e-3 whatever the correction: the second pending step
  depends on gradients not yet computed, and the first windows, which decide such a run, are the ones it
  gets wrong;
- at equal tokens a smaller N takes more optimizer steps, so among windows with drift bound 1 the smallest
  trained best (S=8: N=8 against 16; S=4: N=4 against 8 and 16).

PACI is bubble-free at every N, so time to accuracy follows the loss per token; its activations are the S - s
micro-batches in flight on stage s whatever N is (`lit_efficient.tools.memory_plan.in_flight`), so at a given
micro-batch size the memory plan, and whether it fits the budget, is the same for every N. The recommendation is
therefore the smallest candidate N (powers of two, and the configured one) with drift bound <= 1. Under 1F1B-flush
nothing is stale and a larger N only shrinks the bubble, ``(S-1)/(N+S-1)`` of each window.

Pure arithmetic, no torch: `lit-efficient plan` prints it, and the strategy warns at setup when PACI's
configured N leaves stage 0 two or more steps behind.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

MAX_DRIFT = 1  # the drift bound the default correction holds within ~1% of flush on the grid (module docstring)


def drift_bound(num_stages: int, accumulate: int) -> int:
    """Optimizer steps stage 0's forwards can be behind their backwards under PACI: ``ceil((S-1)/N)``."""
    return math.ceil((num_stages - 1) / accumulate)


def flush_bubble(num_stages: int, accumulate: int) -> float:
    """Idle share of each 1F1B-flush window with balanced stages: ``(S-1)/(N+S-1)`` (PACI's is 0)."""
    return (num_stages - 1) / (accumulate + num_stages - 1)


@dataclass(frozen=True)
class WindowChoice:
    """One candidate window N: its drift bound under PACI and the bubble flush would pay."""

    accumulate: int
    drift_bound: int
    flush_bubble: float


@dataclass(frozen=True)
class WindowAdvice:
    """The recommended N for PACI at ``num_stages`` stages, against the configured one.

    Attributes:
        num_stages: S.
        accumulate: The configured N.
        recommended: The smallest candidate N (powers of two and the configured one) with drift bound <= ``MAX_DRIFT``.
        choices: Every candidate considered, smallest first.
    """

    num_stages: int
    accumulate: int
    recommended: int
    choices: tuple[WindowChoice, ...]

    @property
    def drift_bound(self) -> int:
        """The configured N's drift bound."""
        return drift_bound(self.num_stages, self.accumulate)

    @property
    def too_stale(self) -> bool:
        """Whether the configured N leaves stage 0 more than ``MAX_DRIFT`` steps behind."""
        return self.drift_bound > MAX_DRIFT

    def text(self) -> str:
        """The advice as a user reads it (the plan's last paragraph, the strategy's warning)."""
        s, n, best = self.num_stages, self.accumulate, self.recommended
        head = (
            f"Accumulation window: N={n} with S={s} puts stage 0's forwards up to {self.drift_bound} optimizer "
            f"step{'s' if self.drift_bound != 1 else ''} behind their backwards under PACI (drift bound "
            f"ceil((S-1)/N))"
        )
        if self.too_stale:
            return (
                f"{head}. With a drift bound of 2 or more PACI ended 16% above 1F1B-flush's loss on the benchmark "
                f"grid (S=8 N=4 lr 2e-3, whatever the correction); with 1 within about 1%. Recommended: "
                f"accumulate_grad_batches={best} (the smallest power of two >= S-1 = {s - 1}; drift bound 1), "
                "or schedule='1f1b_flush'."
            )
        if n == best:
            return f"{head}: the recommended N (the smallest with drift bound <= 1)."
        return (
            f"{head}. N={best} also has drift bound 1 and takes {n / best:g}x the optimizer steps per token "
            f"(on the benchmark grid the smallest such N trained best at equal tokens); N sets the global batch, "
            "so keep N if the learning rate was tuned for it."
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "drift_bound": self.drift_bound, "too_stale": self.too_stale}


def advise_window(num_stages: int, accumulate: int) -> WindowAdvice:
    """The window advice for PACI at ``num_stages`` stages with the configured ``accumulate`` (module docstring)."""
    if num_stages < 1 or accumulate < 1:
        raise ValueError(f"num_stages={num_stages} and accumulate={accumulate} must be >= 1")
    powers = {2**k for k in range(max(1, (4 * num_stages).bit_length()) + 1)}
    candidates = sorted(powers | {accumulate})
    choices = tuple(WindowChoice(n, drift_bound(num_stages, n), flush_bubble(num_stages, n)) for n in candidates)
    recommended = min(c.accumulate for c in choices if c.drift_bound <= MAX_DRIFT)
    return WindowAdvice(num_stages, accumulate, recommended, choices)
