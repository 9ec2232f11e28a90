"""Continuous batching: concurrent requests share the engine's decode steps.

One thread owns the engine (vLLM's shape, FACTS.md). Each turn it drops sequences whose
clients left, admits waiting ones (one prefill for all of them, whose caches then join the
running batch), runs one decode step for every running sequence, and retires each finished
sequence at once. The batch never exceeds the engine's profile; the waiting line is
bounded, and a full line is refused at once (the server answers 503 with Retry-After).

Each sequence samples with its own settings and seed and stops on its own conditions;
tokens and text reach its client as its steps complete, through `Sequence.emit`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from components.errors import KilnError, ShapeOutOfProfile
from components.runtime.engine import DecodeState, Engine, left_pad
from components.runtime.sampling import Sampling, pick_each
from serving.text import TextStream


class QueueFull(KilnError):
    """The waiting line is full; the client should retry later."""


class SchedulerClosed(KilnError):
    """The scheduler is draining (its engine is being swapped out) or stopped."""


@dataclass(frozen=True)
class Delta:
    """New text for a streaming client (empty when a token released none yet)."""

    text: str


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str


Event = Delta | Finished | Failed


@dataclass(eq=False)
class Sequence:
    """One prompt being completed. `emit` is called from the scheduler's thread."""

    prompt: list[int]
    sampling: Sampling
    text: TextStream
    emit: Callable[[Event], None]
    stream: bool = True  # False: no Delta events, the text is read from `text` once Finished
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False  # set by the client's side when it disconnects
    first_token_at: float | None = None  # perf_counter, for time-to-first-token
    last_token_at: float | None = None
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.sampling.seed)


class Scheduler:
    """Runs `engine` for every submitted sequence; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        max_waiting: int,
        max_batch: int | None = None,
        observe: Callable[[int, int, int], None] = lambda running, waiting, decoded: None,
    ) -> None:
        profiles = engine.manifest.profiles
        self.engine = engine
        self.max_batch = min(profiles["context"].batch.max, profiles["generation"].batch.max, max_batch or 1 << 30)
        self.max_prompt = profiles["context"].sequence.max
        self.max_total = profiles["generation"].past.max + 1
        self.max_waiting = max_waiting
        self._observe = observe
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._state: DecodeState | None = None
        self._next = np.zeros(0, np.int64)  # the token each running row feeds next
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=f"kiln-batcher-{id(self):x}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ client side

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise ShapeOutOfProfile, naming the limit, for a request the engine cannot hold."""
        if prompt_tokens > self.max_prompt:
            raise ShapeOutOfProfile(f"the prompt has {prompt_tokens} tokens; the engine's profile allows {self.max_prompt}")
        if prompt_tokens + max_tokens > self.max_total:
            raise ShapeOutOfProfile(
                f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {prompt_tokens + max_tokens} tokens; "
                f"the engine's profile allows {self.max_total}"
            )

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue sequences (all or none); QueueFull when the line cannot take them all."""
        for seq in sequences:
            self.check_fits(len(seq.prompt), seq.sampling.max_new_tokens)
        with self._wake:
            if self._closing:
                raise SchedulerClosed("this engine is being swapped out")
            if len(self._waiting) + len(sequences) > self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (limit {self.max_waiting})")
            self._waiting.extend(sequences)
            self._wake.notify()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

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
                while not self._waiting and not self._running and not self._closing:
                    self._wake.wait()
                if self._closing and not self._waiting and not self._running:
                    return
            decoded = 0
            try:
                decoded = self._turn()
            except Exception as err:  # an engine failure ends the sequences it touched, not the server
                self._fail_all(f"the engine failed: {type(err).__name__}: {err}")
            self._observe(len(self._running), len(self._waiting), decoded)

    def _turn(self) -> int:
        """One decode step for the running batch, then admissions; returns the rows decoded."""
        self._retire([row for row, seq in enumerate(self._running) if seq.cancelled])
        decoded = len(self._running)
        if decoded:
            logits, self._state = self.engine.decode(self._state, self._next)
            self._advance(logits, rows=range(decoded))
        admitted = self._take_waiting()
        if admitted:
            self._prefill(admitted)
        return decoded

    def _take_waiting(self) -> list[Sequence]:
        with self._wake:
            room = self.max_batch - len(self._running)
            taken = []
            while self._waiting and len(taken) < room:
                seq = self._waiting.popleft()
                if not seq.cancelled:
                    taken.append(seq)
            return taken

    def _prefill(self, admitted: list[Sequence]) -> None:
        ids, mask = left_pad([s.prompt for s in admitted], self.engine.manifest.eos_token_id)
        try:
            logits, state = self.engine.prefill(ids, mask)
        except Exception as err:
            for seq in admitted:
                seq.emit(Failed(f"the engine failed on the prompt: {type(err).__name__}: {err}"))
            return
        first = len(self._running)
        self._running.extend(admitted)
        self._state = state if self._state is None else self._state.joined(state)
        self._next = np.concatenate([self._next, np.zeros(len(admitted), np.int64)])
        self._advance(logits[:, -1], rows=range(first, len(self._running)))

    def _advance(self, logits: np.ndarray, rows: range) -> None:
        """Pick each row's next token with its own sampling; emit it; retire the finished."""
        done = []
        sequences = [self._running[row] for row in rows]
        tokens = pick_each(logits, [s.sampling for s in sequences], [s.rng for s in sequences])
        for row, seq, token in zip(rows, sequences, tokens.tolist(), strict=True):
            self._next[row] = token
            reason = self._accept(seq, token)
            if reason:
                done.append(row)
                rest = seq.text.finish()
                if rest and seq.stream:
                    seq.emit(Delta(rest))
                seq.emit(Finished(reason, len(seq.prompt), len(seq.generated)))
        self._retire(done)

    def _accept(self, seq: Sequence, token: int) -> str | None:
        """Add a token to the sequence; the finish reason if it ends here."""
        if seq.sampling.stop_at_eos and token == self.engine.manifest.eos_token_id:
            return "stop"
        seq.generated.append(token)
        seq.last_token_at = time.perf_counter()
        seq.first_token_at = seq.first_token_at or seq.last_token_at
        delta = seq.text.add(token)
        if seq.stream:
            seq.emit(Delta(delta))
        if seq.text.stopped:
            return "stop"
        if len(seq.generated) >= seq.sampling.max_new_tokens:
            return "length"
        return None

    def _retire(self, rows: list[int]) -> None:
        """Drop finished or abandoned rows (and their cache) at once: their slots are free."""
        if not rows:
            return
        gone = set(rows)
        keep = [i for i in range(len(self._running)) if i not in gone]
        self._running = [self._running[i] for i in keep]
        self._next = self._next[keep]
        state = self._state.rows(keep)  # frees the dropped rows' cache (an engine's device slots too)
        self._state = state if keep else None

    def _fail_all(self, message: str) -> None:
        for seq in self._running:
            seq.emit(Failed(message))
        if self._state is not None:
            self._state.rows([])  # gives the cache back (an engine's device slots)
        self._running, self._state, self._next = [], None, np.zeros(0, np.int64)
