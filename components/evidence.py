"""Gate verdicts as statistical statements. A gate that compares an engine with a model on a
sample of sequences measures both on the same sequences, keeps per-sequence sums (the
sufficient statistics of each measure) and resamples the sequences in pairs: the
bootstrap's percentile interval of each measure, against its limit, decides.

- passed: the whole interval is within the limit;
- failed: the whole interval is beyond it;
- inconclusive: it straddles the limit. The gate then measures more sequences, up to its
  budget; if that does not settle it, the verdict stays inconclusive and blocks the alias
  like a failure, saying how many sequences would settle it.

A gate looks at its sample up to `looks` times (first sample, then doubled), so each look's
interval is drawn at a Bonferroni-corrected level: over all looks, an engine whose measure
lies within its limit fails with at most 1 - confidence probability.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

Direction = Literal["<=", ">="]
Verdict = Literal["passed", "failed", "inconclusive"]
RESAMPLES = 2000


@dataclass(frozen=True)
class Measure:
    """One measure of a gate: `statistic` maps column sums of the per-sequence table
    (shape (..., columns)) to the measure, vectorised over the leading axis; `limit` bounds
    it in `direction`. `unresolvable` says why a sample cannot resolve the limit at all (the
    measure is then reported and left out of the verdict), or None."""

    name: str
    statistic: Callable[[np.ndarray], np.ndarray]
    limit: float
    direction: Direction
    unresolvable: Callable[[np.ndarray, float], str | None] = lambda sums, limit: None


@dataclass(frozen=True)
class Estimate:
    value: float
    low: float
    high: float
    verdict: Verdict


@dataclass(frozen=True)
class Evidence:
    """Every measure's estimate on the sequences measured, and the measures left out."""

    estimates: dict[str, Estimate]
    excluded: dict[str, str]  # measure → why its sample cannot resolve its limit
    sequences: int
    budget: int
    level: float  # the confidence of each interval (the gate's, corrected for its looks)
    totals: np.ndarray  # the column sums of every sequence measured
    stopped: str | None = None  # why it measured no more while undecided, before its budget

    @property
    def verdict(self) -> Verdict:
        verdicts = {e.verdict for name, e in self.estimates.items() if name not in self.excluded}
        return "failed" if "failed" in verdicts else "inconclusive" if "inconclusive" in verdicts else "passed"

    def to_settle(self, measure: str, limit: float) -> str:
        """How many sequences would settle an inconclusive measure: the interval narrows as
        one over the square root of the sample."""
        estimate = self.estimates[measure]
        margin, half_width = abs(estimate.value - limit), (estimate.high - estimate.low) / 2
        stopped = f"; {self.stopped}" if self.stopped else ""
        if margin == 0:
            return f"no sample size settles it: the estimate lies on the limit{stopped}"
        needed = math.ceil(self.sequences * (half_width / margin) ** 2)
        return f"about {needed} sequences would settle it (measured {self.sequences}, budget {self.budget}){stopped}"


def interval(rows: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray], level: float, seed: int = 0) -> tuple[float, float]:
    """The paired bootstrap's percentile interval of `statistic` over the rows (sequences):
    each resample draws the sequences with replacement, every column of a row together."""
    weights = np.random.default_rng(seed).multinomial(len(rows), np.full(len(rows), 1.0 / len(rows)), size=RESAMPLES)
    values = statistic(weights.astype(np.float64) @ rows)
    tail = 100.0 * (1.0 - level) / 2
    low, high = np.percentile(values, [tail, 100.0 - tail])
    return float(low), float(high)


def verdict_of(low: float, high: float, limit: float, direction: Direction) -> Verdict:
    within, beyond = (high <= limit, low > limit) if direction == "<=" else (low >= limit, high < limit)
    return "passed" if within else "failed" if beyond else "inconclusive"


def assess(rows: np.ndarray, measures: Sequence[Measure], level: float, budget: int) -> Evidence:
    """Each measure's value and interval on these rows, and the measures they cannot resolve."""
    sums = rows.sum(axis=0)
    estimates, excluded = {}, {}
    for measure in measures:
        value = float(measure.statistic(sums[None])[0])
        low, high = interval(rows, measure.statistic, level)
        low, high = min(low, value), max(high, value)  # the estimate lies in its own interval
        estimates[measure.name] = Estimate(value, low, high, verdict_of(low, high, measure.limit, measure.direction))
        reason = measure.unresolvable(sums, measure.limit)
        if reason:
            excluded[measure.name] = reason
    return Evidence(estimates, excluded, len(rows), budget, level, sums)


def looks(first: int, budget: int) -> int:
    """How many times a gate that starts with `first` sequences and doubles up to `budget` looks."""
    return 1 + (math.ceil(math.log2(budget / first)) if budget > first else 0)


def sequential_evidence(
    measure_rows: Callable[[int, int], np.ndarray],
    first: int,
    budget: int,
    measures: Sequence[Measure],
    confidence: float,
    minutes: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Evidence:
    """Measure sequences [0, first), assess; while inconclusive, measure up to twice as many
    (never past `budget`, nor past `minutes` of measuring at the pace so far) and assess the
    whole sample again. `measure_rows(start, stop)` returns the per-sequence table of
    sequences start..stop. Stopping early only drops looks, so each look's level still holds."""
    first = min(first, budget)
    level = 1.0 - (1.0 - confidence) / looks(first, budget)
    start = clock()
    rows = measure_rows(0, first)
    while True:
        evidence = assess(rows, measures, level, budget)
        if evidence.verdict != "inconclusive" or len(rows) >= budget:
            return evidence
        more = min(2 * len(rows), budget) - len(rows)
        stopped = _out_of_time(clock() - start, len(rows), more, minutes)
        if stopped:
            return replace(evidence, stopped=stopped)
        rows = np.concatenate([rows, measure_rows(len(rows), len(rows) + more)])


def measure_ahead(measure_rows: Callable[[int, int], np.ndarray], first: int, budget: int, minutes: float | None = None, clock: Callable[[], float] = time.monotonic) -> np.ndarray:
    """The rows sequential_evidence could ask for at most, measured in the slices it would ask
    for them ([0, first), then doubling up to `budget`), stopping where the next slice would
    take the whole past `minutes` at the pace so far: for a side that must be measured before
    the other is at hand (components.reference)."""
    first = min(first, budget)
    start = clock()
    rows = measure_rows(0, first)
    while len(rows) < budget:
        more = min(2 * len(rows), budget) - len(rows)
        if _out_of_time(clock() - start, len(rows), more, minutes):
            break
        rows = np.concatenate([rows, measure_rows(len(rows), len(rows) + more)])
    return rows


def _out_of_time(elapsed_s: float, measured: int, more: int, minutes: float | None) -> str | None:
    """Why `more` sequences do not fit the time budget at the pace of the first `measured`, or None."""
    if minutes is None:
        return None
    projected = elapsed_s + elapsed_s / measured * more
    if projected <= minutes * 60.0:
        return None
    return f"stopped at its time budget: {more} more would take it to about {projected / 60:.1f} min, over its {minutes:g} (max_minutes)"
