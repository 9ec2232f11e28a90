"""Continuous batching: concurrent requests share the engine's decode steps.

One thread owns the engine (vLLM's engine core loop has this shape). Each turn it drops sequences whose
clients left, runs the decode steps of the turn for every running sequence, admits waiting
ones (one prefill for all of them, whose caches then join the running batch), and retires
each finished sequence at once. A turn nobody waits on takes several steps where the device
samples (the torch-cuda engine, in one graph) and, where the host samples, for a stream
that has run alone a while (see `_turn_steps`). The batch never exceeds the engine's
profile; the waiting line is bounded, and a full line is refused at once (the server
answers 503 with Retry-After).

Each sequence samples with its own settings and seed and stops on its own conditions;
tokens and text reach its client as its steps complete, through `Sequence.emit`. kiln serve
runs this scheduler in a process of its own (serving.engine_process); the serving gate and
the tests run it in theirs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from components.engine_dir import EngineManifest
from components.errors import KilnError, ShapeOutOfProfile
from components.runtime.engine import DecodeState, Engine, Picked, left_pad
from components.runtime.logprobs import TokenLogprob, logprobs_of
from components.runtime.sampling import Draws, Sampling
from components.runtime.tokenizer import EngineTokenizer
from serving.prefix_cache import Hit, PrefixCache, PrefixCounts
from serving.text import TextStream

log = logging.getLogger("kiln.serving")

# A row that finishes in a turn that also admits a waiting sequence leaves its cache as a
# free slot the newcomer is written into in place (no copy of the whole batch's cache);
# slots nobody takes in the turn are compacted away at its end, since a free slot costs its
# share of every decode step (measured: docs/performance.md, "Measured choices in the
# code"). The columns a reused slot leaves unattended on the left are dropped once there
# are this many.
COMPACT_SLACK = 16

# Where the host samples, a stream that has run alone for LONE_AFTER_S takes several steps a
# turn (its events, messages and server-sent events then come once a turn), as many as fit
# in HOST_TURN_BUDGET_S: a request that arrives meanwhile waits at most about that long.
# Without the quiet period, the moments when one row of a busy batch runs alone took long
# turns that newcomers waited on (16 clients: about 10 % fewer tokens/s).
HOST_TURN_BUDGET_S = 0.005
LONE_AFTER_S = 0.1


class QueueFull(KilnError):
    """The waiting line is full; the client should retry later."""


class SchedulerClosed(KilnError):
    """The scheduler is draining (its engine is being swapped out) or stopped."""


@dataclass(frozen=True)
class Delta:
    """New text for a streaming client (empty when a token released none yet), and how many
    tokens the sequence had generated when it was released (its logprobs are theirs)."""

    text: str
    tokens: int


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt's, reused from the prefix cache


@dataclass(frozen=True)
class Failed:
    message: str


Event = Delta | Finished | Failed


@dataclass(frozen=True)
class Turn:
    """What one turn did, for the server's gauges and counters: the batch, the line, the
    rows decoded, the grammars' masks (seconds spent filling them, rows masked), and the
    prefix cache's counts (None without one)."""

    running: int
    waiting: int
    decoded: int
    mask_seconds: float = 0.0
    masked_rows: int = 0
    prefix: PrefixCounts | None = None


def ignore_turn(turn: Turn) -> None:
    """The default observer."""


@dataclass(eq=False)
class Sequence:
    """One prompt being completed. `emit` is called from the scheduler's thread (in kiln
    serve: the thread that reads the engine process's messages)."""

    prompt: list[int]
    sampling: Sampling
    emit: Callable[[Event], None]
    stops: tuple[str, ...] = ()  # OpenAI's `stop`: the text ends just before the first one
    stream: bool = True  # False: no Delta events, the text is read from `text` once Finished
    generated: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens whose cache a prefix cache gave (not prefilled)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the first token's is None (nothing before it)
    text: str = ""  # the completion's whole text, set when it has finished
    cancelled: bool = False
    # time.monotonic(), for time to first token: CLOCK_MONOTONIC on Linux, one clock for
    # every process of the machine, so the engine process's times compare with the server's.
    first_token_at: float | None = None
    last_token_at: float | None = None
    on_cancel: Callable[[], None] = field(default=lambda: None, repr=False)  # set by the scheduler that holds it

    def cancel(self) -> None:
        """The client has gone: the sequence leaves the batch at the next step (no-op once finished)."""
        self.cancelled = True
        self.on_cancel()


