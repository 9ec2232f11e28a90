"""Build a torch-cuda engine directory, then time loading it cold and warm.

Each load runs in a fresh process (what a server start costs):

  cold         empty Inductor/Triton caches beside the engine: export.load, .module(),
               torch.compile of the decode step, graph capture for batch 1 and 16
  warm         same process recipe, caches kept from the cold load
  warm_mega    empty cache dirs, but torch.compiler.load_cache_artifacts() of the
               "mega-cache" bytes the cold load saved beside the engine
  no_compile   no Inductor at all: the loaded program run eagerly inside our CUDA graphs
  cold_fast    like cold, with batch-1 decode through triton_decode's kernels
  warm_fast    like warm, same

    python load_times.py --out DIR [--engine-dir /tmp/kiln_engine]
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 32, 128


def load_phase(args: argparse.Namespace) -> dict:
    """One server start: everything from `import torch` to graphs ready, timed."""
    t = {}
    t0 = time.perf_counter()
    import torch

    t["import_torch_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.init()
        torch.zeros(1, device="cuda")
    t["cuda_init_s"] = time.perf_counter() - t0
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_files import MEGA_CACHE, load_program, shape_of
    from components.runtime.static_kv import StaticKVRunner

    engine = Path(args.engine_dir)
    if args.mega_load:
        t0 = time.perf_counter()
        info = torch.compiler.load_cache_artifacts((engine / MEGA_CACHE).read_bytes())
        t["mega_load_s"] = time.perf_counter() - t0
        t["mega_load_info"] = str(info)[:300]
    t0 = time.perf_counter()
    program, manifest = load_program(engine)
    t["export_load_s"] = time.perf_counter() - t0
    profile = manifest["profile"]
    t0 = time.perf_counter()
    fast = None
    if args.fast:
        # Batch-1 decode through the Triton kernels (JIT-compiled on first use, cached in
        # TRITON_CACHE_DIR); wider calls through the compiled step.
        from components.runtime.triton_decode import TritonDecodeStep

        fast = TritonDecodeStep(dict(program.named_parameters()), shape_of(manifest), profile["max_context"])
    runner = StaticKVRunner(
        program, shape=shape_of(manifest), num_slots=profile["num_slots"], max_context=profile["max_context"],
        compile_step=args.compile, max_chunk=128, fast_step=fast,
    )
    # The serving workload's shapes: batch 1 and 16, 32-token prompts, 128 new tokens.
    runner.warm_up([1, 16], PROMPT_LEN, NEW_TOKENS)
    if cuda:
        torch.cuda.synchronize()
    t["compile_and_capture_s"] = time.perf_counter() - t0
    t["ready_since_process_start_s"] = time.perf_counter() - T_START
    if args.mega_save:
        art = torch.compiler.save_cache_artifacts()
        if art is not None:
            data, info = art
            (engine / MEGA_CACHE).write_bytes(data)
            t["mega_cache_bytes"] = len(data)
            t["mega_save_info"] = str(info)[:300]
        else:
            t["mega_cache_bytes"] = None
    ids = torch.randint(0, manifest["shape"]["vocab_size"], (16, PROMPT_LEN), generator=torch.Generator().manual_seed(1)).tolist()
    for b in (1, 16):
        times = []
        for _ in range(5):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            toks = runner.generate(ids[:b], NEW_TOKENS)
            times.append((time.perf_counter() - t0) * 1e3)
        t[f"generate_b{b}_ms_median"] = sorted(times)[2]
        t[f"tokens_b{b}_row0_head"] = toks[0][:8]
    t["graphs"] = len(runner._graphs)
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()}


def build_phase(args: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_cuda import build_hf
    from engine_files import Profile, build_engine_dir
    from components.runtime.static_kv import StaticKVGPT2

    engine = Path(args.engine_dir)
    shutil.rmtree(engine, ignore_errors=True)
    cuda = torch.cuda.is_available()
    model = StaticKVGPT2.from_hf(build_hf(), dtype=torch.float16 if cuda else torch.float32, device="cuda" if cuda else "cpu")
    manifest = build_engine_dir(model, Profile(num_slots=16, max_context=1024), engine)
    manifest["engine_bytes"] = (engine / "model.pt2").stat().st_size
    return manifest


def run_child(args: argparse.Namespace, phase: str, extra: list[str], cache: Path, timeout: int) -> dict:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    cmd = [sys.executable, __file__, "--child", phase, "--engine-dir", args.engine_dir, *extra]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"timeout after {timeout}s", "stderr_tail": (exc.stderr or "")[-3000:] if isinstance(exc.stderr, str) else ""}
    wall = time.perf_counter() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return {"error": f"exit {p.returncode}", "stderr_tail": p.stderr[-4000:], "stdout_tail": p.stdout[-2000:]}
    res = json.loads(lines[-1][7:])
    res["process_wall_s"] = round(wall, 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--engine-dir", default="/tmp/kiln_engine")
    ap.add_argument("--child", choices=["build", "load"])
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--mega-save", action="store_true")
    ap.add_argument("--mega-load", action="store_true")
    ap.add_argument("--fast", action="store_true", help="Triton step for batch 1")
    ap.add_argument("--timeout", type=int, default=200)
    ap.add_argument("--phases", default="build,cold,warm,warm_mega,no_compile")
    args = ap.parse_args()
    if args.child:
        res = build_phase(args) if args.child == "build" else load_phase(args)
        print("RESULT " + json.dumps(res, default=str), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    engine = Path(args.engine_dir)
    cache = engine / "compile_cache"
    results: dict = {}

    def save() -> None:
        (args.out / "load_times.json").write_text(json.dumps(results, indent=1, default=str))

    phases = args.phases.split(",")
    plan = {
        "build": ("build", [], cache),
        "cold": ("load", ["--mega-save"], cache),
        "warm": ("load", [], cache),
        "warm_mega": ("load", ["--mega-load"], engine / "compile_cache_empty"),
        "no_compile": ("load", ["--no-compile"], engine / "compile_cache_unused"),
        "cold_fast": ("load", ["--fast"], engine / "compile_cache_fast"),
        "warm_fast": ("load", ["--fast"], engine / "compile_cache_fast"),
    }
    for name in phases:
        child, extra, cdir = plan[name]
        if name in ("cold", "warm_mega", "no_compile", "cold_fast"):
            shutil.rmtree(cdir, ignore_errors=True)  # these start with empty compile caches
        cdir.mkdir(parents=True, exist_ok=True)
        print(f"[load_times] {name} ...", flush=True)
        results[name] = run_child(args, child, extra, cdir, args.timeout)
        print(f"[load_times] {name}: {json.dumps(results[name], default=str)[:1500]}", flush=True)
        save()
    if cache.exists():
        results["compile_cache_bytes"] = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    save()


if __name__ == "__main__":
    main()
