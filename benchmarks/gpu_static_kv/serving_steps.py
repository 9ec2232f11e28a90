"""kiln serve's scheduler on the torch-cuda engine, on the GPU, without HTTP: the same work
through the scheduler (device-sampled turns of up to 16 steps) and through the engine's own
`generate` (k-step CUDA graphs, greedy on the device), same engine, interleaved; 32 + 128
tokens at 1 and 16 sequences, greedy and seeded sampling. Checks on the way: the
scheduler's greedy tokens equal `generate`'s and each prompt's alone; seeded sampled
answers equal themselves alone. A turn's profile: the host time in the engine's calls
(device work and the one read-back) vs the scheduler's own Python.

On a GPU machine: OUT=DIR bash benchmarks/gpu_static_kv/run_device.sh steps (builds the GPT-2-small
fp16 engine in /tmp/kiln-bench when absent).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path


def engine_path(work: Path, shape: str) -> Path:
    """The fp16 torch-cuda engine of `kiln bench --device cuda` for `shape`, built if absent;
    without CUDA an fp32 one for the CPU (a check that the script runs, not a measurement)."""
    import torch

    from benchmarks.generation import SHAPES, BenchSetup, benchmark_model_dir
    from benchmarks.generation_cuda import torch_cuda_engine

    found = [p for p in (work / shape / "engines").glob("torch-cuda-*") if not p.name.endswith(".compile-cache")]
    if found:
        return found[0]
    setup = BenchSetup(prompt_tokens=32, new_tokens=128)
    model_dir = benchmark_model_dir(work / shape / "model", SHAPES[shape], setup.seed)
    if torch.cuda.is_available():
        return torch_cuda_engine(model_dir, work / shape / "engines", 16, setup)
    from components.build.torch_cuda import torch_engine_from_model
    from components.config import ProfileParams, ShapeRange
    from components.engine_dir import Lineage

    profiles = ProfileParams(batch=ShapeRange(min=1, opt=1, max=16), prompt=ShapeRange(min=1, opt=32, max=128), context=ShapeRange(min=2, opt=160, max=256))
    lineage = Lineage(source_model_path=str(model_dir), source_model_sha256="random", onnx_sha256="-", data_md5="benchmark")
    return torch_engine_from_model(model_dir, "fp32", lineage, profiles, work / shape / "engines", device="cpu").path


def timed_engine(engine, names: tuple[str, ...]) -> tuple[dict[str, float], dict[str, int]]:
    """Wrap the engine's methods `names` with host timers (seconds) and call counters."""
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for name in names:
        original = getattr(engine, name)

        def wrapper(*a, _original=original, _name=name, **k):
            start = time.perf_counter()
            try:
                return _original(*a, **k)
            finally:
                spent[_name] += time.perf_counter() - start
                calls[_name] += 1

        setattr(engine, name, wrapper)
    return spent, calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-work", type=Path, default=Path("/tmp/kiln-bench"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/kiln-out"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", default="gpt2-small")
    args = ap.parse_args()

    from benchmarks.generation import random_prompts
    from components.engine_dir import load_engine_dir
    from components.runtime import open_engine
    from components.runtime.sampling import Sampling
    from components.runtime.tokenizer import EngineTokenizer
    from serving.scheduler import Finished, Scheduler, Sequence

    path = engine_path(args.bench_work, args.shape)
    engine = open_engine(load_engine_dir(path))
    engine.generate([[0]], Sampling(max_new_tokens=2, stop_at_eos=False))  # as kiln serve's load_warm does
    start = time.perf_counter()
    engine.prepare_to_serve()
    print(f"prepare_to_serve: {time.perf_counter() - start:.2f} s", flush=True)
    greedy = Sampling(max_new_tokens=128, stop_at_eos=False)
    prompts = random_prompts(16, 32, engine.manifest.vocab_size, 0)
    spent, _ = timed_engine(engine, ("prefill", "decode_turn", "pick"))  # host time inside the engine's calls
    scheduler = Scheduler(engine, EngineTokenizer(path), max_waiting=64)

    def through_generate(batch: int) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        tokens = engine.generate(prompts[:batch], greedy)
        return (time.perf_counter() - start) * 1000, tokens

    def through_scheduler(batch: int, sampling: Sampling = greedy, seeded: bool = False, prompt: list[int] | None = None) -> tuple[float, list[list[int]]]:
        done = threading.Semaphore(0)
        samplings = [Sampling(**{**sampling.__dict__, "seed": i}) if seeded else sampling for i in range(batch)]
        chosen = [prompt] if prompt is not None else prompts[:batch]
        sequences = [Sequence(p, s, lambda e: done.release() if isinstance(e, Finished) else None, stream=False) for p, s in zip(chosen, samplings)]
        start = time.perf_counter()
        scheduler.submit(sequences)
        for _ in sequences:
            done.acquire()
        return (time.perf_counter() - start) * 1000, [s.generated for s in sequences]

    sampled = Sampling(max_new_tokens=128, temperature=0.8, top_p=0.95, stop_at_eos=False)
    checks, results, profile = {}, {}, {}
    for batch in (1, 16):
        _, reference = through_generate(batch)
        _, served = through_scheduler(batch)  # warm-up: captures
        through_scheduler(batch, sampled, seeded=True)
        checks[f"batch{batch}_greedy_scheduler_equals_generate"] = served == reference
        times: dict[str, list[float]] = {"engine generate (greedy)": [], "scheduler, greedy": [], "scheduler, sampled (T 0.8, top-p 0.95, seeded)": []}
        in_engine: dict[str, float] = defaultdict(float)
        for _ in range(args.rounds):
            times["engine generate (greedy)"].append(through_generate(batch)[0])
            before = dict(spent)
            ms, _ = through_scheduler(batch)
            times["scheduler, greedy"].append(ms)
            for name, total in spent.items():
                in_engine[name] += (total - before.get(name, 0.0)) * 1000 / args.rounds
            times["scheduler, sampled (T 0.8, top-p 0.95, seeded)"].append(through_scheduler(batch, sampled, seeded=True)[0])
        base = statistics.median(times["engine generate (greedy)"])
        results[f"batch{batch}"] = {
            name: {"median_ms": statistics.median(t), "tokens_per_s": batch * 128 / (statistics.median(t) / 1000), "x_generate": statistics.median(t) / base}
            for name, t in times.items()
        }
        whole = statistics.mean(times["scheduler, greedy"])
        profile[f"batch{batch}"] = {"greedy_ms": whole, "in_engine_calls_ms": dict(in_engine), "scheduler_rest_ms": whole - sum(in_engine.values())}
        print(f"batch {batch}", json.dumps(results[f"batch{batch}"]), json.dumps(profile[f"batch{batch}"]), flush=True)
    alone = [through_scheduler(1, greedy)[1][0]] + [engine.generate([p], greedy)[0] for p in prompts[1:4]]
    _, together = through_scheduler(16)
    checks["greedy_each_prompt_alone_equals_in_the_batch"] = alone == together[:4]
    _, sampled_batch = through_scheduler(16, sampled, seeded=True)
    sampled_alone = [through_scheduler(1, Sampling(**{**sampled.__dict__, "seed": i}), prompt=prompts[i])[1][0] for i in range(16)]
    checks["seeded_sampled_alone_equals_in_the_batch"] = sampled_alone == sampled_batch
    checks["seeded_sampled_first_divergence_alone_vs_batch"] = [
        next((i for i, (a, b) in enumerate(zip(alone, batched)) if a != b), None) for alone, batched in zip(sampled_alone, sampled_batch)
    ]
    checks["seeded_sampled_differs_from_greedy"] = sampled_batch[0] != together[0]
    print("checks", json.dumps(checks), flush=True)
    scheduler.close(timeout=30)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving_steps.json").write_text(json.dumps({"results": results, "profile": profile, "checks": checks}, indent=2))


if __name__ == "__main__":
    main()
