"""How far continuous batching could go on an engine, without HTTP: the ceiling that
`kiln bench serving`'s ratio (continuous batching over one request at a time) lives under.

Two pairs of rows, each pair measured in this process, one after the other, interleaved
three times (medians):
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

from rich.console import Console
from rich.table import Table

from components.runtime import load_engine
from components.runtime.sampling import Sampling
from components.runtime.tokenizer import EngineTokenizer
from flows.bench import random_prompts
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
    rows: dict[str, list[float]] = {name: [] for name in ("engine, 1 row", f"engine, {CLIENTS} rows", "scheduler, batch 1", f"scheduler, batch {CLIENTS}", staggered)}
    for _ in range(3):
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
        baseline = medians["engine, 1 row"] if name.startswith("engine") else medians["scheduler, batch 1"]
        table.add_row(name, f"{rate:,.0f}", f"{rate / baseline:.2f}×")
    Console().print(table)


if __name__ == "__main__":
    main()
