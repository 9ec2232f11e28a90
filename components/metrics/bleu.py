"""Corpus BLEU (up to 4-grams, whitespace tokens) as NLTK computes it, smoothed so that short
texts with no 4-gram match score above zero (Chen & Cherry's method 1), from each
sentence's n-gram counts: NLTK's `corpus_bleu` gives no per-sentence counts, and the gates'
bootstrap resamples sentences and needs BLEU of any sum of them (`bleu_from_counts`)."""

import datasets
import evaluate
import numpy as np
from nltk.translate.bleu_score import closest_ref_length, modified_precision

ORDERS = 4
EPSILON = 0.1  # NLTK's SmoothingFunction().method1
# One row per sentence: hypothesis length, closest reference length, matched n-grams for
# n = 1..4 (clipped), then the hypothesis's n-grams for n = 1..4 (at least 1, as NLTK counts).
COLUMNS = 2 + 2 * ORDERS
MATCHED_4GRAMS = 1 + ORDERS  # the column of matched n-grams of the highest order

_DESCRIPTION = "Corpus-level BLEU of the predictions against one reference each (NLTK's formula, smoothing method 1)."
_INPUTS = """
Args:
    predictions: candidate texts.
    references: one reference text per candidate.
Returns:
    bleu: in [0, 1].
    counts: each sentence's n-gram counts (rows of `COLUMNS`); BLEU of any subset is `bleu_from_counts` of their sum.
"""


def sentence_counts(prediction: str, reference: str) -> list[int]:
    hypothesis, references = prediction.split(), [reference.split()]
    precisions = [modified_precision(references, hypothesis, n) for n in range(1, ORDERS + 1)]
    return [len(hypothesis), closest_ref_length(references, len(hypothesis))] + [p.numerator for p in precisions] + [p.denominator for p in precisions]


def bleu_from_counts(sums: np.ndarray) -> np.ndarray:
    """Corpus BLEU from summed sentence counts, vectorised over leading axes (..., COLUMNS)."""
    hypothesis, reference = sums[..., 0], sums[..., 1]
    matched, total = sums[..., 2 : 2 + ORDERS], sums[..., 2 + ORDERS :]
    precision = np.where(matched > 0, matched, EPSILON) / np.maximum(total, 1)
    geometric = np.exp(np.log(precision).mean(axis=-1))
    with np.errstate(divide="ignore"):
        brevity = np.where(hypothesis > reference, 1.0, np.exp(1.0 - reference / np.maximum(hypothesis, 1e-300)))
    return np.where((matched[..., 0] == 0) | (hypothesis == 0), 0.0, brevity * geometric)


class Bleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Papineni et al., BLEU: a Method for Automatic Evaluation of Machine Translation, 2002",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references):
        counts = np.array([sentence_counts(p, r) for p, r in zip(predictions, references, strict=True)], np.float64).reshape(-1, COLUMNS)
        return {"bleu": float(bleu_from_counts(counts.sum(axis=0))), "counts": counts}
