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
from dataclasses import dataclass, field, replace
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from components.errors import ShapeOutOfProfile
from components.runtime.sampling import Sampling
from registry import tags
from serving.engine_client import EngineLost
from serving.chat import ChatTemplateError
from serving.follow import ServedEngine
from serving.logprobs import chat_logprobs, completion_logprobs
from serving.metrics import ServerMetrics
from serving.scheduler import Delta, Event, Failed, Finished, QueueFull, SchedulerClosed, Sequence
from serving.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatLogprobs,
    Choice,
    Completion,
    CompletionLogprobs,
    CompletionRequest,
    FunctionCall,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ToolCall,
    Usage,
)
from serving.sse import LAST_EVENT
from serving.structured import Constraint, ConstraintError, ToolPlan, chat_constraint, completion_constraint
from serving.tools import CallDelta

RequestT = TypeVar("RequestT", bound=BaseModel)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers: dict[str, str] = {}


def parse_completion(body: bytes, max_tokens_limit: int, max_n: int = 1) -> CompletionRequest:
    """The request body as a CompletionRequest, or a 400 naming the field that is wrong."""
    request = _parsed(body, CompletionRequest)
    _check_limits(request.max_tokens, request.n, max_tokens_limit, max_n)
    return request


def parse_chat(body: bytes, max_tokens_limit: int, max_n: int = 1) -> ChatCompletionRequest:
    """The request body as a ChatCompletionRequest, or a 400 naming the field that is wrong."""
    request = _parsed(body, ChatCompletionRequest)
    _check_limits(request.max_new_tokens, request.n, max_tokens_limit, max_n, "max_completion_tokens" if request.max_completion_tokens else "max_tokens")
    return request


def _parsed(body: bytes, model: type[RequestT]) -> RequestT:
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
        return model.model_validate(payload)
    except ValidationError as err:
        # A union field (prompt, stop) fails once per member; a broken limit ("at most 4
        # items") says more than "should be a valid string" about a list that is too long.
        first = min(err.errors(), key=lambda error: error["type"].endswith("_type"))
        # The field; deeper parts name union members. A check across fields names its field as its type.
        param = str(first["loc"][0]) if first["loc"] else first["type"] if first["type"] in model.model_fields else None
        message = first["msg"] if not first["loc"] and param else f"{param or 'body'}: {first['msg']}"
        raise ApiError(400, message, param=param, code=first["type"]) from None


def _check_limits(max_tokens: int | None, n: int, max_tokens_limit: int, max_n: int, name: str = "max_tokens") -> None:
    if max_tokens is not None and max_tokens > max_tokens_limit:
        raise ApiError(400, f"{name} is {max_tokens}; this server allows at most {max_tokens_limit}", param=name)
    if n > max_n:
        raise ApiError(400, f"n is {n}; this server gives at most {max_n} choices a prompt (serving.max_n)", param="n")


@dataclass(frozen=True)
class Prompt:
    """A prompt as the engine gets it, and as `echo` gives it back."""

    ids: list[int]
    text: str


@dataclass
class Submitted:
    """A request's sequences in the scheduler (`n` a prompt, choice i of prompt p at index
    p * n + i, as OpenAI numbers them) and the one queue their events arrive on."""

    sequences: list[Sequence]
    prompts: list[Prompt]
    n: int
    events: asyncio.Queue
    started: float  # time.monotonic(), the clock of the sequences' token times
    constraint: Constraint | None = None  # what the output must be (its tool calls are read back)
    done: set[int] = field(default_factory=set)

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // self.n]

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


def completion_prompts(request: CompletionRequest, served: ServedEngine) -> list[Prompt]:
    """Each prompt's tokens (text as the model expects to begin, with Llama's BOS; token ids
    as sent), checked against the vocabulary."""
    prompts = []
    for index, prompt in enumerate(request.prompts):
        if isinstance(prompt, str):
            prompts.append(Prompt(served.tokenizer.encode_prompt(prompt), prompt))
            continue
        vocab = served.pulled.engine_dir.manifest.vocab_size
        if max(prompt) >= vocab:
            raise ApiError(400, f"prompt {index} has token id {max(prompt)}; the model's vocabulary has {vocab}", param="prompt")
        prompts.append(Prompt(list(prompt), served.tokenizer.decode(list(prompt))))
    for index, prompt in enumerate(prompts):
        if not prompt.ids:
            raise ApiError(400, f"prompt {index} encodes to no tokens", param="prompt")
    return prompts


