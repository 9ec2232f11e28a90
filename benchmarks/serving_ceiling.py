"""How far continuous batching could go on an engine, without HTTP: the ceiling that
`kiln bench serving`'s ratio (continuous batching over one request at a time) lives under.

Three pairs of rows, each pair measured in this process, one after the other, interleaved
three times (medians):
* engine steps: what a request costs in engine calls alone, nothing else (no scheduler,
  no Python of ours between calls) — one at a time: its one-row prefill, then its decode
  steps at batch 1; continuously batched: its one-row prefill (arrivals are staggered, so
  each is prefilled alone), then a 16th of each 16-row decode step as wide as a staggered
  batch's oldest row. The ceiling of `kiln bench serving`'s ratio on this engine: the
  prefill is not shared, so it weighs on the batched request, and the batched step is
  wider than a lone row's.
* engine alone: `Engine.generate` of 16 prompts at once vs one, prompt + new tokens as
  `kiln bench serving` asks, greedy, every row to full length. The best case for batching:
  all rows start and end together, no scheduler, no padding between rows of other ages.
* scheduler alone: kiln serve's `Scheduler` (continuous batching, per-sequence sampling,
  text decoding), with 16 closed-loop "clients" that resubmit as soon as a sequence ends,
  at batch 16 vs batch 1. What the server does per token, minus HTTP. Started together,
  the 16 sequences stay in step (they end together and are prefilled together); the
  staggered row starts client i with 1 + 2i new tokens, so that from then on sequences of
  every age share the batch, one or two ending and starting at each step — what a server
  sees. Staggering costs: the cache is as wide as the oldest row (63 columns instead of
  48 on average), and each arrival has a prefill and a cache join of its own.

    .venv/bin/python benchmarks/serving_ceiling.py ENGINE_DIR [--seconds 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.generation import random_prompts
from components.runtime import load_engine
from components.runtime.engine import left_pad
from components.runtime.sampling import Sampling
from components.runtime.tokenizer import EngineTokenizer
from serving.scheduler import Finished, Scheduler, Sequence

CLIENTS, PROMPT_TOKENS, NEW_TOKENS = 16, 32, 32


def engine_alone(engine, prompts: list[list[int]], rows: int) -> float:
    """Tokens/s of one `generate` call over `rows` prompts (median of several calls)."""
    sampling = Sampling(max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    engine.generate(prompts[:rows], sampling)  # warm-up
    calls = max(3, 48 // rows)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        engine.generate(prompts[:rows], sampling)
        times.append(time.perf_counter() - started)
    return rows * NEW_TOKENS / statistics.median(times)


def engine_steps(engine, prompts: list[list[int]]) -> tuple[float, float]:
    """Tokens/s one at a time and continuously batched if each request cost only its engine
    calls (see the module docstring). The two are timed call by call in alternation, each
    the median of several calls: this machine's speed drifts by tens of percent."""
    eos = engine.manifest.eos_token_id
    one, batch = (engine.prefill(*left_pad(prompts[:rows], eos))[1] for rows in (1, CLIENTS))
    prefill, single, batched = [], [], []
    for _width in range(NEW_TOKENS - 1):  # widths PROMPT_TOKENS .. PROMPT_TOKENS + NEW_TOKENS - 2
        times: dict[str, list[float]] = {"prefill": [], "single": [], "batched": []}
        for _ in range(7):
            for name, call in (
                ("prefill", lambda: engine.prefill(*left_pad(prompts[:1], eos))),
                ("single", lambda one=one: engine.decode(one, np.zeros(1, np.int64))),
                ("batched", lambda batch=batch: engine.decode(batch, np.zeros(CLIENTS, np.int64))),
            ):
                started = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - started)
        prefill.append(statistics.median(times["prefill"]))
        single.append(statistics.median(times["single"]))
        batched.append(statistics.median(times["batched"]))
        one = engine.decode(one, np.zeros(1, np.int64))[1]
        batch = engine.decode(batch, np.zeros(CLIENTS, np.int64))[1]
    # A step's time is linear in the cache's width: read both off fitted lines, not off
    # single noisy points. One at a time: the row's own widths. Batched: every step as wide
    # as a staggered batch's oldest row (the widest), a 16th of it for this request.
    widths = np.arange(NEW_TOKENS - 1)

    def fit(seconds: list[float]) -> np.ndarray:
        return np.polyval(np.polyfit(widths, seconds, 1), widths)

    first = statistics.median(prefill)
    alone = first + float(fit(single).sum())
    shared = first + (NEW_TOKENS - 1) * float(fit(batched)[-1]) / CLIENTS
    return NEW_TOKENS / alone, NEW_TOKENS / shared


