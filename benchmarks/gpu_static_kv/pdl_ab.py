"""Programmatic dependent launch and GEMV tilings of the batch-1 Triton decode step.

One process, the GPT-2-small-shaped fp16 engine of `kiln bench --device cuda` loaded once
per variant (PDL off or on, tiles), 32 + 128 tokens at batch 1, timed interleaved; every
variant's greedy tokens must equal the first one's.

    python3 -m benchmarks.gpu_static_kv.pdl_ab --out DIR [--runs 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.generation import GPT2_SMALL, BenchSetup, benchmark_model_dir, random_prompts
from benchmarks.generation_cuda import torch_cuda_engine
from components.runtime import load_engine
from components.runtime.sampling import Sampling

# name -> (PDL, tiles set on the step): the tiles before PDL and the defaults, each with PDL
# off and on. The sweep that led from one to the other (docs/performance.md, "On the GPU"
# under "Measured choices in the code") set one attribute at a time.
OLD_TILES = {"QKV": (8, 256, 4), "OPROJ": (2, 256, 4), "FC": (8, 256, 4), "MPROJ": (2, 1024, 4), "HEAD": (16, 256, 4), "ATTN_WARPS": 8, "ATTN_EARLY_KV": False}
VARIANTS = {
    "old-tiles-pdl-off": (False, OLD_TILES),
    "old-tiles-pdl-on": (True, OLD_TILES),
    "default-pdl-off": (False, {}),
    "default": (True, {}),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-bench"))
    args = parser.parse_args()
    setup = BenchSetup()
    model_dir = benchmark_model_dir(args.work / "gpt2-small" / "model", GPT2_SMALL, setup.seed)
    engine_path = torch_cuda_engine(model_dir, args.work / "gpt2-small" / "engines", 16, setup)
    prompts = random_prompts(16, setup.prompt_tokens, GPT2_SMALL["vocab_size"], setup.seed)
    sampling = Sampling(max_new_tokens=setup.new_tokens, stop_at_eos=False)

    engines = {}
    for name, (pdl, tiles) in VARIANTS.items():
        started = time.perf_counter()
        engines[name] = load_engine(engine_path)
        for attribute, value in ({"pdl": pdl} | tiles).items():  # before the first call: graphs are captured then
            setattr(engines[name].runner.fast_step, attribute, value)
        print(f"{name}: loaded in {time.perf_counter() - started:.1f} s", flush=True)

    tokens = {}
    for name, engine in engines.items():
        for _ in range(3):  # compile, capture, settle
            tokens[name] = engine.generate(prompts[:1], sampling)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.runs):
        for name, engine in engines.items():
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = engine.generate(prompts[:1], sampling)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - started) * 1000)
            assert out == tokens[name], f"{name}: greedy tokens changed between runs"
    reference = tokens["old-tiles-pdl-off"][0]
    result = {
        "runs": args.runs,
        "variants": {name: {"pdl": pdl, **tiles} for name, (pdl, tiles) in VARIANTS.items()},
        "median_ms": {name: statistics.median(t) for name, t in times.items()},
        "min_ms": {name: min(t) for name, t in times.items()},
        "first_divergence_from_old_tiles_pdl_off": {
            name: next((i for i, (a, b) in enumerate(zip(out[0], reference)) if a != b), None) for name, out in tokens.items()
        },
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    result["greedy_agreement"] = greedy_agreement(engines["default"], model_dir, prompts, setup.new_tokens)
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pdl_ab.json").write_text(json.dumps(result, indent=2))


def greedy_agreement(engine, model_dir: Path, prompts: list[list[int]], new_tokens: int) -> dict[str, dict[str, int]]:
    """Rows of the engine's one-row path (the Triton step) whose greedy tokens equal Hugging
    Face's, prompt by prompt, in the first 32 and in all tokens: against fp32 (the reference
    the gates use) and fp16 (the same precision)."""
    from components.model_dir import load_model

    sampling = Sampling(max_new_tokens=new_tokens, stop_at_eos=False)
    ours = [engine.generate([prompt], sampling)[0] for prompt in prompts]
    counts = {}
    for name, dtype in (("hf-fp32", torch.float32), ("hf-fp16", torch.float16)):
        model = load_model(model_dir).to("cuda", dtype)
        with torch.no_grad():
            theirs = [
                model.generate(torch.tensor([p], device="cuda"), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0, len(p) :].tolist()
                for p in prompts
            ]
        counts[name] = {
            "rows": len(prompts),
            "first_32": sum(a[:32] == b[:32] for a, b in zip(ours, theirs, strict=True)),
            "all": sum(a == b for a, b in zip(ours, theirs, strict=True)),
        }
    return counts


if __name__ == "__main__":
    main()
