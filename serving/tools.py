"""Tool calls in each model family's own format: the grammar that constrains them, and the
parser that reads them back out of the generated text (streamed or whole).

A format is where a call begins and ends in the text and how several are joined: Qwen2 and
Hermes write `<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>` per call, Llama 3
`{"name": …, "parameters": …}` joined by `; `, Mistral `[TOOL_CALLS] [{…}, {…}]`. The
grammar writes the name and the layout itself, so the model chooses only which tool and its
arguments (llguidance's `%json` for the tool's schema); under `auto` the text is free until
the model writes the format's trigger (a lazy lexeme, as llguidance's structural tags do).
Since the layout is the grammar's, the parser reads back exactly what it wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal

from components.runtime.grammar import JSON_LAYOUT

ToolFormatName = Literal["hermes", "llama3_json", "mistral"]


@dataclass(frozen=True)
class ToolFormat:
    name: ToolFormatName
    trigger: str  # the text that opens a block of calls under `auto`
    opener: str  # a block's text before its first call
    head: str  # a call's text before the function's name
    between: str  # after the name, before the arguments
    end: str  # after the arguments
    separator: str  # between two calls of a block
    closer: str  # after a block's last call

    def begin(self, name: str) -> str:
        return f"{self.head}{name}{self.between}"


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", "<tool_call>", "", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n", ""),
    "llama3_json": ToolFormat("llama3_json", '{"name": "', "", '{"name": "', '", "parameters": ', "}", "; ", ""),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "[TOOL_CALLS] [", '{"name": "', '", "arguments": ', "}", ", ", "]"),
}


def format_of_template(source: str) -> ToolFormat | None:
    """The call format a chat template teaches its model, from the markers it writes."""
    if "<tool_call>" in source:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in source:
        return FORMATS["mistral"]
    if "<|python_tag|>" in source or ('"parameters"' in source and "tools" in source):
        return FORMATS["llama3_json"]
    return None


# ------------------------------------------------------------------ the grammar


def tools_grammar(fmt: ToolFormat, tools: dict[str, dict | None], mode: Literal["auto", "required"], parallel: bool, specials: dict[str, int]) -> str:
    """llguidance's Lark grammar for calls of `tools` (name → parameters schema) in `fmt`:
    from the first token (`required`; one tool: a named choice), or free text until the
    trigger (`auto`). `specials`: the tokenizer's added tokens by text (a marker that is one
    is matched as that token: llguidance never spells an added token from text)."""
    lit = lambda text: _literal(text, specials)  # noqa: E731
    arguments = {name: f"%json {json.dumps(_object_schema(schema) | {'x-guidance': JSON_LAYOUT})} {lit(fmt.end)}" for name, schema in tools.items()}
    more = f" ({lit(fmt.separator)} call)*" if parallel else ""
    lines = ["%llguidance {}", "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    lines += [f"call_{i}: {lit(fmt.begin(name))} {body}" for i, (name, body) in enumerate(arguments.items())]
    if mode == "required":
        return "\n".join([*lines, f"start: {lit(fmt.opener)} call{more} {lit(fmt.closer)}"])
    # auto: the trigger opens a block; then what it leaves of the opener and the first call's head.
    rest = (fmt.opener + fmt.head)[len(fmt.trigger) :]
    lines.append("first: " + " | ".join(f"first_{i}" for i in range(len(tools))))
    lines += [f"first_{i}: {lit(rest + name + fmt.between)} {body}" for i, (name, body) in enumerate(arguments.items())]
    if fmt.trigger in specials:  # an added token never occurs in text: nothing to be lazy about
        lines.append(f"block: TEXT {lit(fmt.trigger)} first{more} {lit(fmt.closer)}")
    else:
        lines += [f"trigger[lazy]: TEXT {json.dumps(fmt.trigger)}", f"block: trigger first{more} {lit(fmt.closer)}"]
    return "\n".join([*lines, "start: block* TEXT", r"TEXT: /(.|\n)*/"])


def _object_schema(schema: dict | None) -> dict:
    """A tool's parameters; none: an empty object."""
    return dict(schema) if schema is not None else {"type": "object", "properties": {}, "additionalProperties": False}


def _literal(text: str, specials: dict[str, int]) -> str:
    """`text` as Lark: quoted strings, and `<[id]>` for each added token in it."""
    if not text:
        return '""'
    markers = [m for m in specials if m and m in text]
    if not markers:
        return json.dumps(text)
    parts = re.split("(" + "|".join(map(re.escape, markers)) + ")", text)
    return " ".join(f"<[{specials[p]}]>" if p in specials else json.dumps(p) for p in parts if p)


# ------------------------------------------------------------------ reading calls back


