"""How the next token is picked from a row of logits: greedy, or nucleus sampling."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from components.runtime.grammar import Constraint


@dataclass(frozen=True)
class Sampling:
    """How to pick the next token: temperature 0 is greedy; otherwise nucleus sampling."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_at_eos: bool = True
    # OpenAI's `n`: choice i of a request draws from stream i of its seed (stream 0 is the
    # seed's own, so a choice of n=1 and the first of n=3 sample alike).
    seed_stream: int = 0
    # Log probabilities reported per generated token: the chosen one's and this many
    # alternatives (0: none); None: not asked, nothing computed.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (`echo`)
    # What the tokens must spell, in llguidance's grammar form (runtime.grammar): only the
    # tokens it allows are drawn, and the sequence ends when it is complete. None: any text.
    grammar: str | None = None

    def __post_init__(self) -> None:
        # Checked here, not at the first draw: in a batch, a sampling that fails mid-step
        # would fail every request the step carries.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0 (numpy's generators take no negative seeds), not {self.seed}")

    def generator(self) -> np.random.Generator:
        """This sampling's random stream (see `seed_stream`); from the OS's entropy when unseeded."""
        if self.seed is None or self.seed_stream == 0:
            return np.random.default_rng(self.seed)
        return np.random.default_rng([self.seed, self.seed_stream])

    @property
    def greedy(self) -> bool:
        """Picks the argmax and draws no random numbers (so needs no generator)."""
        return self.temperature <= 0


@dataclass(eq=False)
class Draws:
    """One sequence's random stream as an engine's steps use it: its sampling, and how many
    tokens it has drawn. Host engines draw from a numpy generator; device engines from a
    counter-based stream keyed by `key` (runtime.torch_sampling), where draw n is the same
    whatever batch or turn the sequence is in."""

    sampling: Sampling
    drawn: int = 0
    constraint: Constraint | None = None  # the sampling's grammar as it advances (made by the engine)
    _rng: np.random.Generator | None = field(default=None, repr=False)
    _key: int | None = field(default=None, repr=False)

    @property
    def rng(self) -> np.random.Generator:
        """Made on first use, and used only by rows that sample: greedy sequences never
        draw, and seeding one from the OS's entropy takes ~10 µs, more than the rest of a
        sequence's submit."""
        if self._rng is None:
            self._rng = self.sampling.generator()
        return self._rng

    @property
    def key(self) -> int:
        """A 62-bit key: from the seed and `seed_stream`, or from the OS's entropy when unseeded."""
        if self._key is None:
            seed = self.sampling.seed
            self._key = secrets.randbits(62) if seed is None else (seed * 1_000_003 + self.sampling.seed_stream) % (1 << 62)
        return self._key


def pick_next(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> np.ndarray:
    """Greedy at temperature 0; else nucleus sampling with temperature and top_p."""
    if sampling.greedy:
        return logits.argmax(-1).astype(np.int64)
    # The maximum comes off before the temperature divides: a tiny temperature then sends the
    # rest to -inf (probability 0) instead of every logit to inf (inf - inf: NaN).
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    with np.errstate(over="ignore"):  # -inf, on purpose
        probs = np.exp(shifted / sampling.temperature)
    probs /= probs.sum(-1, keepdims=True)
    return np.array([_nucleus(row, sampling.top_p, rng) for row in probs], np.int64)


def _nucleus(probs: np.ndarray, top_p: float, rng: np.random.Generator) -> int:
    order = np.argsort(-probs)
    cumulative = np.cumsum(probs[order])
    keep = order[: int(np.searchsorted(cumulative, top_p) + 1)]
    kept = probs[keep] / probs[keep].sum()
    return int(keep[rng.choice(len(keep), p=kept)])


def pick_each(logits: np.ndarray, samplings: list[Sampling], rngs: list[np.random.Generator | None]) -> tuple[np.ndarray, dict[int, str]]:
    """Row i of a batch picked with its own `samplings[i]` and `rngs[i]` (continuous
    batching mixes requests); greedy rows are picked together in one argmax and need no
    generator (None). A row whose draw fails is named in the second value with the reason,
    and the others keep their tokens: one request's sampling is not the batch's fault."""
    picked = logits.argmax(-1).astype(np.int64)
    failed: dict[int, str] = {}
    for row, (sampling, rng) in enumerate(zip(samplings, rngs, strict=True)):
        if not sampling.greedy:
            try:
                picked[row] = pick_next(logits[row : row + 1], sampling, rng)[0]
            except ValueError as err:  # numpy's word for probabilities it cannot draw from (NaN logits)
                failed[row] = f"sampling failed: {err}"
    return picked, failed
