"""The served engine in a process of its own, so that HTTP and the engine stop sharing a GIL.

In one process the engine's thread and the HTTP side (parsing, tokenizing, server-sent
events, the event loop) take turns on one interpreter lock: with 16 streaming clients on
two cores a third of the CPU sat idle while the engine thread waited for the lock
(benchmarks/serving_ceiling.py, the serving issue's notes). vLLM runs its EngineCore in a
child process for the same reason. Here the child holds the engine and the `Scheduler`
(continuous batching, sampling, stop strings, detokenizing); the server's side is the
`EngineClient` of serving.engine_client (`submit`, `max_waiting`, `alive`, `pid`,
`close`), the only type the routes, handlers and follower know.

Two one-way pipes carry the traffic. Server → engine: `submit` (the sequences' prompts,
sampling, stops), `cancel` (a client left) and `close`. Engine → server: `ready` or
`refused` once the engine is loaded and warmed, then one message per scheduler turn —
the batch gauges and every sequence's progress in that turn — so a decode step of 16 rows
is one pickle and one wake-up, not 16. On the server's side a reader thread mirrors each
sequence (its tokens, times, text) from those messages before calling its `emit` (the
event loop reading the pipe itself was tried: the same tokens/s, and the first token
3-5 ms later under load).

The waiting line is bounded on the server's side, where a full one is answered at once
with 503; the child's own line is longer by a batch, so that it never refuses what the
server let in (a cancelled sequence leaves this side's count at once, the child's at its
next turn).

If the child dies (killed, out of memory), every sequence it held fails, later submits
are refused with `EngineLost`, and `on_lost` tells the follower to load the version again.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from components.errors import VersionRefused
from serving.engine_client import EngineLost
from serving.loader import PulledVersion
from serving.prefix_cache import PrefixCache
from serving.scheduler import Delta, Event, Failed, Finished, Limits, QueueFull, Scheduler, SchedulerClosed, Sequence, Turn, ignore_turn

log = logging.getLogger("kiln.serving")

# Progress items in a turn's message; tuples, not the event classes, because they are
# pickled on every decode step.
DELTA, FINISHED, FAILED = 0, 1, 2
_LOAD_POLL_S = 0.5


@dataclass(frozen=True)
class RuntimeOptions:
    """How a served engine runs: ONNX Runtime threads, the batch cap (within the engine's
    profile; 1 serves one request at a time) and the waiting line's length."""

    threads: int | None = None
    max_batch: int | None = None
    max_waiting: int = 64
    prefix_cache_bytes: int = 1 << 30  # the prefix cache's budget (serving.prefix_cache_mib); 0: none


