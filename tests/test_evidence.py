"""A gate's verdict is a statistical statement: an engine equal to its model passes every
time, one clearly worse fails every time, one at the limit is inconclusive every time (not
at random), and a measure that cannot resolve its limit is left out, saying why."""

import numpy as np
import pytest

from components.evidence import Measure, assess, interval, looks, sequential_evidence, verdict_of
from components.gates import bleu_unresolvable, rouge_l_unresolvable

# Rows of a quality gate: agreements, positions (31 a window, as the tiny model's windows).
AGREEMENT = Measure("top1_agreement", lambda s: s[..., 0] / s[..., 1], 0.93, ">=")
POSITIONS = 31


def agreement_rows(rate: float, windows: int, seed: int) -> np.ndarray:
    """Windows whose positions agree with probability `rate`."""
    agreed = np.random.default_rng(seed).binomial(POSITIONS, rate, windows)
    return np.stack([agreed, np.full(windows, POSITIONS)], axis=-1).astype(np.float64)


def exactly_at(rate: float, windows: int, seed: int) -> np.ndarray:
    """Windows that agree `rate` of their positions in all (to the nearest position), spread
    unevenly over the windows."""
    total = round(rate * POSITIONS * windows)
    per_window = np.random.default_rng(seed).multinomial(total, np.full(windows, 1.0 / windows))
    per_window = np.minimum(per_window, POSITIONS)
    per_window[np.argmin(per_window)] += total - per_window.sum()  # what the cap took, back where there is room
    return np.stack([per_window, np.full(windows, POSITIONS)], axis=-1).astype(np.float64)


@pytest.mark.parametrize("seed", range(40))
def test_an_engine_equal_to_its_model_passes_every_time(seed):
    """It agrees at every position: whatever the windows, the interval is [1, 1]."""
    rows = agreement_rows(1.0, 32, seed)
    assert assess(rows, [AGREEMENT], 0.95, 32).verdict == "passed"


@pytest.mark.parametrize("seed", range(40))
def test_an_engine_clearly_worse_fails_every_time(seed):
    rows = agreement_rows(0.80, 32, seed)  # 13 points under the limit
    evidence = assess(rows, [AGREEMENT], 0.95, 32)
    assert evidence.verdict == "failed" and evidence.estimates["top1_agreement"].high < 0.93


@pytest.mark.parametrize("seed", range(20))
def test_an_engine_at_the_limit_is_inconclusive_every_time_and_says_nothing_settles_it(seed):
    rows = np.concatenate([exactly_at(0.93, size, seed) for size in (32, 32, 64)])  # every look's sample at the limit
    assert rows[:, 0].sum() / rows[:, 1].sum() == pytest.approx(0.93, abs=1 / (POSITIONS * 128))
    measured = []
    evidence = sequential_evidence(lambda start, stop: measured.append((start, stop)) or rows[start:stop], 32, 128, [AGREEMENT], 0.95)
    assert evidence.verdict == "inconclusive" and evidence.sequences == 128  # the whole budget spent first
    assert measured == [(0, 32), (32, 64), (64, 128)]  # doubling, each sequence measured once
    assert "settle" in evidence.to_settle("top1_agreement", 0.93)


def test_more_sequences_settle_a_verdict_the_first_look_could_not():
    """95 % agreement against a 93 % limit: 8 windows leave the interval across the limit, 64
    bring it inside."""
    rows = agreement_rows(0.95, 256, seed=0)
    evidence = sequential_evidence(lambda start, stop: rows[start:stop], 8, 256, [AGREEMENT], 0.95)
    assert assess(rows[:8], [AGREEMENT], evidence.level, 256).verdict == "inconclusive"
    assert evidence.verdict == "passed" and evidence.sequences == 64
    assert evidence.level == pytest.approx(1 - 0.05 / looks(8, 256))  # each look at a Bonferroni share of the 5 %


def test_a_gate_measures_more_only_where_the_next_sample_fits_its_time_budget_and_says_why_it_stopped():
    """At a minute a sequence, 32 first take 32 min: the next 32 would end at about 64, within
    a 90-minute budget, the 64 after them at about 128, beyond it. The gate stops there,
    inconclusive, saying so beside how many sequences would settle it."""
    rows = np.concatenate([exactly_at(0.93, size, 0) for size in (32, 32, 64)])
    measured, now = [], [0.0]

    def measure(start: int, stop: int) -> np.ndarray:
        measured.append((start, stop))
        now[0] += 60.0 * (stop - start)  # a minute a sequence
        return rows[start:stop]

    evidence = sequential_evidence(measure, 32, 128, [AGREEMENT], 0.95, minutes=90, clock=lambda: now[0])
    assert measured == [(0, 32), (32, 64)] and evidence.sequences == 64 and evidence.verdict == "inconclusive"
    assert evidence.level == pytest.approx(1 - 0.05 / looks(32, 128))  # the looks it planned: stopping early drops some
    settle = evidence.to_settle("top1_agreement", 0.93)
    assert "(measured 64, budget 128); stopped at its time budget: 64 more would take it to about 128.0 min, over its 90 (max_minutes)" in settle
    unbounded = sequential_evidence(lambda start, stop: rows[start:stop], 32, 128, [AGREEMENT], 0.95, minutes=None)
    assert unbounded.sequences == 128 and unbounded.stopped is None


def test_a_decided_gate_stops_at_its_first_sample_whatever_its_time_budget():
    rows = agreement_rows(1.0, 64, seed=0)
    evidence = sequential_evidence(lambda start, stop: rows[start:stop], 32, 64, [AGREEMENT], 0.95, minutes=1e-9)
    assert evidence.verdict == "passed" and evidence.sequences == 32 and evidence.stopped is None


