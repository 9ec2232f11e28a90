#!/bin/bash
# On the device machine, from the repo root: bash benchmarks/gpu_static_kv/run_device.sh [kilnbench] [kiln] [steps] [serve] [pdl] [test] [bench]
# `before-steps` / `before-serve`: the same from a copy of the previous code in .before (carried).
# Everything it writes lands in $OUT (at most 8 files come back).
set -o pipefail
source "$(dirname "$0")/device_env.sh"
cd benchmarks/gpu_static_kv
# Compile caches of the prototype's bench live in /tmp (kiln's engines keep theirs beside the engine).
export TORCHINDUCTOR_CACHE_DIR=/tmp/kiln_inductor TRITON_CACHE_DIR=/tmp/kiln_triton
for step in "$@"; do
  case "$step" in
    bench) timeout "${BENCH_TIMEOUT:-420}" python3 -m benchmarks.gpu_static_kv.bench_cuda --out "$OUT" --budget-s "${BENCH_BUDGET:-400}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" ;;
    kilnbench) (cd "$ROOT" && timeout "${KILNBENCH_TIMEOUT:-400}" env -u TORCHINDUCTOR_CACHE_DIR -u TRITON_CACHE_DIR python3 -c 'from flows.cli import main; main()' bench --device cuda --runs "${RUNS:-5}" --work /tmp/kiln-bench --json "$OUT/kiln_bench.json" 2>&1 | tee "$OUT/kiln_bench.log") ;;
    kiln) timeout "${KILN_TIMEOUT:-500}" env -u TORCHINDUCTOR_CACHE_DIR -u TRITON_CACHE_DIR python3 -m benchmarks.gpu_static_kv.kiln_engine --out "$OUT" --kit "$ROOT/.devicekit" --bench-work /tmp/kiln-bench ${KILN_PHASES:+--phases $KILN_PHASES} 2>&1 | tee "$OUT/kiln.log" ;;
    steps) (cd "$ROOT" && timeout "${STEPS_TIMEOUT:-300}" env -u TORCHINDUCTOR_CACHE_DIR -u TRITON_CACHE_DIR python3 -m benchmarks.gpu_static_kv.serving_steps --out "$OUT" 2>&1 | tee "$OUT/steps.log") ;;
    before-steps) (cd "$ROOT/.before" && PYTHONPATH="$ROOT/.before:/tmp/site" timeout "${STEPS_TIMEOUT:-300}" env -u TORCHINDUCTOR_CACHE_DIR -u TRITON_CACHE_DIR python3 -m benchmarks.gpu_static_kv.serving_steps --out "$OUT/before" 2>&1 | tee "$OUT/before_steps.log") ;;
    serve|before-serve)
      # kiln serve over HTTP on the engine `steps` built: one streaming client (32 + 128) and 16 (32 + 32).
      dir="$ROOT"; [ "$step" = before-serve ] && dir="$ROOT/.before"
      engine=$(ls -d /tmp/kiln-bench/gpt2-small/engines/torch-cuda-fp16-* | grep -v compile-cache | head -1)
      for load in "1 128" "16 32"; do
        set -- $load
        (cd "$dir" && PYTHONPATH="$dir:/tmp/site" timeout "${SERVE_TIMEOUT:-200}" env -u TORCHINDUCTOR_CACHE_DIR -u TRITON_CACHE_DIR python3 -m flows.cli bench serving \
          --engine "$engine" --clients "$1" --new-tokens "$2" --seconds "${SERVE_SECONDS:-8}" --json "$OUT/${step}_c$1.json" 2>&1 | tee -a "$OUT/${step}.log")
      done ;;
    pdl) (cd "$ROOT" && timeout "${PDL_TIMEOUT:-400}" env -u TORCHINDUCTOR_CACHE_DIR -u TRITON_CACHE_DIR python3 -m benchmarks.gpu_static_kv.pdl_ab --out "$OUT" 2>&1 | tee "$OUT/pdl.log") ;;
    test) (cd "$ROOT" && timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_torch_cuda.py 2>&1 | tee "$OUT/test.log") ;;
    *) echo "unknown step $step" ;;
  esac
done
