"""Structured outputs and tool calls against `kiln serve` on a socket, through the `openai`
SDK, on tiny random-weight Qwen2, Llama and Mistral engines whose chat templates teach tool
calls (Qwen2.5's Hermes `<tool_call>`, Llama 3's JSON, Mistral's `[TOOL_CALLS]` control
token). Random weights write garbage unless
constrained, so an answer that parses and validates proves the constraint."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict, Field

from .live_server import LiveServer
from .model_families import random_model_dir, sentencepiece_style_tokenizer

# Qwen2.5-Instruct's chat template, as its tokenizer_config.json ships it.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3.1's tool prompt, shortened: the tools as JSON in the first user turn, calls as
# {"name": …, "parameters": …}, their results as `ipython` turns.
LLAMA_TEMPLATE = """{{- bos_token }}
{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython<|eot_id|>' }}{%- endif %}
{%- for message in messages %}
    {%- if loop.first and tools and message.role == 'user' %}
        {{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, respond with a JSON for a function call with its proper arguments.\\n\\n' }}
        {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\\n\\n' }}
        {%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
        {{- message.content + '<|eot_id|>' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for tool_call in message.tool_calls %}
            {{- '{"name": "' + tool_call.function.name + '", "parameters": ' + tool_call.function.arguments | tojson + '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# Mistral-7B-Instruct-v0.3's tool prompt, shortened: the tools before the last user turn,
# calls after the [TOOL_CALLS] control token, results in [TOOL_RESULTS].
MISTRAL_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
        {{- '[INST] ' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '[TOOL_CALLS] [' }}
        {%- for tool_call in message.tool_calls %}
            {{- {"name": tool_call.function.name, "arguments": tool_call.function.arguments} | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' + eos_token }}
    {%- elif message.role == 'assistant' %}
        {{- ' ' + message.content + eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS] ' + ({"content": message.content} | tojson) + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""

TEXTS = [
    "The weather in Paris is sunny with a temperature of 21 degrees. " * 4,
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}} ' * 4,
    "def get_weather(city, unit): return {'city': city, 'temperature': 21} " * 4,
    "What is the weather like in Oslo today? Call the tool and answer the user. " * 4,
]


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict schemas are

    city: str = Field(max_length=12)
    celsius: int = Field(ge=-40, le=50)
    sunny: bool


class WeatherQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict schemas are

    city: str = Field(max_length=10)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class Sum(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict schemas are

    a: int = Field(ge=0, le=99)
    b: int = Field(ge=0, le=99)


def function_tool(name: str, model: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": model.model_json_schema()}}


TOOLS = [function_tool("get_weather", WeatherQuery), function_tool("add", Sum)]
ARGUMENTS = {"get_weather": WeatherQuery, "add": Sum}


def qwen_tokenizer():
    from components.config import ModelParams, TokenizerParams
    from components.train import tokenizer_from_texts

    tokenizer = tokenizer_from_texts(TEXTS, ModelParams(tokenizer=TokenizerParams(vocab_size=400, min_frequency=1)))
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # ordinary added tokens in Qwen2.5's tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>"})
    return tokenizer


def llama_tokenizer():
    tokenizer = sentencepiece_style_tokenizer(TEXTS, vocab_size=420)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"], "eos_token": "<|eot_id|>"})
    return tokenizer


def mistral_tokenizer():
    tokenizer = sentencepiece_style_tokenizer(TEXTS, vocab_size=420)
    controls = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
    tokenizer.add_special_tokens({"additional_special_tokens": controls})  # control tokens in Mistral's v3 vocabulary
    return tokenizer


def tool_engine(root: Path, family: str, tokenizer, template: str) -> Path:
    """A tiny random model of `family` with `template`, through export and an fp32 ONNX
    Runtime engine whose profile holds a prompt with tool definitions."""
    from components.build import engine_from_onnx
    from components.config import BuildParams, ExportParams, PrecisionParams, ProfileParams, ShapeRange
    from components.data import DataVersion
    from components.export import onnx_from_model
    from components.model_dir import model_from_directory
    from components.precision import precision_onnx

    directory = random_model_dir(family, tokenizer, root / family, chat_template=template, max_position_embeddings=2048)
    model = model_from_directory(directory)
    onnx = onnx_from_model(model, ExportParams(), root / "onnx")
    graph = precision_onnx(onnx, "fp32", None, PrecisionParams(), root / "precision")
    profiles = ProfileParams(batch=ShapeRange(min=1, opt=1, max=8), prompt=ShapeRange(min=1, opt=256, max=1536), context=ShapeRange(min=2, opt=512, max=2048))
    return engine_from_onnx(graph, model, DataVersion(path=root, md5="structured"), BuildParams(backend="onnxruntime", profiles=profiles), root / "engines", root).path


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("structured")
    return {
        "qwen2": tool_engine(root, "qwen2", qwen_tokenizer(), QWEN_TEMPLATE),
        "llama": tool_engine(root, "llama", llama_tokenizer(), LLAMA_TEMPLATE),
        "mistral": tool_engine(root, "mistral", mistral_tokenizer(), MISTRAL_TEMPLATE),
    }


@pytest.fixture(scope="module", params=["qwen2", "llama", "mistral"])
def served(request, engines):
    from openai import OpenAI

    from serving.app import ServerSettings, create_app
    from serving.engine_process import RuntimeOptions
    from serving.sources import LocalSource

    settings = ServerSettings(poll_interval_s=0, max_tokens=160, runtime=RuntimeOptions(max_waiting=16))
    with LiveServer(create_app(LocalSource(engines[request.param]), settings)) as live:
        model = httpx.get(f"{live.url}/v1/models").json()["data"][0]["id"]
        yield SimpleNamespace(live=live, model=model, family=request.param, client=OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0))


MESSAGES = [{"role": "user", "content": "What is the weather like in Oslo today?"}]


# ---------------------------------------------------------------- structured outputs


def test_parse_with_a_pydantic_model_returns_validated_objects_for_each_of_n_choices(served):
    completion = served.client.chat.completions.parse(model=served.model, messages=MESSAGES, response_format=Weather, n=3, temperature=1.0, seed=7)
    assert len(completion.choices) == 3
    for choice in completion.choices:
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Weather), choice.message.content
    assert len({choice.message.content for choice in completion.choices}) > 1  # each choice its own draws


def test_a_streamed_parse_gives_the_same_validated_object_as_the_whole_answer(served):
    whole = served.client.chat.completions.parse(model=served.model, messages=MESSAGES, response_format=Weather, temperature=0)
    with served.client.chat.completions.stream(model=served.model, messages=MESSAGES, response_format=Weather, temperature=0) as stream:
        streamed = stream.get_final_completion()
    assert isinstance(streamed.choices[0].message.parsed, Weather)
    assert streamed.choices[0].message.parsed == whole.choices[0].message.parsed


def test_json_object_and_schema_outputs_parse(served):
    answer = served.client.chat.completions.create(model=served.model, messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=160, temperature=0)
    if answer.choices[0].finish_reason == "stop":  # an object of any shape may outgrow max_tokens
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    answer = served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": schema, "strict": True}}
    )  # fmt: skip
    assert json.loads(answer.choices[0].message.content) in ({"ok": True}, {"ok": False}) and answer.choices[0].finish_reason == "stop"


def test_regex_and_choice_outputs_match_on_both_endpoints(served):
    import re

    regex = {"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{3}"}}
    text = served.client.completions.create(model=served.model, prompt="Code:", max_tokens=20, temperature=1.0, seed=3, extra_body=regex).choices[0]
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text.text) and text.finish_reason == "stop"
    choice = {"structured_outputs": {"choice": ["sunny", "cloudy", "rain"]}}
    for seed in range(3):
        answer = served.client.chat.completions.create(model=served.model, messages=MESSAGES, temperature=1.0, seed=seed, extra_body=choice)
        assert answer.choices[0].message.content in ("sunny", "cloudy", "rain")


def test_the_same_seed_gives_the_same_constrained_output(served):
    ask = lambda: served.client.chat.completions.create(model=served.model, messages=MESSAGES, response_format=_format(Weather), temperature=1.0, seed=11)  # noqa: E731
    assert ask().choices[0].message.content == ask().choices[0].message.content


def test_no_listed_top_logprob_is_a_token_the_grammar_forbids(served):
    choices = ["sunny", "cloudy"]
    answer = served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, temperature=0, logprobs=True, top_logprobs=5, extra_body={"structured_outputs": {"choice": choices}}
    )  # fmt: skip
    text, so_far = answer.choices[0].message.content, ""
    assert text in choices
    for entry in answer.choices[0].logprobs.content:
        assert all(alternative.logprob > -1e30 for alternative in entry.top_logprobs)
        assert all(any(c.startswith(so_far + alternative.token) for c in choices) for alternative in entry.top_logprobs), (so_far, entry.top_logprobs)
        so_far += entry.token


def test_a_constrained_and_a_free_request_sharing_decode_steps_leave_the_free_ones_tokens_alone(served):
    free = dict(model=served.model, prompt="The weather in Paris", max_tokens=24, temperature=0)
    alone = served.client.completions.create(**free).choices[0].text
    results = {}

    def constrained() -> None:
        results["json"] = served.client.completions.create(model=served.model, prompt="Weather:", max_tokens=80, temperature=0, extra_body={"structured_outputs": {"json": Weather.model_json_schema()}})

    thread = threading.Thread(target=constrained)
    thread.start()
    results["free"] = served.client.completions.create(**free)
    thread.join()
    assert results["free"].choices[0].text == alone
    Weather.model_validate_json(results["json"].choices[0].text)


def _format(model: type[BaseModel]) -> dict:
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": model.model_json_schema(), "strict": True}}


# ---------------------------------------------------------------- tool calls


def _validated(calls) -> list[tuple[str, BaseModel]]:
    return [(call.function.name, ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)) for call in calls]


def test_tool_choice_required_gives_calls_whose_arguments_validate(served):
    for seed in range(2):
        answer = served.client.chat.completions.create(model=served.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=160)
        choice = answer.choices[0]
        calls = [c for c in choice.message.tool_calls or []]
        assert calls and _validated(calls)
        assert choice.message.content is None and all(call.id.startswith("call_") and call.type == "function" for call in calls)
        assert choice.finish_reason in ("tool_calls", "length")


def test_a_named_tool_is_called_and_finishes_with_stop_as_openai_answers(served):
    named = {"type": "function", "function": {"name": "add"}}
    answer = served.client.chat.completions.create(model=served.model, messages=MESSAGES, tools=TOOLS, tool_choice=named, temperature=0)
    choice = answer.choices[0]
    assert [name for name, _ in _validated(choice.message.tool_calls)] == ["add"] and choice.finish_reason == "stop"


def test_streamed_tool_call_deltas_joined_equal_the_whole_call_and_no_markup_reaches_content(served):
    asked = dict(model=served.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0)
    whole = served.client.chat.completions.create(**asked).choices[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in served.client.chat.completions.create(**asked, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for piece in delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name  # the first delta of a call names it
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and not piece.function.name
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    assert content == "" and finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_a_conversation_with_a_call_and_its_result_renders_and_answers(served):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 4}'}]
    answer = served.client.chat.completions.create(model=served.model, messages=messages, tools=TOOLS, response_format=None, max_tokens=8, temperature=0, tool_choice="none")
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.prompt_tokens > 0


def test_the_server_renders_tools_and_calls_exactly_as_transformers_does(engines, tmp_path):
    from transformers import AutoTokenizer

    from serving.chat import chat_template_for
    from serving.schemas import ChatMessage

    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    ours = chat_template_for(engines["qwen2"], None).render([ChatMessage.model_validate(m).for_template() for m in messages], tools=TOOLS)
    theirs_messages = [m | ({"tool_calls": [call | {"function": call["function"] | {"arguments": {"a": 1, "b": 2}}}]} if "tool_calls" in m else {}) for m in messages]
    theirs = AutoTokenizer.from_pretrained(str(engines["qwen2"])).apply_chat_template(theirs_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours == theirs and "<tool_call>" in ours and '"name": "add"' in ours


def test_auto_writes_free_text_until_the_model_opens_a_call_then_constrains_the_call(engines):
    """Under `auto` a model that writes the trigger gets a call of a known name with
    arguments of its schema: the grammar walked token by token from text that opens a call,
    the rest drawn at random among the tokens it allows, read back by the server's reader."""
    import llguidance.numpy as llnp
    from llguidance import LLMatcher

    from components.engine_dir import load_engine_dir
    from serving.structured import GrammarContext
    from serving.tools import FORMATS, ToolCallReader, tools_grammar

    manifest = load_engine_dir(engines["qwen2"]).manifest
    context = GrammarContext(engines["qwen2"], manifest.vocab_size, tuple(sorted(manifest.stop_ids)))
    fmt = FORMATS["hermes"]
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    matcher = LLMatcher(context.tokenizer, tools_grammar(fmt, tools, "auto", True, context.token_ids))
    opened = context.tokenizer.tokenize_str("Let me look that up. <tool_call>")
    assert matcher.consume_tokens(opened), matcher.get_error()
    rng, tokens, mask = np.random.default_rng(0), list(opened), llnp.allocate_token_bitmask(1, context.vocab_size)
    reader = SimpleNamespace(done=False)
    while len(tokens) < 400 and not reader.done:
        llnp.fill_next_token_bitmask(matcher, mask)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: context.vocab_size])
        token = int(rng.choice(allowed))
        tokens.append(token)
        assert matcher.consume_token(token)
        reader.done = context.tokenizer.decode_str(tokens).count("</tool_call>") == 1
    read = ToolCallReader(fmt, tuple(tools))
    read.feed(context.tokenizer.decode_str(tokens), final=True)
    assert read.content == "Let me look that up." and len(read.calls) == 1 and read.calls[0].complete
    ARGUMENTS[read.calls[0].name].model_validate_json(read.calls[0].arguments)


# ---------------------------------------------------------------- bad input, metrics


BAD = {
    "unknown response_format type": ({"response_format": {"type": "xml"}}, "response_format"),
    "schema of an unknown type": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, "Invalid type: foo"),
    "schema that is not an object": ({"structured_outputs": {"json": [1, 2]}}, "a JSON schema is an object"),
    "unsupported schema feature": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}}, "look-around"),
    "bad regex": ({"structured_outputs": {"regex": "a(b"}}, "unclosed group"),
    "bad grammar": ({"structured_outputs": {"grammar": "start: nothing_here"}}, "unknown name"),
    "two structured outputs": ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    "tool_choice without tools": ({"tool_choice": "required"}, "tool_choice needs tools"),
    "tool_choice naming an unknown tool": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope', which is not in tools"),
    "duplicate function names": ({"tools": [TOOLS[0], TOOLS[0]]}, "defined twice"),
    "invalid function name": ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools"),
    "parameters not an object schema": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "object schema"),
    "tools with response_format": ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "cannot constrain one answer together"),
    "arguments that are not JSON": ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "not JSON"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_constraints_are_a_400_naming_what_was_wrong_and_the_server_keeps_answering(served, case):
    body, said = BAD[case]
    response = httpx.post(f"{served.live.url}/v1/chat/completions", json={"model": served.model, "messages": MESSAGES, "max_tokens": 4} | body, timeout=30)
    assert response.status_code == 400, response.text
    assert said in response.json()["error"]["message"], response.json()
    assert served.client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=2).choices