class EngineProcess:
    """A pulled version's engine and scheduler in a child process; see the module docstring.
    The constructor returns once the engine is warm, or raises VersionRefused. The HTTP
    side knows it as an `EngineClient` (serving.engine_client)."""

    def __init__(
        self,
        pulled: PulledVersion,
        options: RuntimeOptions,
        observe: Callable[[Turn], None] = ignore_turn,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        self.limits = Limits.of(pulled.engine_dir.manifest, options.max_batch)
        self.max_batch, self.max_waiting = self.limits.max_batch, options.max_waiting
        self._observe, self._on_lost = observe, on_lost
        self._live: dict[int, Sequence] = {}  # submitted, not yet ended or cancelled
        self._next_id = 0
        self._lock = threading.Lock()  # _live, _next_id, _closing and the pipe to the child
        self._closing = False
        self._running = self._waiting = 0
        # spawn, not fork: the server has threads (uvicorn, the poller) a fork would copy mid-step
        context = multiprocessing.get_context("spawn")
        requests_in, self._requests = context.Pipe(duplex=False)
        self._events, events_out = context.Pipe(duplex=False)
        child_line = options.max_waiting + self.limits.max_batch  # never shorter than what this side lets in
        self._process = context.Process(
            target=_engine_main, args=(requests_in, events_out, pulled, options, child_line), name=f"kiln-engine-{pulled.info.version}", daemon=True
        )
        self._process.start()
        requests_in.close()  # the child's ends: once it exits, reads here see EOF
        events_out.close()
        self._wait_until_warm(pulled)
        self._reader = threading.Thread(target=self._read, name=f"kiln-engine-reader-{pulled.info.version}", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------ the Scheduler's client interface

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue sequences (all or none); QueueFull when the line cannot take them all."""
        for seq in sequences:
            self.limits.check_fits(len(seq.prompt), seq.sampling.max_new_tokens)
        with self._lock:
            if self._closing:
                raise self._closed_error()
            # Those not in the running batch at the child's last turn are waiting, as in the
            # Scheduler's own count: new sequences wait until the next turn admits them.
            waiting = max(0, len(self._live) - self._running)
            if waiting + len(sequences) > self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting (limit {self.max_waiting})")
            sids = range(self._next_id, self._next_id + len(sequences))
            self._next_id += len(sequences)
            try:
                self._requests.send(("submit", [(sid, s.prompt, s.sampling, s.stops, s.stream) for sid, s in zip(sids, sequences, strict=True)]))
            except OSError as err:  # the child died a moment ago; the reader is about to say so
                raise EngineLost(f"the engine process is gone ({err})") from None
            for sid, seq in zip(sids, sequences, strict=True):
                self._live[sid] = seq
                seq.on_cancel = lambda sid=sid: self._cancel(sid)

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return self._running

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def close(self, timeout: float | None = None) -> bool:
        """Take no new sequences, let the child finish the ones it holds, then let it exit
        (freeing the engine). False if it has not exited within `timeout`."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self._send_quietly(("close", None))
        self._process.join(timeout)
        return not self._process.is_alive()

    # ------------------------------------------------------------ this side of the pipes

    def _wait_until_warm(self, pulled: PulledVersion) -> None:
        answer = None
        while self._process.is_alive() and not self._events.poll(_LOAD_POLL_S):
            pass
        with contextlib.suppress(EOFError):  # it died with nothing said
            answer = self._events.recv()
        if answer is None or answer[0] != "ready":
            self._process.join(5)
            raise VersionRefused(answer[1] if answer else f"{pulled.label} is refused: its engine process exited with code {self._process.exitcode} while loading")

    def _cancel(self, sid: int) -> None:
        with self._lock:
            if self._live.pop(sid, None) is not None:
                self._send_quietly(("cancel", [sid]))

    def _send_quietly(self, message: tuple) -> None:
        try:
            self._requests.send(message)
        except OSError:  # the child is gone already; the reader has failed what it held
            pass

    def _read(self) -> None:
        """Apply each turn's message to the mirrored sequences, until the child exits."""
        while True:
            try:
                turn, items = self._events.recv()
            except (EOFError, OSError):
                break
            with self._lock:  # once per turn, not per token: each item's sequence, a finished one leaving
                targets = [(item, self._live.get(item[1]) if item[0] == DELTA else self._live.pop(item[1], None)) for item in items]
            for item, seq in targets:
                if seq is not None:  # None: cancelled here, its client has gone
                    self._apply(item, seq)
            self._running, self._waiting = turn.running, turn.waiting
            self._observe(turn)
        self._process.join(10)  # its end of the pipe is closed: it has exited or is exiting
        self._running = self._waiting = 0
        with self._lock:
            lost, self._live, asked = list(self._live.values()), {}, self._closing
            self._closing = True
        if not asked:
            log.error("the engine process exited with code %s; %d sequences failed", self._process.exitcode, len(lost))
            for seq in lost:
                seq.emit(Failed(f"the engine process exited with code {self._process.exitcode}"))
            self._on_lost()

    def _apply(self, item: tuple, seq: Sequence) -> None:
        kind = item[0]
        if kind == FAILED:
            seq.emit(Failed(item[2]))
            return
        _, _, new_tokens, new_logprobs, prompt_logprobs, seq.first_token_at, seq.last_token_at, *rest = item
        if prompt_logprobs is not None:
            seq.prompt_logprobs = prompt_logprobs
        seq.logprobs += new_logprobs
        seq.generated += new_tokens
        if kind == DELTA:
            seq.emit(Delta(rest[0], len(seq.generated)))
        else:
            reason, seq.text, seq.cached_tokens = rest
            seq.emit(Finished(reason, len(seq.prompt), len(seq.generated), seq.cached_tokens))

    def _closed_error(self) -> SchedulerClosed:
        if self._process.is_alive():
            return SchedulerClosed("this engine is being swapped out")
        return EngineLost(f"the engine process exited with code {self._process.exitcode}; the server is loading it again")


# ---------------------------------------------------------------- the child process


def _engine_main(requests: Connection, events: Connection, pulled: PulledVersion, options: RuntimeOptions, max_waiting: int) -> None:
    """Load and warm the engine, answer `ready` (or `refused`), then run the scheduler for
    whatever arrives until `close`, or until the server's end of the pipe is gone."""
    # Ctrl-C (and a service manager's SIGTERM) reach the whole process group; the server
    # drains this process itself when it shuts down, and if the server dies this process
    # sees its pipe close and exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from components.runtime.grammar import built_in_background
    from components.runtime.onnxruntime import keep_freed_memory
    from components.runtime.tokenizer import EngineTokenizer
    from serving.loader import load_warm

    keep_freed_memory()
    try:
        engine = load_warm(pulled, options.threads)
    except Exception as err:  # VersionRefused, or anything else that stops it serving: the server says which
        events.send(("refused", str(err) if isinstance(err, VersionRefused) else f"{pulled.label} is refused: {type(err).__name__}: {err}"))
        return
    outbox = _Outbox(events)
    # Beside the scheduler, not on its thread at the first constrained request (every running row would wait).
    built_in_background(engine.grammar_tokenizer)
    cache = PrefixCache(engine.prefix_cache_budget(options.prefix_cache_bytes)) if options.prefix_cache_bytes else None  # the scheduler uses it where the engine can
    scheduler = Scheduler(engine, EngineTokenizer(pulled.engine_dir.path), max_waiting, options.max_batch, observe=outbox.flush, prefix_cache=cache)
    held: dict[int, Sequence] = {}
    events.send(("ready",))
    while True:
        try:
            kind, body = requests.recv()
        except EOFError:  # the server died without a word: nobody is left to answer
            kind, body = "close", None
        if kind == "submit":
            _submit(scheduler, [_child_sequence(spec, outbox, held) for spec in body], outbox)
        elif kind == "cancel":
            for sid in body:
                if (seq := held.pop(sid, None)) is not None:
                    seq.cancel()
        else:
            scheduler.close()
            return


def _submit(scheduler: Scheduler, sequences: list[Sequence], outbox: _Outbox) -> None:
    try:
        scheduler.submit(sequences)
    except (QueueFull, SchedulerClosed) as err:  # the server's line is the shorter one: a bug if it happens
        for seq in sequences:
            seq.emit(Failed(f"the engine process refused the sequence: {err}"))
        outbox.flush(Turn(scheduler.running, scheduler.waiting, 0))


def _child_sequence(spec: tuple, outbox: _Outbox, held: dict[int, Sequence]) -> Sequence:
    """The scheduler's sequence for one submitted spec; its events become progress items."""
    sid, prompt, sampling, stops, stream = spec
    sent = 0  # tokens (and their logprobs, when asked) already reported to the server
    prompt_sent = False

    def emit(event: Event) -> None:
        nonlocal sent, prompt_sent
        if isinstance(event, Failed):
            held.pop(sid, None)
            outbox.add((FAILED, sid, event.message))
            return
        new_tokens, new_logprobs, sent = seq.generated[sent:], seq.logprobs[sent:], len(seq.generated)
        prompt_logprobs, prompt_sent = (None if prompt_sent else seq.prompt_logprobs), True
        progress = (sid, new_tokens, new_logprobs, prompt_logprobs, seq.first_token_at, seq.last_token_at)
        if isinstance(event, Delta):
            outbox.add((DELTA, *progress, event.text))
        else:
            held.pop(sid, None)
            outbox.add((FINISHED, *progress, event.reason, seq.text, event.cached_tokens))

    seq = Sequence(prompt, sampling, emit, stops=stops, stream=stream)
    held[sid] = seq
    return seq


class _Outbox:
    """Progress items gathered during a turn, sent with the turn's gauges when it ends."""

    def __init__(self, events: Connection) -> None:
        self._events = events
        self._items: list[tuple] = []
        self._lock = threading.Lock()  # the scheduler's thread adds and flushes; refusals come from the main thread

    def add(self, item: tuple) -> None:
        with self._lock:
            self._items.append(item)

    def flush(self, turn: Turn) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._events.send((turn, items))
