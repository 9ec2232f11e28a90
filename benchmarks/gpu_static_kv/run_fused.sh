#!/bin/bash
# Runs 10 and 11 (the fused Llama Triton step), on the device machine from the repo root, with
# .whl carried: bash benchmarks/gpu_static_kv/run_fused.sh [profile] [ab] [bench] [tests]
#   profile: step_profile.py: the step's kernel time, gaps and launch floor (best_tiles.json's
#          attributes set, as bench)
#   ab:    fused_ab.py --set $AB_SET (run11): variants of the fused step (3 kernels a layer)
#          vs the five-kernel one, on the smollm2-135m bench engine; writes best_tiles.json
#   bench: kiln bench --device cuda --shape smollm2-135m, with best_tiles.json's attributes
#          set on TritonLlamaDecodeStep (none: the defaults)
#   tests: as run9.sh's tests step (GPU tests of test_torch_cuda.py, test_static_kv_prototype.py)
set -o pipefail
source "$(dirname "$0")/device_env.sh"
for step in "$@"; do
  case "$step" in
    profile)
      [ -f "$OUT/best_tiles.json" ] || echo '{}' > "$OUT/best_tiles.json"
      timeout "${PROFILE_TIMEOUT:-150}" python3 -m benchmarks.gpu_static_kv.step_profile --out "$OUT" --tiles "$OUT/best_tiles.json" 2>&1 | grep -v "^DEBUG" | tee "$OUT/step_profile.log" ;;
    ab)
      timeout "${AB_TIMEOUT:-200}" python3 -m benchmarks.gpu_static_kv.fused_ab --out "$OUT" --set "${AB_SET:-run11}" --runs "${AB_RUNS:-15}" 2>&1 | grep -v "^DEBUG" | tee "$OUT/fused_ab.log" ;;
    bench)
      [ -f "$OUT/best_tiles.json" ] || echo '{}' > "$OUT/best_tiles.json"
      timeout "${BENCH_TIMEOUT:-300}" python3 -c '
import json, sys
from components.runtime import triton_decode as td
tiles = json.load(open(sys.argv[1]))
print("TritonLlamaDecodeStep tiles:", tiles or "defaults", flush=True)
for k, v in tiles.items():
    setattr(td.TritonLlamaDecodeStep, k, tuple(v) if isinstance(v, list) else v)
sys.argv = sys.argv[:1] + sys.argv[2:]
from flows.cli import main
main()' "$OUT/best_tiles.json" bench --device cuda --shape smollm2-135m --runs "${RUNS:-5}" \
        --work /tmp/kiln-bench --json "$OUT/kiln_bench_smollm2.json" 2>&1 | tee "$OUT/kiln_bench_smollm2.log" ;;
    tests)
      timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rs --durations=12 tests/test_torch_cuda.py tests/test_static_kv_prototype.py \
        -k "on_the_gpu or rotary or rope or familys or stop_ids or sliding or test_static_kv_prototype" 2>&1 | grep -v "^DEBUG" | tee "$OUT/test.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
