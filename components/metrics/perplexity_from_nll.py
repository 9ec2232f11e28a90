"""Perplexity from per-token negative log-likelihoods (the Hub's `perplexity` metric loads
a model by hub id; the gates already have the log-probabilities)."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "exp(mean negative log-likelihood) over every scored token."
_INPUTS = """
Args:
    predictions: negative log-likelihood (natural log) of each target token.
Returns:
    perplexity: exp of their mean; mean_nll: their mean.
"""


class PerplexityFromNll(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("float64")}),
        )

    def _compute(self, predictions):
        mean_nll = float(np.mean(predictions))
        return {"perplexity": float(np.exp(mean_nll)), "mean_nll": mean_nll}
