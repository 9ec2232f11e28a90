"""How a group of query heads meets its KV head in StaticKVLlama, measured on the GPU: "fold"
(the group's queries as rows of one attention per KV head), "sdpa" (SDPA's enable_gqa),
"repeat" (repeat_interleave of the cache view). SmolLM2-135M's shape (9 query heads on 3 KV
heads), fp16, random weights; 32 + 128 tokens through the runner with eager steps in CUDA
graphs (no Inductor, so the modes differ only in what they ask of SDPA), batch 1 and 16,
interleaved. All three export (components.build.torch_cuda.export_program; checked on the
CPU by tests/test_static_kv_prototype.py's parity over each mode).

    python -m benchmarks.gpu_static_kv.gqa_modes --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

MODES = ("fold", "sdpa", "repeat")


def main() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.generation import SMOLLM2_135M, random_prompts
    from components.runtime.static_kv import StaticKVLlama, StaticKVRunner

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = {k: v for k, v in SMOLLM2_135M.items() if k != "family"}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config)).eval()
    prompts = random_prompts(16, 32, config["vocab_size"], 0)
    runners = {mode: StaticKVRunner(StaticKVLlama.from_hf(hf, dtype=torch.float16, device="cuda", gqa=mode), num_slots=16, max_context=1024) for mode in MODES}
    tokens = {}
    for mode, runner in runners.items():  # warm-up: captures every graph these calls need
        tokens[mode] = [runner.generate(prompts[:b], 128) for b in (1, 16)]
    samples = {(mode, b): [] for mode in MODES for b in (1, 16)}
    for _ in range(args.runs):
        for (mode, batch), times in samples.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            runners[mode].generate(prompts[:batch], 128)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1000.0)
    rows = [{"mode": m, "batch": b, "median_ms": statistics.median(t), "runs_ms": t} for (m, b), t in samples.items()]
    same = {m: tokens[m] == tokens["fold"] for m in MODES}
    for row in rows:
        print(f"{row['mode']:>7} batch {row['batch']:>2}: {row['median_ms']:8.1f} ms  (tokens equal fold's: {same[row['mode']]})")
    (args.out / "gqa_modes.json").write_text(json.dumps({"rows": rows, "tokens_equal_fold": same}, indent=2) + "\n")


if __name__ == "__main__":
    main()
