"""Where one decode step of the Llama Triton step goes, on the smollm2-135m fp16 bench engine.

* The step's wall time: 32 steps (and the runner's copy of each token) captured in one CUDA
  graph, replays timed with events, at attended lengths 64, 128 and 192.
* Kernel time vs the gaps between kernels: one replay of that graph under torch.profiler
  (CUDA activities). Under programmatic dependent launch a kernel starts before the one it
  waits for ends, so a kernel's share of the step is end - previous end, not its duration.
* Each kernel alone: the step run eagerly without PDL, profiled (durations per kernel).
* The launch floor: a graph of as many empty kernels as the step launches, PDL on and off.

* The fixed part of a generation: 32 + 1 tokens (the prefill and its first token).

    python3 -m benchmarks.gpu_static_kv.step_profile --out DIR [--tiles best_tiles.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_static_kv.fused_ab import bench_engine
from components.runtime.static_kv import captured

STEPS = 32

try:  # Triton ships with CUDA torch only: this module imports (and is checked) everywhere, profiles where it runs
    import triton
    import triton.language as tl

    from components.runtime.triton_decode import _after_previous_kernel
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _empty_kernel(x_ptr, USE_PDL: tl.constexpr):
        _after_previous_kernel(USE_PDL)
        tl.store(x_ptr + tl.program_id(0), 1.0)


def capture(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
    graph = captured(body)
    torch.cuda.synchronize()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 30) -> float:
    """Median wall time of one replay (events around each)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def generate_ms(engine, prompt: list[int], sampling) -> float:
    for _ in range(3):
        engine.generate([prompt], sampling)
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.generate([prompt], sampling)
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def kernels_of(prof: profile, out: Path) -> list[dict]:
    prof.export_chrome_trace(str(out))
    events = json.loads(out.read_text())["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def short(name: str) -> str:
    return name if name.startswith("_") else "torch:" + name.split("<")[0][-40:]


def timeline_table(kernels: list[dict], steps: int) -> dict:
    """Per kernel name, per step: launches, summed duration and summed share (end - previous end)."""
    table: dict[str, dict[str, float]] = defaultdict(lambda: {"launches": 0, "dur_us": 0.0, "share_us": 0.0, "gap_us": 0.0})
    for prev, cur in zip(kernels, kernels[1:]):
        row = table[short(cur["name"])]
        row["launches"] += 1 / steps
        row["dur_us"] += cur["dur"] / steps
        row["share_us"] += (cur["ts"] + cur["dur"] - prev["ts"] - prev["dur"]) / steps
        row["gap_us"] += (cur["ts"] - prev["ts"] - prev["dur"]) / steps
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / steps
    return {"per_kernel": dict(table), "span_us_per_step": span, "dur_us_per_step": sum(k["dur"] for k in kernels) / steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-bench"))
    parser.add_argument("--tiles", type=Path, help="attributes to set on the step (fused_ab.py's best_tiles.json)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    engine, prompts, sampling, setup = bench_engine(args.work)
    runner, step = engine.runner, engine.runner.fast_step
    tiles = json.loads(args.tiles.read_text()) if args.tiles else {}
    for k, v in tiles.items():
        setattr(step, k, tuple(v) if isinstance(v, list) else v)
    engine.generate(prompts[:1], sampling)  # a cache filled with real keys and values
    result: dict = {"tiles": tiles, "generate_33_tokens_ms": generate_ms(engine, prompts[0], replace(sampling, max_new_tokens=1))}
    out = torch.zeros(1, STEPS, dtype=torch.long, device="cuda")

    def steps(attended: int, pos: int) -> Callable[[], None]:
        # Inactive row: every kernel does its work, but token and position stay put.
        tok, positions = runner.tokens[:1].clone(), torch.full((1,), pos, dtype=torch.long, device="cuda")
        act, keys = torch.zeros(1, dtype=torch.bool, device="cuda"), runner.key_range[:attended]

        def body() -> None:
            for i in range(STEPS):
                out[:, i].copy_(step(tok, positions, act, keys, runner.k_cache, runner.v_cache))

        return body

    graphs = {a: capture(steps(a, a - 8)) for a in (64, 128, 192)}
    result["graph_us_per_step"] = {a: 1000 * replay_ms(g) / STEPS for a, g in graphs.items()}
    print("graph us/step by attended length:", result["graph_us_per_step"], flush=True)

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs[128].replay()
        torch.cuda.synchronize()
    result["graph_timeline_128"] = timeline_table(kernels_of(prof, Path("/tmp/trace_graph.json")), STEPS)

    step.pdl = False
    body = steps(128, 120)
    body()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        body()
        torch.cuda.synchronize()
    result["eager_no_pdl_128"] = timeline_table(kernels_of(prof, Path("/tmp/trace_eager.json")), STEPS)
    result["graph_no_pdl_us_per_step"] = 1000 * replay_ms(capture(body)) / STEPS
    step.pdl = True

    launches = round(sum(r["launches"] for r in result["graph_timeline_128"]["per_kernel"].values()))
    x = torch.zeros(256, device="cuda")
    for ctas in (1, 132):
        for pdl in (True, False):
            g = capture(lambda ctas=ctas, pdl=pdl: [_empty_kernel[(ctas,)](x, USE_PDL=pdl, launch_pdl=pdl) for _ in range(launches)])
            result[f"empty_us_per_launch_{ctas}ctas_pdl{int(pdl)}"] = 1000 * replay_ms(g) / launches
    (args.out / "step_profile.json").write_text(json.dumps(result, indent=2, default=str))
    print_summary(result)


def print_summary(result: dict) -> None:
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict) or "per_kernel" not in v}, indent=1, default=str))
    for key in ("graph_timeline_128", "eager_no_pdl_128"):
        t = result[key]
        print(f"{key}: span {t['span_us_per_step']:.1f} us/step, kernel durations {t['dur_us_per_step']:.1f} us/step")
        for name, row in sorted(t["per_kernel"].items(), key=lambda kv: -kv[1]["share_us"]):
            n = max(row["launches"], 1e-9)
            print(f"  {name:42s} {row['launches']:5.1f}/step  share {row['share_us']:6.1f} us ({row['share_us'] / n:5.2f}/launch)  "
                  f"dur {row['dur_us']:6.1f} us ({row['dur_us'] / n:5.2f}/launch)  gap {row['gap_us'] / n:6.2f}/launch")


if __name__ == "__main__":
    main()
