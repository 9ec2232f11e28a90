"""How the next token is picked from a row of logits: greedy, or nucleus sampling."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    """How to pick the next token: temperature 0 is greedy; otherwise nucleus sampling."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_at_eos: bool = True

    @property
    def greedy(self) -> bool:
        """Picks the argmax and draws no random numbers (so needs no generator)."""
        return self.temperature <= 0


def pick_next(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> np.ndarray:
    """Greedy at temperature 0; else nucleus sampling with temperature and top_p."""
    if sampling.greedy:
        return logits.argmax(-1).astype(np.int64)
    scaled = logits.astype(np.float64) / sampling.temperature
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.array([_nucleus(row, sampling.top_p, rng) for row in probs], np.int64)


def _nucleus(probs: np.ndarray, top_p: float, rng: np.random.Generator) -> int:
    order = np.argsort(-probs)
    cumulative = np.cumsum(probs[order])
    keep = order[: int(np.searchsorted(cumulative, top_p) + 1)]
    kept = probs[keep] / probs[keep].sum()
    return int(keep[rng.choice(len(keep), p=kept)])


def pick_each(logits: np.ndarray, samplings: list[Sampling], rngs: list[np.random.Generator | None]) -> np.ndarray:
    """Row i of a batch picked with its own `samplings[i]` and `rngs[i]` (continuous
    batching mixes requests); greedy rows are picked together in one argmax and need no
    generator (None)."""
    picked = logits.argmax(-1).astype(np.int64)
    for row, (sampling, rng) in enumerate(zip(samplings, rngs, strict=True)):
        if not sampling.greedy:
            picked[row] = pick_next(logits[row : row + 1], sampling, rng)[0]
    return picked
