#!/bin/bash
# Run 9 (the Llama family on the torch-cuda backend), on the device machine from the repo root,
# with .whl carried (see README.md): bash benchmarks/gpu_static_kv/run9.sh [tests] [bench]
#   tests: tests/test_torch_cuda.py's GPU tests (GPT-2 and each Llama-family model, the Triton
#          step against the decode step) and the family tests that need no DVC; the CPU parity
#          file; then gqa_modes.py (three ways of grouped-query attention, timed)
#   bench: kiln bench --device cuda --shape smollm2-135m
set -o pipefail
source "$(dirname "$0")/device_env.sh"
for step in "$@"; do
  case "$step" in
    tests)
      timeout "${TEST_TIMEOUT:-360}" python3 -m pytest -q -p no:cacheprovider -rs --durations=12 tests/test_torch_cuda.py tests/test_static_kv_prototype.py \
        -k "on_the_gpu or rotary or rope or familys or stop_ids or sliding or test_static_kv_prototype" 2>&1 | grep -v "^DEBUG" | tee "$OUT/test.log"
      timeout "${GQA_TIMEOUT:-150}" python3 -m benchmarks.gpu_static_kv.gqa_modes --out "$OUT" 2>&1 | tee "$OUT/gqa_modes.log" ;;
    bench)
      timeout "${BENCH_TIMEOUT:-560}" python3 -c 'from flows.cli import main; main()' bench --device cuda --shape smollm2-135m --runs "${RUNS:-5}" \
        --work /tmp/kiln-bench --json "$OUT/kiln_bench_smollm2.json" 2>&1 | tee "$OUT/kiln_bench_smollm2.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
