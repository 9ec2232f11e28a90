"""Corpus BLEU (up to 4-grams, whitespace tokens) from NLTK, smoothed so that short texts
with no 4-gram match score above zero (Chen & Cherry's method 1)."""

import datasets
import evaluate
from nltk.translate.bleu_score import SmoothingFunction, corpus_bleu

_DESCRIPTION = "Corpus-level BLEU of the predictions against one reference each (NLTK, smoothing method 1)."
_INPUTS = """
Args:
    predictions: candidate texts.
    references: one reference text per candidate.
Returns:
    bleu: in [0, 1].
"""


class Bleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Papineni et al., BLEU: a Method for Automatic Evaluation of Machine Translation, 2002",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references):
        hypotheses = [prediction.split() for prediction in predictions]
        reference_lists = [[reference.split()] for reference in references]
        return {"bleu": float(corpus_bleu(reference_lists, hypotheses, smoothing_function=SmoothingFunction().method1))}