def chat_prompt(request: ChatCompletionRequest, served: ServedEngine) -> Prompt:
    """The messages rendered with the served version's chat template, then tokenized as they
    stand (the template writes the special tokens), as transformers' apply_chat_template does."""
    if served.chat_template is None:
        raise ApiError(400, f"{served.model} version {served.version} has no chat template (its tokenizer_config.json or chat_template.jinja defines none, and serving.chat_template names none): use /v1/completions", param="messages", code="no_chat_template")
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    try:
        text = served.chat_template.render([message.for_template() for message in request.messages], tools=tools)
    except ChatTemplateError as err:
        raise ApiError(400, str(err), param="messages", code="chat_template_error") from None
    except ValueError as err:  # an earlier call's arguments that are not JSON
        raise ApiError(400, f"messages: {err}", param="messages") from None
    ids = served.tokenizer.encode(text)
    if not ids:
        raise ApiError(400, "the messages render to no tokens", param="messages")
    return Prompt(ids, text)


def chat_max_tokens(request: ChatCompletionRequest, prompt: Prompt, served: ServedEngine, server_limit: int) -> int:
    """What the client asked for, else as much as the server and the engine's context allow."""
    if request.max_new_tokens is not None:
        return request.max_new_tokens
    return max(1, min(server_limit, served.scheduler.limits.max_total - len(prompt.ids)))


@dataclass(frozen=True)
class Prepared:
    """A request as its engine takes it: prompts, how to sample them, what they must spell."""

    prompts: list[Prompt]
    sampling: Sampling
    constraint: Constraint | None = None


def submit(prepared: Prepared, request: CompletionRequest | ChatCompletionRequest, served: ServedEngine, started: float, mailbox: Mailbox) -> Submitted:
    """Queue `request.n` sequences for each prompt, each choice on its own seed stream."""
    prompts, sampling = prepared.prompts, prepared.sampling
    events: asyncio.Queue = asyncio.Queue()
    count = len(prompts) * request.n
    if count > served.scheduler.max_waiting:  # a 503 would have it retry what can never fit
        raise ApiError(400, f"the request asks for {count} sequences (prompts × n); this server takes at most {served.scheduler.max_waiting} in one request", param="prompt" if request.n == 1 else "n")
    sequences = [
        Sequence(prompt.ids, replace(sampling, seed_stream=choice), _emitter(mailbox, events, index * request.n + choice), stops=request.stops, stream=request.stream)
        for index, prompt in enumerate(prompts)
        for choice in range(request.n)
    ]
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
    return Submitted(sequences, prompts, request.n, events, started, prepared.constraint)


def completion_prepared(request: CompletionRequest, served: ServedEngine, server_limit: int) -> Prepared:
    """A completion's prompts on the served engine, how to sample them, and their grammar."""
    asked = request.logprobs
    constraint = _checked(lambda: completion_constraint(request, served.grammar))
    sampling = Sampling(
        max_new_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p, seed=request.seed, stop_at_eos=not request.ignore_eos,
        logprobs=asked, prompt_logprobs=asked if request.echo else None, grammar=constraint.grammar if constraint else None,
    )  # fmt: skip
    return Prepared(completion_prompts(request, served), sampling, constraint)


def chat_prepared(request: ChatCompletionRequest, served: ServedEngine, server_limit: int) -> Prepared:
    """A chat's rendered prompt on the served engine, how to sample it (max_tokens by
    default: what the server and the engine's context leave), and its grammar (its tools',
    its response_format's)."""
    constraint = _checked(lambda: chat_constraint(request, served.grammar, served.tool_format))
    prompt = chat_prompt(request, served)
    sampling = Sampling(
        max_new_tokens=chat_max_tokens(request, prompt, served, server_limit), temperature=request.temperature, top_p=request.top_p,
        seed=request.seed, stop_at_eos=not request.ignore_eos, logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        grammar=constraint.grammar if constraint else None,
    )  # fmt: skip
    return Prepared([prompt], sampling, constraint)


