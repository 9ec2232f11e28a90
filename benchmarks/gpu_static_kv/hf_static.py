"""HF's own static cache + torch.compile on the GPU, the peer a GPU user would pick.

Run in its own process by bench_cuda.py, as `python -m benchmarks.gpu_static_kv.hf_static`
(a compile can hang or poison the process).
Attempts, in order, each timed at batch 1 then batch 16 while the budget lasts:

  recipe       model.forward = torch.compile(model.forward, mode="reduce-overhead",
               fullgraph=True); model.generate(..., cache_implementation="static")
  auto         model.generate(..., cache_implementation="static") with no manual compile:
               on CUDA, generate compiles the forward itself when the cache is static
  manual_loop  a StaticCache and a compiled forward driven by a plain Python loop

Writes hf_static.json under --out: timings, tokens agreement vs HF eager fp16, and the
exact error (type, message, traceback tail) of every attempt that failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.generation_cuda import StaticCacheLoop
from benchmarks.gpu_static_kv.bench_cuda import NEW_TOKENS, build_hf, hf_generate, hf_on, log, prompts, timed


class ManualLoop(StaticCacheLoop):
    """Eager prefill, compiled one-token forward over HF's StaticCache (kiln bench's peer)."""

    def generate(self, ids: torch.Tensor) -> torch.Tensor:
        return super().generate(ids, NEW_TOKENS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=140)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    deadline = time.perf_counter() + args.budget_s
    res: dict = {"timing": {}, "errors": {}, "agreement_vs_hf_eager_fp16": {}}

    def save() -> None:
        (args.out / "hf_static.json").write_text(json.dumps(res, indent=1, default=str))

    base = build_hf()
    ids = prompts().cuda()
    ref_model = hf_on(base, torch.float16)
    refs = {b: hf_generate(ref_model, ids[:b]).tolist() for b in (1, 16)}
    del ref_model

    def recipe() -> Callable[[torch.Tensor], torch.Tensor]:
        m = hf_on(base, torch.float16)
        m.forward = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
        return lambda x: m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static")[:, x.shape[1] :]

    def auto() -> Callable[[torch.Tensor], torch.Tensor]:
        m = hf_on(base, torch.float16)
        return lambda x: m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static")[:, x.shape[1] :]

    def manual() -> Callable[[torch.Tensor], torch.Tensor]:
        return ManualLoop(hf_on(base, torch.float16)).generate

    for name, make in (("recipe", recipe), ("auto", auto), ("manual_loop", manual)):
        if time.perf_counter() > deadline - 20:
            res["errors"][name] = {"type": "skipped", "message": "time budget"}
            continue
        torch._dynamo.reset()
        try:
            fn = make()
            for b in (1, 16):
                if time.perf_counter() > deadline - 15:
                    break
                with torch.no_grad():
                    first, toks = timed(lambda: fn(ids[:b]))
                    log(f"hf_static/{name}/b{b}: first call {first:.0f} ms")
                    timed(lambda: fn(ids[:b]))
                    samples = [round(timed(lambda: fn(ids[:b]))[0], 3) for _ in range(args.runs)]
                res["timing"][f"{name}_b{b}"] = {
                    "first_call_ms": round(first, 1),
                    "samples_ms": samples,
                    "median_ms": round(statistics.median(samples), 3),
                    "spread_ms": round(max(samples) - min(samples), 3),
                }
                toks = toks.tolist()
                same = [next((i for i, (x, y) in enumerate(zip(r, q)) if x != y), len(r)) for r, q in zip(toks, refs[b])]
                res["agreement_vs_hf_eager_fp16"][f"{name}_b{b}"] = same
                save()
        except Exception as exc:  # noqa: BLE001 - record the exact error and try the next way
            tb = traceback.format_exc()
            log(f"hf_static/{name} FAILED: {type(exc).__name__}: {str(exc)[:1500]}")
            res["errors"][name] = {"type": type(exc).__name__, "message": str(exc)[:6000], "traceback": tb[-8000:]}
            save()
    save()


if __name__ == "__main__":
    main()