@dataclass
class CallDelta:
    """A streamed piece of call `index`: its first carries id and name, later ones arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class ToolCallReader:
    """Reads the generated text (special tokens kept) as it grows: the content outside the
    calls and each call's name and arguments, in pieces that never need taking back.
    Whitespace before a call or at the end is not content (an answer of calls alone has
    none)."""

    fmt: ToolFormat
    names: tuple[str, ...]
    in_block: bool = False  # `required` or a named tool: the text begins with the calls
    calls: list[ParsedCall] = field(default_factory=list)
    content: str = ""
    _at: int = 0  # how far the text has been read
    _state: str = "text"  # text | opener | call | arguments | after

    def __post_init__(self) -> None:
        self._state = "opener" if self.in_block else "text"

    def feed(self, text: str, final: bool = False) -> list[str | CallDelta]:
        """The new content (str) and call pieces in `text`, the whole text so far; `final`:
        generation has ended, so what was held back is decided."""
        text = text if final else text.rstrip("\ufffd")  # a character still being decoded
        out: list[str | CallDelta] = []
        while (step := getattr(self, f"_{self._state}")(text, final)) is not None:
            out += step
        return out

    def _text(self, text: str, final: bool) -> list | None:
        found = text.find(self.fmt.trigger, self._at)
        if found >= 0:
            piece = self._release(text, found)
            self._at, self._state = found, "opener"
            return piece
        piece = self._release(text, len(text) if final else _safe_end(text, self._at, self.fmt.trigger))
        return piece or None

    def _release(self, text: str, upto: int) -> list[str]:
        """Content up to `upto` but its trailing whitespace (held until text follows it)."""
        piece = text[self._at : upto].rstrip()
        self._at += len(piece)
        self.content += piece
        return [piece] if piece else []

    def _opener(self, text: str, final: bool) -> list | None:
        return self._expect(text, self.fmt.opener, "call", final)

    def _call(self, text: str, final: bool) -> list | None:
        for name in self.names:
            begin = self.fmt.begin(name)
            if text.startswith(begin, self._at):
                self.calls.append(ParsedCall(f"call_{uuid.uuid4().hex[:24]}", name))
                self._at, self._state = self._at + len(begin), "arguments"
                return [CallDelta(len(self.calls) - 1, self.calls[-1].id, name)]
        rest = text[self._at :]
        if not final and any(self.fmt.begin(name).startswith(rest) for name in self.names):
            return None
        return self._not_a_call(final)

    def _arguments(self, text: str, final: bool) -> list | None:
        call = self.calls[-1]
        try:
            end = json.JSONDecoder().raw_decode(text, self._at - len(call.arguments))[1]
        except json.JSONDecodeError:
            end = None
        piece = text[self._at : len(text) if end is None else end]
        self._at += len(piece)
        call.arguments += piece
        if end is not None:
            self._state = "after"
        elif not piece:
            return None
        return [CallDelta(len(self.calls) - 1, arguments=piece)] if piece else []

    def _after(self, text: str, final: bool) -> list | None:
        rest = text[self._at :]
        if not rest.startswith(self.fmt.end):
            return None
        rest = rest[len(self.fmt.end) :]
        another = self.fmt.separator + self.fmt.head
        if rest.startswith(another):
            self.calls[-1].complete = True
            self._at, self._state = self._at + len(self.fmt.end) + len(self.fmt.separator), "call"
            return []
        if not final and (another.startswith(rest) or (self.fmt.closer and self.fmt.closer.startswith(rest))):
            return None  # another call, or the block's end, may be on its way
        if not rest.startswith(self.fmt.closer):
            return None
        self.calls[-1].complete = True
        self._at, self._state = self._at + len(self.fmt.end) + len(self.fmt.closer), "text"
        return []

    def _expect(self, text: str, literal: str, then: str, final: bool) -> list | None:
        rest = text[self._at :]
        if rest.startswith(literal):
            self._at, self._state = self._at + len(literal), then
            return []
        if not final and literal.startswith(rest):
            return None
        return self._not_a_call(final)

    def _not_a_call(self, final: bool) -> list | None:
        """What followed the trigger is no call of ours (free text that happens to hold it):
        the trigger is content after all."""
        if self.in_block:
            return None  # the grammar wrote it: only a cut (max_tokens) ends it early
        self._state = "text"
        piece = self.fmt.trigger
        self._at += len(piece)
        self.content += piece
        return [piece]


def _safe_end(text: str, start: int, trigger: str) -> int:
    """Where released text may end: before any tail that could be the trigger's beginning."""
    for keep in range(min(len(trigger) - 1, len(text) - start), 0, -1):
        if trigger.startswith(text[len(text) - keep :]):
            return len(text) - keep
    return len(text)
