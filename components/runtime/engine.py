"""The one `Engine` interface: prefill, decode and generate over a KV cache.

A backend supplies `forward` (one call of the exported graph); everything above it —
padding, positions, the cache's growth, sampling, stopping — lives here once, so the gates
and the server drive every backend through the same code: what was gated is what is served.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from components.engine_dir import LOGITS_POSITIONS, EngineDir
from components.errors import ShapeOutOfProfile
from components.runtime.grammar import MaskClock
from components.runtime.logprobs import TokenLogprob, logprobs_of
from components.runtime.sampling import Draws, Sampling, pick_each, pick_next


@dataclass
class DecodeState:
    """What a decode step needs: the cache, the mask over it, and each row's last position."""

    cache: list[np.ndarray]
    attention_mask: np.ndarray  # (batch, past_length), int64
    last_position: np.ndarray  # (batch, 1), int64

    @property
    def past_length(self) -> int:
        return self.attention_mask.shape[1]

    # Continuous batching: rows join and leave between steps. Every row is its padding
    # (mask 0) followed by its real tokens (mask 1), right-aligned; the cache is
    # (batch, heads, past, head_dim) per tensor, padded the same way.

    def joined(self, other: DecodeState) -> DecodeState:
        """This batch's rows followed by `other`'s, the shorter side padded on the left."""
        width = max(self.past_length, other.past_length)
        return DecodeState(
            [_stacked_right_aligned(a, b, width, axis=2) for a, b in zip(self.cache, other.cache, strict=True)],
            _stacked_right_aligned(self.attention_mask, other.attention_mask, width, axis=1),
            np.concatenate([self.last_position, other.last_position]),
        )

    def put(self, slot: int, other: DecodeState, row: int) -> None:
        """Row `row` of `other` into row `slot` of this batch, in place, right-aligned (a new
        sequence taking a finished one's slot: no copy of the rest of the batch). `other`
        must be no wider than this batch."""
        pad = self.past_length - other.past_length
        for mine, theirs in zip(self.cache, other.cache, strict=True):
            mine[slot, :, :pad] = 0
            mine[slot, :, pad:] = theirs[row]
        self.attention_mask[slot, :pad] = 0
        self.attention_mask[slot, pad:] = other.attention_mask[row]
        self.last_position[slot] = other.last_position[row]

    def rows(self, keep: list[int]) -> DecodeState:
        """Only the rows `keep`, without the leading columns no remaining row attends to."""
        mask = self.attention_mask[keep]
        start = int(np.argmax(mask.any(axis=0))) if mask.size else self.past_length
        # One indexing expression per tensor: a contiguous copy of just the kept part (the
        # runtime would copy a strided view again before the next step).
        return DecodeState([c[keep, :, start:] for c in self.cache], mask[:, start:], self.last_position[keep])


def _stacked_right_aligned(top: np.ndarray, bottom: np.ndarray, width: int, axis: int) -> np.ndarray:
    """`top`'s rows over `bottom`'s, each right-aligned in `width` along `axis`, zeros to the
    left: one allocation, one copy of each and zeros only where they go (a join runs
    between decode steps, on the server's hot path; np.pad then np.concatenate copied every
    cache twice, and zero-filling the whole output first wrote it twice)."""
    shape = list(top.shape)
    shape[0], shape[axis] = len(top) + len(bottom), width
    out = np.empty(shape, top.dtype)
    for rows, part in ((slice(0, len(top)), top), (slice(len(top), None), bottom)):
        pad = width - part.shape[axis]
        region = [rows] + [slice(None)] * (top.ndim - 1)
        region[axis] = slice(pad, None)
        out[tuple(region)] = part
        region[axis] = slice(0, pad)
        out[tuple(region)] = 0
    return out


_ONLY_POSITION = np.zeros(1, np.int64)  # a decode step's one new position


@dataclass(frozen=True)
class Picked:
    """The tokens a turn picked: (rows, steps); for the rows that asked, their log
    probabilities (one per step); rows whose draw failed, with the reason (their tokens
    mean nothing)."""

    tokens: np.ndarray
    logprobs: dict[int, list[TokenLogprob]]
    failed: dict[int, str]


