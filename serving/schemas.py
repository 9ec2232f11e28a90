"""The HTTP contract as pydantic models: OpenAI's completions and chat completions APIs
(docs/reference/http-api.md), the model list with the registry's facts, and OpenAI's
error body.

Requests are strict: unknown fields and wrong types are errors naming the field, never
coerced (a `"max_tokens": "10"` is a mistake the client should hear about).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

NonEmptyText = Annotated[str, Field(min_length=1)]
TextList = Annotated[list[NonEmptyText], Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


Stops = NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=4)] | None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    include_usage: bool = False
    """A last chunk carries the usage (prompt and completion tokens)."""


class _SamplingRequest(BaseModel):
    """What completions and chat completions share: the model, how to sample, when to stop."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    model: str
    """The served model's name (`GET /v1/models`); another name is 404."""
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    """Sampling temperature; 0 is greedy."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling: draw from the smallest set of tokens holding this much probability."""
    stop: Stops = None
    """Up to 4 strings; the text ends before the first that appears."""
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None  # numpy's generators take no negative seed
    """Makes sampling reproducible, whatever batch the request joins."""
    stream: bool = False
    """Answer server-sent events as tokens arrive, ending with `data: [DONE]`."""
    stream_options: StreamOptions | None = None
    """With stream: `include_usage` adds a last chunk with the usage."""
    n: Annotated[int, Field(ge=1)] = 1
    """Independent choices per prompt (at most serving.max_n)."""
    user: str | None = None
    """Accepted and ignored, as OpenAI's servers do."""

    ignore_eos: bool = False
    """vLLM's extension: generate max_tokens whatever comes (benchmarks)."""

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: NonEmptyText | TextList | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    """Text, a list of texts, or (as OpenAI's API allows) token ids: one list, or a list of lists."""
    max_tokens: Annotated[int, Field(ge=0)] = 16
    """Tokens to generate; 0 only with echo (the prompt scored, nothing generated)."""
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    """The chosen token's log probability and this many alternatives', per token."""
    echo: bool = False
    """The prompt comes back before the completion (with its log probabilities when asked)."""

    @field_validator("prompt")
    @classmethod
    def _no_blank_prompt(cls, prompt):
        if any(isinstance(p, str) and not p.strip() for p in ([prompt] if isinstance(prompt, str) else prompt)):
            raise ValueError("a prompt must contain text, not only whitespace")
        return prompt

    @model_validator(mode="after")
    def _generates_or_echoes(self):
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("max_tokens", "max_tokens: 0 generates nothing; it is only allowed with echo (to score the prompt)")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a text, or the token ids of one prompt."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    role: Literal["system", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    """Text, or a list of text parts (joined by newlines)."""
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        """The message as chat templates read it: text parts joined by newlines (what vLLM
        does for templates that expect a string, which most do)."""
        content = self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)
        return {"role": self.role, "content": content} | ({"name": self.name} if self.name else {})


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    """The conversation, rendered with the served version's chat template."""
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    """The older name of max_completion_tokens."""
    max_completion_tokens: Annotated[int, Field(gt=0)] | None = None
    """Tokens to generate; null: what serving.max_tokens and the context leave."""
    logprobs: bool = False
    """Each generated token's log probability."""
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    """With logprobs: this many alternatives per token."""

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's completions logprobs: per token its text, log probability (None for a
    prompt's first token, which nothing predicts), the most likely alternatives (with the
    chosen token) and where its text begins in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class Choice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobs(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobs]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    """An entry of `GET /v1/models`: OpenAI's fields, then what the registry says it is."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kiln"
    version: str
    alias: str | None  # None: a local engine directory, not a registry alias
    precision: str
    backend: str
    engine_sha256: str
    signing_key: str  # the fingerprint of the trusted key that signed it; "unsigned" where that is allowed


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