def scheduler_alone(engine_dir: Path, threads: int, prompts: list[list[int]], max_batch: int, seconds: float, staggered: bool = False) -> float:
    """Tokens/s of the server's scheduler under CLIENTS closed-loop clients (its own engine:
    closing a scheduler closes its engine, as a swap does)."""
    tokenizer = EngineTokenizer(engine_dir)
    scheduler = Scheduler(load_engine(engine_dir, threads=threads), tokenizer, max_waiting=4 * CLIENTS, max_batch=max_batch)
    tokens = [0]
    sampling = Sampling(max_new_tokens=NEW_TOKENS, stop_at_eos=False)

    def submit(index: int, first: Sampling | None = None) -> None:
        def emit(event) -> None:
            if isinstance(event, Finished):
                tokens[0] += event.completion_tokens
                submit(index + CLIENTS)  # the client's next request, at once

        sequence = Sequence(prompts[index % len(prompts)], first or sampling, emit)
        scheduler.submit([sequence])

    for client in range(CLIENTS):
        submit(client, Sampling(max_new_tokens=1 + 2 * client, stop_at_eos=False) if staggered else None)
    time.sleep(1.0)  # past the first prefills (and the staggered start)
    start_tokens, started = tokens[0], time.perf_counter()
    time.sleep(seconds)
    rate = (tokens[0] - start_tokens) / (time.perf_counter() - started)
    scheduler.close(timeout=30)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", type=Path, help="engine directory (e.g. one under .kiln/stages/engines)")
    parser.add_argument("--seconds", type=float, default=4.0, help="per scheduler row")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads (kiln serve's serving.threads)")
    args = parser.parse_args()
    engine = load_engine(args.engine, threads=args.threads)
    prompts = random_prompts(64, PROMPT_TOKENS, engine.manifest.vocab_size, seed=0)
    staggered = f"scheduler, batch {CLIENTS}, staggered"
    names = ("engine steps, 1 row", f"engine steps, {CLIENTS} rows, staggered", "engine, 1 row", f"engine, {CLIENTS} rows", "scheduler, batch 1", f"scheduler, batch {CLIENTS}", staggered)
    rows: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(3):
        alone, shared = engine_steps(engine, prompts)
        rows["engine steps, 1 row"].append(alone)
        rows[f"engine steps, {CLIENTS} rows, staggered"].append(shared)
        rows["engine, 1 row"].append(engine_alone(engine, prompts, 1))
        rows[f"engine, {CLIENTS} rows"].append(engine_alone(engine, prompts, CLIENTS))
        rows["scheduler, batch 1"].append(scheduler_alone(args.engine, args.threads, prompts, 1, args.seconds))
        rows[f"scheduler, batch {CLIENTS}"].append(scheduler_alone(args.engine, args.threads, prompts, CLIENTS, args.seconds))
        rows[staggered].append(scheduler_alone(args.engine, args.threads, prompts, CLIENTS, args.seconds, staggered=True))
    medians = {name: statistics.median(rates) for name, rates in rows.items()}
    table = Table(title=f"{args.engine.name}: {PROMPT_TOKENS} + {NEW_TOKENS} tokens, no HTTP, {args.threads} ONNX Runtime thread(s)")
    for column in ("row", "tokens/s", "vs its one-at-a-time row"):
        table.add_column(column, justify="left" if column == "row" else "right")
    for name, rate in medians.items():
        baseline = medians[next(first for first in medians if first.split(",")[0] == name.split(",")[0])]
        table.add_row(name, f"{rate:,.0f}", f"{rate / baseline:.2f}×")
    Console().print(table)


if __name__ == "__main__":
    main()
