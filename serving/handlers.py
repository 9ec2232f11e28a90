"""What the routes do, as plain functions over the served engine: parse and check a
request, hand its prompts to the scheduler, gather or stream what comes back. Errors are
`ApiError`s carrying the status and OpenAI's error fields; the app maps them to responses.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import ValidationError

from components.errors import ShapeOutOfProfile
from components.runtime.sampling import Sampling
from registry import tags
from serving.engine_client import EngineLost
from serving.follow import ServedEngine
from serving.metrics import ServerMetrics
from serving.scheduler import Delta, Event, Failed, Finished, QueueFull, SchedulerClosed, Sequence
from serving.schemas import Choice, Completion, CompletionRequest, ModelCard, ModelList, Usage


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers: dict[str, str] = {}


def parse_completion(body: bytes, max_tokens_limit: int) -> CompletionRequest:
    """The request body as a CompletionRequest, or a 400 naming the field that is wrong."""
    try:
        payload = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ApiError(400, f"the request body is not UTF-8: {err}", code="invalid_encoding") from None
    except json.JSONDecodeError as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body nests arrays or objects too deeply to read", code="invalid_json") from None
    except ValueError as err:  # Python's limit on an integer's digits (sys.get_int_max_str_digits)
        raise ApiError(400, f"the request body holds a number kiln will not read: {str(err).split(';')[0]}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(payload).__name__}", code="invalid_json")
    try:
        request = CompletionRequest.model_validate(payload)
    except ValidationError as err:
        # A union field (prompt, stop) fails once per member; a broken limit ("at most 4
        # items") says more than "should be a valid string" about a list that is too long.
        first = min(err.errors(), key=lambda error: error["type"].endswith("_type"))
        param = str(first["loc"][0]) if first["loc"] else None  # the field; deeper parts name union members
        raise ApiError(400, f"{param or 'body'}: {first['msg']}", param=param, code=first["type"]) from None
    if request.max_tokens > max_tokens_limit:
        raise ApiError(400, f"max_tokens is {request.max_tokens}; this server allows at most {max_tokens_limit}", param="max_tokens")
    return request


@dataclass
class Submitted:
    """A request's sequences in the scheduler and the one queue their events arrive on."""

    sequences: list[Sequence]
    events: asyncio.Queue
    started: float  # time.monotonic(), the clock of the sequences' token times
    done: set[int] = field(default_factory=set)

    def cancel(self) -> None:
        for seq in self.sequences:
            seq.cancel()


class Mailbox:
    """Events from the scheduler's thread into the event loop, with one wake-up per batch
    of events rather than one per token: a decode step of 16 rows wakes the loop once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: deque[tuple[asyncio.Queue, object]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item: object) -> None:  # any thread
        with self._lock:
            self._pending.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def _deliver(self) -> None:  # the event loop
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, deque(), False
        for queue, item in pending:
            queue.put_nowait(item)


def submit(request: CompletionRequest, served: ServedEngine, started: float, mailbox: Mailbox) -> Submitted:
    """Tokenize, check against the engine's profile, and queue every prompt of the request."""
    events: asyncio.Queue = asyncio.Queue()
    sampling = Sampling(
        max_new_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p, seed=request.seed, stop_at_eos=not request.ignore_eos
    )
    vocab = served.pulled.engine_dir.manifest.vocab_size
    if len(request.prompts) > served.scheduler.max_waiting:  # a 503 would have it retry what can never fit
        raise ApiError(400, f"the request has {len(request.prompts)} prompts; this server takes at most {served.scheduler.max_waiting} in one request", param="prompt")
    sequences = []
    for index, prompt in enumerate(request.prompts):
        ids = served.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise ApiError(400, f"prompt {index} encodes to no tokens", param="prompt")
        if max(ids) >= vocab:
            raise ApiError(400, f"prompt {index} has token id {max(ids)}; the model's vocabulary has {vocab}", param="prompt")
        sequences.append(Sequence(ids, sampling, _emitter(mailbox, events, index), stops=request.stops, stream=request.stream))
    try:
        served.scheduler.submit(sequences)
    except ShapeOutOfProfile as err:
        raise ApiError(400, str(err), param="max_tokens" if "max_tokens" in str(err) else "prompt", code="context_length_exceeded") from None
    except QueueFull as err:
        raise _busy(f"the server is busy: {err}; retry shortly", "queue_full") from None
    except EngineLost as err:
        raise _busy(f"the engine is not running: {err}", "engine_lost") from None
    except SchedulerClosed as err:
        raise _busy(f"the engine is being swapped: {err}; retry", "engine_swapping") from None
    return Submitted(sequences, events, started)


def _busy(message: str, code: str) -> ApiError:
    busy = ApiError(503, message, type="server_busy", code=code)
    busy.headers["Retry-After"] = "1"
    return busy


def _emitter(mailbox: Mailbox, events: asyncio.Queue, index: int):
    return lambda event: mailbox.post(events, (index, event))  # called on the scheduler's thread


