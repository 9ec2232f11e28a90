"""Where a served request's time goes on the GPU, without HTTP: kiln serve's scheduler on the
torch-cuda engine driven by closed-loop clients (each submits its next 32 + 32 request as soon
as its last one finishes, optionally after a simulated round trip), beside the engine's own
`generate` of the same work at the same batch, interleaved. The host time inside each engine
call (prefill, decode turns, picking the first token, slot moves) and their counts, so what is
not decoding shows up. Then the cost of one admission's prefill graph, through the exported
program's own kernels and through the runner's Inductor-compiled prefill core (as served).

On a GPU machine: OUT=DIR bash benchmarks/gpu_static_kv/run_device.sh loop (builds the fp16
engines of `kiln bench --device cuda` in /tmp/kiln-bench when absent).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.gpu_static_kv.serving_steps import engine_path, timed_engine
from components.gates import median_generate_ms


def closed_loop(scheduler, prompts: list[list[int]], new_tokens: int, seconds: float, round_trip_s: float) -> dict:
    """Clients each keep one request in flight for `seconds`; tokens/s of finished requests."""
    from components.runtime.sampling import Sampling
    from serving.scheduler import Finished, Sequence

    sampling = Sampling(max_new_tokens=new_tokens, stop_at_eos=False)
    lock, finished, stop_at = threading.Lock(), [0], time.perf_counter() + seconds
    latencies: list[float] = []

    def client(index: int) -> None:
        while time.perf_counter() < stop_at:
            done = threading.Event()
            seq = Sequence(prompts[index], sampling, lambda e, d=done: d.set() if isinstance(e, Finished) else None)
            start = time.perf_counter()
            scheduler.submit([seq])
            done.wait()
            with lock:
                finished[0] += 1
                latencies.append(time.perf_counter() - start)
            if round_trip_s:
                time.sleep(round_trip_s)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "tokens_per_s": finished[0] * new_tokens / elapsed,
        "requests": finished[0],
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
        "elapsed_s": elapsed,
    }


def serve_profile(engine, scheduler, spent, calls, prompts, args) -> dict:
    from components.runtime.sampling import Sampling

    greedy = Sampling(max_new_tokens=args.new_tokens, stop_at_eos=False)
    rows: dict[str, list[dict]] = defaultdict(list)
    closed_loop(scheduler, prompts, args.new_tokens, 2.0, 0.0)  # warm-up: every graph captured
    for _ in range(args.rounds):
        start = time.perf_counter()
        engine.generate(prompts, greedy)
        ms = (time.perf_counter() - start) * 1000
        rows["generate"].append({"tokens_per_s": len(prompts) * args.new_tokens / (ms / 1000), "ms": ms})
        for rtt in args.round_trips:
            before_s, before_n = dict(spent), dict(calls)
            row = closed_loop(scheduler, prompts, args.new_tokens, args.seconds, rtt / 1000)
            row["engine_calls_ms_per_s"] = {n: (spent[n] - before_s.get(n, 0.0)) * 1000 / row["elapsed_s"] for n in spent}
            row["engine_calls_per_s"] = {n: (calls[n] - before_n.get(n, 0)) / row["elapsed_s"] for n in calls}
            rows[f"scheduler, round trip {rtt} ms"].append(row)
            print(f"rtt {rtt} ms", json.dumps(row), flush=True)
    base = statistics.median(r["tokens_per_s"] for r in rows["generate"])
    table = {}
    for name, rs in rows.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        table[name] = {"tokens_per_s": tps, "of_generate": tps / base, "runs": rs}
        print(f"{name:34s} {tps:10.0f} tokens/s  {tps / base:6.1%} of generate", flush=True)
    return table


def prefill_costs(engine, replays: int = 50) -> dict:
    """One admission's prefill graph (P = 32) at 1 and 16 rows: the exported program's aten
    kernels, and the runner's own prefill core (compiled by Inductor, as served); ms per replay."""
    import torch

    from components.runtime.static_kv import captured, causal_bias

    runner = engine.runner
    out = {}
    for name, model in (("exported", runner.model), ("compiled", runner.prefill_core)):
        for width in (1, 16):
            P = 32
            ids = torch.zeros(width, P, dtype=torch.long, device=runner.device)
            pos = torch.arange(P, device=runner.device).expand(width, P).contiguous()
            last = runner.key_range[P - 1 : P].expand(width, 1)

            def body(model=model, ids=ids, pos=pos, last=last) -> None:
                model(ids, pos, causal_bias(pos, runner.key_range[:P], runner.dtype), last, runner.k_cache, runner.v_cache)

            graph = captured(body)
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(replays):
                    graph.replay()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1000 / replays)
            out[f"{name}_width{width}_ms"] = statistics.median(times)
            print(f"prefill {name} width {width}: {out[f'{name}_width{width}_ms']:.3f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-work", type=Path, default=Path("/tmp/kiln-bench"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/kiln-out"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--round-trips", type=float, nargs="*", default=[0.0, 1.0])
    ap.add_argument("--shapes", nargs="*", default=["gpt2-small"])
    ap.add_argument("--prefill-shapes", nargs="*", default=["gpt2-small", "smollm2-135m"])
    ap.add_argument("--prefill-ab", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()

    from benchmarks.generation import random_prompts
    from components.engine_dir import load_engine_dir
    from components.runtime import open_engine
    from components.runtime.sampling import Sampling
    from components.runtime.tokenizer import EngineTokenizer
    from serving.scheduler import Scheduler

    report: dict = {}
    for shape in sorted(set(args.shapes) | set(args.prefill_shapes)):
        path = engine_path(args.bench_work, shape)
        engine = open_engine(load_engine_dir(path))
        engine.generate([[0]], Sampling(max_new_tokens=2, stop_at_eos=False))
        prompts = random_prompts(16, 32, engine.manifest.vocab_size, 0)
        if shape in args.prefill_shapes:
            generations = {n: median_generate_ms(engine, prompts[0], n, runs=10) for n in (1, 128)}
            graphs = prefill_costs(engine) if engine.runner.use_graphs and args.prefill_ab else {}
            report[f"{shape}_prefill"] = {f"generate_32_plus_{n}_ms": ms for n, ms in generations.items()} | graphs
            print(shape, json.dumps(report[f"{shape}_prefill"]), flush=True)
        if shape in args.shapes:
            engine.prepare_to_serve()
            spent, calls = timed_engine(engine, ("prefill", "decode_turn", "pick", "_keep"))
            scheduler = Scheduler(engine, EngineTokenizer(path), max_waiting=64)
            report[f"{shape}_serve"] = serve_profile(engine, scheduler, spent, calls, prompts, args)
            scheduler.close(timeout=30)
        del engine
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_loop.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
