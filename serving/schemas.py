"""The HTTP contract as pydantic models: OpenAI's completions API (FACTS.md, "Serving
conventions"), the model list with the registry's facts, and OpenAI's error body.

Requests are strict: unknown fields and wrong types are errors naming the field, never
coerced (a `"max_tokens": "10"` is a mistake the client should hear about).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

NonEmptyText = Annotated[str, Field(min_length=1)]
TextList = Annotated[list[NonEmptyText], Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    # Text, texts, or (as OpenAI's API allows) token ids: one list, or a list of lists.
    prompt: NonEmptyText | TextList | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: Annotated[int, Field(gt=0)] = 16
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=4)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None  # numpy's generators take no negative seed
    stream: bool = False
    n: Literal[1] = 1  # one choice per prompt: kiln does not sample alternatives
    user: str | None = None  # accepted and ignored, as OpenAI's servers do for routing

    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever comes (benchmarks)

    @field_validator("prompt")
    @classmethod
    def _no_blank_prompt(cls, prompt):
        if any(isinstance(p, str) and not p.strip() for p in ([prompt] if isinstance(prompt, str) else prompt)):
            raise ValueError("a prompt must contain text, not only whitespace")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a text, or the token ids of one prompt."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Choice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


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
