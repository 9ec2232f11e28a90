"""The HTTP contract as pydantic models: OpenAI's completions and chat completions APIs
(docs/reference/http-api.md), the model list with the registry's facts, and OpenAI's
error body.

Requests are strict: unknown fields and wrong types are errors naming the field, never
coerced (a `"max_tokens": "10"` is a mistake the client should hear about).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

NonEmptyText = Annotated[str, Field(min_length=1)]
TextList = Annotated[list[NonEmptyText], Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class _Strict(BaseModel):
    """A part of a request: unknown fields and wrong types are errors, never coerced."""

    model_config = ConfigDict(extra="forbid", strict=True)


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


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, a list of choices
    or a Lark grammar, so that clients written for vLLM work unchanged."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True, use_attribute_docstrings=True)

    json_schema: object = Field(None, alias="json")
    """A JSON schema (an object, or its text) the output must match; checked when compiled."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect) the output must match."""

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name, value in (("json", self.json_schema), ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar)) if value is not None]
        if len(given) != 1:
            raise PydanticCustomError("structured_outputs", "structured_outputs takes exactly one of json, regex, choice or grammar, not {given}", {"given": ", ".join(given) or "none"})
        return self


class _StructuredRequest(_SamplingRequest):
    structured_outputs: StructuredOutputs | None = None
    """vLLM's extension: constrain the output to a JSON schema, regex, choice or grammar."""


class CompletionRequest(_StructuredRequest):
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


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str
    """The arguments as JSON text, as the model wrote them."""


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    """Text, or a list of text parts (joined by newlines); null only for an assistant's tool calls."""
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None
    """An assistant's earlier calls, rendered back into the conversation."""
    tool_call_id: str | None = None
    """A tool message: the call it answers."""

    @model_validator(mode="after")
    def _says_something(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("messages", "only an assistant message carries tool_calls, not a {role} message", {"role": self.role})
        if self.content is None and self.tool_calls is None:
            raise PydanticCustomError("messages", "a {role} message needs content", {"role": self.role})
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("messages", "a tool message needs tool_call_id: the call it answers")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it: text parts joined by newlines (what vLLM
        does for templates that expect a string, which most do); a call's arguments as an
        object, as transformers' templates take them (ValueError: arguments that are not
        JSON)."""
        content = self.content if self.content is None or isinstance(self.content, str) else "\n".join(part.text for part in self.content)
        message = {"role": self.role, "content": content} | ({"name": self.name} if self.name else {})
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            message["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}} for call in self.tool_calls
            ]
        return message


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"a tool call's arguments are not JSON: {err}") from None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    name: FunctionName
    """Letters, digits, _ and -, at most 64."""
    description: str | None = None
    parameters: dict | None = None
    """The arguments' JSON schema: an object schema; null takes none."""
    strict: bool | None = None
    """Accepted: kiln constrains every call to its schema."""

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, parameters):
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError(f"parameters must be an object schema (type object), not type {parameters.get('type')!r}")
        return parameters


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: FunctionName
    description: str | None = None
    json_schema: object = Field(None, alias="schema")  # checked when compiled, naming what is wrong
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class ChatCompletionRequest(_StructuredRequest):
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
    response_format: ResponseFormat | None = None
    """`text`, `json_object` (any JSON object) or `json_schema` (one that matches the schema)."""
    tools: Annotated[list[Tool], Field(min_length=1)] | None = None
    """Functions the model may call, rendered into its chat template."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """none, auto (the default with tools), required, or a named function."""
    parallel_tool_calls: bool = True
    """More than one call in an answer."""

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tools_are_known(self):
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) < len(names):
            raise PydanticCustomError("tools", "tools: the function '{name}' is defined twice", {"name": next(n for n in names if names.count(n) > 1)})
        if self.tool_choice not in (None, "none") and not names:
            raise PydanticCustomError("tool_choice", "tool_choice needs tools to choose from")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise PydanticCustomError("tool_choice", "tool_choice names '{name}', which is not in tools ({names})", {"name": self.tool_choice.function.name, "names": ", ".join(names)})
        constrained = self.structured_outputs is not None or (self.response_format is not None and self.response_format.type != "text")
        if names and self.tool_choice != "none" and constrained:
            raise PydanticCustomError("tools", "tools and response_format (or structured_outputs) cannot constrain one answer together: send one of them")
        if self.structured_outputs is not None and self.response_format is not None and self.response_format.type != "text":
            raise PydanticCustomError("response_format", "response_format and structured_outputs both constrain the answer: send one of them")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens whose KV cache was reused (serving.prefix_cache_mib), not computed."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # with a prefix cache, as OpenAI reports it


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
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


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