def test_looks_count_the_doublings_up_to_the_budget():
    assert [looks(32, b) for b in (32, 33, 64, 100, 128, 129)] == [1, 2, 2, 3, 3, 4]


def test_verdicts_by_interval_and_direction_with_inclusive_limits():
    assert verdict_of(0.95, 0.99, 0.95, ">=") == "passed"
    assert verdict_of(0.90, 0.94, 0.95, ">=") == "failed"
    assert verdict_of(0.94, 0.96, 0.95, ">=") == "inconclusive"
    assert verdict_of(1.0, 2.0, 2.0, "<=") == "passed"
    assert verdict_of(2.5, 3.0, 2.0, "<=") == "failed"
    assert verdict_of(1.5, 2.5, 2.0, "<=") == "inconclusive"


def test_the_interval_resamples_sequences_in_pairs_and_is_the_same_every_time():
    """A constant shift between the two columns has no spread when paired; noise does, as
    about 1.96 standard errors of the mean drop say."""
    rng = np.random.default_rng(1)
    theirs = rng.uniform(0.1, 0.3, 400)
    drop = lambda s: 100.0 * (s[..., 1] - s[..., 0]) / s[..., 1]  # noqa: E731
    assert interval(np.stack([theirs * 0.97, theirs], -1), drop, 0.95) == pytest.approx((3.0, 3.0))
    noisy = np.stack([theirs * 0.97 + rng.normal(0, 0.05, 400), theirs], -1)
    low, high = interval(noisy, drop, 0.95)
    assert low < float(drop(noisy.sum(0))) < high and 3 < high - low < 12
    assert interval(noisy, drop, 0.95) == (low, high) and interval(noisy, drop, 0.95, seed=2) != (low, high)


def test_a_measure_that_cannot_resolve_its_limit_is_reported_and_left_out_with_the_reason():
    shaky = Measure("shaky", lambda s: s[..., 0] / s[..., 1], 0.5, ">=", unresolvable=lambda s, limit: "too few events")
    rows = agreement_rows(0.2, 16, seed=0)  # far below its limit: would fail
    evidence = assess(rows, [AGREEMENT, shaky], 0.95, 16)
    assert evidence.excluded == {"shaky": "too few events"} and evidence.estimates["shaky"].verdict == "failed"
    assert evidence.verdict == "failed"  # decided by the agreement alone, which fails here too
    passing = assess(agreement_rows(1.0, 16, seed=0), [AGREEMENT, Measure("shaky", lambda s: 0 * s[..., 0], 0.5, ">=", lambda s, limit: "too few")], 0.95, 16)
    assert passing.verdict == "passed"  # the shaky measure, beyond its limit, does not decide


def test_bleu_over_a_handful_of_4_gram_matches_cannot_resolve_a_2_percent_limit():
    """BLEU is a geometric mean: with 1 matched 4-gram, one more moves it by 2^(1/4) - 1 ≈ 19 %."""
    from components.metrics.bleu import COLUMNS

    few = np.zeros(COLUMNS)
    few[:2] = 400, 400  # hypothesis and reference lengths
    few[2:6] = 200, 60, 12, 1  # matched 1..4-grams
    few[6:10] = 400, 390, 380, 370  # hypothesis n-grams
    reason = bleu_unresolvable(few, 2.0)
    assert reason is not None and "share 1 4-grams" in reason and "18.9 %" in reason and "limit of 2 %" in reason
    assert bleu_unresolvable(few, 25.0) is None  # a limit it can resolve
    many = few.copy()
    many[5] = 200  # one match more moves it 0.12 %
    assert bleu_unresolvable(many, 2.0) is None
    nothing = few.copy()
    nothing[2:6] = 0  # not a word in common: BLEU 0
    assert "its BLEU is 0" in bleu_unresolvable(nothing, 2.0)


def test_rouge_l_near_0_cannot_resolve_a_2_percent_limit_and_is_left_out_instead_of_asking_for_millions_of_sequences():
    """A random model's continuations score ROUGE-L near 0 against held-out text: 128 of
    them at 0.01 sum to 1.28, where one word more in one 32-token continuation moves the mean
    by ~2.4 %; a trained model's (0.2 each) resolve 2 % easily."""
    reason = rouge_l_unresolvable(128 * 0.01, 32, 2.0)
    assert reason == "the model's continuations score ROUGE-L 1.28 in all against the held-out text: one word more in one continuation moves it by about 2.44 %, more than its limit of 2 %"
    assert rouge_l_unresolvable(128 * 0.01, 32, 5.0) is None  # a limit it can resolve
    assert rouge_l_unresolvable(128 * 0.2, 32, 2.0) is None
    assert "its ROUGE-L is 0" in rouge_l_unresolvable(0.0, 32, 2.0)


def test_bleu_from_summed_sentence_counts_is_nltks_corpus_bleu():
    from nltk.translate.bleu_score import SmoothingFunction, corpus_bleu

    from components.metrics import load_metric

    rng = np.random.default_rng(0)
    words = "the a list type of is in and to for with on".split()
    for _ in range(20):
        n = int(rng.integers(1, 10))
        predictions = [" ".join(rng.choice(words, rng.integers(0, 12))) for _ in range(n)]
        references = [" ".join(rng.choice(words, rng.integers(1, 12))) for _ in range(n)]
        ours = load_metric("bleu").compute(predictions=predictions, references=references)
        nltk = corpus_bleu([[r.split()] for r in references], [p.split() for p in predictions], smoothing_function=SmoothingFunction().method1)
        assert ours["bleu"] == pytest.approx(nltk, abs=1e-12) and ours["counts"].shape == (n, 10)