async def events_of(job: Submitted) -> AsyncIterator[tuple[int, Event]]:
    """Every event of the request, in order, until each of its sequences has ended."""
    while len(job.done) < len(job.sequences):
        index, event = await job.events.get()
        if isinstance(event, Finished | Failed):
            job.done.add(index)
        if isinstance(event, Failed):
            raise ApiError(500, event.message, type="server_error", code="engine_failed")
        yield index, event


async def complete(served: ServedEngine, job: Submitted) -> Completion:
    """The whole answer once every sequence has ended (its text is then final: the
    scheduler sends no deltas for a request that does not stream)."""
    finished: dict[int, Finished] = {}
    async for index, event in events_of(job):
        if isinstance(event, Finished):
            finished[index] = event
    choices = [Choice(index=i, text=seq.text, finish_reason=finished[i].reason) for i, seq in enumerate(job.sequences)]
    return Completion(id=job_id(), created=int(time.time()), model=served.model, choices=choices, usage=usage_of(finished.values()))


async def stream(served: ServedEngine, job: Submitted) -> AsyncIterator[str]:
    """Server-sent events: a chunk per generated token, a last chunk per choice with its
    finish_reason (and the usage, once all have ended), then `data: [DONE]`. Chunks that
    are ready together leave in one write. A token's chunk may carry no text (part of a
    character, or text held back while it could begin a stop string): sent all the same,
    as vLLM does, so that a client sees each token as its step completes (a model whose
    tokens decode to nothing for a while streamed nothing until its end)."""
    chunks = _ChunkWriter(job_id(), int(time.time()), served.model)
    finished: dict[int, Finished] = {}
    ready: list[str] = []
    try:
        async for index, event in events_of(job):
            if isinstance(event, Delta):
                ready.append(chunks.delta(index, event.text))
            else:
                finished[index] = event
                last = len(finished) == len(job.sequences)
                ready.append(chunks.last(index, event.reason, usage_of(finished.values()) if last else None))
            if ready and job.events.empty():
                yield "".join(ready)
                ready.clear()
    except ApiError as err:  # the headers are sent: the error travels as an event
        error = {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
        ready.append(f"data: {json.dumps({'error': error})}\n\n")
    yield "".join(ready) + "data: [DONE]\n\n"


class _ChunkWriter:
    """A request's `text_completion` chunks as SSE lines. A delta chunk differs from the
    last only in its index and text, so its JSON is the request's fixed head plus the
    encoded text, not a json.dumps of the whole object: one chunk per token per client is
    the server's hottest path (the bytes are json.dumps's, which a test compares)."""

    def __init__(self, id: str, created: int, model: str) -> None:
        self._head = {"id": id, "object": "text_completion", "created": created, "model": model}
        self._prefix = "data: " + json.dumps(self._head, ensure_ascii=False)[:-1] + ', "choices": [{"index": '

    def delta(self, index: int, text: str) -> str:
        return f'{self._prefix}{index}, "text": {json.dumps(text, ensure_ascii=False)}, "logprobs": null, "finish_reason": null}}]}}\n\n'

    def last(self, index: int, reason: str, usage: Usage | None) -> str:
        choice = {"index": index, "text": "", "logprobs": None, "finish_reason": reason}
        body = self._head | {"choices": [choice]} | ({"usage": usage.model_dump()} if usage else {})
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def usage_of(finished) -> Usage:
    finished = list(finished)
    prompt = sum(f.prompt_tokens for f in finished)
    completion = sum(f.completion_tokens for f in finished)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def observe(job: Submitted, metrics: ServerMetrics, outcome: str) -> None:
    """A finished request's times and counts (token times as the engine process saw them)."""
    now = time.monotonic()
    metrics.requests.labels(outcome).inc()
    metrics.request_duration.observe(now - job.started)
    metrics.prompt_tokens.inc(sum(len(s.prompt) for s in job.sequences))
    metrics.generated_tokens.inc(sum(len(s.generated) for s in job.sequences))
    for seq in job.sequences:
        if seq.first_token_at is not None:
            metrics.time_to_first_token.observe(seq.first_token_at - job.started)
            if len(seq.generated) > 1:
                metrics.time_per_output_token.observe((seq.last_token_at - seq.first_token_at) / (len(seq.generated) - 1))


def model_list(served: ServedEngine, alias: str | None) -> ModelList:
    facts = served.facts
    card = ModelCard(
        id=served.model, created=served.created, version=served.version, alias=alias,
        precision=facts[tags.PRECISION], backend=facts[tags.BACKEND], engine_sha256=facts[tags.ENGINE_SHA256],
    )  # fmt: skip
    return ModelList(data=[card])


def check_model(request: CompletionRequest, served: ServedEngine) -> None:
    if request.model != served.model:
        raise ApiError(404, f"model {request.model!r} is not served here; this server serves {served.model!r}", param="model", code="model_not_found")


def job_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"