def _checked(constraint_of):
    """The request's constraint, or a 400 naming what in it is wrong."""
    try:
        return constraint_of()
    except ConstraintError as err:
        raise ApiError(400, str(err), param=err.param, code="invalid_constraint") from None


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


async def finished_of(job: Submitted) -> dict[int, Finished]:
    """Each sequence's end, once all have ended (their texts are then final: the scheduler
    sends no deltas for a request that does not stream)."""
    return {index: event async for index, event in events_of(job) if isinstance(event, Finished)}


async def complete(served: ServedEngine, job: Submitted, request: CompletionRequest) -> Completion:
    """The whole completion once every sequence has ended."""
    finished = await finished_of(job)
    choices = [
        Choice(index=i, text=(job.prompt_of(i).text if request.echo else "") + seq.text, finish_reason=finished[i].reason, logprobs=_completion_logprobs(served, job, i, request))
        for i, seq in enumerate(job.sequences)
    ]  # fmt: skip
    return Completion(id=job_id(), created=int(time.time()), model=served.model, choices=choices, usage=usage_of(finished.values()))


def _completion_logprobs(served: ServedEngine, job: Submitted, index: int, request: CompletionRequest) -> CompletionLogprobs | None:
    if request.logprobs is None:
        return None
    seq = job.sequences[index]
    tokens, logprobs = list(seq.generated), list(seq.logprobs)
    if request.echo:
        tokens, logprobs = seq.prompt + tokens, list(seq.prompt_logprobs or [None] * len(seq.prompt)) + logprobs
    return completion_logprobs(served.tokenizer, tokens, logprobs)


async def complete_chat(served: ServedEngine, job: Submitted, request: ChatCompletionRequest) -> ChatCompletion:
    """The whole chat completion once every choice has ended; with tools, each choice's
    calls read out of its text."""
    finished = await finished_of(job)
    plan = job.constraint.tools if job.constraint else None
    choices = []
    for i, seq in enumerate(job.sequences):
        logprobs = ChatLogprobs(content=chat_logprobs(served.tokenizer, seq.generated, seq.logprobs)) if request.logprobs else None
        message, reason = AssistantMessage(content=seq.text), finished[i].reason
        if plan is not None:
            reader = plan.reader()
            reader.feed(served.tokenizer.decode(seq.generated, skip_special_tokens=not _marker_is_special(served, plan)), final=True)
            calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in reader.calls if c.complete]
            message, reason = AssistantMessage(content=reader.content or None, tool_calls=calls or None), tool_finish(plan, bool(calls), reason)
        choices.append(ChatChoice(index=i, message=message, finish_reason=reason, logprobs=logprobs))
    return ChatCompletion(id=job_id("chatcmpl"), created=int(time.time()), model=served.model, choices=choices, usage=usage_of(finished.values()))


def tool_finish(plan: ToolPlan, called: bool, reason: str) -> str:
    """OpenAI's finish_reason for an answer with tools: `tool_calls` where it made calls (a
    named function: `stop`), `length` where max_tokens cut it."""
    if reason == "length" or not called:
        return reason
    return "stop" if plan.named else "tool_calls"


def _marker_is_special(served: ServedEngine, plan: ToolPlan) -> bool:
    """The calls' text needs the special tokens kept where the format's marker is one
    (Mistral's [TOOL_CALLS]); elsewhere they stay out, as in any answer's text."""
    return not served.grammar.decoded_as_text(plan.fmt.trigger)


