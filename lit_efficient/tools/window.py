"""The accumulation window N for PACI: what a user would otherwise tune by hand.

Under PACI stage s runs a micro-batch's forward on weights up to ``ceil((S-1-s)/N)`` optimizer steps older than
those its gradient is applied to (its drift bound; stage 0's is the pipeline's). What the benchmark grid measured
(benchmarks/reports/exp31-staleness.md: a GPT, S = 4 and 8, lr 5e-4 to 2e-3, three seeds) with PACI's defaults
(AdamW; the in-place weight prediction and the synchronous start):

- drift bound 1 (S=4 N=4, S=8 N=8 and N=16) ends within 0.3% of 1F1B-flush's final loss at the same N;
- drift bound 2 (S=8 N=4) ends 1.5-2.3% above it (plain PACI: 24.5%): the second pending step depends on
  gradients not computed yet, and no correction measured predicted it.

The recommendation keeps what the user tuned, the global batch (each replica's ``B = N x micro-batch``, times the
replicas), and chooses how each replica's B is cut:
at a fixed B, 1F1B-flush computes the same step at every N (its bubble ``(S-1)/(N+S-1)`` shrinks as N grows)
and PACI, bubble-free at every N, differs from it only by its drift. So among the windows that divide B, the
recommended one is the smallest N >= S (drift bound 1, as measured; N = S - 1 also has drift bound 1 but every
forward of stage 0 is then stale, which the grid did not measure) whose micro-batch, the largest of those (fewest,
largest kernels), fits the memory budget; PACI's activations are the S - s micro-batches in flight on stage s whatever
N is (`lit_efficient.tools.memory_plan.in_flight`), so memory depends on N only through the micro-batch size.
Without a micro-batch size (the strategy's warning) the candidates are the powers of two and the configured N.

Pure arithmetic, no torch: `lit-efficient plan` prints it with each candidate's peak memory, and the strategy
warns at setup when PACI's configured N leaves stage 0 two or more steps behind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from lit_efficient.runtime.partition import predicted_utilization
from lit_efficient.runtime.staleness import delay_bound

MAX_DRIFT = 1  # the drift bound the defaults hold within 0.3% of flush on the grid (module docstring)


def drift_bound(num_stages: int, accumulate: int) -> int:
    """Optimizer steps stage 0's forwards can be behind their backwards under PACI: ``ceil((S-1)/N)``."""
    return delay_bound("paci", 0, num_stages, accumulate)


def flush_bubble(num_stages: int, accumulate: int) -> float:
    """Idle share of each 1F1B-flush window with balanced stages: ``(S-1)/(N+S-1)`` (PACI's is 0)."""
    return 1.0 - predicted_utilization([1.0] * num_stages, accumulate, "1f1b_flush")


@dataclass(frozen=True)
class WindowChoice:
    """One candidate window N: its micro-batch at the configured global batch (None: unknown), drift bound
    under PACI, flush's bubble, and the peak bytes per device at that micro-batch (None: not estimated)."""

    accumulate: int
    micro_batch: int | None
    drift_bound: int
    flush_bubble: float
    peak: int | None = None
    fits: bool | None = None


