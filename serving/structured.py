"""What a request's output must be, as the grammar the engine process constrains it by:
`response_format`, vLLM's `structured_outputs` and tool calls, each compiled to llguidance's
form and checked here, against the served tokenizer, so that a bad schema, regex or grammar
is a 400 naming what was wrong and never reaches the engine process."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from components.runtime.grammar import GrammarError, check_grammar, grammar_tokenizer, json_schema_grammar
from serving.schemas import ChatCompletionRequest, CompletionRequest, NamedToolChoice, StructuredOutputs
from serving.tools import ToolCallReader, ToolFormat, tools_grammar


class ConstraintError(ValueError):
    """A constraint the request cannot have: the message says what, `param` where."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """How a chat's tool calls are read back out of its text."""

    fmt: ToolFormat
    names: tuple[str, ...]
    from_first_token: bool  # `required` or a named function: the text is calls alone
    named: bool  # a named function: finish_reason `stop`, as OpenAI answers

    def reader(self) -> ToolCallReader:
        return ToolCallReader(self.fmt, self.names, in_block=self.from_first_token)


@dataclass(frozen=True)
class Constraint:
    """A request's grammar; `kind` names it in the metrics."""

    kind: str
    grammar: str
    tools: ToolPlan | None = None


@dataclass(frozen=True)
class GrammarContext:
    """What grammars are checked against: the served engine's tokenizer and its special tokens."""

    engine_dir: Path
    vocab_size: int
    stop_ids: tuple[int, ...]

    @property
    def tokenizer(self):
        return grammar_tokenizer(self.engine_dir / "tokenizer.json", self.vocab_size, self.stop_ids)

    @functools.cached_property
    def added(self) -> dict[str, dict]:
        """The tokenizer's added tokens by their text: llguidance reads every one as a
        special token, which a grammar names by id (text never spells it)."""
        return {token["content"]: token for token in json.loads((self.engine_dir / "tokenizer.json").read_text()).get("added_tokens", [])}

    @property
    def token_ids(self) -> dict[str, int]:
        return {text: token["id"] for text, token in self.added.items()}

    def decoded_as_text(self, marker: str) -> bool:
        """Whether decoding keeps `marker` with special tokens skipped (Qwen's <tool_call>
        is an added token, not a special one; Mistral's [TOOL_CALLS] is special)."""
        return not self.added.get(marker, {}).get("special", False)

    def checked(self, kind: str, grammar: str, param: str, tools: ToolPlan | None = None) -> Constraint:
        try:
            check_grammar(grammar, self.tokenizer)  # the tokenizer too may be unreadable: a GrammarError
        except GrammarError as err:
            raise ConstraintError(f"{param}: {err}", param) from None
        return Constraint(kind, grammar, tools)


def completion_constraint(request: CompletionRequest, context: GrammarContext) -> Constraint | None:
    return _structured(request.structured_outputs, context) if request.structured_outputs else None


def chat_constraint(request: ChatCompletionRequest, context: GrammarContext, tool_format: ToolFormat | None) -> Constraint | None:
    """The chat's grammar: its tools' (unless tool_choice is none), its response_format's, or
    its structured_outputs'; None where the text is free."""
    if request.tools and request.tool_choice != "none":
        return _tools(request, context, tool_format)
    if request.structured_outputs is not None:
        return _structured(request.structured_outputs, context)
    if request.response_format is None or request.response_format.type == "text":
        return None
    if request.response_format.type == "json_object":
        return context.checked("json_object", json_schema_grammar({"type": "object"}), "response_format")
    schema = request.response_format.json_schema.json_schema
    return context.checked("json_schema", _schema_grammar(schema if schema is not None else {"type": "object"}, "response_format"), "response_format")


def _structured(asked: StructuredOutputs, context: GrammarContext) -> Constraint:
    from llguidance import LLMatcher, gbnf_to_lark

    param = "structured_outputs"
    if asked.json_schema is not None:
        schema = asked.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise ConstraintError(f"structured_outputs.json is not JSON: {err}", param) from None
        return context.checked("json_schema", _schema_grammar(schema, param), param)
    if asked.regex is not None:
        return context.checked("regex", LLMatcher.grammar_from_regex(asked.regex), param)
    if asked.choice is not None:
        return context.checked("choice", LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, asked.choice))), param)
    grammar = asked.grammar
    if "::=" in grammar:  # GBNF, as llama.cpp and xgrammar write grammars
        try:
            grammar = gbnf_to_lark(grammar)
        except Exception as err:  # noqa: BLE001 — the converter's own words name the fault
            raise ConstraintError(f"structured_outputs.grammar: {err}", param) from None
    return context.checked("grammar", LLMatcher.grammar_from_lark(grammar), param)


def _schema_grammar(schema: object, param: str) -> str:
    if not isinstance(schema, dict | bool):
        raise ConstraintError(f"{param}: a JSON schema is an object (or true/false), not {type(schema).__name__}", param)
    return json_schema_grammar(schema)


def _tools(request: ChatCompletionRequest, context: GrammarContext, fmt: ToolFormat | None) -> Constraint:
    if fmt is None:
        raise ConstraintError(
            "tools: this model's chat template writes no tool-call format kiln knows (Hermes <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS]); "
            "set serving.tool_format for it",
            "tools",
        )
    tools = {tool.function.name: tool.function.parameters for tool in request.tools}
    named = isinstance(request.tool_choice, NamedToolChoice)
    if named:
        tools = {request.tool_choice.function.name: tools[request.tool_choice.function.name]}
    mode = "required" if named or request.tool_choice == "required" else "auto"
    grammar = tools_grammar(fmt, tools, mode, request.parallel_tool_calls and not named, context.token_ids)
    plan = ToolPlan(fmt, tuple(tools), from_first_token=mode == "required", named=named)
    return context.checked("tools", grammar, "tools", plan)
