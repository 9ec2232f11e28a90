"""The HTTP contract as pydantic models: OpenAI's completions and chat completions APIs
(FACTS.md, "Serving conventions"), the model list with the registry's facts, and OpenAI's
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
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """What completions and chat completions share: the model, how to sample, when to stop."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop: Stops = None
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None  # numpy's generators take no negative seed
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1)] = 1  # choices per prompt (the server's serving.max_n caps it)
    user: str | None = None  # accepted and ignored, as OpenAI's servers do for routing

    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever comes (benchmarks)

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    # Text, texts, or (as OpenAI's API allows) token ids: one list, or a list of lists.
    prompt: NonEmptyText | TextList | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0)] = 16  # 0 only with echo: the prompt scored, nothing generated
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # the chosen token's and this many alternatives'
    echo: bool = False  # the prompt comes back before the completion (with its logprobs when asked)

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
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        """The message as chat templates read it: text parts joined by newlines (what vLLM
        does for templates that expect a string, which most do)."""
        content = self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)
        return {"role": self.role, "content": content} | ({"name": self.name} if self.name else {})


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(gt=0)] | None = None  # the older name of max_completion_tokens
    max_completion_tokens: Annotated[int, Field(gt=0)] | None = None  # None: up to the server's limit and the context's
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

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
