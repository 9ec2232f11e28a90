"""`kiln bench serving`: the server under concurrent clients, continuous batching vs one
request at a time, on the same engine in the same run, beside the engine's own `generate`
of the same work with no server (the ceiling the server's rows are read against).

Each row starts `kiln serve --engine DIR` as its own process (loopback only), waits until
it is ready, then N clients (asyncio + aiohttp, streaming so that time to first token is
seen) send requests back to back for T seconds or until a request budget is spent. The
clients run in this process and the server in its own, so they share no GIL; they share
the CPU, though, so the load generator is aiohttp (as in vLLM's serving benchmark), which
needs less than half of httpx's CPU time per streamed request here. Prompts are
random token ids of a fixed length and `ignore_eos` holds every answer to `new_tokens`,
so both rows do the same work. With `--constrained`, the batching server also answers the
same clients asking for JSON of a schema (`CONSTRAINED_SCHEMA`): a grammar ends an answer
where its JSON is complete, so that row is read per output token.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from benchmarks.generation import random_prompts
from components.config import Params, load_params
from components.engine_dir import load_engine_dir
from components.errors import KilnError, RegistryError
from components.workspace import Workspace

MODES = {"one-at-a-time": 1, "continuous-batching": None}  # row name → `kiln serve --max-batch`
CONSTRAINED = "JSON schema"  # the row of `--constrained`: the batching server, clients asking for JSON
# A list of records that can run to any length: most answers reach max_tokens under it too.
CONSTRAINED_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["records"],
    "properties": {"records": {"type": "array", "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "name", "score", "tags"],
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24}, "score": {"type": "number"},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    }}},
}  # fmt: skip
GENERATE = "engine generate"  # the row of the engine's own `generate`, in this process
AS_SERVED = "as served"  # the row of a server given by its URL (`--openai-url`)


@dataclass(frozen=True)
class ServingBenchSetup:
    clients: int = 16
    seconds: float = 10.0
    max_requests: int = 5000
    prompt_tokens: int = 32
    new_tokens: int = 32
    seed: int = 0
    rounds: int = 1  # both modes once per round, interleaved; the rows are medians over rounds
    constrained: bool = False  # also the batching server's row with CONSTRAINED_SCHEMA


@dataclass(frozen=True)
class ServingRow:
    name: str
    engine: str
    requests_per_s: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float
    requests: int
    failed: int
    rounds: int = 1  # the numbers are medians over this many rounds (requests and failed: sums)
    tpot_p50_ms: float = float("nan")  # median of each request's time per output token after its first


@dataclass(frozen=True)
class _Sample:
    seconds: float
    ttft: float
    tokens: int
    ok: bool


def serving_rounds(engines: dict[str, Path], setup: ServingBenchSetup, params_file: Path, on_row=lambda row: None) -> list[ServingRow]:
    """Two rows per engine and round, one-at-a-time then continuous-batching, each on a
    fresh server; rounds interleave the modes, so that a shared machine's slow spells fall
    on both."""
    rows = []
    threads = load_params(params_file).serving.threads
    for label, engine_dir in engines.items():
        vocab = load_engine_dir(engine_dir).manifest.vocab_size
        for _ in range(setup.rounds):
            row = generate_row(engine_dir, label, vocab, setup, threads)
            rows.append(row)
            on_row(row)
            for mode, max_batch in MODES.items():
                with _Server(engine_dir, max_batch, params_file) as url:
                    measured = [_measure(url, mode, label, vocab, setup)]
                    if setup.constrained and max_batch is None:
                        measured.append(_measure(url, CONSTRAINED, label, vocab, setup, {"structured_outputs": {"json": CONSTRAINED_SCHEMA}}))
                for row in measured:
                    rows.append(row)
                    on_row(row)
    return rows


def url_rounds(urls: list[str], vocab: int, setup: ServingBenchSetup, on_row=lambda row: None) -> list[ServingRow]:
    """One row per server and round: an OpenAI-compatible server already running (llama.cpp's
    llama-server, vLLM, another kiln serve), driven by the same clients as kiln's rows, with
    prompts of token ids below `vocab`. Its batching is its own (row name "as served")."""
    rows = []
    for _ in range(setup.rounds):
        for url in urls:
            row = _measure(url.rstrip("/"), AS_SERVED, url, vocab, setup)
            rows.append(row)
            on_row(row)
    return rows


def generate_row(engine_dir: Path, label: str, vocab: int, setup: ServingBenchSetup, threads: int | None) -> ServingRow:
    """The engine's `generate` of `clients` of the benchmark's prompts at once, greedy and
    to `new_tokens`, back to back for the row's seconds: what the engine gives with no
    server, no HTTP and no scheduler. Its latency is the whole batch's; it has no first
    token to time (NaN)."""
    from components.runtime import load_engine
    from components.runtime.sampling import Sampling

    prompts = bench_prompts(vocab, setup)[: setup.clients]
    sampling = Sampling(max_new_tokens=setup.new_tokens, stop_at_eos=False)
    with load_engine(engine_dir, threads=threads) as engine:
        engine.generate(prompts, sampling)  # warm-up: graphs, first calls
        times: list[float] = []
        started = time.perf_counter()
        while time.perf_counter() - started < setup.seconds and len(times) * setup.clients < setup.max_requests:
            call = time.perf_counter()
            engine.generate(prompts, sampling)
            times.append(time.perf_counter() - call)
    elapsed, latencies = time.perf_counter() - started, np.array(times) * 1000
    requests = len(times) * setup.clients
    return ServingRow(
        name=GENERATE, engine=label,
        requests_per_s=requests / elapsed, tokens_per_s=requests * setup.new_tokens / elapsed,
        p50_ms=float(np.percentile(latencies, 50)), p99_ms=float(np.percentile(latencies, 99)), ttft_p50_ms=float("nan"),
        requests=requests, failed=0,
    )  # fmt: skip


def bench_prompts(vocab: int, setup: ServingBenchSetup) -> list[list[int]]:
    """The benchmark's 64 prompts: random token ids of `prompt_tokens`, from its seed."""
    return random_prompts(64, setup.prompt_tokens, vocab, setup.seed)


