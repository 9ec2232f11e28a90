"""GPU benchmark: HF generate vs kiln's static-KV engine, plus greedy agreement.

GPT-2-small shape, random weights (seed 0, N(0, 0.02) biases), 32-token prompts, 128 new
greedy tokens, batch 1 and 16. Variants of one batch size run interleaved (one of each
per round), medians over `--runs` rounds after warm-up. Writes bench.json under --out
after every section, so a timeout still leaves the finished sections.

    python -m benchmarks.gpu_static_kv.bench_cuda --out DIR [--runs 7] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from components.runtime.static_kv import DecodeStep, StaticKVGPT2, StaticKVRunner, bytes_of_weights, causal_bias, randomize_biases

PROMPT_LEN, NEW_TOKENS, SLOTS, CONTEXT = 32, 128, 16, 1024
T0 = time.perf_counter()
# KILN_BENCH_SMOKE=1: a 2-layer model, CPU allowed, Dynamo with the eager backend — to
# exercise every code path on the development machine before spending device time.
SMOKE = os.environ.get("KILN_BENCH_SMOKE") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def device_facts() -> dict:
    """torch, CUDA and the GPU (as kiln's engine.json records them), and the architecture."""
    from components.build.torch_cuda import torch_target, torch_versions

    return torch_versions() | ({"arch": torch_target("cuda")} if torch.cuda.is_available() else {})


def compile_(fn, **kwargs):
    if SMOKE:
        return torch.compile(fn, backend="eager", fullgraph=True)
    return torch.compile(fn, fullgraph=True, **kwargs)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def log(*args) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *args, flush=True)


def build_hf(scale: float = 1.0, diverse: bool = False) -> GPT2LMHeadModel:
    """The benchmark model (CPU, fp32). `scale` multiplies wte (= the tied lm_head).

    diverse: an untied lm_head and init std 0.05. The benchmark's tied random model
    greedily repeats 1-5 distinct tokens per row (a token's own embedding dominates its
    logits), so agreement on it proves little; this variant emits ~20 distinct tokens
    in 24 steps with top-1/top-2 gaps of ~0.2-0.7.
    """
    torch.manual_seed(0)
    size = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1000) if SMOKE else dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257)
    if diverse:
        size |= dict(initializer_range=0.05, tie_word_embeddings=False)
    model = GPT2LMHeadModel(GPT2Config(n_positions=1024, **size)).eval()
    randomize_biases(model)
    if scale != 1.0:
        with torch.no_grad():
            model.transformer.wte.weight.mul_(scale)
    # Exactly NEW_TOKENS every time: no EOS stop (kiln's runner is run without one too).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompts() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 1000 if SMOKE else 50257, (SLOTS, PROMPT_LEN), generator=g)


def hf_on(model: GPT2LMHeadModel, dtype: torch.dtype) -> GPT2LMHeadModel:
    import copy

    return copy.deepcopy(model).to(DEV, dtype)


@torch.no_grad()
def hf_generate(model: GPT2LMHeadModel, ids: torch.Tensor) -> torch.Tensor:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[:, ids.shape[1] :]