@dataclass(frozen=True)
class WindowAdvice:
    """The recommended N for PACI at ``num_stages`` stages, against the configured one.

    Attributes:
        num_stages: S.
        accumulate: The configured N.
        micro_batch: The configured micro-batch size (None: unknown).
        replicas: Data-parallel replicas of the pipeline (the global batch is theirs together; each cuts its share).
        recommended: The smallest candidate N >= S (drift bound 1) whose micro-batch fits (or whose fit is
            unknown); None when none fits.
        choices: Every candidate considered, smallest N first.
    """

    num_stages: int
    accumulate: int
    micro_batch: int | None
    recommended: int | None
    choices: tuple[WindowChoice, ...]
    replicas: int = 1

    @property
    def drift_bound(self) -> int:
        """The configured N's drift bound."""
        return drift_bound(self.num_stages, self.accumulate)

    @property
    def too_stale(self) -> bool:
        """Whether the configured N leaves stage 0 more than ``MAX_DRIFT`` steps behind."""
        return self.drift_bound > MAX_DRIFT

    def _cut(self, n: int) -> str:
        """``N=n`` and, when known, its micro-batch at the configured global batch."""
        choice = next((c for c in self.choices if c.accumulate == n), None)
        return f"N={n}" + (f" x micro-batch {choice.micro_batch}" if choice and choice.micro_batch else "")

    def text(self) -> str:
        """The advice as a user reads it (the plan's last paragraph, the strategy's warning)."""
        s, n, best = self.num_stages, self.accumulate, self.recommended
        batch = ""
        if self.micro_batch:
            per_replica = n * self.micro_batch
            split = f": {self.replicas} replicas x {per_replica}" if self.replicas > 1 else ""
            batch = f" (global batch {self.replicas * per_replica}{split})"
        head = (
            f"Accumulation window: {self._cut(n)}{batch} with S={s} puts stage 0's forwards up to {self.drift_bound} "
            f"optimizer step{'s' if self.drift_bound != 1 else ''} behind their backwards under PACI (drift bound "
            "ceil((S-1)/N))"
        )
        if best is None and not any(c.accumulate >= s for c in self.choices):
            return (
                f"{head}. Each replica's batch has fewer than S={s} micro-batches of size 1, so no window N >= S cuts "
                "it: a larger global batch, or fewer stages, would let PACI run with drift bound 1."
            )
        if best is None:
            return (
                f"{head}. No window N >= S fits the device memory at this global batch (see the candidates); "
                "more stages, recompute or a smaller global batch would."
            )
        if self.micro_batch is not None:
            keep = " at the same global batch"
        elif best % n == 0:
            keep = f", with the micro-batch divided by {best // n} to keep the global batch"
        elif n % best == 0:
            keep = f", with the micro-batch multiplied by {n // best} to keep the global batch"
        else:
            keep = " (another global batch: keep the tokens per step, or retune the learning rate)"
        if self.too_stale:
            return (
                f"{head}. With a drift bound of 2 PACI ended 1.5-2.3% above 1F1B-flush's loss on the benchmark grid "
                f"(S=8 N=4 lr 2e-3, with its defaults; plain PACI 24.5%), with 1 within 0.3%. Recommended: "
                f"accumulate_grad_batches={best}{self._cut(best).removeprefix(f'N={best}').replace(' x ', ' with ')} "
                "(N >= S: drift bound 1)"
                f"{keep}, or schedule='1f1b_flush'."
            )
        if n == best:
            fits = " that fits" if any(c.fits is not None for c in self.choices) else ""
            return f"{head}: the recommended window (the smallest N >= S{fits})."
        return f"{head}. Recommended: {self._cut(best)}, the smallest N >= S{keep}" + (
            " (larger micro-batches: fewer, larger kernels for the same tokens per step)." if best < n else "."
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "drift_bound": self.drift_bound, "too_stale": self.too_stale}


def advise_window(
    num_stages: int,
    accumulate: int,
    micro_batch: int | None = None,
    peak_at: Callable[[int], int] | None = None,
    device_memory: int | None = None,
    replicas: int = 1,
) -> WindowAdvice:
    """The window advice for PACI at ``num_stages`` stages with the configured ``accumulate`` (module docstring).

    Args:
        num_stages: S.
        accumulate: The configured N.
        micro_batch: The configured micro-batch size: the candidates are then the N that divide the global batch
            ``accumulate * micro_batch``, each with micro-batch ``global / N``. None: powers of two and N.
        peak_at: Micro-batch size -> peak bytes per device (`lit-efficient plan`'s estimate), for the budget.
        device_memory: Bytes of one device; with ``peak_at``, a candidate fits when its peak does not exceed it.
        replicas: Data-parallel replicas of the pipeline (said in the global batch; the cut is each replica's).
    """
    if num_stages < 1 or accumulate < 1 or (micro_batch is not None and micro_batch < 1):
        raise ValueError(f"num_stages={num_stages}, accumulate={accumulate} and micro_batch={micro_batch} must be >= 1")
    if micro_batch is None:
        cuts = [(n, None) for n in sorted({2**k for k in range((4 * num_stages).bit_length() + 1)} | {accumulate})]
    else:
        total = accumulate * micro_batch
        cuts = [(n, total // n) for n in range(1, total + 1) if total % n == 0]
    choices = []
    for n, b in cuts:
        peak = peak_at(b) if peak_at is not None and b is not None else None
        fits = None if peak is None or device_memory is None else peak <= device_memory
        choices.append(WindowChoice(n, b, drift_bound(num_stages, n), flush_bubble(num_stages, n), peak, fits))
    usable = [c.accumulate for c in choices if c.accumulate >= num_stages and c.fits is not False]
    return WindowAdvice(num_stages, accumulate, micro_batch, min(usable, default=None), tuple(choices), replicas)
