"""`kiln serve`: the champion over an OpenAI-compatible API, with continuous batching, hot
swap when the alias moves, Prometheus metrics, and 4xx answers to bad input.

Real components only: engines built in the session, a real MLflow store (SQLite; an
`mlflow server` where webhooks must be delivered), uvicorn on a real socket, the `openai`
client. What the server answers is compared with the runtime the gates drove.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from components.runtime.engine import Engine
from components.runtime.sampling import Sampling
from components.runtime.tokenizer import EngineTokenizer
from registry import CHAMPION, RegistryTarget, Signing, promote, register_engine
from registry.signing import fingerprint
from serving.app import VERSION_HEADER, ServerSettings, create_app
from serving.engine_process import RuntimeOptions
from serving.sources import AliasSource
from serving.webhooks import signature_of

from .conftest import SIGNING, build_engine, new_mlflow_store
from .live_server import LiveServer, free_port
from .live_server import mlflow_server as running_mlflow_server
from .test_faults import stored_engine, tamper
from .test_signing import ATTACKS
from .test_registry import record

MODEL = "kiln-serve"
SECRET = "webhook-secret-for-tests"


@pytest.fixture(scope="module")
def int8_engine_dir(project, params, tiny_model, exported, data_version, calibration):
    return build_engine(project, params, tiny_model, exported, data_version, "int8", calibration)


class Store:
    """A registry holding the fp32 and the int8 engine, champion on fp32."""

    def __init__(self, root: Path, engine_dir, int8_engine_dir) -> None:
        self.root = root
        self.target = RegistryTarget(new_mlflow_store(root / "mlflow.db"), MODEL, MODEL, root / "artifacts", SIGNING)
        self.fp32 = register_engine(self.target, engine_dir.path, engine_dir.sha256, record()).version
        self.int8 = register_engine(self.target, int8_engine_dir.path, int8_engine_dir.sha256, record()).version
        promote(self.target, CHAMPION, version=self.fp32)

    def app(self, **settings):
        source = AliasSource(self.target, CHAMPION, self.root / "cache")
        runtime = RuntimeOptions(max_waiting=settings.pop("max_waiting", 32))
        if "prefix_cache_bytes" in settings:
            runtime = replace(runtime, prefix_cache_bytes=settings.pop("prefix_cache_bytes"))
        defaults = {"poll_interval_s": 0, "max_tokens": 64, "max_body_bytes": 8192, "webhook_secret": SECRET, "runtime": runtime}
        return create_app(source, ServerSettings(**(defaults | settings)))


@pytest.fixture(scope="module")
def store(tmp_path_factory, engine_dir, int8_engine_dir) -> Store:
    return Store(tmp_path_factory.mktemp("serving"), engine_dir, int8_engine_dir)


@pytest.fixture()
def fresh_store(tmp_path, engine_dir, int8_engine_dir) -> Store:
    """A store of its own, for tests that move the alias."""
    return Store(tmp_path, engine_dir, int8_engine_dir)


@pytest.fixture(scope="module")
def server(store):
    with LiveServer(store.app()) as live:
        yield live


@pytest.fixture(scope="module")
def tokenizer(engine_dir) -> EngineTokenizer:
    return EngineTokenizer(engine_dir.path)


def expected_text(engine, tokenizer, prompt: str, max_tokens: int) -> str:
    """What the gated runtime generates greedily, one prompt alone."""
    return tokenizer.decode(engine.generate([tokenizer.encode(prompt)], Sampling(max_new_tokens=max_tokens))[0])


def metrics_of(live: LiveServer) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus-client's own parser."""
    text = httpx.get(f"{live.url}/metrics").text
    return {
        sample.name + json.dumps(sample.labels, sort_keys=True) * bool(sample.labels): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def completion(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL} | body)


# ---------------------------------------------------------------- the API, through the openai client


def test_the_openai_client_gets_the_champions_greedy_completion_with_usage(server, store, engine, tokenizer):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="The list", max_tokens=12, temperature=0)
    answer = raw.parse()
    assert raw.headers[VERSION_HEADER] == store.fp32
    assert answer.choices[0].text == expected_text(engine, tokenizer, "The list", 12)
    assert answer.choices[0].finish_reason in {"length", "stop"}
    assert answer.usage.prompt_tokens == len(tokenizer.encode("The list"))
    finished_early = answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == 12 or (finished_early and answer.usage.completion_tokens < 12)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_streaming_through_the_openai_client_gives_the_same_text_token_by_token(server, engine, tokenizer):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    chunks = list(client.completions.create(model=MODEL, prompt="A class", max_tokens=12, temperature=0, stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == expected_text(engine, tokenizer, "A class", 12)
    assert len([t for t in texts if t]) > 1  # tokens arrive as their steps complete, not at the end
    assert chunks[-1].choices[0].finish_reason in {"length", "stop"}
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_a_stream_sends_held_back_text_before_it_finishes_and_loses_none(server, engine, tokenizer):
    """A 12-character stop string holds back the text until it cannot begin one: the first
    token's chunk comes all the same (empty), later chunks come as turns end (a lone stream
    takes several steps a turn), and the held-back tail arrives before the finish."""
    body = {"model": MODEL, "prompt": "The list", "max_tokens": 12, "ignore_eos": True, "stop": "~" * 12, "temperature": 0, "stream": True}
    with server.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        chunks = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line and line != "data: [DONE]"]
    deltas = [c["choices"][0]["text"] for c in chunks if c["choices"][0]["finish_reason"] is None]
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    whole = engine.generate([tokenizer.encode("The list")], Sampling(max_new_tokens=12, stop_at_eos=False))[0]
    assert "".join(deltas) == tokenizer.decode(whole)
    assert 2 <= len(deltas) <= 12 and deltas[0] == "" and deltas[-1]  # the first token's text could still begin the stop string


def test_a_raw_stream_ends_with_done(server):
    with server.client() as client, client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}) as response:
        events = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_a_streams_last_piece_ends_its_body_in_the_same_write():
    """Each ASGI send is a socket write: the piece that carries `[DONE]` also ends the body
    (no empty write after it); a stream that ends otherwise still ends its body."""
    from serving.sse import LAST_EVENT, EventStream

    async def pieces(*texts: str):
        for text in texts:
            yield text

    async def sends(stream: EventStream) -> list[tuple[bytes, bool]]:
        messages = []

        async def receive() -> dict:
            await asyncio.sleep(60)  # the client stays to the end
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            messages.append(message)

        await stream({"type": "http"}, receive, send)
        assert messages[0]["type"] == "http.response.start"
        return [(m["body"], m["more_body"]) for m in messages[1:]]

    ended = asyncio.run(sends(EventStream(pieces("data: 1\n\n", "data: 2\n\n" + LAST_EVENT))))
    assert ended == [(b"data: 1\n\n", True), (b"data: 2\n\n" + LAST_EVENT.encode(), False)]
    assert asyncio.run(sends(EventStream(pieces("data: 1\n\n")))) == [(b"data: 1\n\n", True), (b"", False)]


def test_a_requests_last_chunks_leave_with_done_in_one_piece():
    """Chunks ready together leave together; once every choice has finished, its last chunk
    and the usage wait for `[DONE]` (one write less a request)."""
    from serving.handlers import Submitted, _stream_events
    from serving.scheduler import Delta, Finished
    from serving.sse import LAST_EVENT

    async def pieces() -> list[str]:
        job = Submitted([None], [], 1, asyncio.Queue(), 0.0)
        job.events.put_nowait((0, Delta("a", 1)))
        stream = _stream_events(job, [], lambda i, e: f"{e.text};", lambda i, e, usage: "last;", lambda usage: "usage;")
        first = await anext(stream)
        job.events.put_nowait((0, Finished("length", 3, 1)))
        return [first] + [piece async for piece in stream]

    assert asyncio.run(pieces()) == ["a;", "last;usage;" + LAST_EVENT]


@pytest.mark.parametrize("text", ["plain", 'quote " backslash \\ newline \n tab \t', "é 漢字 😀", "\u2028 \x00 \x1f"])
def test_a_streamed_delta_chunk_is_the_json_of_the_whole_chunk(text):
    """Delta chunks are put together from a prefix and the encoded text (the hot path);
    they must stay byte for byte what json.dumps of the chunk gives."""
    from serving.handlers import _ChunkWriter

    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": 'model "x"'}
    chunk["choices"] = [{"index": 2, "text": text, "logprobs": None, "finish_reason": None}]
    assert _ChunkWriter("cmpl-1", 7, 'model "x"').delta(2, text) == f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def test_models_lists_the_served_version_with_its_precision_backend_sha256_and_signer(server, store, engine_dir):
    response = httpx.get(f"{server.url}/v1/models")
    (card,) = response.json()["data"]
    assert card["id"] == MODEL and card["object"] == "model"
    assert (card["version"], card["alias"], card["precision"], card["backend"]) == (store.fp32, "champion", "fp32", "onnxruntime")
    assert card["engine_sha256"] == engine_dir.sha256
    assert card["signing_key"] == fingerprint(SIGNING.trusted[0].read_bytes())
    assert metrics_of(server)[f'kiln_served_engine_info{{"backend": "onnxruntime", "engine_sha256": "{engine_dir.sha256}", "model": "{MODEL}", "precision": "fp32", "signing_key": "{card["signing_key"]}", "version": "{store.fp32}"}}'] == 1
    assert response.headers[VERSION_HEADER] == store.fp32
    assert httpx.get(f"{server.url}/readyz").json()["version"] == store.fp32


