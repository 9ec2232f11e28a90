"""Latency in serving terms: time to first token, time per output token and whole requests,
measured through the server's own scheduler (continuous batching included, HTTP left out).
The pipeline's serving gate (flows.serving_gate) runs it for each scenario of params.yaml.

Clients are threads that submit a request, wait for it to finish and submit the next, as
the serving benchmark's clients do over HTTP.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from components.errors import KilnError
from components.runtime.engine import Engine
from components.runtime.sampling import Sampling
from components.runtime.tokenizer import EngineTokenizer
from serving.scheduler import Event, Failed, Finished, Scheduler, Sequence


def measure_scenario(
    engine: Engine, tokenizer: EngineTokenizer, prompts: list[list[int]], clients: int, requests: int, new_tokens: int
) -> dict[str, float]:
    """p50 / p95 of time to first token and per output token, p50 / p95 / p99 of whole
    requests, in ms: `clients` threads each sending `requests` requests back to back,
    taking prompts in turn from `prompts`, each answered with `new_tokens` tokens. The
    engine is prepared and then the scheduler's, as in the server: it is closed when this
    returns."""
    # As kiln serve's warm-up: a torch-cuda engine otherwise captures its graphs during the
    # first concurrent turns, which set the gate's TTFT p95 at 8-10 s on an H100.
    engine.prepare_to_serve()
    scheduler = Scheduler(engine, tokenizer, max_waiting=clients)
    sampling = Sampling(max_new_tokens=new_tokens, stop_at_eos=False)
    timings: list[tuple[float, float, float]] = []  # (ttft, per output token, whole request) in ms
    failures: list[str] = []

    def client(index: int) -> None:
        for request in range(requests):
            outcome = _one_request(scheduler, prompts[(index + request * clients) % len(prompts)], sampling)
            (failures.append(outcome) if isinstance(outcome, str) else timings.append(outcome))

    try:
        _one_request(scheduler, prompts[0], sampling)  # warm-up
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        scheduler.close(timeout=60)
    if failures:
        raise KilnError(f"requests failed in the scheduler: {failures[0]}")
    ttft, tpot, whole = (np.array(column) for column in zip(*timings, strict=True))
    return {
        "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p95_ms": float(np.percentile(ttft, 95)),
        "tpot_p50_ms": float(np.percentile(tpot, 50)), "tpot_p95_ms": float(np.percentile(tpot, 95)),
        "request_p50_ms": float(np.percentile(whole, 50)), "request_p95_ms": float(np.percentile(whole, 95)),
        "request_p99_ms": float(np.percentile(whole, 99)),
    }  # fmt: skip


def _one_request(scheduler: Scheduler, prompt: list[int], sampling: Sampling) -> tuple[float, float, float] | str:
    done = threading.Event()
    ended: list[Event] = []

    def emit(event: Event) -> None:
        if isinstance(event, Finished | Failed):
            ended.append(event)
            done.set()

    sequence = Sequence(prompt, sampling, emit, stream=False)
    started = time.monotonic()
    scheduler.submit([sequence])
    done.wait()
    if isinstance(ended[0], Failed):
        return ended[0].message
    first, last = sequence.first_token_at or started, sequence.last_token_at or started
    per_token = (last - first) / max(len(sequence.generated) - 1, 1)
    return (first - started) * 1000.0, per_token * 1000.0, (last - started) * 1000.0