def test_tools_on_a_template_with_no_tool_format_are_a_400_saying_so_until_serving_tool_format_names_one(engine_dir, tmp_path):
    """The suite's GPT-2 engine has no template: served with a plain one (serving.chat_template)."""
    from serving.app import ServerSettings, create_app
    from serving.sources import LocalSource

    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    body = {"model": engine_dir.path.name, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 100}
    with LiveServer(create_app(LocalSource(engine_dir.path), ServerSettings(poll_interval_s=0, chat_template=plain))) as live:
        refused = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=30)
    assert refused.status_code == 400 and "serving.tool_format" in refused.json()["error"]["message"]
    with LiveServer(create_app(LocalSource(engine_dir.path), ServerSettings(poll_interval_s=0, chat_template=plain, tool_format="llama3_json"))) as live:
        answer = httpx.post(f"{live.url}/v1/chat/completions", json=body | {"parallel_tool_calls": False}, timeout=60).json()
    assert "choices" in answer, answer
    call = answer["choices"][0]["message"]["tool_calls"][0]["function"]
    ARGUMENTS[call["name"]].model_validate_json(call["arguments"])


def test_metrics_count_constrained_requests_and_the_masks_time(served):
    served.client.chat.completions.create(model=served.model, messages=MESSAGES, response_format=_format(Sum), temperature=0)
    text = httpx.get(f"{served.live.url}/metrics").text
    metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("kiln_") and " " in line}
    assert metrics['kiln_constrained_requests_total{kind="json_schema"}'] >= 1
    assert metrics["kiln_grammar_masked_tokens_total"] > 0 and metrics["kiln_grammar_mask_seconds_total"] > 0


