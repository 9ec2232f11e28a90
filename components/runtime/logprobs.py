"""Log probabilities of tokens, from the logits of the step that chose them.

They are the log-softmax of the model's own logits, before temperature and top-p (vLLM's
default, `raw_logprobs`), so a token's log probability means the same whatever the request
sampled with; under a grammar, of the logits its mask left (what the choice was made from).
Computed only for sequences that ask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class TokenLogprob(NamedTuple):
    """A token's log probability and the `k` most likely tokens at its step, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of logits → rows of log probabilities. The normalizer is summed in float64: a
    vocabulary of 50 k float32 terms loses ~1e-5 otherwise, and the fp32 engine's log
    probabilities are meant to match Hugging Face's to 1e-4."""
    rows = logits.astype(np.float32, copy=False)
    shifted = rows - rows.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True, dtype=np.float64)).astype(np.float32)


def logprobs_of(logits: np.ndarray, chosen: Sequence[int], top: int) -> list[TokenLogprob]:
    """For each row of `logits` (vocab wide), the log probability of `chosen[row]` and the
    `top` most likely tokens (0: none)."""
    logprobs = log_softmax(logits)
    picked = logprobs[np.arange(len(chosen)), np.asarray(chosen, np.int64)].tolist()
    if top <= 0:
        return [TokenLogprob(p, ()) for p in picked]
    best = np.argpartition(-logprobs, top - 1, axis=-1)[:, :top]
    best_lp = np.take_along_axis(logprobs, best, -1)
    order = np.argsort(-best_lp, axis=-1, kind="stable")
    best, best_lp = np.take_along_axis(best, order, -1).tolist(), np.take_along_axis(best_lp, order, -1).tolist()
    # A grammar's forbidden tokens are -inf: never listed, though fewer than `top` remain.
    return [TokenLogprob(p, tuple((i, lp) for i, lp in zip(ids, lps, strict=True) if lp > -np.inf)) for p, ids, lps in zip(picked, best, best_lp, strict=True)]