class Engine(ABC):
    """A loaded engine. Use it as a context manager (or call `close`) to free what the
    backend holds: a session, device buffers, streams."""

    # Decode steps one `decode_turn` may take (the scheduler chooses how many; see there).
    max_turn_steps = 16
    # A prefill can go on from a prefix cache's hit (`prefill_after`, `kv_of`).
    continues_prefills = True

    @property
    def turn_queued(self) -> bool:
        """A turn of the running rows is queued on the device (`decode_turn`'s `room`): the
        next call takes it. Host engines queue none."""
        return False

    def __init__(self, engine_dir: EngineDir) -> None:
        self.engine_dir = engine_dir
        self.manifest = engine_dir.manifest
        self.mask_clock = MaskClock()  # time spent on grammars' masks, read by the server's metrics

    def close(self) -> None:
        """Release the backend's resources; the engine is unusable afterwards."""

    def runtime_settings(self) -> dict[str, str]:
        """How this engine runs, in the terms that change its speed (a gate's timings are
        recorded with them): the backend and, where the backend has them, its threads."""
        return {"runtime": f"{self.manifest.backend} {self.manifest.backend_version}"}

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @abstractmethod
    def forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        cache: list[np.ndarray],
        logits_positions: np.ndarray | None = None,
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One call of the graph: logits (batch, kept positions, vocab) and the grown cache.
        `logits_positions`: the sequence positions whose logits are wanted (None: all);
        a graph without that input (exported before it) returns all of them."""

    # ------------------------------------------------------------ phases

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, every_position: bool = False) -> tuple[np.ndarray, DecodeState]:
        """Context phase on left-padded prompts; returns the last position's logits (batch,
        1, vocab), or every position's, and the decode state."""
        self._check_context(input_ids.shape)
        positions = np.clip(attention_mask.cumsum(-1) - 1, 0, None).astype(np.int64)
        kept = None if every_position else np.array([input_ids.shape[1] - 1], np.int64)
        logits, cache = self.forward(input_ids, attention_mask, positions, self._empty_cache(len(input_ids)), kept)
        if not every_position and logits.shape[1] > 1:  # a graph that computes every position
            logits = logits[:, -1:]
        return logits, DecodeState(cache, attention_mask, positions[:, -1:])

    def extend(self, state: DecodeState, new_ids: list[int]) -> tuple[np.ndarray, DecodeState]:
        """One sequence's prefill continued after a cache it already has (the prefix of a
        prompt computed before): `new_ids` at the positions after `state`'s, attending to its
        cache; the last position's logits (1, 1, vocab) and the grown state. One row only:
        ONNX Runtime's GroupQueryAttention takes several new tokens after a past at batch 1
        alone. What a prefix cache prefills a hit's uncached suffix with."""
        if state.attention_mask.shape[0] != 1 or not new_ids:
            raise ShapeOutOfProfile(f"extend takes one row and at least one new token, not {state.attention_mask.shape[0]} rows and {len(new_ids)} tokens")
        self._check_context((1, len(new_ids)))
        self._check_total(state.past_length + len(new_ids))
        ids = np.asarray([new_ids], np.int64)
        mask = np.concatenate([state.attention_mask, np.ones_like(ids)], axis=1)
        positions = state.last_position + 1 + np.arange(len(new_ids), dtype=np.int64)[None]
        logits, cache = self.forward(ids, mask, positions, state.cache, np.array([len(new_ids) - 1], np.int64))
        if logits.shape[1] > 1:  # a graph that computes every position
            logits = logits[:, -1:]
        return logits, DecodeState(cache, mask, positions[:, -1:])

    def prefill_after(self, cached: list[np.ndarray], new_ids: list[int]) -> tuple[np.ndarray, DecodeState]:
        """A prompt whose first tokens' KV `cached` holds (a prefix cache's hit: each part (1,
        kv heads, tokens, head dim), in `kv_of`'s order), prefilled from there: the last
        position's logits (1, 1, vocab) and the sequence's state."""
        tokens = cached[0].shape[2]
        return self.extend(DecodeState(cached, np.ones((1, tokens), np.int64), np.array([[tokens - 1]], np.int64)), new_ids)

    def prefill_after_each(self, hits: list[tuple[list[np.ndarray], list[int]]]) -> tuple[np.ndarray, DecodeState]:
        """Several prompts, each `(cached, new_ids)` as `prefill_after` takes them, in order:
        their last positions' logits (rows, 1, vocab) and their state. Here one after the
        other; torch-cuda prefills them in one pass."""
        results = [self.prefill_after(cached, new_ids) for cached, new_ids in hits]
        state = results[0][1]
        for _, other in results[1:]:
            state = state.joined(other)
        return np.concatenate([logits for logits, _ in results]), state

    def kv_of(self, state: DecodeState, row: int, tokens: int) -> list[np.ndarray]:
        """The KV of a row's first `tokens` positions (views; a prefix cache copies what it
        keeps), each part (1, kv heads, tokens, head dim). A row is left-padded: its
        positions are its last ones."""
        start = state.past_length - int(state.attention_mask[row].sum())
        return [part[row : row + 1, :, start : start + tokens] for part in state.cache]

    def prefix_cache_budget(self, requested: int) -> int:
        """The bytes a prefix cache of `requested` may hold here (host memory: all of them)."""
        return requested

    def score(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Every position's logits (batch, sequence, vocab) of left-padded rows: what the
        quality gates compare with the PyTorch model."""
        return self.prefill(input_ids, attention_mask, every_position=True)[0]

    def decode(self, state: DecodeState, next_ids: np.ndarray) -> tuple[np.ndarray, DecodeState]:
        """Generation phase: one new token per row; returns its logits (batch, vocab)."""
        self._check_generation(len(next_ids), state.past_length)
        mask = np.concatenate([state.attention_mask, np.ones((len(next_ids), 1), np.int64)], axis=1)
        positions = state.last_position + 1
        logits, cache = self.forward(next_ids.reshape(-1, 1).astype(np.int64), mask, positions, state.cache, _ONLY_POSITION)
        return logits[:, -1], DecodeState(cache, mask, positions)

    def prepare_to_serve(self) -> None:
        """Whatever serving's first requests would otherwise pay for (kiln serve calls it
        once, after loading): nothing for engines that run each shape as it comes."""

    def pick(self, logits: np.ndarray, draws: list[Draws]) -> Picked:
        """Row i's next token from `logits` (rows, vocab) with `draws[i]`'s own sampling
        (continuous batching mixes requests), within its grammar where it has one, and its
        log probabilities (of the masked logits) where asked."""
        logits, failed = self.constrained(logits, draws)
        tokens, failed_draws = pick_each(logits, [d.sampling for d in draws], [None if d.sampling.greedy else d.rng for d in draws])
        failed |= failed_draws
        logprobs = {
            row: logprobs_of(logits[row : row + 1], [int(tokens[row])], d.sampling.logprobs)
            for row, d in enumerate(draws)
            if d.sampling.logprobs is not None and row not in failed
        }
        return Picked(tokens[:, None], logprobs, failed | advanced(draws, tokens, failed))

    def constrained(self, logits: np.ndarray, draws: list[Draws]) -> tuple[np.ndarray, dict[int, str]]:
        """`logits` with what each row's grammar forbids at -inf (the same array where no
        row has one), and the rows that cannot go on, with the reason."""
        if all(d.sampling.grammar is None for d in draws):
            return logits, {}
        from components.runtime.grammar import masked

        constraints, failed = self.constraints(draws, logits.shape[-1])
        logits, refused = masked(logits, constraints, self.mask_clock)
        return logits, failed | refused

    def constraints(self, draws: list[Draws], vocab: int) -> tuple[list, dict[int, str]]:
        """Each row's grammar as it stands (None for a row without one), made at a row's first
        token; the rows whose grammar cannot be made, with the reason."""
        from components.runtime.grammar import Constraint, GrammarError

        failed = {}
        for row, d in enumerate(draws):
            if d.sampling.grammar is not None and d.constraint is None:
                try:
                    d.constraint = Constraint(self.grammar_tokenizer(vocab), d.sampling.grammar)
                except GrammarError as err:  # the server checked it: only a grammar that outgrows a limit gets here
                    failed[row] = f"the grammar cannot be used: {err}"
        return [None if row in failed else d.constraint for row, d in enumerate(draws)], failed

    def grammar_tokenizer(self, vocab_size: int | None = None):
        """llguidance's reading of the engine's tokenizer, `vocab_size` (default: the
        model's) wide; built once per process. GrammarError where it cannot be read."""
        from components.runtime.grammar import grammar_tokenizer

        return grammar_tokenizer(self.engine_dir.path / "tokenizer.json", vocab_size or self.manifest.vocab_size, tuple(sorted(self.manifest.stop_ids)))

    def decode_turn(self, state: DecodeState, next_ids: np.ndarray, draws: list[Draws], steps: int = 1, room: int = 0) -> tuple[Picked, DecodeState]:
        """`steps` (at most `max_turn_steps`) decode steps for every row, each sampling with
        its own draws; what they picked, and the state after the last step. Here each step's
        logits come to the host, which picks the next tokens. `room` (how many steps the rows
        may all take before the batch changes) lets a device engine queue the next turn
        early, and then bring a turn of its own length; here it changes nothing."""
        if not 1 <= steps <= self.max_turn_steps:
            raise ValueError(f"a turn takes 1..{self.max_turn_steps} steps, not {steps}")
        tokens = np.empty((len(next_ids), steps), np.int64)
        logprobs: dict[int, list[TokenLogprob]] = {row: [] for row, d in enumerate(draws) if d.sampling.logprobs is not None}
        failed: dict[int, str] = {}
        for step in range(steps):
            logits, state = self.decode(state, next_ids)
            picked = self.pick(logits, draws)
            tokens[:, step] = next_ids = picked.tokens[:, 0]
            for row, each in picked.logprobs.items():
                logprobs[row] += each
            failed = picked.failed | failed  # a row's first failure is the one reported
        return Picked(tokens, {row: each for row, each in logprobs.items() if row not in failed}, failed), state

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """New token ids for each prompt (left-padded into one batch), without the prompt."""
        if not prompts or any(not p for p in prompts):
            raise ShapeOutOfProfile("every prompt needs at least one token")
        self._check_total(max(map(len, prompts)) + sampling.max_new_tokens)
        ids, mask = left_pad(prompts, self.manifest.eos_token_id)
        rng = np.random.default_rng(sampling.seed)
        logits, state = self.prefill(ids, mask)
        step_logits = logits[:, -1]
        generated: list[list[int]] = [[] for _ in prompts]
        finished = np.zeros(len(prompts), bool)
        for step in range(sampling.max_new_tokens):
            next_ids = pick_next(step_logits, sampling, rng)
            for row, token in enumerate(next_ids.tolist()):
                if not finished[row]:
                    generated[row].append(token)
            if sampling.stop_at_eos:
                finished |= np.isin(next_ids, list(self.manifest.stop_ids))
            if finished.all() or step == sampling.max_new_tokens - 1:
                break
            step_logits, state = self.decode(state, next_ids)
        if sampling.stop_at_eos:
            generated = [[t for t in row if t not in self.manifest.stop_ids] for row in generated]
        return generated

    def _logits_positions_feed(self, input_ids: np.ndarray, logits_positions: np.ndarray | None) -> dict[str, np.ndarray]:
        """The graph's LOGITS_POSITIONS input for a `forward` call (None: every position of
        `input_ids`); none for a graph exported before it, which computes them all."""
        if not self.manifest.takes_logits_positions:
            return {}
        return {LOGITS_POSITIONS: np.arange(input_ids.shape[1], dtype=np.int64) if logits_positions is None else logits_positions}

    # ------------------------------------------------------------ profile checks

    def _empty_cache(self, batch: int) -> list[np.ndarray]:
        shape = (batch, self.manifest.kv_heads, 0, self.manifest.head_dim)
        return [np.zeros(shape, np.float32) for _ in self.manifest.past_names]

    def _check_context(self, shape: tuple[int, ...]) -> None:
        profile = self.manifest.profiles["context"]
        batch, length = shape
        if not profile.batch.admits(batch):
            raise ShapeOutOfProfile(f"batch {batch} is outside the engine's profile ({profile.batch.min}..{profile.batch.max})")
        if not profile.sequence.admits(length):
            raise ShapeOutOfProfile(
                f"prompt of {length} tokens is outside the engine's profile ({profile.sequence.min}..{profile.sequence.max} tokens)"
            )

    def _check_generation(self, batch: int, past: int) -> None:
        profile = self.manifest.profiles["generation"]
        if not profile.past.admits(past):
            raise ShapeOutOfProfile(f"context of {past + 1} tokens exceeds the engine's profile ({profile.past.max + 1})")
        if not profile.batch.admits(batch):
            raise ShapeOutOfProfile(f"batch {batch} is outside the engine's profile ({profile.batch.min}..{profile.batch.max})")

    def _check_total(self, total: int) -> None:
        limit = self.manifest.profiles["generation"].past.max + 1
        if total > limit:
            raise ShapeOutOfProfile(f"prompt plus max_tokens is {total} tokens; the engine's profile allows {limit}")


def advanced(draws: list[Draws], tokens: np.ndarray, failed: dict[int, str]) -> dict[int, str]:
    """Each constrained row's grammar past its picked token; the rows where it would not go."""
    refused = {}
    for row, d in enumerate(draws):
        if d.constraint is not None and row not in failed and (reason := d.constraint.advance(int(tokens[row]))):
            refused[row] = reason
    return refused


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of unequal length as one left-padded batch: (ids, attention_mask)."""
    width = max(map(len, prompts))
    ids = np.full((len(prompts), width), pad_id, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask
