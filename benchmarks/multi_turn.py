"""`kiln bench serving --workload multi-turn`: conversations, as a dialogue service sees them.

N clients each hold a conversation of T turns and then begin another, until the row's time
is up. Every conversation begins with the same system prompt of S tokens; each turn sends
the whole conversation so far (the system prompt, every earlier user message and reply) and
a new user message, and waits for the reply. The rows are kiln serve with its prefix cache
off and on, and any other server given by URL (llama-server keeps each slot's prompt and a
host-memory prompt cache, as it ships). Prompts are text, as chat clients send them (made by
decoding random token ids with the engine's tokenizer), so every server tokenizes them itself.

What a row reads from each response's usage: prompt tokens, and the cached ones
(`prompt_tokens_details.cached_tokens`, which kiln serve, vLLM and llama-server report):
prefilled tokens are the difference, and the hit rate is cached over prompt tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from benchmarks.serving_load import ServingBenchSetup, _Server
from components.errors import KilnError

CACHE_OFF, CACHE_ON = "prefix cache off", "prefix cache on"
WARM_UP = 1 << 30  # the conversation number of the warm-up request: none of the clients'


@dataclass(frozen=True)
class Conversations:
    system_tokens: int = 512
    turns: int = 8
    cache_mib: int = 1024  # the cache-on row's serving.prefix_cache_mib


@dataclass(frozen=True)
class TurnRow:
    name: str
    engine: str
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    turns: int  # answered
    failed: int
    prompt_tokens: int  # over every answered turn
    cached_tokens: int
    longest_prompt: int  # tokens: the context the conversations reached

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")


@dataclass(frozen=True)
class _Answer:
    ttft: float
    tokens: int
    prompt_tokens: int
    cached_tokens: int
    text: str
    ok: bool


def multi_turn_rows(
    engines: dict[str, Path], urls: list[str], setup: ServingBenchSetup, talk: Conversations, params_file: Path, on_row=lambda row: None
) -> list[TurnRow]:
    """Each kiln engine with its cache off, then on (a fresh server each), then each URL;
    the conversations' text is made with the first engine's tokenizer."""
    if not engines:
        raise KilnError("--workload multi-turn needs --engine DIR (or a champion): its tokenizer writes the conversations' text")
    texts = ConversationText(next(iter(engines.values())), setup, talk)
    rows = []
    for _ in range(setup.rounds):  # every row once a round: a shared machine's slow spell falls on all of them
        for label, engine_dir in engines.items():
            for name, mib in ((CACHE_OFF, 0), (CACHE_ON, talk.cache_mib)):
                with _Server(engine_dir, None, params_file, ("--prefix-cache-mib", str(mib))) as url:
                    rows.append(_measure(url, name, label, texts, setup, talk))
                on_row(rows[-1])
        for url in urls:
            rows.append(_measure(url.rstrip("/"), "as served", url, texts, setup, talk))
            on_row(rows[-1])
    return rows


def median_rows(rounds: list[TurnRow]) -> list[TurnRow]:
    """One row per server: the medians of its rates and times over the rounds, the sums of
    its counts."""
    rows = []
    for key in dict.fromkeys((row.engine, row.name) for row in rounds):
        mine = [row for row in rounds if (row.engine, row.name) == key]
        medians = {name: float(np.median([getattr(row, name) for row in mine])) for name in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms")}
        sums = {name: sum(getattr(row, name) for row in mine) for name in ("turns", "failed", "prompt_tokens", "cached_tokens")}
        rows.append(TurnRow(name=key[1], engine=key[0], **medians, **sums, longest_prompt=max(row.longest_prompt for row in mine)))
    return rows


class ConversationText:
    """The system prompt and every user message, from random token ids decoded to text: the
    same for every row (one seed), a conversation's own messages its own."""

    def __init__(self, engine_dir: Path, setup: ServingBenchSetup, talk: Conversations) -> None:
        from components.engine_dir import load_engine_dir
        from components.runtime.tokenizer import EngineTokenizer

        self._tokenizer = EngineTokenizer(engine_dir)
        self._vocab = min(load_engine_dir(engine_dir).manifest.vocab_size, self._tokenizer.vocab_size)
        self._setup = setup
        self.system = self._text(np.random.default_rng(setup.seed), talk.system_tokens)

    def user(self, conversation: int, turn: int) -> str:
        return self._text(np.random.default_rng((self._setup.seed, conversation, turn)), self._setup.prompt_tokens)

    def _text(self, rng: np.random.Generator, tokens: int) -> str:
        return self._tokenizer.decode(rng.integers(0, self._vocab, tokens).tolist()) if tokens else ""


def _measure(url: str, name: str, label: str, texts: ConversationText, setup: ServingBenchSetup, talk: Conversations) -> TurnRow:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    answers, elapsed = asyncio.run(_drive(url, model, texts, setup, talk))
    ok = [a for a in answers if a.ok]
    if not ok:
        raise KilnError(f"every turn sent to {url} failed")
    ttft = np.array([a.ttft for a in ok]) * 1000
    return TurnRow(
        name=name, engine=label, tokens_per_s=sum(a.tokens for a in ok) / elapsed,
        ttft_p50_ms=float(np.percentile(ttft, 50)), ttft_p99_ms=float(np.percentile(ttft, 99)),
        turns=len(ok), failed=len(answers) - len(ok), prompt_tokens=sum(a.prompt_tokens for a in ok),
        cached_tokens=sum(a.cached_tokens for a in ok), longest_prompt=max(a.prompt_tokens for a in ok),
    )  # fmt: skip


async def _drive(url: str, model: str, texts: ConversationText, setup: ServingBenchSetup, talk: Conversations) -> tuple[list[_Answer], float]:
    """`setup.clients` clients, each holding conversations of `talk.turns` turns one after
    another until `setup.seconds` have passed; the conversation under way is finished, so
    that every row's turns are whole conversations (early turns, with short contexts, are
    not over-counted by a slow row)."""
    connector = aiohttp.TCPConnector(limit=setup.clients, force_close=True)
    answers: list[_Answer] = []
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as client:
        await _turn(client, model, texts.user(WARM_UP, 0), setup)  # sharing nothing with the conversations
        started = time.perf_counter()
        deadline = started + setup.seconds

        async def client_loop(index: int) -> None:
            conversation = index
            while time.perf_counter() < deadline:
                history = texts.system
                for turn in range(talk.turns):
                    history += texts.user(conversation, turn)
                    answer = await _turn(client, model, history, setup)
                    answers.append(answer)
                    if not answer.ok:
                        return
                    history += answer.text
                conversation += setup.clients

        await asyncio.gather(*(client_loop(i) for i in range(setup.clients)))
        return answers, time.perf_counter() - started


async def _turn(client: aiohttp.ClientSession, model: str, prompt: str, setup: ServingBenchSetup) -> _Answer:
    """One streamed completion of `prompt`: its reply's text, when its first token came, and
    its usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": setup.new_tokens, "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, text, usage, buffer = None, [], {}, b""
    try:
        async with client.post("/v1/completions", json=body) as response:
            if response.status != 200:
                await response.read()
                return _Answer(0.0, 0, 0, 0, "", False)
            async for piece in response.content.iter_any():
                first = first or time.perf_counter()
                *lines, buffer = (buffer + piece).split(b"\n")
                for line in lines:
                    if line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        text += [choice.get("text", "") for choice in event.get("choices") or []]
                        usage = event.get("usage") or usage
    except (aiohttp.ClientError, TimeoutError):
        return _Answer(0.0, 0, 0, 0, "", False)
    tokens = int(usage.get("completion_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return _Answer((first or time.perf_counter()) - started, tokens, int(usage.get("prompt_tokens", 0)), cached, "".join(text), tokens == setup.new_tokens)


def write_json(rows: list[TurnRow], rounds: list[TurnRow], setup: ServingBenchSetup, talk: Conversations, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    described = lambda row: asdict(row) | {"prefilled_tokens": row.prefilled_tokens, "hit_rate": row.hit_rate}  # noqa: E731
    report = {"setup": asdict(setup), "conversations": asdict(talk), "rows": [described(r) for r in rows], "rounds": [described(r) for r in rounds]}
    path.write_text(json.dumps(report, indent=2))
