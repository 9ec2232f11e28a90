"""Top-1 agreement: the fraction of positions where two models pick the same next token."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Fraction of positions where the candidate's argmax token equals the reference's."
_INPUTS = """
Args:
    predictions: argmax token ids of the candidate (an engine), one per position.
    references: argmax token ids of the reference model at the same positions.
Returns:
    top1_agreement: a fraction in [0, 1].
"""


class Top1Agreement(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        return {"top1_agreement": float((predictions == references).mean())}