async def stream(served: ServedEngine, job: Submitted, request: CompletionRequest) -> AsyncIterator[str]:
    """Server-sent events: a chunk per generated token, a last chunk per choice with its
    finish_reason (and the usage, once all have ended), then `data: [DONE]`. Chunks that
    are ready together leave in one write. A token's chunk may carry no text (part of a
    character, or text held back while it could begin a stop string): sent all the same,
    as vLLM does, so that a client sees each token as its step completes (a model whose
    tokens decode to nothing for a while streamed nothing until its end). With `echo`, a
    choice's first chunk is its prompt."""
    chunks = _ChunkWriter(job_id(), int(time.time()), served.model)
    sent = [0] * len(job.sequences)  # tokens whose logprobs have gone out, per choice
    offsets = [0] * len(job.sequences)  # text sent, per choice (logprobs' text_offset)
    echoed: set[int] = set()

    def echo(index: int) -> str:
        # At the choice's first event: its prompt's log probabilities come with it.
        if not request.echo or index in echoed:
            return ""
        echoed.add(index)
        prompt, seq = job.prompt_of(index), job.sequences[index]
        if request.logprobs is None:
            return chunks.delta(index, prompt.text)
        logprobs = completion_logprobs(served.tokenizer, seq.prompt, seq.prompt_logprobs or [None] * len(seq.prompt))
        offsets[index] = sum(map(len, logprobs.tokens))
        return chunks.chunk(index, prompt.text, logprobs.model_dump())

    def delta(index: int, event: Delta) -> str:
        if request.logprobs is None:
            return echo(index) + chunks.delta(index, event.text)
        head, seq, start = echo(index), job.sequences[index], sent[index]
        sent[index] = event.tokens
        logprobs = completion_logprobs(served.tokenizer, seq.generated[start : event.tokens], seq.logprobs[start : event.tokens], offsets[index])
        offsets[index] += sum(map(len, logprobs.tokens))
        return head + chunks.chunk(index, event.text, logprobs.model_dump())

    def last(index: int, event: Finished, usage: Usage | None) -> str:
        return echo(index) + chunks.last(index, event.reason, usage)

    async for piece in _stream_events(job, [], delta, last, lambda usage: ""):
        yield piece


async def stream_chat(served: ServedEngine, job: Submitted, request: ChatCompletionRequest) -> AsyncIterator[str]:
    """`chat.completion.chunk` events: each choice's role first, then its content token by
    token, then its finish_reason; with stream_options.include_usage, every chunk has a
    `usage` of null and a last chunk with no choices carries the usage; then `data: [DONE]`."""
    head = {"id": job_id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time()), "model": served.model}
    with_usage = {"usage": None} if request.include_usage else {}
    sent = [0] * len(job.sequences)

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: list | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": finish_reason}
        return f"data: {json.dumps(head | {'choices': [choice]} | with_usage, ensure_ascii=False)}\n\n"

    def content_delta(index: int, event: Delta) -> str:
        if not request.logprobs:
            return chunk(index, {"content": event.text})
        seq, start = job.sequences[index], sent[index]
        sent[index] = event.tokens
        entries = chat_logprobs(served.tokenizer, seq.generated[start : event.tokens], seq.logprobs[start : event.tokens])
        return chunk(index, {"content": event.text}, logprobs=[entry.model_dump() for entry in entries])

    def usage_chunk(usage: Usage) -> str:
        return f"data: {json.dumps(head | {'choices': [], 'usage': usage.model_dump(exclude_none=True)}, ensure_ascii=False)}\n\n" if request.include_usage else ""

    plan = job.constraint.tools if job.constraint else None
    if plan is not None:
        delta, last = _tool_deltas(served, job, request, plan, chunk)
    else:
        delta, last = content_delta, lambda index, event, usage: chunk(index, {}, event.reason)
    ready = [chunk(i, {"role": "assistant", "content": ""}) for i in range(len(job.sequences))]
    async for piece in _stream_events(job, ready, delta, last, usage_chunk):
        yield piece


