"""Constrained decoding: a row whose request carries a grammar (a JSON schema, a regex, a
choice, a Lark grammar or a tool call's format, compiled to llguidance's form by the
server) picks only tokens its grammar allows.

llguidance (MIT; a backend of vLLM, SGLang and llama.cpp) builds its token trie from the
engine's tokenizer.json and fills a bitmask per row without the GIL; the mask is applied to
the logits before temperature, top-p and log probabilities, so a forbidden token is never
drawn and never listed. Ids past the tokenizer's vocabulary (a padded embedding) have no
bytes and stay forbidden.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from components.errors import KilnError

# JSON as json.dumps writes it (", " and ": ", no other whitespace): a model cannot loop on
# blank space until max_tokens, and the text is what a client's parser expects.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(KilnError):
    """A grammar that llguidance refuses (its message names what), or one that has failed."""


@functools.cache
def grammar_tokenizer(tokenizer_json: Path, vocab_size: int, stop_ids: tuple[int, ...]):
    """The engine's tokenizer as llguidance reads it, `vocab_size` wide (the logits' width)
    with the engine's end-of-text ids (those inside the vocabulary; none: the tokenizer's
    own); built once per engine directory and process. GrammarError where llguidance cannot
    read it."""
    from llguidance import LLTokenizer

    eos = [token for token in stop_ids if token < vocab_size]
    try:
        return LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab_size, eos_token=eos or None)
    except (ValueError, OSError) as err:
        raise GrammarError(f"the engine's tokenizer ({tokenizer_json}) cannot be read for grammars: {err}") from None


def built_in_background(tokenizer: Callable[[], object]) -> None:
    """Build llguidance's tokenizer (`tokenizer()`, cached by `grammar_tokenizer`) in a thread
    now, not at the first constrained request, which would wait on it (a large vocabulary
    takes a while); one that cannot be built is said by each constrained request instead."""

    def build() -> None:
        try:
            tokenizer()
        except GrammarError:
            pass

    threading.Thread(target=build, name="kiln-grammar-tokenizer", daemon=True).start()


def json_schema_grammar(schema: dict | bool) -> str:
    """llguidance's grammar for a JSON schema, laid out as `JSON_LAYOUT` whatever the schema's
    own `x-guidance` says."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)


def check_grammar(grammar: str, tokenizer) -> None:
    """GrammarError with llguidance's own words where it will not compile `grammar` for
    `tokenizer` (an unsupported schema feature, a bad regex, an unknown rule)."""
    from llguidance import LLMatcher

    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if failed:
        raise GrammarError(messages[0].strip())


class Constraint:
    """One sequence's grammar as it advances token by token."""

    def __init__(self, tokenizer, grammar: str) -> None:
        from llguidance import LLMatcher

        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())

    def advance(self, token: int) -> str | None:
        """Take the picked token; the reason where the grammar cannot (it allowed it, so a bug)."""
        if self.matcher.consume_token(token):
            return None
        return f"the grammar refused token {token}: {_first_line(self.matcher.get_error())}"


@dataclass
class MaskClock:
    """Time spent filling masks and the rows masked, since the owner last read them."""

    seconds: float = 0.0
    rows: int = 0

    def read(self) -> tuple[float, int]:
        seconds, rows, self.seconds, self.rows = self.seconds, self.rows, 0.0, 0
        return seconds, rows


def masked(logits: np.ndarray, constraints: list[Constraint | None], clock: MaskClock) -> tuple[np.ndarray, dict[int, str]]:
    """`logits` (rows, vocab) with what each row's constraint forbids at -inf (rows without
    one untouched); rows whose grammar allows nothing at all are named with the reason."""
    started = time.perf_counter()
    rows, bitmask, failed = allowed_tokens(constraints, logits.shape[-1])
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[-1]].view(bool)
    out = np.array(logits, np.float32, copy=True)
    out[rows] = np.where(allowed, out[rows], -np.inf)
    clock.seconds += time.perf_counter() - started
    clock.rows += len(rows)
    return out, failed


def allowed_tokens(constraints: list[Constraint | None], vocab: int) -> tuple[list[int], np.ndarray, dict[int, str]]:
    """The constrained rows, their allowed tokens as llguidance's bitmask ((rows, vocab / 32)
    int32, bit t of a row set where token t is allowed), and the rows whose grammar allows
    nothing at all, with the reason."""
    import llguidance.numpy as llnp

    rows = [row for row, c in enumerate(constraints) if c is not None]
    # Zeros, not llguidance's all-allowed default: a row the executor leaves unwritten (its
    # matcher has failed) then allows nothing and fails, rather than letting any token through.
    bitmask = np.zeros(llnp.get_bitmask_shape(len(rows), vocab), np.int32)
    _executor().unsafe_compute_mask_ptr([(constraints[row].matcher, i) for i, row in enumerate(rows)], bitmask.ctypes.data, bitmask.shape[1] * 4, len(rows))
    failed = {row: f"the grammar allows no token: {_first_line(constraints[row].matcher.get_error()) or 'it has ended'}" for i, row in enumerate(rows) if not bitmask[i].any() or constraints[row].matcher.is_error()}
    return rows, bitmask, failed


def _first_line(error: str) -> str:
    """llguidance's error's first line (the rest dumps its state and the whole grammar)."""
    return error.strip().split("\n", 1)[0]


@functools.cache
def _executor():
    """One pool of llguidance's threads per process, filling a batch's masks in parallel."""
    from llguidance import LLExecutor

    return LLExecutor()