@dataclass(frozen=True)
class Limits:
    """What one engine can hold: rows in a batch, prompt tokens, prompt plus new tokens."""

    max_batch: int
    max_prompt: int
    max_total: int

    @classmethod
    def of(cls, manifest: EngineManifest, max_batch: int | None = None) -> Limits:
        """The engine's profiles, the batch capped at `max_batch` (1: one request at a time)."""
        profiles = manifest.profiles
        batch = min(profiles["context"].batch.max, profiles["generation"].batch.max, max_batch or 1 << 30)
        return cls(batch, profiles["context"].sequence.max, profiles["generation"].past.max + 1)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise ShapeOutOfProfile, naming the limit, for a request the engine cannot hold."""
        if prompt_tokens > self.max_prompt:
            raise ShapeOutOfProfile(f"the prompt has {prompt_tokens} tokens; the engine's profile allows {self.max_prompt}")
        if prompt_tokens + max_tokens > self.max_total:
            raise ShapeOutOfProfile(
                f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {prompt_tokens + max_tokens} tokens; "
                f"the engine's profile allows {self.max_total}"
            )


@dataclass(eq=False)
class _Held:
    """A sequence as the scheduler holds it, with its text so far and its random stream."""

    seq: Sequence
    text: TextStream
    draws: Draws

    @property
    def left(self) -> int:
        """Tokens it may still generate."""
        return self.seq.sampling.max_new_tokens - len(self.seq.generated)


class Scheduler:
    """Runs `engine` for every submitted sequence; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: EngineTokenizer,
        max_waiting: int,
        max_batch: int | None = None,
        observe: Callable[[Turn], None] = ignore_turn,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.engine = engine
        self.prefix_cache = prefix_cache if engine.continues_prefills else None
        self.limits = Limits.of(engine.manifest, max_batch)
        self.max_batch = self.limits.max_batch
        self.max_waiting = max_waiting
        self._tokenizer = tokenizer
        self._observe = observe
        self._waiting: deque[_Held] = deque()
        self._running: list[_Held | None] = []  # the batch's rows; None: a free slot
        self._live = 0  # rows that are not free
        self._free: set[int] = set()  # rows of finished sequences, within a turn
        self._state: DecodeState | None = None
        self._next = np.zeros(0, np.int64)  # the token each running row feeds next
        self._lone_step_s = float("inf")  # a decode step's time with one row, as last measured
        self._crowded_until = 0.0  # time.monotonic() until which a lone row is not yet alone
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=f"kiln-batcher-{id(self):x}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ client side

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue sequences (all or none); QueueFull when the line cannot take them all."""
        for seq in sequences:
            self.limits.check_fits(len(seq.prompt), seq.sampling.max_new_tokens)
        with self._wake:
            if self._closing:
                raise SchedulerClosed("this engine is being swapped out")
            if len(self._waiting) + len(sequences) > self.max_waiting:  # the abandoned hold no place in line
                self._waiting = deque(r for r in self._waiting if not r.seq.cancelled)
            if len(self._waiting) + len(sequences) > self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (limit {self.max_waiting})")
            self._waiting.extend(_Held(s, TextStream(self._tokenizer.stream_decoder(), s.stops), Draws(s.sampling)) for s in sequences)
            self._wake.notify()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return self._live

    def close(self, timeout: float | None = None) -> bool:
        """Take no new sequences, finish the queued and running ones, then free the engine.
        False if they did not finish within `timeout` (the engine is then left open)."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self.engine.close()
        return True

    # ------------------------------------------------------------ the engine's thread

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._live and not self._closing:
                    self._wake.wait()
                if self._closing and not self._waiting and not self._live:
                    return
            decoded = 0
            try:
                decoded = self._turn()
            except Exception as err:  # an engine failure ends the sequences it touched, not the server
                self._fail_all(f"the engine failed: {type(err).__name__}: {err}")
            try:
                prefix = self.prefix_cache.read() if self.prefix_cache is not None else None
                self._observe(Turn(self._live, len(self._waiting), decoded, *self.engine.mask_clock.read(), prefix))
            except Exception:  # a broken metrics hook must not stop the engine's thread (every client would hang)
                log.exception("the scheduler's turn observer failed; serving goes on")

    def _turn(self) -> int:
        """The turn's decode steps for the running batch, then admissions; returns the rows decoded."""
        self._release([row for row, r in enumerate(self._running) if r is not None and r.seq.cancelled])
        self._compact_if_wasteful()
        decoded = len(self._running)
        if decoded + len(self._waiting) > 1:
            self._crowded_until = time.monotonic() + LONE_AFTER_S
        if decoded:
            draws, steps, started = [r.draws for r in self._running], self._turn_steps(), time.perf_counter()
            picked, self._state = self.engine.decode_turn(self._state, self._next, draws, steps, self._room())
            steps = picked.tokens.shape[1]
            if decoded == 1:
                self._lone_step_s = (time.perf_counter() - started) / steps
            self._advance(picked, rows=list(range(decoded)))
        # Behind a queued turn a newcomer waits for the next call, which takes that turn:
        # its prefill now would throw the turn's work away and still wait for it.
        admitted = [] if self.engine.turn_queued else self._take_waiting()
        if admitted:
            self._prefill(admitted)
        if self._free:
            self._compact()
        return decoded

    def _turn_steps(self) -> int:
        """1 while someone waits and the batch has room (the newcomer joins at the end of
        this turn), and where the host samples unless one stream has run alone for
        LONE_AFTER_S (a batch's steps gain nothing from a longer turn); else as many steps
        as every running row still may take (with a full batch, the turn ends when the first
        row can leave), at most the engine's `max_turn_steps` — where the host samples, as
        many as the lone stream's steps fit in HOST_TURN_BUDGET_S; where the device samples,
        rounded down to a power of two (few graphs to capture). A row that stops early (end
        of text, a stop string) drops the rest of its turn's tokens."""
        if self._waiting and self._live < self.max_batch:
            return 1
        steps = min(min(r.left for r in self._running), self.engine.max_turn_steps)
        if isinstance(self._state, DecodeState):  # the host samples: a turn of any length, each one a message and a write
            alone = len(self._running) == 1 and time.monotonic() >= self._crowded_until
            return max(min(steps, int(HOST_TURN_BUDGET_S / self._lone_step_s)), 1) if alone else 1
        return 1 << (max(steps, 1).bit_length() - 1)

    def _room(self) -> int:
        """How many steps the running rows may all take before the batch changes: none
        while a newcomer waits for room (it joins after this turn); else until the first
        row may leave. Rows that end early (end of text, a stop string) change it anyway."""
        if self._waiting and self._live < self.max_batch:
            return 0
        return min(r.left for r in self._running)

    def _take_waiting(self) -> list[_Held]:
        with self._wake:
            room = self.max_batch - self._live
            taken = []
            while self._waiting and len(taken) < room:
                waiting = self._waiting.popleft()
                if not waiting.seq.cancelled:
                    taken.append(waiting)
            return taken

    def _prefill(self, admitted: list[_Held]) -> None:
        """The admitted prompts' first tokens: those whose beginning the prefix cache holds
        prefill only the rest, each on its own; the others together. A prompt that mostly
        repeats an earlier one's beginning waits for that one's prefill, then takes its
        blocks from the cache: a burst that shares an uncached prefix computes it once."""
        if self.prefix_cache is None:
            self._prefill_whole(admitted)
            return
        first, then = _coalesced(admitted, self.prefix_cache.block)
        self._prefill_cached(first)
        self._prefill_cached(then)

    def _prefill_cached(self, admitted: list[_Held]) -> None:
        hits = {}
        for r in admitted:
            if r.seq.sampling.prompt_logprobs is None and (hit := self.prefix_cache.lookup(r.seq.prompt)) is not None:
                hits[r] = hit
        whole = [r for r in admitted if r not in hits]
        if whole:
            self._prefill_whole(whole)
        if hits:
            self._prefill_after(hits)

    def _prefill_after(self, hits: dict[_Held, Hit]) -> None:
        """The hits' prompts prefilled after their cached beginnings, together."""
        admitted = list(hits)
        try:
            logits, state = self.engine.prefill_after_each([(hit.cache, r.seq.prompt[hit.tokens :]) for r, hit in hits.items()])
        except Exception as err:
            for r in admitted:
                r.seq.emit(Failed(f"the engine failed on the prompt: {type(err).__name__}: {err}"))
            return
        for index, (r, hit) in enumerate(hits.items()):
            r.seq.cached_tokens = hit.tokens
            self.prefix_cache.store(r.seq.prompt, partial(self.engine.kv_of, state, index, len(r.seq.prompt)))
        rows = self._place(admitted, state)
        self._live += len(admitted)
        self._advance(self.engine.pick(logits[:, -1], [r.draws for r in admitted]), rows)

    def _prefill_whole(self, admitted: list[_Held]) -> None:
        ids, mask = left_pad([r.seq.prompt for r in admitted], self.engine.manifest.eos_token_id)
        scored = [r for r in admitted if r.seq.sampling.prompt_logprobs is not None]
        try:
            logits, state = self.engine.prefill(ids, mask, every_position=bool(scored))
        except Exception as err:
            for r in admitted:
                r.seq.emit(Failed(f"the engine failed on the prompt: {type(err).__name__}: {err}"))
            return
        for index, r in enumerate(admitted):
            if r.seq.sampling.prompt_logprobs is not None:
                r.seq.prompt_logprobs = _prompt_logprobs(logits[index], r.seq.prompt, r.seq.sampling.prompt_logprobs)
            if self.prefix_cache is not None:
                self.prefix_cache.store(r.seq.prompt, partial(self.engine.kv_of, state, index, len(r.seq.prompt)))
        rows = self._place(admitted, state)
        self._live += len(admitted)
        self._advance(self.engine.pick(logits[:, -1], [r.draws for r in admitted]), rows)

    def _place(self, admitted: list[_Held], state: DecodeState) -> list[int]:
        """Put the prefilled sequences in the batch: into free slots in place while there
        are any (and the batch's cache is as wide as theirs), the rest joined at the end."""
        if not self._live and self._state is not None:
            self._compact()  # nothing runs: the newcomers' state is the batch, no copy
        if self._state is None:
            self._running, self._state, self._next = list(admitted), state, np.zeros(len(admitted), np.int64)
            return list(range(len(admitted)))
        if self._free and state.past_length > self._state.past_length:
            self._compact()  # narrower than the newcomers: no slot can take them in place
        free = sorted(self._free)[: len(admitted)]
        for index, row in enumerate(free):
            self._state.put(row, state, index)
            self._running[row] = admitted[index]
            self._free.discard(row)
        joining = list(range(len(free), len(admitted)))
        if joining:
            first = len(self._running)
            self._running.extend(admitted[i] for i in joining)
            self._state = self._state.joined(state if not free else state.rows(joining))
            self._next = np.concatenate([self._next, np.zeros(len(joining), np.int64)])
            return free + list(range(first, len(self._running)))
        return free

    def _advance(self, picked: Picked, rows: list[int]) -> None:
        """Take each row's picked tokens (`picked`: one row each, in `rows`' order) until it
        finishes; emit its turn's text at once; free the finished rows."""
        done = []
        now = time.monotonic()  # one clock read for the turn's tokens: they became known together
        for index, (row, tokens) in enumerate(zip(rows, picked.tokens.tolist(), strict=True)):
            r = self._running[row]
            if index in picked.failed:
                done.append(row)
                r.seq.emit(Failed(picked.failed[index]))
                continue
            r.draws.drawn += len(tokens)
            self._next[row] = tokens[-1]
            logprobs, text, before, reason = picked.logprobs.get(index), [], len(r.seq.generated), None
            for step, token in enumerate(tokens):
                reason = self._accept(r, token, logprobs[step] if logprobs else None, now, text)
                if reason:
                    break
            if reason:
                done.append(row)
                text.append(r.text.finish())
            if r.seq.stream and (len(r.seq.generated) > before or any(text)):
                r.seq.emit(Delta("".join(text), len(r.seq.generated)))
            if reason:
                r.seq.text = r.text.text
                r.seq.emit(Finished(reason, len(r.seq.prompt), len(r.seq.generated), r.seq.cached_tokens))
                self._keep_turn(row, r)
        self._release(done)

    def _keep_turn(self, row: int, r: _Held) -> None:
        """A finished sequence's prompt and reply into the prefix cache: a conversation's next
        turn begins with them. Its last token was never fed, so its cache is not written
        (and a multi-step turn may have fed tokens past its end: those stay out)."""
        if self.prefix_cache is not None:
            tokens = r.seq.prompt + r.seq.generated[:-1]
            self.prefix_cache.store(tokens, partial(self.engine.kv_of, self._state, row, len(tokens)))

    def _accept(self, r: _Held, token: int, logprob: TokenLogprob | None, now: float, text: list[str]) -> str | None:
        """Add a token to the sequence, its text to `text`; the finish reason if it ends
        here. A sequence of max_tokens 0 (a prompt scored with `echo`) takes none."""
        seq = r.seq
        if seq.sampling.max_new_tokens == 0:
            return "length"
        if token in self.engine.manifest.stop_ids and (seq.sampling.stop_at_eos or r.draws.constraint is not None):
            return "stop"  # a grammar allows end of text where it is complete, and only that once it has ended
        seq.generated.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        seq.last_token_at = now
        seq.first_token_at = seq.first_token_at or seq.last_token_at
        text.append(r.text.add(token))
        if r.text.stopped:
            return "stop"
        if len(seq.generated) >= seq.sampling.max_new_tokens:
            return "length"
        return None

    def _release(self, rows: list[int]) -> None:
        """Finished or abandoned rows leave at once: their slots are free for the waiting
        sequences of this turn (in a host cache) and compacted away at its end."""
        if not rows:
            return
        for row in rows:
            self._running[row] = None
        self._free.update(rows)
        self._live -= len(rows)
        if not isinstance(self._state, DecodeState):
            self._compact()  # a device's slots (the CUDA engine's) are its own to reuse

    def _compact_if_wasteful(self) -> None:
        """Before a decode step: no free rows, and not COMPACT_SLACK columns (or the
        profile's limit) that no running row attends to."""
        if self._state is None:
            return
        if self._free or not self._live:
            self._compact()
            return
        if not isinstance(self._state, DecodeState):  # a device's slots hold no columns to spare
            return
        needed = max(len(r.seq.prompt) + len(r.seq.generated) for r in self._running if r is not None)
        width = self._state.past_length
        if width - needed >= COMPACT_SLACK or width >= self.limits.max_total - 1:
            self._compact()

    def _compact(self) -> None:
        keep = _holes_filled_from_the_tail(self._running)
        self._running = [self._running[row] for row in keep]
        self._next = self._next[keep]
        state = self._state.rows(keep)  # frees the dropped rows' cache (an engine's device slots too)
        self._state = state if keep else None
        self._free.clear()

    def _fail_all(self, message: str) -> None:
        for r in self._running:
            if r is not None:
                r.seq.emit(Failed(message))
        if self._state is not None:
            self._state.rows([])  # gives the cache back (an engine's device slots)
        self._running, self._state, self._next = [], None, np.zeros(0, np.int64)
        self._live, self._free = 0, set()