def _tool_deltas(served: ServedEngine, job: Submitted, request: ChatCompletionRequest, plan: ToolPlan, chunk):
    """`delta` and `last` for a chat with tools: each choice's text read as it grows, content
    as content and each call as OpenAI streams one (its first delta with id, type and name,
    then fragments of its arguments); no call's markup reaches the content."""
    keep = _marker_is_special(served, plan)
    readers = [plan.reader() for _ in job.sequences]
    decoders = [served.tokenizer.stream_decoder(skip_special_tokens=not keep) for _ in job.sequences]
    texts, sent, called = [""] * len(job.sequences), [0] * len(job.sequences), [False] * len(job.sequences)

    def pieces(index: int, upto: int, final: bool = False) -> str:
        seq = job.sequences[index]
        texts[index] += "".join(decoders[index](token) or "" for token in seq.generated[sent[index] : upto])
        logprobs = chat_logprobs(served.tokenizer, seq.generated[sent[index] : upto], seq.logprobs[sent[index] : upto]) if request.logprobs else []
        sent[index] = upto
        out = []
        for item in readers[index].feed(texts[index], final):
            if isinstance(item, CallDelta):
                called[index] = True
                out.append(chunk(index, {"tool_calls": [_call_delta(item)]}))
            else:
                out.append(chunk(index, {"content": item}))
        if logprobs:
            out.append(chunk(index, {"content": ""}, logprobs=[entry.model_dump() for entry in logprobs]))
        return "".join(out)

    def delta(index: int, event: Delta) -> str:
        return pieces(index, event.tokens)

    def last(index: int, event: Finished, usage: Usage | None) -> str:
        return pieces(index, len(job.sequences[index].generated), final=True) + chunk(index, {}, tool_finish(plan, called[index], event.reason))

    return delta, last


def _call_delta(item: CallDelta) -> dict:
    if item.id is None:
        return {"index": item.index, "function": {"arguments": item.arguments}}
    return {"index": item.index, "id": item.id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}


async def _stream_events(job: Submitted, ready: list[str], delta, last, usage_chunk) -> AsyncIterator[str]:
    """The request's events as SSE text: `delta(index, Delta)`, `last(index, Finished, usage
    or None)` per choice, `usage_chunk(usage)` once all have ended, then `[DONE]`; an error
    after the headers went out travels as an event."""
    finished: dict[int, Finished] = {}
    try:
        async for index, event in events_of(job):
            if isinstance(event, Delta):
                ready.append(delta(index, event))
            else:
                finished[index] = event
                usage = usage_of(finished.values()) if len(finished) == len(job.sequences) else None
                ready.append(last(index, event, usage))
                if usage is not None:
                    ready.append(usage_chunk(usage))
            if ready and job.events.empty() and len(finished) < len(job.sequences):  # the last ones leave with [DONE]
                yield "".join(ready)
                ready.clear()
    except ApiError as err:  # the headers are sent: the error travels as an event
        error = {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
        ready.append(f"data: {json.dumps({'error': error})}\n\n")
    yield "".join(ready) + LAST_EVENT


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

    def chunk(self, index: int, text: str, logprobs: dict) -> str:
        """A delta with its tokens' logprobs (asked for, so off the hot path)."""
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
        return f"data: {json.dumps(self._head | {'choices': [choice]}, ensure_ascii=False)}\n\n"

    def last(self, index: int, reason: str, usage: Usage | None) -> str:
        choice = {"index": index, "text": "", "logprobs": None, "finish_reason": reason}
        body = self._head | {"choices": [choice]} | ({"usage": usage.model_dump(exclude_none=True)} if usage else {})
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def usage_of(finished) -> Usage:
    finished = list(finished)
    prompt = sum(f.prompt_tokens for f in finished)
    completion = sum(f.completion_tokens for f in finished)
    cached = sum(f.cached_tokens for f in finished)
    details = PromptTokensDetails(cached_tokens=cached) if cached else None
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion, prompt_tokens_details=details)


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
        precision=facts[tags.PRECISION], backend=facts[tags.BACKEND], engine_sha256=facts[tags.ENGINE_SHA256], signing_key=facts[tags.SIGNING_KEY],
    )  # fmt: skip
    return ModelList(data=[card])


def check_model(request: CompletionRequest | ChatCompletionRequest, served: ServedEngine) -> None:
    if request.model != served.model:
        raise ApiError(404, f"model {request.model!r} is not served here; this server serves {served.model!r}", param="model", code="model_not_found")


def job_id(kind: str = "cmpl") -> str:
    return f"{kind}-{uuid.uuid4().hex}"
