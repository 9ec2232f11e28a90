"""kiln serve's path on the torch-cuda engine, on the GPU: the scheduler's step-wise decode
over the device cache's slots (host sampling per request) vs the engine's own `generate`
(k-step CUDA graphs, greedy on the device), same engine, 32 + 128 tokens, 1 and 16
sequences. Uses the engine `kiln bench --device cuda` built (--bench-work).

Run after `run_device.sh kilnbench`: bash benchmarks/gpu_static_kv/run_device.sh steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-work", type=Path, default=Path("/tmp/kiln-bench"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/kiln-out"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from benchmarks.generation import random_prompts
    from components.engine_dir import load_engine_dir
    from components.runtime import open_engine
    from components.runtime.sampling import Sampling
    from components.runtime.tokenizer import EngineTokenizer
    from serving.scheduler import Finished, Scheduler, Sequence

    engine_path = next(p for p in (args.bench_work / "gpt2-small" / "engines").glob("torch-cuda-fp16-*") if not p.name.endswith(".compile-cache"))
    engine = open_engine(load_engine_dir(engine_path))
    sampling = Sampling(max_new_tokens=128, stop_at_eos=False)
    prompts = random_prompts(16, 32, engine.manifest.vocab_size, 0)

    def through_generate(batch: int) -> float:
        start = time.perf_counter()
        engine.generate(prompts[:batch], sampling)
        return (time.perf_counter() - start) * 1000

    scheduler = Scheduler(engine, EngineTokenizer(engine_path), max_waiting=64)

    def through_scheduler(batch: int) -> float:
        done = threading.Semaphore(0)
        sequences = [Sequence(p, sampling, lambda e: done.release() if isinstance(e, Finished) else None, stream=False) for p in prompts[:batch]]
        start = time.perf_counter()
        scheduler.submit(sequences)
        for _ in sequences:
            done.acquire()
        return (time.perf_counter() - start) * 1000

    results = {}
    for batch in (1, 16):
        through_generate(batch), through_scheduler(batch)  # warm-up: capture, first calls
        times = {"generate (k-step CUDA graphs)": [], "kiln serve scheduler (step-wise, host sampling)": []}
        for _ in range(args.rounds):
            times["generate (k-step CUDA graphs)"].append(through_generate(batch))
            times["kiln serve scheduler (step-wise, host sampling)"].append(through_scheduler(batch))
        results[f"batch{batch}"] = {name: {"median_ms": statistics.median(t), "tokens_per_s": batch * 128 / (statistics.median(t) / 1000)} for name, t in times.items()}
        print(f"batch {batch}", json.dumps(results[f"batch{batch}"]), flush=True)
    scheduler.close(timeout=30)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving_steps.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
