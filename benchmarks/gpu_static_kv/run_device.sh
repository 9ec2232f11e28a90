#!/bin/bash
# On the device machine, from the repo root: bash benchmarks/gpu_static_kv/run_device.sh [bench] [load] [...]
# Everything it writes lands in $OUT (at most 8 files come back).
set -o pipefail
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1
# Compile caches of the bench live in /tmp (load_times keeps its own beside the engine).
export TORCHINDUCTOR_CACHE_DIR=/tmp/kiln_inductor TRITON_CACHE_DIR=/tmp/kiln_triton
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm --format=csv
  python3 -c "import torch, transformers, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for step in "$@"; do
  case "$step" in
    bench) timeout "${BENCH_TIMEOUT:-420}" python3 bench_cuda.py --out "$OUT" --budget-s "${BENCH_BUDGET:-400}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" ;;
    load) timeout "${LOAD_TIMEOUT:-200}" python3 load_times.py --out "$OUT" --timeout 120 ${LOAD_PHASES:+--phases $LOAD_PHASES} 2>&1 | tee "$OUT/load.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