def test_a_grammar_tokenizer_skips_end_ids_outside_the_vocabulary_and_names_an_unreadable_tokenizer(engines, tmp_path):
    """A random bench model keeps GPT-2's end id (50256) beside a 300-token vocabulary:
    its grammars still compile; a tokenizer llguidance cannot read is a GrammarError (a 400),
    not a server error."""
    from components.runtime.grammar import GrammarError, grammar_tokenizer

    tokenizer = grammar_tokenizer(engines["qwen2"] / "tokenizer.json", 400, (50256,))
    assert tokenizer.vocab_size == 400
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"model": {"type": "Unigram", "vocab": []}}')
    with pytest.raises(GrammarError, match="cannot be read for grammars"):
        grammar_tokenizer(broken, 400, (0,))


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        ("hermes", 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>',
         "Let me check.", [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Oslo", "unit": "celsius"}')]),
        ("llama3_json", '{"name": "add", "parameters": {"a": 3, "b": 4}}; {"name": "add", "parameters": {"a": 5, "b": 6}}', "", [("add", '{"a": 3, "b": 4}'), ("add", '{"a": 5, "b": 6}')]),
        ("mistral", 'Sure [TOOL_CALLS] [{"name": "add", "arguments": {"a": 7, "b": 8}}, {"name": "add", "arguments": {"a": 9, "b": 0}}] done', "Sure done",
         [("add", '{"a": 7, "b": 8}'), ("add", '{"a": 9, "b": 0}')]),
        ("hermes", "No tool needed: <tool_cat> is not a call.", "No tool needed: <tool_cat> is not a call.", []),
    ],
    ids=["hermes-text-then-two-calls", "llama3-two-calls", "mistral-block-between-text", "hermes-a-near-miss-is-text"],
)
def test_the_call_reader_gives_the_same_calls_and_content_fed_whole_or_a_character_at_a_time(fmt, text, content, calls):
    """What the server reads back out of a generated text, whatever pieces the stream brings
    it in: the content outside the calls, each call's name and its arguments as written, the
    streamed fragments joining into the whole."""
    from serving.tools import FORMATS, CallDelta, ToolCallReader

    whole = ToolCallReader(FORMATS[fmt], ("add", "get_weather"))
    whole.feed(text, final=True)
    streamed, fragments, said = ToolCallReader(FORMATS[fmt], ("add", "get_weather")), {}, ""
    pieces = [item for end in range(1, len(text) + 1) for item in streamed.feed(text[:end])] + streamed.feed(text, final=True)
    for item in pieces:
        if isinstance(item, CallDelta):
            fragments[item.index] = fragments.get(item.index, "") + item.arguments
        else:
            said += item
    for reader in (whole, streamed):
        assert reader.content == content and [(c.name, c.arguments) for c in reader.calls if c.complete] == calls
    assert said == content and [fragments[i] for i in range(len(calls))] == [arguments for _, arguments in calls]


def test_the_servers_grammar_tokenizer_is_built_when_the_engine_starts_not_at_the_first_constrained_request(engine_dir):
    """llguidance's reading of a large vocabulary takes a while: built in a thread beside the
    engine's start, the first constrained request does not wait on it on the event loop."""
    import time

    from components.runtime.grammar import grammar_tokenizer
    from serving.app import ServerSettings, create_app
    from serving.sources import LocalSource

    grammar_tokenizer.cache_clear()
    with LiveServer(create_app(LocalSource(engine_dir.path), ServerSettings(poll_interval_s=0))):
        deadline = time.monotonic() + 30
        while grammar_tokenizer.cache_info().currsize == 0:
            assert time.monotonic() < deadline, "no grammar tokenizer was built within 30 s of the engine's start"
            time.sleep(0.05)
