"""What a decode step of more rows costs, from the engine's own steps: the price of verifying
drafts, against which a sequence's draft length is chosen (speculator.DraftLength).

On an MoE a verified position may wake experts no other row needs, and every row adds its
products; how much that costs depends on the model and the CPU, so it is measured: the mean
duration of decode-only steps by their number of rows, each an exponentially weighted
average. Until a row count has been seen often enough, a prior stands in for it (the demo MoE's
cost per extra row with batch-invariant tiles, AMD EPYC: 1.21x a one-row step at two rows,
1.58x at five; CPU time, interleaved).
"""

from __future__ import annotations

PRIOR_PER_ROW = 0.15  # a step's cost per extra decode row, as a share of a one-row step
MIN_SEEN = 4  # steps of a row count before its measured mean replaces the prior
WEIGHT = 0.1  # of each new step in its row count's mean


class StepCost:
    """Relative cost of decode steps by their rows. `batch`: the sequences the coming step
    runs (the speculator sets it before drafting), each at least one row."""

    __slots__ = ("batch", "mean", "seen")

    def __init__(self) -> None:
        self.batch = 1
        self.mean: dict[int, float] = {}  # seconds of a decode-only step of r rows
        self.seen: dict[int, int] = {}

    def observe(self, rows: int, seconds: float) -> None:
        """One decode-only step (no prefill in it) of `rows` rows took `seconds`."""
        if rows < 1 or seconds <= 0.0:
            return
        n = self.seen.get(rows, 0)
        self.seen[rows] = n + 1
        old = self.mean.get(rows)
        self.mean[rows] = seconds if old is None else old + WEIGHT * (seconds - old)

    def ratio(self, rows: int, base: int) -> float:
        """A step of `rows` rows over one of `base` rows: measured where both counts have been
        seen MIN_SEEN times, else the prior."""
        if self.seen.get(rows, 0) >= MIN_SEEN and self.seen.get(base, 0) >= MIN_SEEN:
            return self.mean[rows] / self.mean[base]
        return (1.0 + PRIOR_PER_ROW * (rows - 1)) / (1.0 + PRIOR_PER_ROW * (base - 1))
