#!/bin/bash
# The torch-cuda measurements on a GPU machine, from the repository root:
#   OUT=DIR bash benchmarks/gpu_static_kv/run_device.sh STEP...
# Steps (README.md here says what each measures; docs/performance.md has the figures):
#   kilnbench  kiln bench --device cuda, per shape in $SHAPES (default gpt2-small)
#   kiln       kiln_engine.py: the trained default model (.devicekit) gated on the GPU, loads
#   steps      serving_steps.py: kiln serve's scheduler without HTTP vs the engine's generate
#   serve      kiln bench serving on the GPT-2-small fp16 engine: 1 client 32 + 128, 16 clients 32 + 32
#   loop       serve_loop.py: the scheduler under closed-loop clients, host time per engine call
#   pdl        pdl_ab.py: the one-row Triton step with programmatic dependent launch on and off
#   fused      fused_ab.py: the Llama one-row step in three kernels a layer vs five, and its tiles
#   profile    step_profile.py: where one decode step of the Llama Triton step goes
#   test       the GPU tests: tests/test_torch_cuda.py and tests/test_static_kv_prototype.py, TEST_WORKERS (6) at a time
# Each step writes STEP.log (and its JSON) under $OUT, and a line to $OUT/run_device.txt;
# the exit status is 1 when any step failed. Settings through the environment: RUNS,
# SHAPES, KILNBENCH_ARGS, KILN_PHASES, STEPS_ARGS, SERVE_SECONDS, LOOP_ARGS, FUSED_SET,
# FUSED_RUNS, PDL_RUNS, TEST_K, TEST_WORKERS, and <STEP>_TIMEOUT in seconds (e.g. KILNBENCH_TIMEOUT=600).
set -o pipefail
source "$(dirname "$0")/device_env.sh"
PY=${PYTHON:-python3}
WORK=/tmp/kiln-bench  # benchmark models and engines, shared by the steps (built once per machine)
TEST_SELECTION="on_the_gpu or rotary or rope or familys or stop_ids or sliding or test_static_kv_prototype"
failed=0

run() {  # run NAME DEFAULT_TIMEOUT COMMAND...: the command's output to the terminal and $OUT/NAME.log
  local name=$1 limit=$2 var started=$SECONDS rc
  shift 2
  var="$(echo "${name%%_*}" | tr '[:lower:]' '[:upper:]')_TIMEOUT"
  timeout "${!var:-$limit}" "$@" 2>&1 | sed -u '/^DEBUG/d' | tee -a "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  echo "$name rc $rc in $((SECONDS - started)) s" | tee -a "$OUT/run_device.txt"
  [ "$rc" = 0 ] || failed=1
}

gpt2_engine() {  # the GPT-2-small fp16 engine of kiln bench --device cuda, built when absent
  "$PY" -c 'import sys; from pathlib import Path; from benchmarks.gpu_static_kv.serving_steps import engine_path; print(engine_path(Path(sys.argv[1]), "gpt2-small"))' "$WORK" | tail -1
}

for step in "$@"; do
  case "$step" in
    kilnbench)
      for shape in ${SHAPES:-gpt2-small}; do
        run "kilnbench_$shape" 500 "$PY" -m flows.cli bench --device cuda --shape "$shape" --runs "${RUNS:-5}" --work "$WORK" \
          --json "$OUT/kiln_bench_$shape.json" ${KILNBENCH_ARGS:-}
      done ;;
    kiln) run kiln 500 "$PY" -m benchmarks.gpu_static_kv.kiln_engine --out "$OUT" --kit "$ROOT/.devicekit" --bench-work "$WORK" --phases "${KILN_PHASES:-gates,load}" ;;
    steps) run steps 300 "$PY" -m benchmarks.gpu_static_kv.serving_steps --out "$OUT" --bench-work "$WORK" ${STEPS_ARGS:-} ;;
    serve)
      engine=$(gpt2_engine) || { echo "serve: no engine" | tee -a "$OUT/run_device.txt"; failed=1; continue; }
      run serve_c1 200 "$PY" -m flows.cli bench serving --engine "$engine" --clients 1 --new-tokens 128 --seconds "${SERVE_SECONDS:-8}" --json "$OUT/serve_c1.json"
      run serve_c16 200 "$PY" -m flows.cli bench serving --engine "$engine" --clients 16 --new-tokens 32 --seconds "${SERVE_SECONDS:-8}" --json "$OUT/serve_c16.json" ;;
    loop) run loop 300 "$PY" -m benchmarks.gpu_static_kv.serve_loop --out "$OUT" --bench-work "$WORK" ${LOOP_ARGS:-} ;;
    pdl) run pdl 400 "$PY" -m benchmarks.gpu_static_kv.pdl_ab --out "$OUT" --work "$WORK" --runs "${PDL_RUNS:-15}" ;;
    fused) run fused 300 "$PY" -m benchmarks.gpu_static_kv.fused_ab --out "$OUT" --work "$WORK" --set "${FUSED_SET:-default}" --runs "${FUSED_RUNS:-15}" ;;
    profile)
      # With the attributes `fused` found fastest, when it ran before in this $OUT.
      tiles=(); [ -f "$OUT/best_tiles.json" ] && tiles=(--tiles "$OUT/best_tiles.json")
      run profile 200 "$PY" -m benchmarks.gpu_static_kv.step_profile --out "$OUT" --work "$WORK" "${tiles[@]}" ;;
    test)
      run test 580 "$PY" -m pytest -q -p no:cacheprovider -rs --durations=12 -n "${TEST_WORKERS:-6}" tests/test_torch_cuda.py tests/test_static_kv_prototype.py \
        -k "${TEST_K:-$TEST_SELECTION}" ;;
    *) echo "unknown step $step (see the top of $0)" | tee -a "$OUT/run_device.txt"; failed=1 ;;
  esac
done
exit $failed