def test_a_list_of_prompts_gets_one_choice_each_in_order(server, engine, tokenizer):
    prompts = ["The list", "A class", "Importing a module"]
    with server.client() as client:
        body = completion(client, prompt=prompts, max_tokens=6, temperature=0).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [expected_text(engine, tokenizer, p, 6) for p in prompts]


def test_token_id_prompts_are_served_like_their_text(server, tokenizer):
    ids = tokenizer.encode("The list")
    with server.client() as client:
        by_text = completion(client, prompt="The list", max_tokens=6, temperature=0).json()
        by_ids = completion(client, prompt=[ids, ids], max_tokens=6, temperature=0).json()
    assert [c["text"] for c in by_ids["choices"]] == [by_text["choices"][0]["text"]] * 2
    assert by_ids["usage"]["prompt_tokens"] == 2 * len(ids)


def test_ignore_eos_generates_exactly_max_tokens(server):
    with server.client() as client:
        usage = completion(client, prompt="The list", max_tokens=40, temperature=1.0, seed=1, ignore_eos=True).json()["usage"]
    assert usage["completion_tokens"] == 40


def test_a_seed_makes_sampling_reproducible_and_another_seed_differs(server):
    with server.client() as client:
        runs = [completion(client, prompt="The list", max_tokens=24, temperature=1.5, top_p=0.95, seed=seed).json()["choices"][0]["text"] for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_a_stop_string_ends_the_text_before_it(server):
    sampled = dict(prompt="The list", max_tokens=24, temperature=1.0, seed=3)  # seeded: the same tokens twice
    with server.client() as client:
        full = completion(client, **sampled).json()["choices"][0]["text"]
        stop = next(full[i : i + 2] for i in range(len(full) // 3, len(full)) if full[i : i + 2].strip())
        choice = completion(client, **sampled, stop=[stop, "never-appears"]).json()["choices"][0]
    assert choice["text"] == full[: full.index(stop)]
    assert choice["finish_reason"] == "stop"


# ---------------------------------------------------------------- log probabilities, echo, n


def hf_logprobs(model_dir: Path, ids: list[int]):
    """Hugging Face's log_softmax of the source model's logits at every position (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()


def test_greedy_logprobs_of_the_fp32_engine_match_hugging_faces_log_softmax_with_the_prompt_echoed(server, tiny_model, engine, tokenizer):
    prompt, new = "The list type", 6
    with server.client() as client:
        body = completion(client, prompt=prompt, max_tokens=new, temperature=0, logprobs=3, echo=True, ignore_eos=True).json()
    choice = body["choices"][0]
    prompt_ids = tokenizer.encode_prompt(prompt)
    ids = prompt_ids + engine.generate([prompt_ids], Sampling(max_new_tokens=new, stop_at_eos=False))[0]
    expected = hf_logprobs(tiny_model.path, ids)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tokenizer.token_text(i) for i in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None  # nothing predicts the first token
    for position in range(1, len(ids)):
        assert abs(logprobs["token_logprobs"][position] - expected[position - 1, ids[position]]) < 1e-4, position
        best = np.argsort(-expected[position - 1])[:3]
        top = logprobs["top_logprobs"][position]
        assert list(top)[:3] == [tokenizer.token_text(i) for i in best]  # most likely first
        assert np.allclose(list(top.values())[:3], expected[position - 1, best], atol=1e-4)
    for position in range(len(prompt_ids), len(ids)):  # greedy: each generated token is its step's most likely
        assert logprobs["token_logprobs"][position] == max(logprobs["top_logprobs"][position].values())
    assert choice["text"] == prompt + tokenizer.decode(ids[len(prompt_ids) :])
    assert [choice["text"][o : o + len(t)] for o, t in zip(logprobs["text_offset"], logprobs["tokens"], strict=True)] == logprobs["tokens"]


def test_echo_with_max_tokens_0_scores_the_prompt_alone_as_lm_eval_asks(server, tokenizer):
    ids = tokenizer.encode("The list type is a")
    with server.client() as client:
        scored = completion(client, prompt=[ids, ids[:3]], max_tokens=0, echo=True, logprobs=1, temperature=0).json()
        longer = completion(client, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0).json()
    first, short = scored["choices"]
    assert first["finish_reason"] == "length" and first["text"] == tokenizer.decode(ids)
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == len(ids) + 3
    assert len(first["logprobs"]["token_logprobs"]) == len(ids) and len(short["logprobs"]["token_logprobs"]) == 3
    # The same prompt scores the same alone, beside another (padded) prompt, or before a generated token.
    assert short["logprobs"]["token_logprobs"] == pytest.approx(first["logprobs"]["token_logprobs"][:3], abs=1e-5)
    assert longer["choices"][0]["logprobs"]["token_logprobs"][: len(ids)] == pytest.approx(first["logprobs"]["token_logprobs"], abs=1e-5)


def test_logprobs_stream_with_their_tokens_and_add_up_to_the_whole_answers(server):
    body = {"prompt": "A class", "max_tokens": 8, "temperature": 0, "logprobs": 2, "echo": True, "ignore_eos": True}
    with server.client() as client:
        whole = completion(client, **body).json()["choices"][0]
        with client.stream("POST", "/v1/completions", json={"model": MODEL, "stream": True} | body) as response:
            chunks = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line and line != "data: [DONE]"]
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["text"] == "A class"  # the echo comes first
    streamed = {key: [v for c in choices if c["logprobs"] for v in c["logprobs"][key]] for key in ("tokens", "token_logprobs", "text_offset")}
    assert streamed["tokens"] == whole["logprobs"]["tokens"]
    assert streamed["token_logprobs"][0] is None and whole["logprobs"]["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-5)
    assert streamed["text_offset"] == whole["logprobs"]["text_offset"]
    assert "".join(c["text"] for c in choices) == whole["text"]


def test_concurrent_seeded_requests_sharing_decode_steps_each_sample_as_they_would_alone(server):
    """Each sequence draws from its own generator: requests batched together with the same
    seed get the same text as that seed alone, and another seed's requests agree among themselves."""
    sampled = dict(prompt="The list", max_tokens=16, temperature=1.2, top_p=0.9, ignore_eos=True)
    with server.client() as client:
        alone = {seed: completion(client, seed=seed, **sampled).json()["choices"][0]["text"] for seed in (5, 6)}
    seeds = [5, 6] * 4
    together = threading.Barrier(len(seeds))

    def ask(seed: int) -> str:
        with server.client() as client:
            client.get("/healthz")
            together.wait()
            return completion(client, seed=seed, **sampled).json()["choices"][0]["text"]

    before = metrics_of(server)
    with ThreadPoolExecutor(len(seeds)) as pool:
        answers = list(pool.map(ask, seeds))
    after = metrics_of(server)
    assert alone[5] != alone[6]
    assert answers == [alone[seed] for seed in seeds]
    assert after["kiln_decoded_rows_total"] - before["kiln_decoded_rows_total"] > after["kiln_decode_steps_total"] - before["kiln_decode_steps_total"]  # they shared steps
    wait_for_empty_batch(server)


def test_n_choices_are_independent_draws_and_the_first_is_the_single_choice_of_the_same_seed(server):
    sampled = dict(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    with server.client() as client:
        one = completion(client, prompt="The list", **sampled).json()
        three = completion(client, prompt="The list", n=3, **sampled).json()
        again = completion(client, prompt="The list", n=3, **sampled).json()
        two_prompts = completion(client, prompt=["The list", "A class"], n=2, **sampled).json()
    texts = [c["text"] for c in three["choices"]]
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert texts[0] == one["choices"][0]["text"]
    assert len(set(texts)) == 3  # each choice draws from its own stream
    assert [c["text"] for c in again["choices"]] == texts  # and the seed makes them reproducible
    assert three["usage"]["completion_tokens"] == 30 and three["usage"]["prompt_tokens"] == 3 * one["usage"]["prompt_tokens"]
    # Choice i of prompt p is index p * n + i, as OpenAI numbers them.
    assert [c["text"] for c in two_prompts["choices"][:2]] == texts[:2]


def test_the_openai_client_gets_logprobs_echo_and_n_from_completions(server, tokenizer):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    answer = client.completions.create(model=MODEL, prompt="The list", max_tokens=4, temperature=0, logprobs=2, echo=True, n=2, extra_body={"ignore_eos": True})
    assert len(answer.choices) == 2 and answer.choices[0].text == answer.choices[1].text  # greedy: the same twice
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(tokenizer.encode_prompt("The list")) + 4
    assert logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])  # two alternatives and the chosen token


def test_asking_for_no_logprobs_computes_none(own_engine, tokenizer):
    """Log probabilities cost nothing when not asked: the scheduler computes none."""
    from serving.scheduler import Finished, Scheduler, Sequence

    scheduler, done = Scheduler(own_engine, tokenizer, max_waiting=4), threading.Semaphore(0)
    plain = Sequence(tokenizer.encode("The list"), Sampling(max_new_tokens=5, stop_at_eos=False), lambda e: isinstance(e, Finished) and done.release())
    asked = Sequence(tokenizer.encode("The list"), Sampling(max_new_tokens=5, stop_at_eos=False, logprobs=0), lambda e: isinstance(e, Finished) and done.release())
    scheduler.submit([plain, asked])
    assert done.acquire(timeout=30) and done.acquire(timeout=30) and scheduler.close(timeout=5)
    assert plain.logprobs == [] and plain.prompt_logprobs is None
    assert len(asked.logprobs) == 5 and all(entry.top == () for entry in asked.logprobs)
    assert plain.generated == asked.generated


def test_logprobs_are_the_models_own_before_temperature_and_top_p(own_engine, tokenizer, tiny_model):
    """Sampled hot and with a narrow nucleus, a token's log probability is still the raw
    log-softmax of the model's logits (vLLM's default), so it means the same whatever the sampling."""
    from serving.scheduler import Finished, Scheduler, Sequence

    scheduler, done = Scheduler(own_engine, tokenizer, max_waiting=4), threading.Event()
    sampled = Sequence(tokenizer.encode("The list"), Sampling(max_new_tokens=6, temperature=1.7, top_p=0.5, seed=3, stop_at_eos=False, logprobs=0), lambda e: isinstance(e, Finished) and done.set())
    scheduler.submit([sampled])
    assert done.wait(timeout=30) and scheduler.close(timeout=5)
    ids = sampled.prompt + sampled.generated
    expected = hf_logprobs(tiny_model.path, ids)
    got = [entry.logprob for entry in sampled.logprobs]
    assert got == pytest.approx([expected[p - 1, ids[p]] for p in range(len(sampled.prompt), len(ids))], abs=1e-4)


# ---------------------------------------------------------------- chat completions


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# Templates in the style of the families' own: Llama 3's (BOS, headers, strftime_now, trim),
# Qwen2's (a default system prompt found with a namespace and break), Mistral's (alternation
# enforced with raise_exception) and one with transformers' generation tag and tojson.
TEMPLATES = {
    "llama3": (
        "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
        "{%- else %}{%- set system_message = '' %}{%- endif %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
        "{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n\\n' }}{{- system_message }}{{- '<|eot_id|>' }}{%- for message in messages %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    ),
    "qwen2": (
        "{%- set ns = namespace(found=false) -%}{%- for message in messages -%}{%- if message.role == 'system' -%}{%- set ns.found = true -%}{%- break -%}"
        "{%- endif -%}{%- endfor -%}{%- if not ns.found -%}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}{%- endif -%}"
        "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for message in messages %}\n    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
        "        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n    {% endif %}\n"
        "    {% if message['role'] == 'user' %}\n{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}\n"
        "{{ message['content'] + eos_token }}{% endif %}\n{% endfor %}"
    ),
    "generation-tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m | tojson }}{% endif %}{% endfor %}",
}
CONVERSATION = [
    {"role": "user", "content": '  Is <b>"é"</b> a list?  '},
    {"role": "assistant", "content": "Yes — a list."},
    {"role": "user", "content": "And 漢字?"},
]


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_server_renders_a_chat_template_exactly_as_transformers_does(engine_dir, name):
    import jinja2
    from transformers import PreTrainedTokenizerFast

    from serving.chat import ChatTemplate, ChatTemplateError

    hf = PreTrainedTokenizerFast(tokenizer_file=str(engine_dir.path / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    ours = ChatTemplate(TEMPLATES[name], {"bos_token": "<s>", "eos_token": "</s>"}, name)
    for messages in (CONVERSATION, [{"role": "system", "content": "Be brief."}, *CONVERSATION]):
        try:
            expected = hf.apply_chat_template(messages, chat_template=TEMPLATES[name], tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as refused:  # Mistral's refuses a system message: so must the server, in the template's words
            with pytest.raises(ChatTemplateError, match="roles must alternate"):
                ours.render(messages)
            assert "roles must alternate" in str(refused)
            continue
        assert ours.render(messages) == expected


@pytest.fixture(scope="module")
def chat_server(store, tmp_path_factory):
    """The champion (a model without a chat template) served with serving.chat_template."""
    template = tmp_path_factory.mktemp("chat") / "chatml.jinja"
    template.write_text(CHATML)
    with LiveServer(store.app(chat_template=template)) as live:
        yield live


def test_a_model_without_a_chat_template_answers_chat_with_400_saying_so(server):
    with server.client() as client:
        response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert completion(client, prompt="x", max_tokens=2).status_code == 200
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "no_chat_template") and "no chat template" in error["message"]


def test_chat_renders_the_template_and_answers_what_the_engine_generates_for_it(chat_server, engine, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "The list"}, {"type": "text", "text": "type"}]}]
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nThe list\ntype<|im_end|>\n<|im_start|>assistant\n"
    client = OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused")
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    expected = tokenizer.decode(engine.generate([tokenizer.encode(rendered)], Sampling(max_new_tokens=10))[0])
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].message.content == expected
    assert answer.usage.prompt_tokens == len(tokenizer.encode(rendered))


def test_chat_streams_the_role_then_the_content_then_the_finish_reason_then_the_usage(chat_server):
    client = OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused")
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "A class"}], max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs_give_each_token_with_its_bytes_and_top_alternatives(chat_server):
    client = OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused")
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The list"}], max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content
    for entry in content:
        assert bytes(entry.bytes).decode() == entry.token and len(entry.top_logprobs) == 3
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy: the chosen token is the most likely
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)


def test_a_chat_without_max_tokens_may_use_the_rest_of_the_context(chat_server):
    with chat_server.client() as client:
        response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "The list"}], "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 64  # the test server's max_tokens, which the context allows


BAD_CHATS = {
    "no-messages": ({"messages": None}, "messages"),  # None: the field is left out
    "empty-messages": ({"messages": []}, "messages"),
    "unknown-role": ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    "content-not-text": ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    "image-part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    "top-logprobs-without-logprobs": ({"top_logprobs": 2}, "top_logprobs"),
    "too-many-top-logprobs": ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "max-completion-tokens-over-limit": ({"max_completion_tokens": 65}, "max_completion_tokens"),
    "n-over-the-servers-limit": ({"n": 9}, "n"),
    "tools": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
}


@pytest.mark.parametrize("case", BAD_CHATS, ids=list(BAD_CHATS))
def test_a_bad_chat_request_is_a_400_naming_the_field_and_the_server_keeps_answering(chat_server, case):
    fields, param = BAD_CHATS[case]
    with chat_server.client() as client:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]} | fields
        response = client.post("/v1/chat/completions", json={key: value for key, value in body.items() if value is not None})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).status_code == 200


def test_a_template_that_refuses_the_messages_is_a_400_with_its_own_words(store, tmp_path):
    template = tmp_path / "strict.jinja"
    template.write_text("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user message') }}{% endif %}" + CHATML)
    with LiveServer(store.app(chat_template=template)) as live, live.client() as client:
        response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "assistant", "content": "x"}]})
        assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).status_code == 200
    assert response.status_code == 400
    assert "Conversations must start with a user message" in response.json()["error"]["message"]


# ---------------------------------------------------------------- continuous batching


def test_concurrent_requests_share_decode_steps_and_each_gets_its_own_answer(server, engine, tokenizer):
    prompts = [f"{word} is" for word in ("The list", "A class", "Importing", "def", "The for", "Raise", "With", "Return", "Yield", "Assert", "The if", "Lambda")]
    lengths = [30 + (i % 4) * 10 for i in range(len(prompts))]  # they finish at different steps
    before = metrics_of(server)
    together = threading.Barrier(len(prompts))  # connections open first, then all ask at once

    def ask(i: int) -> str:
        with server.client() as client:
            client.get("/healthz")
            together.wait()
            return completion(client, prompt=prompts[i], max_tokens=lengths[i], temperature=0).json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, range(len(prompts))))
    after = metrics_of(server)
    assert answers == [expected_text(engine, tokenizer, p, n) for p, n in zip(prompts, lengths, strict=True)]
    steps = after["kiln_decode_steps_total"] - before["kiln_decode_steps_total"]
    rows = after["kiln_decoded_rows_total"] - before["kiln_decoded_rows_total"]
    assert rows / steps > 2, f"{rows:.0f} rows in {steps:.0f} decode steps: the requests did not share steps"
    wait_for_empty_batch(server)


def wait_for_empty_batch(live: LiveServer) -> None:
    """The gauges are set when the scheduler's turn ends, just after the last answer left."""
    deadline = time.monotonic() + 10
    while (m := metrics_of(live))["kiln_running_batch_size"] or m["kiln_queue_depth"]:
        assert time.monotonic() < deadline, "sequences stayed in the batch after every client had its answer"
        time.sleep(0.05)


def test_a_full_queue_answers_503_with_retry_after_and_the_server_keeps_answering(store):
    """The line (max_waiting 2) is filled while the engine process is stopped (SIGSTOP), so
    that nothing leaves it before the next request arrives."""
    with LiveServer(store.app(max_waiting=2)) as live, live.client() as client:
        engine_pid = live.app.state.follower.current.scheduler.pid
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 4, "stream": True}) as waiting:
                assert waiting.status_code == 200  # its headers come once both prompts are in line
                busy = completion(client, prompt="c", max_tokens=4)
                os.kill(engine_pid, signal.SIGCONT)
                lines = [line for line in waiting.iter_lines() if line]
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        assert busy.status_code == 503
        assert busy.headers["Retry-After"] == "1"
        assert busy.json()["error"]["code"] == "queue_full"
        assert lines[-1] == "data: [DONE]" and "error" not in lines[-2]
        assert completion(client, prompt=["a", "b"], max_tokens=4).status_code == 200


LONG_STREAM = {"model": MODEL, "prompt": ["The list"] * 4, "max_tokens": 120, "ignore_eos": True, "stream": True}


def test_a_client_that_disconnects_mid_stream_frees_its_rows_and_the_server_keeps_answering(store):
    with LiveServer(store.app(max_tokens=120)) as live:
        before = metrics_of(live)["kiln_decoded_rows_total"]
        with live.client() as client, client.stream("POST", "/v1/completions", json=LONG_STREAM) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # one chunk, then hang up
        wait_for_empty_batch(live)
        decoded = metrics_of(live)["kiln_decoded_rows_total"] - before
        with live.client() as client:
            assert completion(client, prompt="x", max_tokens=2).status_code == 200
    assert decoded < 4 * 120 / 2, f"{decoded:.0f} rows decoded: the engine went on with the sequences of a client that had left"


def test_an_engine_process_that_dies_is_loaded_again_and_the_server_keeps_answering(store):
    """What is in flight ends with an error event, not a hang; meanwhile requests are 503
    (retry) or 200, never a 5xx; then the same version serves again from a new process."""
    with LiveServer(store.app(max_tokens=120)) as live, live.client() as client:
        lost = live.app.state.follower.current.scheduler
        with client.stream("POST", "/v1/completions", json=LONG_STREAM) as response:
            lines = response.iter_lines()
            next(lines)
            os.kill(lost.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        statuses = []
        deadline = time.monotonic() + 60
        while not statuses or statuses[-1] != 200:
            assert time.monotonic() < deadline, f"the server did not serve again within 60 s: {statuses[-5:]}"
            statuses.append(completion(client, prompt="x", max_tokens=2).status_code)
        answer = completion(client, prompt="x", max_tokens=2)
        swaps = metrics_of(live)['kiln_engine_swaps_total{"result": "swapped"}']
        ready = httpx.get(f"{live.url}/readyz").status_code
    assert rest[-1] == "data: [DONE]" and '"code": "engine_failed"' in rest[-2]
    assert set(statuses) <= {200, 503}, statuses
    assert answer.headers[VERSION_HEADER] == store.fp32 and ready == 200
    assert swaps == 2  # the first load, then the reload


@pytest.fixture()
def own_engine(engine_dir):
    """An engine a scheduler may own (and close), not the session's shared one."""
    from components.runtime import load_engine

    return load_engine(engine_dir.path)


def test_the_batch_never_exceeds_the_engines_profile_and_the_rest_wait(own_engine, tokenizer):
    engine = own_engine
    from serving.scheduler import Finished, Scheduler, Sequence

    batches, finished = [], threading.Semaphore(0)
    scheduler = Scheduler(engine, tokenizer, max_waiting=32, observe=lambda turn: batches.append((turn.running, turn.waiting)))
    emit = lambda event: finished.release() if isinstance(event, Finished) else None  # noqa: E731
    sequences = [Sequence(tokenizer.encode(f"The list {i}"), Sampling(max_new_tokens=6, stop_at_eos=False), emit) for i in range(20)]
    scheduler.submit(sequences)
    for _ in sequences:
        assert finished.acquire(timeout=30)
    profile_max = engine.manifest.profiles["generation"].batch.max
    assert max(running for running, _ in batches) == profile_max
    assert max(waiting for _, waiting in batches) > 0
    assert all(len(s.generated) == 6 for s in sequences)
    assert scheduler.close(timeout=5)


def test_sequences_arriving_as_others_finish_each_get_the_answer_they_get_alone(own_engine, engine, tokenizer):
    """Slots freed by finished sequences are taken in place by later ones, the batch is
    compacted now and then, and some newcomers join at its end: through all of that every
    sequence decodes exactly as it does alone (greedy, so the text is the proof)."""
    from serving.scheduler import Finished, Scheduler, Sequence

    words = ("The list", "A class", "Importing", "def", "The for", "Raise", "With", "Return", "Yield", "Assert", "The if", "Lambda")
    asks = [(f"{words[i % len(words)]} {i} is" if i % 3 else words[i % len(words)], 3 + (7 * i) % 23) for i in range(30)]
    scheduler = Scheduler(own_engine, tokenizer, max_waiting=len(asks), max_batch=4)
    finished = threading.Semaphore(0)

    def emit(event) -> None:
        if isinstance(event, Finished):
            finished.release()

    sequences = []
    for prompt, max_tokens in asks:  # one at a time, 2 ms apart, so that most arrive while others run
        sequences.append(Sequence(tokenizer.encode(prompt), Sampling(max_new_tokens=max_tokens, stop_at_eos=False), emit))
        scheduler.submit(sequences[-1:])
        time.sleep(0.002)
    for _ in sequences:
        assert finished.acquire(timeout=30)
    assert scheduler.close(timeout=5)
    alone = [engine.generate([tokenizer.encode(p)], Sampling(max_new_tokens=n, stop_at_eos=False))[0] for p, n in asks]
    assert [s.generated for s in sequences] == alone


def test_a_stream_alone_takes_several_steps_a_turn_and_a_batch_one_with_the_same_answers(own_engine, engine, tokenizer, monkeypatch):
    """Where the host samples, a stream that has run alone for LONE_AFTER_S takes as many
    steps a turn as fit in HOST_TURN_BUDGET_S (its messages and events come once a turn,
    so the fewer turns the better);
    two at once step together one step a turn, and a stream right after them is not yet
    alone. Either way each answer is the one it gets alone."""
    import serving.scheduler as scheduling
    from serving.scheduler import Finished, Scheduler, Sequence

    turns: list[tuple[int, int]] = []
    decode_turn = own_engine.decode_turn
    own_engine.decode_turn = lambda state, ids, draws, steps, room=0: turns.append((len(ids), steps)) or decode_turn(state, ids, draws, steps, room)
    scheduler, finished = Scheduler(own_engine, tokenizer, max_waiting=4), threading.Semaphore(0)
    sampling = Sampling(max_new_tokens=40, stop_at_eos=False)

    def ask(*prompts: str) -> list[list[int]]:
        turns.clear()
        sequences = [Sequence(tokenizer.encode(p), sampling, lambda e: finished.release() if isinstance(e, Finished) else None) for p in prompts]
        scheduler.submit(sequences)
        for _ in sequences:
            assert finished.acquire(timeout=30)
        assert [seq.generated for seq in sequences] == [engine.generate([tokenizer.encode(p)], sampling)[0] for p in prompts]
        return sorted({steps for _, steps in turns})

    monkeypatch.setattr(scheduling, "LONE_AFTER_S", 0.0)
    monkeypatch.setattr(scheduling, "HOST_TURN_BUDGET_S", 10.0)  # room for the engine's longest turn
    # One step that measures a step, then the longest turns: 39 steps in 3 more turns, the
    # last as long as the rows left (no graphs to capture here, so no power of two).
    assert ask("The list") == [1, 6, own_engine.max_turn_steps] and len(turns) == 4
    monkeypatch.setattr(scheduling, "LONE_AFTER_S", 60.0)
    assert ask("A class", "Importing") == [1]
    assert ask("The list") == [1]  # the pair ran a moment ago: not alone yet
    assert scheduler.close(timeout=5)


def test_a_temperature_too_small_to_divide_by_samples_greedily_and_leaves_its_batch_alone(own_engine, engine, tokenizer):
    """Logits over a temperature of 1e-308 overflow to inf, and inf - inf is NaN: numpy
    refused to draw, and the failure took down every request in the step."""
    from serving.scheduler import Failed, Finished, Scheduler, Sequence

    scheduler = Scheduler(own_engine, tokenizer, max_waiting=8)
    events: dict[int, list] = {0: [], 1: [], 2: []}
    ended = threading.Semaphore(0)

    def emitter(index: int):
        def emit(event) -> None:
            events[index].append(event)
            if isinstance(event, Finished | Failed):
                ended.release()

        return emit

    prompts = [tokenizer.encode(p) for p in ("The list", "A class", "Importing")]
    samplings = [Sampling(max_new_tokens=12, stop_at_eos=False), Sampling(max_new_tokens=12, temperature=1e-308, seed=1, stop_at_eos=False), Sampling(max_new_tokens=12, stop_at_eos=False)]
    sequences = [Sequence(prompt, sampling, emitter(i)) for i, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True))]
    scheduler.submit(sequences)
    for _ in sequences:
        assert ended.acquire(timeout=30)
    assert scheduler.close(timeout=5)
    assert [type(e[-1]) for e in events.values()] == [Finished] * 3, events
    greedy = [engine.generate([p], Sampling(max_new_tokens=12, stop_at_eos=False))[0] for p in prompts]
    assert [s.generated for s in sequences] == greedy  # the tiny temperature is the argmax


def test_a_cancelled_sequence_leaves_the_batch_at_the_end_of_its_turn(own_engine, tokenizer):
    """What a disconnect does (the server marks the client's sequences cancelled): the slot
    is free after the turn in flight, not after max_tokens."""
    from serving.scheduler import Delta, Finished, Scheduler, Sequence

    scheduler = Scheduler(own_engine, tokenizer, max_waiting=4)
    events, gone, when = [], threading.Event(), []

    def emit(event) -> None:
        events.append(event)
        if isinstance(event, Delta) and len(events) == 3:
            when.append(len(sequence.generated))
            sequence.cancel()
            gone.set()

    sequence = Sequence(tokenizer.encode("The list"), Sampling(max_new_tokens=120, stop_at_eos=False), emit)
    scheduler.submit([sequence])
    assert gone.wait(10)
    deadline = time.monotonic() + 5
    while scheduler.running:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert len(sequence.generated) <= when[0] + own_engine.max_turn_steps  # the turn in flight when it was cancelled, no more
    assert not any(isinstance(e, Finished) for e in events)
    assert scheduler.close(timeout=5)


def test_cancelled_sequences_in_the_waiting_line_make_room_for_new_ones(own_engine, tokenizer):
    """Clients that left while waiting hold no place: the line takes new sequences."""
    from serving.scheduler import Finished, QueueFull, Scheduler, Sequence

    scheduler = Scheduler(own_engine, tokenizer, max_waiting=2, max_batch=1)
    done = threading.Semaphore(0)

    def sequence(new_tokens: int) -> Sequence:
        return Sequence(tokenizer.encode("The list"), Sampling(max_new_tokens=new_tokens, stop_at_eos=False), lambda e: done.release() if isinstance(e, Finished) else None)

    admitted, hold = threading.Event(), threading.Event()

    def held(event) -> None:
        """The scheduler's thread waits at the long one's first text until the line is
        filled: polling `running` instead missed a sequence that had already finished."""
        if not admitted.is_set():
            admitted.set()
            hold.wait(10)
        if isinstance(event, Finished):
            done.release()

    running = Sequence(tokenizer.encode("The list"), Sampling(max_new_tokens=100, stop_at_eos=False), held)
    gone = [sequence(4), sequence(4)]
    scheduler.submit([running])
    assert admitted.wait(10)  # admitted: the line is empty again
    scheduler.submit(gone)  # the line is full now
    with pytest.raises(QueueFull):
        scheduler.submit([sequence(4)])
    hold.set()
    for seq in gone:
        seq.cancel()
    scheduler.submit([sequence(4), sequence(4)])
    for _ in range(3):  # the long one and the two that took the abandoned places
        assert done.acquire(timeout=30)
    assert scheduler.close(timeout=5)


# ---------------------------------------------------------------- bad input


BAD_INPUTS = {
    "malformed-json": (b'{"model": "kiln-serve", "prompt": ', 400, None),
    "not-an-object": (b"[1, 2]", 400, None),
    "non-utf8": (b'{"model": "kiln-serve", "prompt": "\xff\xfe"}', 400, None),
    "wrong-type": (b'{"model": "kiln-serve", "prompt": "x", "max_tokens": "10"}', 400, "max_tokens"),
    "unknown-field": (b'{"model": "kiln-serve", "prompt": "x", "best_of": 3}', 400, "best_of"),
    "missing-prompt": (b'{"model": "kiln-serve"}', 400, "prompt"),
    "empty-prompt": (b'{"model": "kiln-serve", "prompt": ""}', 400, "prompt"),
    "blank-prompt": (b'{"model": "kiln-serve", "prompt": "   "}', 400, "prompt"),
    "empty-prompt-list": (b'{"model": "kiln-serve", "prompt": []}', 400, "prompt"),
    "max-tokens-zero": (b'{"model": "kiln-serve", "prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    "max-tokens-over-limit": (b'{"model": "kiln-serve", "prompt": "x", "max_tokens": 65}', 400, "max_tokens"),
    "negative-temperature": (b'{"model": "kiln-serve", "prompt": "x", "temperature": -0.1}', 400, "temperature"),
    "top-p-zero": (b'{"model": "kiln-serve", "prompt": "x", "top_p": 0}', 400, "top_p"),
    "top-p-above-one": (b'{"model": "kiln-serve", "prompt": "x", "top_p": 1.5}', 400, "top_p"),
    "token-id-beyond-vocabulary": (b'{"model": "kiln-serve", "prompt": [5, 99999]}', 400, "prompt"),
    "negative-token-id": (b'{"model": "kiln-serve", "prompt": [5, -1]}', 400, "prompt"),
    "text-and-ids-mixed": (b'{"model": "kiln-serve", "prompt": [5, "x"]}', 400, "prompt"),
    "unknown-model": (b'{"model": "gpt-4", "prompt": "x"}', 404, "model"),
    "body-over-limit": (b'{"model": "kiln-serve", "prompt": "' + b"x" * 9000 + b'"}', 413, None),
    # numpy's generators take no negative seed: drawn at the first step, it failed the whole batch
    "negative-seed": (b'{"model": "kiln-serve", "prompt": "x", "temperature": 1, "seed": -1}', 400, "seed"),
    "seed-beyond-64-bits": (b'{"model": "kiln-serve", "prompt": "x", "temperature": 1, "seed": 18446744073709551616}', 400, "seed"),
    # json.loads raises RecursionError and, past 4300 digits, a plain ValueError: not JSONDecodeError
    "nested-too-deeply": (b"[" * 2000 + b"]" * 2000, 400, None),
    "more-prompts-than-the-waiting-line": (b'{"model": "kiln-serve", "prompt": [' + b", ".join([b'"x"'] * 33) + b"]}", 400, "prompt"),
    "integer-with-5000-digits": (b'{"model": "kiln-serve", "prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}", 400, None),
    "logprobs-over-5": (b'{"model": "kiln-serve", "prompt": "x", "logprobs": 6}', 400, "logprobs"),
    "echo-not-a-bool": (b'{"model": "kiln-serve", "prompt": "x", "echo": "yes"}', 400, "echo"),
    "n-zero": (b'{"model": "kiln-serve", "prompt": "x", "n": 0}', 400, "n"),
    "n-over-the-servers-limit": (b'{"model": "kiln-serve", "prompt": "x", "n": 9}', 400, "n"),
    "prompts-times-n-over-the-waiting-line": (b'{"model": "kiln-serve", "prompt": ["x", "y", "z", "w", "v"], "n": 7}', 400, "n"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_is_a_4xx_naming_what_was_wrong_and_the_server_keeps_answering(server, case):
    body, status, param = BAD_INPUTS[case]
    with server.client() as client:
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and error["type"]
        assert error["param"] == param
        assert completion(client, prompt="x", max_tokens=2).status_code == 200


@pytest.mark.parametrize(
    ("body", "named"),
    [({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"), ({"prompt": [5, -1]}, "greater than or equal to 0"), ({"prompt": []}, "at least 1")],
    ids=["five-stops", "negative-token-id", "empty-prompt-list"],
)
def test_a_union_fields_error_names_the_broken_limit_not_another_members_type(server, body, named):
    with server.client() as client:
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"} | body)
    assert response.status_code == 400 and named in response.json()["error"]["message"], response.text


@pytest.mark.parametrize(
    ("repeats", "max_tokens", "param", "limit"),
    [(25, 64, "max_tokens", 128), (60, 64, "prompt", 96), (60, 1, "prompt", 96)],
    ids=["prompt-plus-max-tokens", "prompt-alone", "prompt-alone-with-room-for-its-tokens"],  # the last: never cut to fit
)
def test_a_request_beyond_the_engines_profile_is_refused_with_both_numbers(server, tokenizer, repeats, max_tokens, param, limit):
    prompt = "list " * repeats
    tokens = len(tokenizer.encode(prompt))
    with server.client() as client:
        response = completion(client, prompt=prompt, max_tokens=max_tokens)
        assert completion(client, prompt="x", max_tokens=2).status_code == 200
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert f"{tokens} tokens" in error["message"] and f"allows {limit}" in error["message"]


def test_the_openai_client_sees_a_bad_request_as_its_own_error_type(server):
    import openai

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1000)
    assert caught.value.param == "max_tokens"


def test_a_bearer_token_guards_the_api_but_not_health_or_metrics(store):
    with LiveServer(store.app(api_key="s3cret")) as live, live.client() as client:
        assert completion(client, prompt="x", max_tokens=2).status_code == 401
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert OpenAI(base_url=f"{live.url}/v1", api_key="s3cret").completions.create(model=MODEL, prompt="x", max_tokens=2).choices
        assert client.get("/healthz").status_code == 200 and client.get("/metrics").status_code == 200
        assert client.get("/openapi.json").status_code == 401 and client.get("/docs").status_code == 401
        assert client.get("/openapi.json", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert "swagger-ui" in client.get("/docs", headers={"Authorization": "Bearer s3cret"}).text


def test_the_openapi_schema_describes_the_bodies_the_completion_routes_parse(server):
    """The routes parse their own bodies (OpenAI-style errors), so FastAPI cannot see them:
    the served schema names the same pydantic models, and a body it documents is answered."""
    schema = httpx.get(f"{server.url}/openapi.json").json()
    completions = schema["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/CompletionRequest"}
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "n", "logprobs", "echo"} <= set(fields)
    assert schema["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ModelList")
    assert "signing_key" in schema["components"]["schemas"]["ModelCard"]["properties"]
    assert "/openapi.json" not in schema["paths"] and "/docs" not in schema["paths"]


def test_the_schema_names_kilns_version_even_where_kiln_runs_from_a_checkout_it_was_not_installed_from(monkeypatch):
    """The lent GPU machine runs kiln serve from the source tree: the server must start there."""
    import importlib.metadata
    import tomllib

    from serving import openapi

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(openapi, "version", not_installed)
    project = tomllib.loads((Path(openapi.__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert openapi.kiln_version() == project["version"]


# ---------------------------------------------------------------- metrics


def test_metrics_count_what_clients_received(server):
    before = metrics_of(server)
    with server.client() as client:
        usages = [completion(client, prompt=p, max_tokens=5, temperature=0).json()["usage"] for p in ("The list", "A class")]
    after = metrics_of(server)
    generated = sum(u["completion_tokens"] for u in usages)
    assert after["kiln_generated_tokens_total"] - before["kiln_generated_tokens_total"] == generated
    assert after["kiln_prompt_tokens_total"] - before["kiln_prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert after['kiln_requests_total{"outcome": "ok"}'] - before.get('kiln_requests_total{"outcome": "ok"}', 0) == 2  # absent before a first request
    assert after["kiln_request_duration_seconds_count"] - before["kiln_request_duration_seconds_count"] == 2
    assert after["kiln_time_to_first_token_seconds_count"] - before["kiln_time_to_first_token_seconds_count"] == 2
    assert after["process_resident_memory_bytes"] > 0
    assert after["kiln_engine_process_resident_memory_bytes"] > 0  # the engine's own process
    assert after["kiln_engine_process_cpu_seconds_total"] > before["kiln_engine_process_cpu_seconds_total"]
    info = {k: v for k, v in after.items() if k.startswith("kiln_served_engine_info")}
    assert len(info) == 1 and '"precision": "fp32"' in next(iter(info))
    assert after["kiln_ready"] == 1 and after['kiln_engine_swaps_total{"result": "swapped"}'] == 1
    # The registry as the pipeline row reads it: both engines of the store, passed (record()'s tags name no precision).
    assert after['kiln_registry_versions{"gates_passed": "true", "precision": "unknown"}'] == 2
    assert 0 < time.time() - after["kiln_registry_last_registered_timestamp_seconds"] < 3600


def test_registry_metrics_follow_new_versions_and_survive_a_registry_that_cannot_be_read():
    from serving.metrics import RegistryCollector

    versions = {"1": ({"precision": "fp32", "gates.passed": "true"}, 100.0)}

    def read():
        if versions is None:
            raise OSError("the tracking server is down")
        return versions

    collector = RegistryCollector(read, min_interval_s=0)
    samples = lambda: {(f.name, tuple(sorted(s.labels.items()))): s.value for f in collector.collect() for s in f.samples}  # noqa: E731
    assert samples() == {("kiln_registry_versions", (("gates_passed", "true"), ("precision", "fp32"))): 1, ("kiln_registry_last_registered_timestamp_seconds", ()): 100.0}
    versions["2"] = ({"precision": "int8", "gates.passed": "false"}, 200.0)
    assert samples()[("kiln_registry_versions", (("gates_passed", "false"), ("precision", "int8")))] == 1
    assert samples()[("kiln_registry_last_registered_timestamp_seconds", ())] == 200.0
    versions = None
    assert samples() == {}  # left out for this scrape, not an error on /metrics


def test_every_metric_the_dashboard_and_the_alerts_query_is_one_kiln_serve_exports(server):
    """Read from the live server's /metrics (names with their sample suffixes, labelled
    families too before their first sample), not from a list kept beside the dashboard."""
    import re

    from components.config import load_params
    from flows import monitoring

    exported = set()
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}.get(family.type, ("",))
        exported |= {family.name + suffix for suffix in suffixes}
    exprs = [t["expr"] for p in monitoring.dashboard()["panels"] for t in p.get("targets") or []]
    rules = monitoring.rules(load_params(Path(__file__).resolve().parents[1] / "params.yaml"))
    exprs += [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    queried = {name for expr in exprs for name in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\{", expr)}
    # `up` is Prometheus's own; GPU gauges exist where a GPU does (tested apart, checked on the H200).
    missing = {name for name in queried - exported if name != "up" and not name.startswith("kiln_gpu_")}
    assert not missing, f"the dashboard or the rules query metrics kiln serve does not export: {sorted(missing)}"
    assert {"kiln_request_duration_seconds_bucket", "kiln_served_engine_info", "kiln_engine_process_start_time_seconds"} <= queried


class SlowSteps(Engine):
    """The real engine, each forward pass (prefill or decode step) `seconds` slower: a
    request's first token then comes one step after arrival, its last after all of them,
    whatever the machine's speed."""

    def __init__(self, inner: Engine, seconds: float) -> None:
        super().__init__(inner.engine_dir)
        self.inner, self.seconds = inner, seconds

    def forward(self, input_ids, attention_mask, position_ids, cache, logits_positions=None):
        time.sleep(self.seconds)
        return self.inner.forward(input_ids, attention_mask, position_ids, cache, logits_positions)


def test_time_to_first_token_records_the_first_token_not_the_whole_request(own_engine, tokenizer):
    from serving.handlers import Prompt, Submitted, observe
    from serving.metrics import ServerMetrics
    from serving.scheduler import Finished, Scheduler, Sequence

    step_s, new_tokens = 0.05, 12
    scheduler = Scheduler(SlowSteps(own_engine, step_s), tokenizer, max_waiting=4)
    done = threading.Event()
    sequence = Sequence(tokenizer.encode("The list"), Sampling(max_new_tokens=new_tokens, stop_at_eos=False), lambda e: done.set() if isinstance(e, Finished) else None)
    job = Submitted([sequence], [Prompt(sequence.prompt, "The list")], 1, asyncio.Queue(), started=time.monotonic())
    scheduler.submit([sequence])
    assert done.wait(timeout=30) and scheduler.close(timeout=5)
    metrics = ServerMetrics()
    observe(job, metrics, "ok")
    sample = metrics.registry.get_sample_value
    ttft, whole = sample("kiln_time_to_first_token_seconds_sum"), sample("kiln_request_duration_seconds_sum")
    tpot = sample("kiln_time_per_output_token_seconds_sum")
    # The first token needs the prefill (one slow step); the request all 12 steps (≥ 0.6 s).
    assert step_s <= ttft < whole / 3, (ttft, whole)
    assert whole >= new_tokens * step_s and tpot >= step_s * 0.9


# ---------------------------------------------------------------- following the alias


def hammer(live: LiveServer, stop: threading.Event, results: list) -> None:
    """Requests back to back until `stop`: (status, version header)."""
    with live.client() as client:
        while not stop.is_set():
            response = completion(client, prompt="The list", max_tokens=8, temperature=0)
            results.append((response.status_code, response.headers.get(VERSION_HEADER)))


def wait_for_version(live: LiveServer, version: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{live.url}/v1/models").json()["data"][0]["version"] != version:
        assert time.monotonic() < deadline, f"the server did not move to version {version} within {timeout} s"
        time.sleep(0.1)


def test_a_moved_alias_is_picked_up_by_polling_under_load_with_no_failed_request(fresh_store):
    with LiveServer(fresh_store.app(poll_interval_s=0.3)) as live:
        stop, results = threading.Event(), []
        clients = [threading.Thread(target=hammer, args=(live, stop, results)) for _ in range(4)]
        for thread in clients:
            thread.start()
        time.sleep(0.5)
        promote(fresh_store.target, CHAMPION, version=fresh_store.int8)
        wait_for_version(live, fresh_store.int8)
        time.sleep(0.5)
        stop.set()
        for thread in clients:
            thread.join()
        swaps = metrics_of(live)['kiln_engine_swaps_total{"result": "swapped"}']
    assert {status for status, _ in results} == {200}, results
    assert {version for _, version in results} == {fresh_store.fp32, fresh_store.int8}
    assert swaps == 2  # the first load, then the move


def test_a_swapped_in_version_never_reuses_the_prefix_cache_of_the_one_before(fresh_store):
    """The KV of one engine is not another's: a prompt cached under fp32 is prefilled in
    full by int8 once the alias moves, then cached again."""
    prompt = "The list type is a mutable sequence, and a tuple is an immutable sequence of values. Which"
    with LiveServer(fresh_store.app(poll_interval_s=0.3, prefix_cache_bytes=16 << 20)) as live, live.client() as client:
        cached = [completion(client, prompt=prompt, max_tokens=2).json()["usage"] for _ in range(2)]
        promote(fresh_store.target, CHAMPION, version=fresh_store.int8)
        wait_for_version(live, fresh_store.int8)
        swapped = [completion(client, prompt=prompt, max_tokens=2).json()["usage"] for _ in range(2)]
    reused = [u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in cached + swapped]
    assert reused[0] == 0 and reused[1] >= 16 and reused[2] == 0 and reused[3] == reused[1]


def spoil_tampered(store: Store) -> str:
    tamper(stored_engine(store.target, store.int8), also_manifest=True)
    return "its files are not the ones signed"


def spoil_gates(store: Store) -> str:
    from mlflow import MlflowClient

    MlflowClient(store.target.tracking_uri).set_model_version_tag(MODEL, store.int8, "gates.passed", "false")
    return "did not pass its gates"


def spoil_artifacts(store: Store) -> str:
    import shutil

    shutil.rmtree(stored_engine(store.target, store.int8))
    return "artifacts cannot be downloaded"


def spoil_forced_then_tampered(store: Store) -> str:
    """A version a person forced past failed gates (with a recorded reason), whose engine is
    edited afterwards: the reason excuses the gates, never the bytes."""
    from mlflow import MlflowClient

    MlflowClient(store.target.tracking_uri).set_model_version_tag(MODEL, store.int8, "gates.passed", "false")
    promote(store.target, "reviewed", version=store.int8, by="a person", reason="latency only; quality checked by hand", force=True)
    tamper(stored_engine(store.target, store.int8), also_manifest=True)
    return "its files are not the ones signed"


def attacked(attack):
    """An attack of test_signing.py on the int8 version (the one the alias will move to)."""
    return lambda store: attack(store.target, store.int8)


SPOILS = {
    "tampered-engine": spoil_tampered, "gates-failed": spoil_gates, "artifacts-gone": spoil_artifacts, "forced-then-tampered": spoil_forced_then_tampered,
    **{name: attacked(attack) for name, attack in ATTACKS.items()},
}  # fmt: skip


@pytest.mark.parametrize("spoil", SPOILS.values(), ids=SPOILS.keys())
def test_a_version_the_loader_refuses_is_never_served_and_the_old_one_keeps_serving(fresh_store, engine_dir, caplog, spoil):
    from mlflow import MlflowClient

    reason = spoil(fresh_store)
    with LiveServer(fresh_store.app(poll_interval_s=0.2)) as live:
        # `kiln promote` would refuse it; a person in the MLflow UI can still set the alias
        MlflowClient(fresh_store.target.tracking_uri).set_registered_model_alias(MODEL, CHAMPION, fresh_store.int8)
        deadline = time.monotonic() + 15
        while metrics_of(live).get('kiln_engine_swaps_total{"result": "refused"}', 0) < 1:
            assert time.monotonic() < deadline, "the refusal was never counted"
            time.sleep(0.1)
        time.sleep(0.5)  # more polls: still refused, never retried into service
        with live.client() as client:
            response = completion(client, prompt="x", max_tokens=2)
        card = httpx.get(f"{live.url}/v1/models").json()["data"][0]
        refusals = metrics_of(live)['kiln_engine_swaps_total{"result": "refused"}']
    assert response.status_code == 200 and response.headers[VERSION_HEADER] == fresh_store.fp32
    assert card["version"] == fresh_store.fp32 and card["engine_sha256"] == engine_dir.sha256
    assert refusals == 1  # logged and counted once, not at every poll
    assert any(f"keeping version {fresh_store.fp32}" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_an_unsigned_version_serves_only_where_signatures_are_not_required_and_says_so(engine_dir, tmp_path, caplog):
    """registry.require_signature false (migrating an old store): the unsigned version serves,
    with a warning in the log and `signing_key="unsigned"` on kiln_served_engine_info; a
    server that requires signatures refuses to start on it."""
    lenient = RegistryTarget(new_mlflow_store(tmp_path / "mlflow.db"), MODEL, MODEL, tmp_path / "artifacts", Signing(tmp_path / "no-key.pem", SIGNING.trusted, required=False))
    promote(lenient, CHAMPION, version=register_engine(lenient, engine_dir.path, engine_dir.sha256, record()).version)
    with caplog.at_level(logging.WARNING, logger="kiln.serving"), LiveServer(create_app(AliasSource(lenient, CHAMPION, tmp_path / "cache"), ServerSettings(poll_interval_s=0))) as live:
        (card,) = httpx.get(f"{live.url}/v1/models").json()["data"]
        served = [value for name, value in metrics_of(live).items() if name.startswith("kiln_served_engine_info") and '"signing_key": "unsigned"' in name]
    assert card["signing_key"] == "unsigned" and served == [1.0]
    assert any("UNSIGNED" in r.getMessage() and "require_signature is false" in r.getMessage() for r in caplog.records)
    strict = replace(lenient, signing=SIGNING)
    with pytest.raises(RuntimeError, match="it is not signed"), LiveServer(create_app(AliasSource(strict, CHAMPION, tmp_path / "strict"), ServerSettings(poll_interval_s=0))):
        pass


# ---------------------------------------------------------------- webhooks


def signed(body: bytes, secret: str = SECRET, age_s: float = 0, delivery: str = "d-1") -> dict[str, str]:
    timestamp = str(int(time.time() - age_s))
    return {
        "content-type": "application/json",
        "x-mlflow-delivery-id": delivery,
        "x-mlflow-timestamp": timestamp,
        "x-mlflow-signature": signature_of(secret, delivery, timestamp, body),
    }


ALIAS_BODY = json.dumps({"entity": "model_version_alias", "action": "created", "timestamp": "", "data": {"name": MODEL, "alias": "champion", "version": "2"}}).encode()


@pytest.mark.parametrize(
    ("case", "headers"),
    [
        ("unsigned", {"content-type": "application/json"}),
        ("wrong-secret", signed(ALIAS_BODY, secret="not-the-secret")),
        ("stale", signed(ALIAS_BODY, age_s=3600)),
    ],
    ids=["unsigned", "wrong-secret", "stale"],
)
def test_webhook_deliveries_that_are_unsigned_badly_signed_or_stale_are_401(server, case, headers):
    response = httpx.post(f"{server.url}/hooks/mlflow", content=ALIAS_BODY, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_a_signed_fresh_delivery_is_accepted(server):
    response = httpx.post(f"{server.url}/hooks/mlflow", content=ALIAS_BODY, headers=signed(ALIAS_BODY))
    assert response.status_code == 200 and response.json()["followed"] is True


def test_a_secret_that_kiln_up_writes_after_the_server_started_is_picked_up(store, tmp_path, caplog):
    """`kiln serve` before the first `kiln up`: deliveries are refused, with the reason in
    the server's log, until the secret file appears; then they are checked with it."""
    secret_file = tmp_path / "webhook.secret"
    with caplog.at_level("WARNING", logger="kiln.serving"), LiveServer(store.app(webhook_secret=None, webhook_secret_file=secret_file)) as live:
        refused = httpx.post(f"{live.url}/hooks/mlflow", content=ALIAS_BODY, headers=signed(ALIAS_BODY))
        secret_file.write_text(SECRET + "\n")
        accepted = httpx.post(f"{live.url}/hooks/mlflow", content=ALIAS_BODY, headers=signed(ALIAS_BODY, delivery="d-2"))
    assert refused.status_code == 401 and str(secret_file) in refused.json()["error"]["message"]
    assert any("webhook delivery refused" in r.getMessage() and str(secret_file) in r.getMessage() for r in caplog.records)
    assert accepted.status_code == 200 and accepted.json()["followed"] is True


@pytest.fixture()
def mlflow_server(fresh_store):
    with running_mlflow_server(fresh_store.target.tracking_uri, fresh_store.target.artifact_root) as url:
        yield url


def test_an_alias_set_through_the_mlflow_server_reaches_the_server_by_webhook_under_load(fresh_store, mlflow_server):
    from mlflow import MlflowClient

    from registry import register_alias_webhook

    http_target = RegistryTarget(mlflow_server, MODEL, MODEL, signing=SIGNING)
    with LiveServer(fresh_store.app(poll_interval_s=0)) as live:  # no polling: only the webhook can move it
        register_alias_webhook(http_target, f"{live.url}/hooks/mlflow", SECRET)
        stop, results = threading.Event(), []
        clients = [threading.Thread(target=hammer, args=(live, stop, results)) for _ in range(3)]
        for thread in clients:
            thread.start()
        started = time.monotonic()
        MlflowClient(mlflow_server).set_registered_model_alias(MODEL, CHAMPION, fresh_store.int8)
        wait_for_version(live, fresh_store.int8, timeout=30)
        latency = time.monotonic() - started
        time.sleep(0.3)
        stop.set()
        for thread in clients:
            thread.join()
        followed = metrics_of(live)['kiln_webhook_deliveries_total{"result": "followed"}']
    assert {status for status, _ in results} == {200}
    assert {version for _, version in results} == {fresh_store.fp32, fresh_store.int8}
    assert followed >= 1
    print(f"alias set → served by webhook in {latency:.2f} s")


# ---------------------------------------------------------------- the command


def test_kiln_serve_with_no_version_behind_the_alias_says_how_to_get_one_and_exits_2(tmp_path):
    params = {"registry": {"tracking_uri": new_mlflow_store(tmp_path / "mlflow.db"), "model_name": "kiln-nothing-yet"}}
    (tmp_path / "params.yaml").write_text(json.dumps(params))
    result = subprocess.run([str(Path(sys.executable).parent / "kiln"), "serve", "--port", str(free_port())], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr + result.stdout
    output = " ".join((result.stdout + result.stderr).split())
    assert "kiln-nothing-yet@champion names no version yet" in output
    assert "kiln promote" in output and "MLflow UI" in output


def test_kiln_bench_serving_measures_both_modes_beside_the_engines_generate_and_writes_json(tmp_path, engine_dir):
    """Also, with --constrained, the batching server answering clients that ask for JSON of a schema."""
    (tmp_path / "params.yaml").write_text("{}\n")  # the defaults
    command = [str(Path(sys.executable).parent / "kiln"), "bench", "serving", "--engine", str(engine_dir.path), "--constrained",
               "--clients", "4", "--seconds", "1", "--prompt-tokens", "8", "--new-tokens", "8", "--rounds", "2", "--json", str(tmp_path / "serving.json")]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "one-at-a-time" in result.stdout and "continuous-batching" in result.stdout and "of gen" in result.stdout
    report = json.loads((tmp_path / "serving.json").read_text(), parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    modes = ["engine generate", "one-at-a-time", "continuous-batching", "JSON schema"]
    assert [row["name"] for row in report["rows"]] == modes
    for row in report["rows"]:
        assert row["failed"] == 0 and row["requests"] >= 4
        if row["name"] != "JSON schema":  # a grammar may end an answer where its JSON is complete
            assert row["tokens_per_s"] == pytest.approx(row["requests_per_s"] * 8, rel=1e-6)  # ignore_eos: 8 tokens each
        assert 0 < row["p50_ms"] <= row["p99_ms"]
        # the engine's own generate has no stream, so no first token to time
        assert row["ttft_p50_ms"] is None if row["name"] == "engine generate" else 0 < row["ttft_p50_ms"] <= row["p50_ms"]
        assert row["tpot_p50_ms"] is None if row["name"] == "engine generate" else 0 < row["tpot_p50_ms"] < row["p50_ms"]
    assert set(report["rows"][0]) == {"name", "engine", "requests_per_s", "tokens_per_s", "p50_ms", "p99_ms", "ttft_p50_ms", "tpot_p50_ms", "requests", "failed", "rounds"}
    # two rounds, the rows interleaved; each row is the median of its mode's rounds
    assert [row["name"] for row in report["rounds"]] == modes * 2
    for row in report["rows"]:
        mine = [r for r in report["rounds"] if r["name"] == row["name"]]
        assert row["rounds"] == 2 and row["requests"] == sum(r["requests"] for r in mine)
        assert row["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in mine) / 2)
    assert "ratio by round" in result.stdout


def test_kiln_bench_serving_drives_any_openai_server_given_by_its_url(server, tmp_path, engine_dir):
    """`--openai-url` measures a server kiln did not start (llama-server, vLLM, ...) with the same
    clients; here kiln's own, running in this process. Without --vocab or an engine to
    draw prompt ids from, one line says what is missing."""
    kiln = str(Path(sys.executable).parent / "kiln")
    (tmp_path / "params.yaml").write_text("{}\n")
    common = ["--clients", "2", "--seconds", "1", "--prompt-tokens", "8", "--new-tokens", "8"]
    command = [kiln, "bench", "serving", "--openai-url", server.url, "--vocab", str(engine_dir.manifest.vocab_size), *common, "--json", str(tmp_path / "url.json")]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    [row] = json.loads((tmp_path / "url.json").read_text())["rows"]
    assert row["name"] == "as served" and row["engine"] == server.url
    assert row["failed"] == 0 and row["requests"] >= 2 and row["tokens_per_s"] == pytest.approx(row["requests_per_s"] * 8, rel=1e-6)
    missing = subprocess.run([kiln, "bench", "serving", "--openai-url", server.url, *common], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert missing.returncode == 2 and "--openai-url needs --vocab" in missing.stderr and "Traceback" not in missing.stderr


def test_the_loader_keeps_only_the_last_few_pulled_versions_and_never_the_served_one(store, tmp_path):
    from serving.loader import prune, pull_version

    cache = tmp_path / "cache"
    for version in (store.fp32, store.int8):
        pull_version(store.target, version, cache)
        time.sleep(0.02)  # distinct mtimes
    assert prune(cache, MODEL, keep=1, in_use={store.fp32}) == []  # the older one is in use
    assert prune(cache, MODEL, keep=1, in_use=set()) == [store.fp32]
    assert sorted(p.name for p in (cache / MODEL).iterdir() if not p.name.startswith(".")) == [store.int8]


def test_gpu_metrics_are_absent_without_a_gpu_and_come_from_nvml_with_one():
    """Here NVML cannot start (no driver): no kiln_gpu_* series at all, not zeros. With a GPU
    (checked on the lent H200) the collector reads NVML; a stand-in with NVML's calls and
    shapes: two boards, one without utilisation (a MIG slice), the engine process on one."""
    from types import SimpleNamespace

    from serving.metrics import GpuCollector, ServerMetrics

    assert GpuCollector.if_present() is None
    assert "kiln_gpu_" not in generate_latest(ServerMetrics().registry).decode()

    class NVMLError(Exception):
        pass

    def utilisation(handle):
        if handle == 1:
            raise NVMLError("Not Supported")
        return SimpleNamespace(gpu=37)

    running = {0: [SimpleNamespace(pid=4242, usedGpuMemory=3 * 2**30), SimpleNamespace(pid=7, usedGpuMemory=2**30)], 1: []}
    nvml = SimpleNamespace(
        NVMLError=NVMLError, nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=(4 + h) * 2**30, total=141 * 2**30),
        nvmlDeviceGetUtilizationRates=utilisation, nvmlDeviceGetComputeRunningProcesses=lambda h: running[h],
    )  # fmt: skip
    families = {f.name: [(s.labels["gpu"], s.value) for s in f.samples] for f in GpuCollector(nvml, engine_pid=lambda: 4242).collect()}
    assert families["kiln_gpu_utilization_ratio"] == [("0", 0.37)]
    assert families["kiln_gpu_memory_used_bytes"] == [("0", 4 * 2**30), ("1", 5 * 2**30)]
    assert families["kiln_gpu_memory_total_bytes"] == [("0", 141 * 2**30), ("1", 141 * 2**30)]
    assert families["kiln_gpu_engine_process_memory_used_bytes"] == [("0", 3 * 2**30)]
    idle = {f.name: f.samples for f in GpuCollector(nvml).collect()}  # no engine process yet
    assert idle["kiln_gpu_engine_process_memory_used_bytes"] == []


def test_a_version_whose_backend_cannot_run_here_is_refused_naming_it(tmp_path, engine_dir, caplog):
    """A TensorRT engine registered from a GPU machine, promoted, then served on this CPU one."""
    import shutil

    from components.files import file_sha256

    trt_dir = tmp_path / "tensorrt-engine"
    shutil.copytree(engine_dir.path, trt_dir)
    (trt_dir / "model.onnx").rename(trt_dir / "model.engine")  # stands in for a serialized plan: it is never opened
    manifest = json.loads((trt_dir / "engine.json").read_text())
    manifest |= {"backend": "tensorrt", "backend_version": "11.0.0", "target": "sm_90", "engine_file": "model.engine"}
    manifest["engine_sha256"] = file_sha256(trt_dir / "model.engine")
    (trt_dir / "engine.json").write_text(json.dumps(manifest))
    target = RegistryTarget(new_mlflow_store(tmp_path / "mlflow.db"), MODEL, MODEL, tmp_path / "artifacts", SIGNING)
    version = register_engine(target, trt_dir, manifest["engine_sha256"], record()).version
    promote(target, CHAMPION, version=version)
    app = create_app(AliasSource(target, CHAMPION, tmp_path / "cache"), ServerSettings(poll_interval_s=0))
    with pytest.raises(RuntimeError, match="cannot be served: .*tensorrt"):
        LiveServer(app).__enter__()
    assert "refused" in str(app.state.startup_error)


def test_the_server_says_what_the_running_batchs_kv_cache_can_take(engine_dir):
    from serving.follow import kv_memory_text

    # the test model: 2 layers × 2 KV heads × 16 dims × keys and values × fp32 = 512 bytes a token
    assert engine_dir.manifest.kv_bytes_per_token == 512
    assert kv_memory_text(engine_dir.manifest, None) == "KV cache: 0.5 KiB a token a sequence; 16 sequences × 128 tokens take 1.0 MiB at most"
    assert kv_memory_text(engine_dir.manifest, 1).endswith("1 sequence × 128 tokens take 0.1 MiB at most")
    assert kv_memory_text(engine_dir.manifest, 1, 64 << 20).endswith("take 0.1 MiB at most; the prefix cache's 64.0 MiB hold 131,072 prompt tokens")


def test_a_failing_turn_observer_is_logged_and_the_scheduler_keeps_answering(own_engine, tokenizer, caplog):
    """The turn's metrics hook (kiln serve's gauges, Triton's metrics) once took a signature
    the scheduler no longer called it with: the engine's thread died and every client hung."""
    import logging

    from serving.scheduler import Finished, Scheduler, Sequence

    def broken(turn) -> None:
        raise TypeError("observe() takes 4 positional arguments but 2 were given")

    done = threading.Event()
    scheduler = Scheduler(own_engine, tokenizer, max_waiting=4, observe=broken)
    with caplog.at_level(logging.ERROR, logger="kiln.serving"):
        scheduler.submit([Sequence(tokenizer.encode("The list"), Sampling(max_new_tokens=3), lambda e: done.set() if isinstance(e, Finished) else None)])
        assert done.wait(30)
    assert scheduler.close(timeout=10)
    assert "turn observer failed" in caplog.text
