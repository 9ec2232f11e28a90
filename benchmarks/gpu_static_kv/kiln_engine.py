"""kiln's torch-cuda backend on the GPU machine, through kiln's own code: the engine built
by components.build.torch_cuda, opened by components.runtime (TorchCudaEngine), gated by
components.gates.quality_gate. Phases (each writes a JSON under --out):

  gates   the default model kiln trains (carried: --kit/model, --kit/eval.parquet) built in
          fp32 and fp16: build time, the quality and latency gates (params.yaml's defaults)
          against the PyTorch model, greedy tokens vs the fp32 PyTorch model for 32 steps.
  load    cold (empty compile caches) and warm (caches kept beside the engine) loads of
          the engine `kiln bench --device cuda` built (--bench-work), each in a fresh
          process: open + warm-up until ready.
  serve   `kiln serve --engine` on the default model's fp16 engine (its engine process
          holds the GPU): the card, 12 concurrent greedy requests against each prompt
          alone, a stream against the same request whole, the engine process's metrics,
          then `kiln bench serving` on that engine (both modes).

The speed table itself is `kiln bench --device cuda` (benchmarks/generation_cuda.py).

On a GPU machine: OUT=DIR bash benchmarks/gpu_static_kv/run_device.sh kiln (KILN_PHASES picks the phases)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from components.config import ProfileParams, QualityGateParams, ShapeRange
from components.engine_dir import Lineage, load_engine_dir

PROMPT_LEN, NEW_TOKENS, SLOTS = 32, 128, 16  # kiln bench --device cuda's work and batch
T0 = time.perf_counter()


def log(*args) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *args, flush=True)


def profile(context: int) -> ProfileParams:
    return ProfileParams(batch=ShapeRange(min=1, opt=1, max=SLOTS), prompt=ShapeRange(min=1, opt=32, max=min(128, context)), context=ShapeRange(min=2, opt=160, max=context))


def build(model_dir: Path, precision: str, context: int, out: Path) -> tuple[object, float]:
    from components.build.torch_cuda import torch_engine_from_model

    lineage = Lineage(source_model_path=str(model_dir), source_model_sha256="device-" + model_dir.name, onnx_sha256="-", data_md5="-")
    start = time.perf_counter()
    engine_dir = torch_engine_from_model(model_dir, precision, lineage, profile(context), out)
    return engine_dir, time.perf_counter() - start


def gates_phase(kit: Path, work: Path) -> dict:
    import pandas as pd

    from components.config import LatencyGateParams
    from components.gates import eval_windows, latency_gate, latency_prompt, quality_gate
    from components.model_dir import load_model
    from components.runtime import open_engine
    from components.runtime.sampling import Sampling
    from components.runtime.tokenizer import EngineTokenizer

    texts = pd.read_parquet(kit / "eval.parquet")["text"].tolist()
    reference = load_model(kit / "model")
    results = {}
    for precision in ("fp32", "fp16"):
        engine_dir, build_s = build(kit / "model", precision, reference.config.n_positions, work / "gates")
        params = QualityGateParams()
        windows = eval_windows(EngineTokenizer(engine_dir.path), texts, params)
        with open_engine(engine_dir) as engine:
            gate = quality_gate(engine, reference, windows, params)
            latency_params = LatencyGateParams()
            latency = latency_gate(engine, latency_prompt(windows, latency_params.prompt_tokens), latency_params)
            first = [w[:16].tolist() for w in windows[:16]]
            ours = engine.generate(first, Sampling(max_new_tokens=32, stop_at_eos=False))
        with torch.no_grad():
            theirs = [reference.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, 16:].tolist() for p in first]
        results[precision] = {
            "build_s": round(build_s, 2),
            "passed": gate.passed,
            "measured": gate.measured,
            "thresholds": gate.thresholds,
            "latency": {"passed": latency.passed, "measured": latency.measured, "thresholds": latency.thresholds},
            "greedy_rows_identical_32": sum(a == b for a, b in zip(ours, theirs, strict=True)),
            "rows": len(first),
            "parity": engine_dir.manifest.parity.model_dump(),
            "manifest": {k: v for k, v in json.loads((engine_dir.path / "engine.json").read_text()).items() if k in ("backend", "backend_version", "target", "runtime", "precision")},
        }
        log(precision, json.dumps(results[precision]))
    return results


def load_child(engine_path: str) -> None:
    """One load, in a fresh process: what `kiln serve` pays before its first request."""
    start = time.perf_counter()
    from components.runtime import open_engine

    engine = open_engine(load_engine_dir(Path(engine_path)))
    opened = time.perf_counter() - start
    engine.warm_up(PROMPT_LEN, NEW_TOKENS)
    torch.cuda.synchronize()
    print(json.dumps({"open_s": opened, "ready_s": time.perf_counter() - start}))


def load_phase(bench_work: Path) -> dict:
    engine_path = next(p for p in (bench_work / "gpt2-small" / "engines").glob("torch-cuda-fp16-*") if p.is_dir() and not p.name.endswith(".compile-cache"))
    shutil.rmtree(engine_path.parent / f"{engine_path.name}.compile-cache", ignore_errors=True)
    results = {}
    for name in ("cold", "warm"):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_static_kv.kiln_engine", "--load-child", str(engine_path)], capture_output=True, text=True, timeout=400, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{name} load failed: {done.stderr[-3000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1]) | {"process_s": time.perf_counter() - start}
        log(name, json.dumps(results[name]))
    return results


def serve_phase(kit: Path, work: Path, out: Path) -> dict:
    import os
    import signal
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    root = Path(__file__).resolve().parents[2]
    model = kit / "model"
    engine_dir, _ = build(model, "fp16", json.loads((model / "config.json").read_text())["n_positions"], work / "serve")
    kiln = [sys.executable, "-c", "from flows.cli import main; main()"]
    url = "http://127.0.0.1:8200"

    def call(path: str, body: dict | None = None) -> bytes:
        request = urllib.request.Request(url + path, data=json.dumps(body).encode() if body else None, headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.read()

    server = subprocess.Popen([*kiln, "serve", "--engine", str(engine_dir.path), "--port", "8200"], cwd=root, stdout=(out / "serve.log").open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                call("/readyz")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kiln serve did not become ready: {(out / 'serve.log').read_text()[-3000:]}") from None
                time.sleep(0.5)
        card = json.loads(call("/v1/models"))["data"][0]
        prompts = [f"{word} is" for word in ("The list", "A class", "Importing", "def", "The for", "Raise", "With", "Return", "Yield", "Assert", "The if", "Lambda")]

        def complete(prompt: str) -> str:
            body = {"model": card["id"], "prompt": prompt, "max_tokens": 24, "temperature": 0}
            return json.loads(call("/v1/completions", body))["choices"][0]["text"]

        alone = [complete(p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(complete, prompts))
        streamed = call("/v1/completions", {"model": card["id"], "prompt": prompts[0], "max_tokens": 24, "temperature": 0, "stream": True}).decode()
        stream_text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed.splitlines() if line.startswith("data: {"))
        metrics = {line.split()[0]: float(line.split()[1]) for line in call("/metrics").decode().splitlines() if line.startswith(("kiln_engine_process_resident", "process_resident", "kiln_decode", "kiln_engine_load_seconds_sum"))}
        children = [int(c) for t in Path(f"/proc/{server.pid}/task").iterdir() for c in (t / "children").read_text().split()]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    bench = subprocess.run([*kiln, "bench", "serving", "--engine", str(engine_dir.path), "--json", str(out / "serve_bench.json")], cwd=root, capture_output=True, text=True, timeout=400, check=False, env=os.environ)
    result = {
        "card": card,
        "concurrent_equal_alone": sum(a == b for a, b in zip(alone, together, strict=True)),
        "prompts": len(prompts),
        "stream_equals_whole": stream_text == alone[0],
        "sample": alone[0],
        "child_processes": len(children),  # the engine process and multiprocessing's resource tracker
        "metrics": metrics,
        "server_exit": server.returncode,
        "bench_exit": bench.returncode,
        "bench_tail": bench.stdout[-2500:] + bench.stderr[-1500:],
    }
    log("serve", json.dumps(result))
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/kiln-out"))
    ap.add_argument("--kit", type=Path, default=Path(".devicekit"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/kiln-engines"))
    ap.add_argument("--phases", default="gates,load")
    ap.add_argument("--bench-work", type=Path, default=Path("/tmp/kiln-bench"))
    ap.add_argument("--load-child")
    args = ap.parse_args()
    if args.load_child:
        return load_child(args.load_child)
    args.out.mkdir(parents=True, exist_ok=True)
    for phase in args.phases.split(","):
        try:
            phases = {"gates": lambda: gates_phase(args.kit, args.work), "load": lambda: load_phase(args.bench_work), "serve": lambda: serve_phase(args.kit, args.work, args.out)}
            result = phases[phase]()
        except Exception as err:  # noqa: BLE001 - one phase's failure is reported (traceback and JSON); the others still run
            import traceback

            traceback.print_exc()
            result = {"error": f"{type(err).__name__}: {err}"}
        (args.out / f"kiln_{phase}.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