def median_rows(rounds: list[ServingRow]) -> list[ServingRow]:
    """One row per engine and mode: the median of each number over its rounds."""
    rows = []
    for key in dict.fromkeys((row.engine, row.name) for row in rounds):
        mine = [row for row in rounds if (row.engine, row.name) == key]
        median = {name: float(np.median([getattr(row, name) for row in mine])) for name in ("requests_per_s", "tokens_per_s", "p50_ms", "p99_ms", "ttft_p50_ms", "tpot_p50_ms")}
        rows.append(ServingRow(name=key[1], engine=key[0], **median, requests=sum(r.requests for r in mine), failed=sum(r.failed for r in mine), rounds=len(mine)))
    return rows


def promoted_engine(root: Path, params: Params) -> tuple[str, Path]:
    """The champion's verified engine directory (else the challenger's), pulled into the
    serving cache as `kiln serve` pulls it: what the serving benchmark measures."""
    from registry import CHALLENGER, CHAMPION, preflight, registry_target
    from serving.sources import AliasSource

    target = registry_target(params.registry, root)
    preflight(target)
    for alias in (CHAMPION, CHALLENGER):
        source = AliasSource(target, alias, Workspace(root).serving_cache)
        try:
            info = source.resolve()
        except RegistryError:
            continue
        engine_dir = source.pull(info).engine_dir
        return f"{info.name} v{info.version} ({engine_dir.manifest.precision}, @{alias})", engine_dir.path
    raise KilnError(f"{target.model_name} has no champion or challenger to benchmark: run `kiln run` first, or pass --engine DIR")


def write_json(rows: list[ServingRow], setup: ServingBenchSetup, path: Path, rounds: list[ServingRow]) -> None:
    """The rows and each round's as JSON; a measure a row has not (the engine's `generate`
    streams no first token) is null, not NaN, which strict JSON parsers reject."""
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"setup": asdict(setup), "rows": [_json_row(r) for r in rows], "rounds": [_json_row(r) for r in rounds]}
    path.write_text(json.dumps(report, indent=2, allow_nan=False))