class TokenLoop:
    """Baselines: decode driven token by token from Python over the same static cache.

    Attention always spans the whole cache (static shapes, so reduce-overhead compiles
    once per batch size); `sync` reads each token back to the host, as a stop-token check
    or a streaming server would.
    """

    def __init__(self, model: StaticKVGPT2, core: Callable, sync: bool, caches: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.model, self.core, self.sync = model, core, sync
        # Loops that share a compiled core share caches too: cudagraph trees re-record
        # when a static input's address changes, which interleaved runs would trigger.
        self.kc, self.vc = caches or model.new_cache(SLOTS, CONTEXT)
        if core is not model:
            # reduce-overhead copies non-static inputs into its graph each call: the
            # caches (600 MB) must be marked static or every step would copy them.
            torch._dynamo.mark_static_address(self.kc)
            torch._dynamo.mark_static_address(self.vc)
        self.keys = torch.arange(CONTEXT, device=DEV)

    @torch.no_grad()
    def generate(self, ids: torch.Tensor) -> list[list[int]]:
        B, P = ids.shape
        dtype = self.model.wte.dtype
        pos = torch.arange(P, device=DEV).expand(B, P)
        # Prefill eagerly in every loop variant: only the decode loop is what differs, and
        # a compiled prefill would add one more compile per batch size to the bench.
        logits = self.model(ids, pos, causal_bias(pos, self.keys, dtype), torch.full((B,), P - 1, device=DEV), self.kc, self.vc)
        nxt = logits.argmax(-1)
        out = [nxt]
        zeros = torch.zeros(B, dtype=torch.long, device=DEV)
        for step in range(NEW_TOKENS - 1):
            p = torch.full((B, 1), P + step, device=DEV)
            logits = self.core(nxt.view(B, 1), p, causal_bias(p, self.keys, dtype), zeros, self.kc, self.vc)
            nxt = logits.argmax(-1)
            if self.sync:
                nxt.tolist()
            out.append(nxt)
        return torch.stack(out, 1).tolist()


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    sync()
    t = time.perf_counter()
    result = fn()
    sync()
    return (time.perf_counter() - t) * 1e3, result


def as_lists(x) -> list[list[int]]:
    return x.tolist() if isinstance(x, torch.Tensor) else x


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    lens = []
    for ra, rb in zip(a, b):
        n = 0
        while n < min(len(ra), len(rb)) and ra[n] == rb[n]:
            n += 1
        lens.append(n)
    return {
        "rows": len(lens),
        "rows_identical_first_32": sum(n >= 32 for n in lens),
        "rows_identical_all_128": sum(n >= NEW_TOKENS for n in lens),
        "min_prefix": min(lens),
        "mean_prefix": round(sum(lens) / len(lens), 1),
        "prefix_per_row": lens,
    }


class Bench:
    def __init__(self, out: Path, runs: int, warmup: int, budget_s: float) -> None:
        self.out, self.runs, self.warmup, self.deadline = out, runs, warmup, T0 + budget_s
        self.results: dict = {"facts": {}, "timing": {}, "correctness": {}, "errors": {}, "ideas": {}}

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def save(self) -> None:
        (self.out / "bench.json").write_text(json.dumps(self.results, indent=1, default=str))

    def error(self, where: str, exc: BaseException) -> None:
        tb = traceback.format_exc()
        log(f"ERROR in {where}: {type(exc).__name__}: {str(exc)[:2000]}")
        self.results["errors"][where] = {"type": type(exc).__name__, "message": str(exc)[:4000], "traceback": tb[-6000:]}
        self.save()

    def time_variants(self, group: str, variants: dict[str, Callable[[], object]], runs: int | None = None) -> dict:
        """Warm up each variant (first call = compile/capture, timed), then interleave."""
        runs = runs or self.runs
        res: dict = {}
        live: dict[str, Callable[[], object]] = {}
        for name, fn in variants.items():
            if self.left() < 30:
                log(f"{group}/{name}: skipped, {self.left():.0f}s left")
                res[name] = {"skipped": "time budget"}
                continue
            try:
                t_first, tokens = timed(fn)
                for _ in range(self.warmup - 1):
                    timed(fn)
                res[name] = {"first_call_ms": round(t_first, 1), "samples_ms": [], "tokens": as_lists(tokens)}
                live[name] = fn
                log(f"{group}/{name}: first call {t_first:.0f} ms")
            except Exception as exc:  # noqa: BLE001 - a failing variant must not stop the others
                self.error(f"{group}/{name}", exc)
                res[name] = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
        for r in range(runs):
            if self.left() < 10:
                break
            for name, fn in live.items():
                ms, _ = timed(fn)
                res[name]["samples_ms"].append(round(ms, 3))
        for name in live:
            s = res[name]["samples_ms"]
            res[name]["median_ms"] = round(statistics.median(s), 3) if s else None
            res[name]["spread_ms"] = round(max(s) - min(s), 3) if s else None
        self.results["timing"][group] = {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in res.items()}
        self.save()
        return res


@torch.no_grad()
def kernel_profile(step_fn: Callable, model: StaticKVGPT2, B: int, A: int, n: int = 20) -> dict:
    """GPU busy time and kernel count of one decode step, run eagerly (no graph)."""
    from torch.profiler import ProfilerActivity, profile

    kc, vc = model.new_cache(SLOTS, CONTEXT)
    tok = torch.zeros(B, dtype=torch.long, device=DEV)
    pos = torch.full((B,), 150, dtype=torch.long, device=DEV)
    act = torch.zeros(B, dtype=torch.bool, device=DEV)  # frozen: every step is identical
    keys = torch.arange(A, device=DEV)
    for _ in range(3):
        step_fn(tok, pos, act, keys, kc, vc)
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step_fn(tok, pos, act, keys, kc, vc)
        sync()

    def dev_us(row) -> float:
        return float(getattr(row, "self_device_time_total", None) or getattr(row, "self_cuda_time_total", 0) or 0)

    rows = [r for r in prof.key_averages() if dev_us(r) > 0]
    rows.sort(key=dev_us, reverse=True)
    return {
        "gpu_busy_us_per_step": sum(map(dev_us, rows)) / n,
        "kernels_per_step": sum(r.count for r in rows) / n,
        "top": [[r.key[:90], round(dev_us(r) / n, 2), r.count // n] for r in rows[:14]],
    }


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the memory ceiling)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    return round(2 * 10 * x.numel() / (start.elapsed_time(end) * 1e-3) / 1e9, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--hf-static-timeout", type=int, default=150)
    ap.add_argument("--set", choices=["full", "fast", "tune"], default="fast", help="full: run 1's ablation; fast: the Triton step vs the best")
    ap.add_argument("--skip-hf-static", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args.out, args.runs, args.warmup, args.budget_s)
    torch.set_float32_matmul_precision("highest")  # fp32 reference without TF32
    facts = device_facts() | {"transformers": __import__("transformers").__version__, "smoke": SMOKE}
    if DEV == "cuda":
        facts["capability"] = torch.cuda.get_device_capability()
    bench.results["facts"] = facts
    log("facts", facts)

    ids_cpu = prompts()
    ids = ids_cpu.to(DEV)
    plist = ids_cpu.tolist()
    hf32_cpu = build_hf()
    hf16 = hf_on(hf32_cpu, torch.float16)
    k16 = StaticKVGPT2.from_hf(hf32_cpu, dtype=torch.float16, device=DEV)
    bench.results["facts"]["weight_bytes_fp16"] = bytes_of_weights(k16)
    log("models built")

    # ---------------------------------------------------------------- batch 1 ablation
    def runner(model: StaticKVGPT2, **kw) -> StaticKVRunner:
        return StaticKVRunner(model, num_slots=SLOTS, max_context=CONTEXT, **kw)

    shared_step = compile_(DecodeStep(k16, CONTEXT))
    ro_core = compile_(k16, mode="reduce-overhead")
    k16_gelu = StaticKVGPT2.from_hf(hf32_cpu, dtype=torch.float16, device=DEV, fused_gelu=True)
    k16_lin = StaticKVGPT2.from_hf(hf32_cpu, dtype=torch.float16, device=DEV, linear_layout=True)
    kbf16 = StaticKVGPT2.from_hf(hf32_cpu, dtype=torch.bfloat16, device=DEV)
    bf16_step = compile_(DecodeStep(kbf16, CONTEXT))

    def triton_step(model: StaticKVGPT2, blocks: dict | None = None):
        from components.runtime.triton_decode import TritonDecodeStep

        step = TritonDecodeStep(dict(model.named_parameters()), model.shape, CONTEXT, linear_layout=model.linear_layout)
        for k, v in (blocks or {}).items():
            setattr(step, k, v)
        return step

    # Tile variants of the Triton GEMVs (BLOCK_N, BLOCK_K): default, narrower, wider.
    narrow = {"QKV": (8, 256), "OPROJ": (2, 256), "FC": (8, 256), "MPROJ": (2, 1024), "HEAD": (16, 256)}
    attn1 = {"ATTN_BLOCK_T": 256, "ATTN_WARPS": 4}  # one pass over the attended keys
    fullk = {"QKV": (8, 1024), "OPROJ": (4, 1024), "FC": (8, 1024), "MPROJ": (4, 1024), "HEAD": (16, 1024)}
    fullk_narrow = {"QKV": (4, 1024), "OPROJ": (2, 1024), "FC": (4, 1024), "MPROJ": (2, 1024), "HEAD": (8, 1024)}
    tune = {
        "tune_narrow_attn1": narrow | attn1,
        "tune_narrow_attn1_w8": narrow | {"ATTN_BLOCK_T": 256, "ATTN_WARPS": 8},
        "tune_fullk_attn1": fullk | attn1,
        "tune_fullkn_attn1": fullk_narrow | attn1,
        "tune_fullkn_attn1_gw2": fullk_narrow | attn1 | {"GEMV_WARPS": 2},
        "tune_fullkn_attn1_gw8": fullk_narrow | attn1 | {"GEMV_WARPS": 8},
    }
    wide = {"QKV": (32, 128), "OPROJ": (8, 256), "FC": (32, 128), "MPROJ": (8, 256), "HEAD": (64, 128)}
    factories: dict[str, Callable[[], StaticKVRunner]] = {
        "graph_eager_k1": lambda: runner(k16, max_chunk=1),
        "graph_eager_k32": lambda: runner(k16, max_chunk=32),
        "graph_eager_k128": lambda: runner(k16, max_chunk=128),
        "graph_eager_k128_fullattn": lambda: runner(k16, max_chunk=128, attn_bucket=0),
        "graph_eager_k128_fusedgelu": lambda: runner(k16_gelu, max_chunk=128),
        "graph_inductor_k128": lambda: runner(k16, max_chunk=128, decode_step=shared_step),
        "graph_inductor_k128_fullattn": lambda: runner(k16, max_chunk=128, attn_bucket=0, decode_step=shared_step),
        "graph_inductor_k128_bf16": lambda: runner(kbf16, max_chunk=128, decode_step=bf16_step),
        "graph_eager_k128_linearlayout": lambda: runner(k16_lin, max_chunk=128),
        "graph_inductor_k128_cdt": lambda: runner(
            k16, max_chunk=128, decode_step=compile_(DecodeStep(k16, CONTEXT), options={"coordinate_descent_tuning": True})
        ),
        # Triton step for width 1, the shared Inductor step above it.
        "graph_triton_k1": lambda: runner(k16, max_chunk=1, decode_step=shared_step, fast_step=triton_step(k16)),
        "graph_triton_k128": lambda: runner(k16, max_chunk=128, decode_step=shared_step, fast_step=triton_step(k16)),
        "graph_triton_k128_narrow": lambda: runner(k16, max_chunk=128, decode_step=shared_step, fast_step=triton_step(k16, narrow)),
        "graph_triton_k128_wide": lambda: runner(k16, max_chunk=128, decode_step=shared_step, fast_step=triton_step(k16, wide)),
        "graph_triton_k128_bf16": lambda: runner(kbf16, max_chunk=128, decode_step=bf16_step, fast_step=triton_step(kbf16)),
        # Triton step at every width (its GEMVs re-read weights per row: expected slower at 16).
        "graph_triton_all_k128": lambda: runner(k16, max_chunk=128, fast_step=triton_step(k16), fast_max_width=SLOTS),
        **{f"graph_triton_k128_{n}": (lambda c=c: runner(k16, max_chunk=128, decode_step=shared_step, fast_step=triton_step(k16, c)))
           for n, c in tune.items()},
    }
    ro_caches = k16.new_cache(SLOTS, CONTEXT)
    loops = {
        "loop_eager_sync": TokenLoop(k16, k16, sync=True),
        "loop_reduce_overhead_sync": TokenLoop(k16, ro_core, sync=True, caches=ro_caches),
        "loop_reduce_overhead_nosync": TokenLoop(k16, ro_core, sync=False, caches=ro_caches),
    }
    if args.set == "full":
        b1_names = ["hf_eager_fp16", "loop_eager_sync", "loop_reduce_overhead_sync", "loop_reduce_overhead_nosync",
                    *[n for n in factories if not n.startswith("graph_triton")]]
        b16_names = ["hf_eager_fp16", "loop_reduce_overhead_nosync", "graph_eager_k128", "graph_eager_k128_fullattn",
                     "graph_inductor_k128", "graph_inductor_k128_fullattn", "graph_inductor_k128_bf16", "graph_eager_k128_linearlayout"]
    elif args.set == "tune":  # tile / warp variants of the Triton step at batch 1
        b1_names = ["hf_eager_fp16", "graph_triton_k128", "graph_triton_k128_narrow", *[f"graph_triton_k128_{n}" for n in tune]]
        b16_names = []
    else:  # "fast": the Triton step against the best earlier variants
        b1_names = ["hf_eager_fp16", "loop_reduce_overhead_sync", "graph_eager_k128", "graph_inductor_k128", "graph_triton_k1",
                    "graph_triton_k128", "graph_triton_k128_narrow", "graph_triton_k128_wide", "graph_triton_k128_bf16"]
        b16_names = ["hf_eager_fp16", "loop_reduce_overhead_nosync", "graph_inductor_k128", "graph_triton_all_k128"]
    runners: dict[str, StaticKVRunner] = {}
    for name in dict.fromkeys(b1_names + b16_names):
        if name in factories:
            try:
                runners[name] = factories[name]()
            except Exception as exc:  # noqa: BLE001 - e.g. no Triton on a CPU smoke run
                bench.error(f"build/{name}", exc)

    def variants_for(b: int, names: list[str]) -> dict[str, Callable[[], object]]:
        v: dict[str, Callable[[], object]] = {}
        for name in names:
            if name == "hf_eager_fp16":
                v[name] = lambda b=b: hf_generate(hf16, ids[:b])
            elif name in loops:
                v[name] = lambda b=b, lp=loops[name]: lp.generate(ids[:b])
            elif name in runners:
                v[name] = lambda b=b, r=runners[name]: r.generate(plist[:b], NEW_TOKENS)
        return v

    tokens_by: dict[str, dict] = {}
    with torch.no_grad():
        tokens_by["b1"] = bench.time_variants("batch1", variants_for(1, b1_names))
        tokens_by["b16"] = bench.time_variants("batch16", variants_for(16, b16_names), runs=max(5, args.runs - 2))
    for name, r in runners.items():
        bench.results["ideas"].setdefault("runner_stats", {})[name] = {"graphs": len(r._graphs), **r.stats}
    # Prefill alone (max_new_tokens=1: prefill graph, first token, read-back).
    for name in ("graph_triton_k128", "graph_inductor_k128"):
        if name in runners:
            for b in (1, 16):
                try:
                    runners[name].generate(plist[:b], 1)
                    ms = sorted(timed(lambda: runners[name].generate(plist[:b], 1))[0] for _ in range(9))[4]
                    bench.results["ideas"].setdefault("prefill_only_ms", {})[f"{name}_b{b}"] = round(ms, 3)
                except Exception as exc:  # noqa: BLE001
                    bench.error(f"prefill_only/{name}", exc)
    log("prefill only", bench.results["ideas"].get("prefill_only_ms"))
    bench.save()

    # ---------------------------------------------------------------- where a step's time goes
    if DEV == "cuda":
        try:
            prof = bench.results["ideas"].setdefault("kernel_profile", {})
            steps = [("eager_step", DecodeStep(k16, CONTEXT), k16), ("inductor_step", shared_step, k16)]
            if args.set == "full":
                steps.append(("eager_step_linearlayout", DecodeStep(k16_lin, CONTEXT), k16_lin))
            elif args.set == "tune":
                steps = [("triton_step", triton_step(k16), k16)] + [(f"triton_{n}", triton_step(k16, c), k16) for n, c in tune.items()]
            else:
                steps.append(("triton_step", triton_step(k16), k16))
            for label, step_fn, model in steps:
                for b in (1, 16):
                    prof[f"{label}_b{b}_A192"] = kernel_profile(step_fn, model, b, 192)
                    log(f"profile {label} b{b}: {prof[f'{label}_b{b}_A192']['gpu_busy_us_per_step']:.1f} us GPU busy, "
                        f"{prof[f'{label}_b{b}_A192']['kernels_per_step']:.0f} kernels per step")
            bench.results["facts"]["copy_bandwidth_GBps"] = copy_bandwidth()
            bench.save()
        except Exception as exc:  # noqa: BLE001
            bench.error("kernel_profile", exc)

    # ---------------------------------------------------------------- correctness
    try:
        corr = bench.results["correctness"]
        with torch.no_grad():
            hf32 = hf_on(hf32_cpu, torch.float32)
            ref32 = hf_generate(hf32, ids).tolist()
            hf16_tok = hf_generate(hf16, ids).tolist()
            k32 = StaticKVGPT2.from_hf(hf32_cpu, dtype=torch.float32, device=DEV)
            k32_tok = runner(k32, max_chunk=128).generate(plist, NEW_TOKENS)
            # Logit parity of the prefill (fp32 engine vs HF fp32, fp16 engine vs HF fp32).
            ref_logits = hf32(ids).logits[:, -1].float()
            kc, vc = k32.new_cache(SLOTS, CONTEXT)
            pos = torch.arange(PROMPT_LEN, device=DEV).expand(SLOTS, PROMPT_LEN)
            keys = torch.arange(64, device=DEV)
            last = torch.full((SLOTS, 1), PROMPT_LEN - 1, device=DEV)
            l32 = k32(ids, pos, causal_bias(pos, keys, torch.float32), last, kc, vc)[:, 0].float()
            kc16, vc16 = k16.new_cache(SLOTS, CONTEXT)
            l16 = k16(ids, pos, causal_bias(pos, keys, torch.float16), last, kc16, vc16)[:, 0].float()
            corr["prefill_logits_max_abs_diff_fp32_engine_vs_hf_fp32"] = float((l32 - ref_logits).abs().max())
            corr["prefill_logits_max_abs_diff_fp16_engine_vs_hf_fp32"] = float((l16 - ref_logits).abs().max())
            corr["ref_logit_std"] = float(ref_logits.std())
            top2 = ref_logits.topk(2, -1).values
            corr["ref_top1_minus_top2_gap_median"] = float((top2[:, 0] - top2[:, 1]).median())
            corr["distinct_tokens_per_row_ref32"] = [len(set(r)) for r in ref32]
            agree = corr.setdefault("agreement_vs_hf_fp32_greedy", {})
            agree["hf_fp16"] = prefix_agreement(hf16_tok, ref32)
            agree["kiln_fp32_graphs"] = prefix_agreement(k32_tok, ref32)
            for name in ("graph_eager_k128", "graph_inductor_k128", "graph_inductor_k128_bf16", "loop_reduce_overhead_nosync", "graph_triton_all_k128"):
                if "tokens" in tokens_by["b16"].get(name, {}):
                    agree[f"kiln_{name}"] = prefix_agreement(tokens_by["b16"][name]["tokens"], ref32)
            agree["kiln_fp16_vs_hf_fp16"] = prefix_agreement(tokens_by["b16"].get("graph_inductor_k128", {}).get("tokens", k32_tok), hf16_tok)
            # Batch 1 must equal row 0 of batch 16 (the same math at another row width).
            b1 = tokens_by["b1"].get("graph_inductor_k128", {}).get("tokens")
            b16 = tokens_by["b16"].get("graph_inductor_k128", {}).get("tokens")
            if b1 and b16:
                corr["batch1_equals_batch16_row0"] = b1[0] == b16[0]
            t1 = tokens_by["b1"].get("graph_triton_k128", {}).get("tokens")
            t16 = tokens_by["b16"].get("graph_triton_all_k128", {}).get("tokens")
            if t1 and t16:
                corr["triton_batch1_equals_batch16_row0"] = t1[0] == t16[0]
            if t1 and b16:
                corr["triton_b1_row0_prefix_vs_inductor_b16_row0"] = prefix_agreement([t1[0]], [b16[0]])["min_prefix"]
            # fused-GELU epilogue vs F.gelu(tanh): does cuBLASLt's epilogue match?
            gd = torch.float16 if DEV == "cuda" else torch.float32
            a = torch.randn(16, 768, device=DEV, dtype=gd)
            w = torch.randn(768, 3072, device=DEV, dtype=gd) * 0.02
            bias = torch.randn(3072, device=DEV, dtype=gd) * 0.02
            fused = torch._addmm_activation(bias, a, w, use_gelu=True).float()
            plain = torch.nn.functional.gelu(torch.addmm(bias, a, w), approximate="tanh").float()
            exact = torch.nn.functional.gelu(torch.addmm(bias, a, w)).float()
            corr["fused_gelu_vs_tanh_max_abs"] = float((fused - plain).abs().max())
            corr["fused_gelu_vs_exact_max_abs"] = float((fused - exact).abs().max())
            bench.save()
            del hf32
            log("correctness (base model)", json.dumps({k: v for k, v in agree.items()}, default=str)[:1500])
            # A model whose greedy output is diverse (see build_hf), so agreement means something.
            div_cpu = build_hf(diverse=True)
            d32 = hf_on(div_cpu, torch.float32)
            d_ref = hf_generate(d32, ids).tolist()
            d_logits = d32(ids).logits[:, -1].float()
            top2 = d_logits.topk(2, -1).values
            del d32
            d_hf16 = hf_generate(hf_on(div_cpu, torch.float16), ids).tolist()
            div = corr["diverse_untied_init005"] = {
                "ref_logit_std": float(d_logits.std()),
                "ref_top1_minus_top2_gap_median": float((top2[:, 0] - top2[:, 1]).median()),
                "distinct_tokens_per_row_ref32": [len(set(r)) for r in d_ref],
                "hf_fp16": prefix_agreement(d_hf16, d_ref),
            }
            dk32 = StaticKVGPT2.from_hf(div_cpu, dtype=torch.float32, device=DEV)
            dk16 = StaticKVGPT2.from_hf(div_cpu, dtype=torch.float16, device=DEV)
            dkbf = StaticKVGPT2.from_hf(div_cpu, dtype=torch.bfloat16, device=DEV)
            d16 = runner(dk16, max_chunk=128).generate(plist, NEW_TOKENS)
            div["kiln_fp32_graphs"] = prefix_agreement(runner(dk32, max_chunk=128).generate(plist, NEW_TOKENS), d_ref)
            div["kiln_fp16_graphs"] = prefix_agreement(d16, d_ref)
            div["kiln_bf16_graphs"] = prefix_agreement(runner(dkbf, max_chunk=128).generate(plist, NEW_TOKENS), d_ref)
            div["kiln_fp16_vs_hf_fp16"] = prefix_agreement(d16, d_hf16)
            if DEV == "cuda" and args.set == "tune":
                for n, c in tune.items():
                    t16 = runner(dk16, max_chunk=128, fast_step=triton_step(dk16, c), fast_max_width=SLOTS).generate(plist, NEW_TOKENS)
                    div[f"kiln_fp16_triton_{n}"] = prefix_agreement(t16, d_ref)
                    if n in ("tune_narrow_attn1", "tune_fullkn_attn1"):  # fp32: exact-logic check of these tilings
                        t32 = runner(dk32, max_chunk=128, fast_step=triton_step(dk32, c), fast_max_width=SLOTS).generate(plist, NEW_TOKENS)
                        div[f"kiln_fp32_triton_{n}"] = prefix_agreement(t32, d_ref)
            if DEV == "cuda":
                dtri = runner(dk16, max_chunk=128, fast_step=triton_step(dk16), fast_max_width=SLOTS).generate(plist, NEW_TOKENS)
                div["kiln_fp16_triton"] = prefix_agreement(dtri, d_ref)
                div["kiln_fp16_triton_vs_hf_fp16"] = prefix_agreement(dtri, d_hf16)
                div["kiln_fp32_triton"] = prefix_agreement(
                    runner(dk32, max_chunk=128, fast_step=triton_step(dk32), fast_max_width=SLOTS).generate(plist, NEW_TOKENS), d_ref
                )
            bench.save()
            log("correctness (diverse)", json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "prefix_per_row"} if isinstance(v, dict) else v for k, v in div.items()}, default=str)[:2500])
    except Exception as exc:  # noqa: BLE001
        bench.error("correctness", exc)

    # ---------------------------------------------------------------- HF static cache + compile (own process)
    left = int(min(args.hf_static_timeout, bench.left() - 5))
    if args.skip_hf_static:
        bench.results["hf_static"] = {"skipped": "--skip-hf-static (measured in an earlier run)"}
    elif left > 40 and not SMOKE:
        log(f"hf static+compile in a subprocess, timeout {left}s")
        cmd = [sys.executable, "-m", "benchmarks.gpu_static_kv.hf_static", "--out", str(args.out), "--budget-s", str(left - 10)]
        try:
            subprocess.run(cmd, timeout=left, check=False)
        except subprocess.TimeoutExpired:
            bench.results["errors"]["hf_static"] = {"type": "TimeoutExpired", "message": f"killed after {left}s"}
        hf_json = args.out / "hf_static.json"
        if hf_json.exists():
            bench.results["hf_static"] = json.loads(hf_json.read_text())
    else:
        bench.results["hf_static"] = {"skipped": f"only {bench.left():.0f}s of budget left"}
    bench.save()
    print_table(bench.results)


def print_table(results: dict) -> None:
    hf_static = results.get("hf_static", {}).get("timing", {})
    lines = ["", f"{'batch':>5} {'variant':<32} {'median ms':>10} {'spread':>8} {'ms/token':>9} {'tokens/s':>10} {'vs HF eager':>11} {'first call ms':>13}"]
    for group, b in (("batch1", 1), ("batch16", 16)):
        rows = dict(results["timing"].get(group, {}))
        for k, v in hf_static.items():
            if k.endswith(f"b{b}") and v.get("median_ms"):
                rows[f"hf_static:{k}"] = v
        base = rows.get("hf_eager_fp16", {}).get("median_ms")
        for name, v in rows.items():
            med = v.get("median_ms")
            if not med:
                lines.append(f"{b:>5} {name:<32} {v.get('failed') or v.get('skipped') or v.get('error', '')!s:.80}")
                continue
            speed = f"{base / med:10.1f}x" if base else ""
            lines.append(
                f"{b:>5} {name:<32} {med:10.2f} {v.get('spread_ms', 0):8.2f} {med / NEW_TOKENS:9.3f} {b * NEW_TOKENS / med * 1e3:10.0f} {speed:>11} {v.get('first_call_ms', 0):13.0f}"
            )
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
