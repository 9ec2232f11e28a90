#!/bin/bash
# Run 9 (the Llama family on the torch-cuda backend), on the device machine from the repo root,
# with .whl carried (see README.md): bash benchmarks/gpu_static_kv/run9.sh [tests] [bench]
#   tests: tests/test_torch_cuda.py's GPU tests (GPT-2 and each Llama-family model, the Triton
#          step against the decode step) and the family tests that need no DVC; the CPU parity
#          file; then gqa_modes.py (three ways of grouped-query attention, timed)
#   bench: kiln bench --device cuda --shape smollm2-135m
set -o pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm --format=csv
  python3 -c "import torch, transformers, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
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