def _json_row(row: ServingRow) -> dict:
    return {name: None if isinstance(value, float) and value != value else value for name, value in asdict(row).items()}


class _Server:
    """`kiln serve --engine DIR` on a free loopback port; stopped with SIGTERM."""

    def __init__(self, engine_dir: Path, max_batch: int | None, params_file: Path, options: tuple[str, ...] = ()) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The interpreter running this, not a `kiln` script beside it: a checkout on PYTHONPATH has none.
        self.command = [sys.executable, "-m", "flows.cli", "serve", "--engine", str(engine_dir), "--params", str(params_file), "--port", str(self.port)]
        if max_batch:
            self.command += ["--max-batch", str(max_batch)]
        self.command += options
        self.log = Path(tempfile.mkstemp(prefix="kiln-bench-serve-", suffix=".log")[1])

    def __enter__(self) -> str:
        with self.log.open("w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + 600  # a torch-cuda engine's first start compiles for minutes
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise KilnError(f"the benchmark server did not become ready: {self.log.read_text()[-800:]}")
            time.sleep(0.2)
        return self.url

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def __exit__(self, *_exc) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _measure(url: str, mode: str, label: str, vocab: int, setup: ServingBenchSetup, extra: dict | None = None) -> ServingRow:
    """The row of `mode`; `extra`: more fields of each request (a constraint)."""
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    prompts = bench_prompts(vocab, setup)
    samples, elapsed = asyncio.run(_drive(url, prompts, setup, lambda client, prompt: _one(client, model, prompt, setup, extra or {})))
    return _row(samples, elapsed, mode, label)


def _row(samples: list[_Sample], elapsed: float, mode: str, label: str) -> ServingRow:
    ok = [s for s in samples if s.ok]
    if not ok:
        raise KilnError(f"every request to the {mode} server failed")
    latencies = np.array([s.seconds for s in ok]) * 1000
    return ServingRow(
        name=mode, engine=label,
        requests_per_s=len(ok) / elapsed, tokens_per_s=sum(s.tokens for s in ok) / elapsed,
        p50_ms=float(np.percentile(latencies, 50)), p99_ms=float(np.percentile(latencies, 99)),
        ttft_p50_ms=float(np.percentile([s.ttft * 1000 for s in ok], 50)),
        requests=len(ok), failed=len(samples) - len(ok),
        tpot_p50_ms=float(np.percentile([(s.seconds - s.ttft) / (s.tokens - 1) * 1000 for s in ok], 50)) if all(s.tokens > 1 for s in ok) else float("nan"),
    )  # fmt: skip


async def _drive(url: str, prompts: list, setup: ServingBenchSetup, one) -> tuple[list[_Sample], float]:
    """`setup.clients` clients sending `one(client, prompt)` back to back for `setup.seconds`."""
    # A connection per request, for every server alike: llama-server says keep-alive yet
    # closes after each stream, and a reused socket it closed failed half its requests.
    connector = aiohttp.TCPConnector(limit=setup.clients, force_close=True)
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as client:
        await asyncio.gather(*(one(client, prompts[i % len(prompts)]) for i in range(setup.clients)))  # warm-up
        samples: list[_Sample] = []
        started = time.perf_counter()
        deadline = started + setup.seconds

        async def client_loop(index: int) -> None:
            sent = 0
            while time.perf_counter() < deadline and len(samples) < setup.max_requests:
                samples.append(await one(client, prompts[(index + sent * setup.clients) % len(prompts)]))
                sent += 1

        await asyncio.gather(*(client_loop(i) for i in range(setup.clients)))
        return samples, time.perf_counter() - started


async def _one(client: aiohttp.ClientSession, model: str, prompt: list[int], setup: ServingBenchSetup, extra: dict | None = None) -> _Sample:
    """One streamed request; it counts where it generated all its `new_tokens` (under a
    constraint, which ends it where its grammar is complete: where it generated any)."""
    # stream_options: servers that send the usage in a chunk of its own (vLLM, llama-server) send it only when asked.
    body = {"model": model, "prompt": prompt, "max_tokens": setup.new_tokens, "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    body |= extra or {}
    started = time.perf_counter()
    first, tokens = None, 0
    try:
        async with client.post("/v1/completions", json=body) as response:
            if response.status != 200:
                await response.read()
                return _Sample(time.perf_counter() - started, 0.0, 0, False)
            tail = b""
            async for piece in response.content.iter_any():  # raw bytes: the client's own CPU stays small
                first = first or time.perf_counter()
                tail = (tail + piece)[-8192:]
            tokens = _completion_tokens(tail)
    except (aiohttp.ClientError, TimeoutError):
        return _Sample(time.perf_counter() - started, 0.0, 0, False)
    return _Sample(time.perf_counter() - started, (first or time.perf_counter()) - started, tokens, tokens == setup.new_tokens or (bool(extra) and tokens > 0))


def triton_rounds(urls: list[str], tokenizer_dir: Path, vocab: int, setup: ServingBenchSetup, on_row=lambda row: None) -> list[ServingRow]:
    """One row per Triton server and round: the model its repository serves (`kiln export
    triton`), driven through Triton's generate_stream by the same clients, with the same
    prompts as text (Triton's generate takes text: the token ids decoded by the engine's
    tokenizer, which re-encodes them to about as many tokens)."""
    from components.runtime.tokenizer import EngineTokenizer

    tokenizer = EngineTokenizer(tokenizer_dir)
    texts = [tokenizer.decode(ids) for ids in bench_prompts(vocab, setup)]
    rows = []
    for _ in range(setup.rounds):
        for url in urls:
            model = _triton_model(url.rstrip("/"))
            samples, elapsed = asyncio.run(_drive(url.rstrip("/"), texts, setup, lambda client, text, m=model: _one_triton(client, m, text, setup)))
            rows.append(_row(samples, elapsed, AS_SERVED, f"triton {url}"))
            on_row(rows[-1])
    return rows


def _triton_model(url: str) -> str:
    ready = [m["name"] for m in httpx.post(f"{url}/v2/repository/index", json={"ready": True}).json()]
    if len(set(ready)) != 1:
        raise KilnError(f"the Triton server at {url} serves {sorted(set(ready)) or 'no model'}; the benchmark drives one")
    return ready[0]


async def _one_triton(client: aiohttp.ClientSession, model: str, text: str, setup: ServingBenchSetup) -> _Sample:
    body = {"text_input": text, "max_tokens": setup.new_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    first, tail = None, b""
    try:
        async with client.post(f"/v2/models/{model}/generate_stream", json=body) as response:
            if response.status != 200:
                await response.read()
                return _Sample(time.perf_counter() - started, 0.0, 0, False)
            async for piece in response.content.iter_any():
                first = first or time.perf_counter()
                tail = (tail + piece)[-4096:]
    except (aiohttp.ClientError, TimeoutError):
        return _Sample(time.perf_counter() - started, 0.0, 0, False)
    finished = b'"finish_reason":"length"' in tail  # with ignore_eos, every token asked for was generated
    return _Sample(time.perf_counter() - started, (first or time.perf_counter()) - started, setup.new_tokens if finished else 0, finished)


def _completion_tokens(tail: bytes) -> int:
    """completion_tokens of the stream's usage, parsed from its last events (the last chunk
    carries it, or one of its own before [DONE]); 0 if none does. Parsed as JSON, not matched
    as bytes: servers write it compact or spaced."""
    for line in reversed(tail.split(b"\n")):
        if not line.startswith(b"data: {"):
            continue
        try:
            usage = json.loads(line[6:]).get("usage")
        except ValueError:  # the first event in the tail, cut by it
            return 0
        if usage:
            return int(usage.get("completion_tokens", 0))
    return 0
