"""ROUGE-L: longest-common-subsequence F-measure between candidate and reference texts,
from Google's `rouge_score` (the implementation the Hub's `rouge` module wraps)."""

import datasets
import evaluate
from rouge_score import rouge_scorer

_DESCRIPTION = "Mean ROUGE-L F-measure of each prediction against its reference (rouge_score, stemmed)."
_INPUTS = """
Args:
    predictions: candidate texts.
    references: one reference text per candidate.
Returns:
    rouge_l: the mean F-measure, in [0, 1].
    rouge_l_scores: each prediction's F-measure (for paired statistics over sequences).
"""


class RougeL(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Lin, ROUGE: A Package for Automatic Evaluation of Summaries, 2004",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references):
        scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
        scores = [scorer.score(reference, prediction)["rougeL"].fmeasure for prediction, reference in zip(predictions, references, strict=True)]
        return {"rouge_l": float(sum(scores) / len(scores)) if scores else 0.0, "rouge_l_scores": scores}
