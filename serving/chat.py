"""Chat messages → the prompt text, rendered with the model's chat template the way
transformers renders it (`transformers.utils.chat_template_utils`), without importing
transformers: templates are untrusted code from a model's files, so they run in jinja2's
immutable sandbox, with transformers' globals and its `tojson`.

Written here because transformers' renderer comes only with transformers (and torch), which
the server does not load; the environment below is a copy of its `_compile_jinja_template`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from components.engine_dir import CHAT_TEMPLATE
from components.errors import KilnError


class ChatTemplateError(KilnError):
    """The template cannot be compiled, or refused to render these messages."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}`, which some templates wrap assistant turns in
    (transformers uses it to mask training tokens): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters, which no chat template wants.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str) -> None:
        self.origin = origin  # the file it came from, for messages
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template {origin} does not compile: {err}") from None
        self._special = special_tokens

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt for `messages` (each {"role", "content"}, with an assistant's earlier
        `tool_calls`), ending where the assistant's answer begins, with `tools` (OpenAI's
        function definitions, as transformers passes them); ChatTemplateError with the
        template's own words when it refuses."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, documents=None, **self._special)
        except jinja2.TemplateError as err:  # raise_exception(...) included: the template's own refusal
            raise ChatTemplateError(f"the chat template refused these messages: {err}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise ChatTemplateError(f"the chat template failed on these messages: {type(err).__name__}: {err}") from None


def chat_template_for(engine_dir: Path, fallback: Path | None) -> ChatTemplate | None:
    """The engine's own chat template, else `fallback` (serving.chat_template), else None."""
    path = engine_dir / CHAT_TEMPLATE
    if not path.is_file():
        path = fallback
    if path is None:
        return None
    return ChatTemplate(path.read_text(), special_tokens(engine_dir), str(path))


def special_tokens(engine_dir: Path) -> dict[str, str]:
    """bos_token, eos_token, unk_token and pad_token from tokenizer_config.json, as strings
    (transformers passes its special tokens map to the template)."""
    try:
        config = json.loads((engine_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    found = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            found[name] = token
    return found