def _coalesced(admitted: list[_Held], block: int) -> tuple[list[_Held], list[_Held]]:
    """Those to prefill first, and those that wait for them: a prompt whose first whole
    blocks, half of it or more, are an earlier one's waits (prompts asking for their own
    log probabilities are computed in full and never wait)."""
    first: list[_Held] = []
    then: list[_Held] = []
    for r in admitted:
        prompt = r.seq.prompt
        shared = max((_shared_blocks(prompt, other.seq.prompt, block) for other in first), default=0)
        waits = r.seq.sampling.prompt_logprobs is None and shared >= block and 2 * shared >= len(prompt)
        (then if waits else first).append(r)
    return first, then


def _shared_blocks(a: list[int], b: list[int], block: int) -> int:
    """Tokens `a` and `b` begin with in common, in whole blocks."""
    n = min(len(a), len(b))
    same = np.asarray(a[:n]) == np.asarray(b[:n])
    common = n if same.all() else int(np.argmin(same))
    return common // block * block


def _holes_filled_from_the_tail(running: list[_Held | None]) -> list[int]:
    """The surviving rows, each hole among the first ones taken by a survivor from the end:
    a device cache (the torch-cuda engine's slots) then moves one slot per hole, not every
    slot after it (measured on the H200: ~1 ms of slot moves per finished request at 16)."""
    survivors = sum(r is not None for r in running)
    tail = [row for row in range(survivors, len(running)) if running[row] is not None]
    return [row if running[row] is not None else tail.pop() for row in range(survivors)]


def _prompt_logprobs(logits: np.ndarray, prompt: list[int], top: int) -> list[TokenLogprob | None]:
    """The log probability of each prompt token given those before it, from the prefill's
    logits of a left-padded row (`logits`: every position, the prompt at the right end)."""
    before = logits[len(logits) - len(prompt) : len(logits) - 1]  # position i predicts token i + 1
    return [None, *logprobs_of(before, prompt[1:], top)]
