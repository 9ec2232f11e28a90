# Run 13 (on the device, from the repo root, .whl and .before carried): the scheduler without HTTP
# (serving_steps.py), then kiln bench serving at 16 clients with this code and with .before
# (a git archive of the previous commit), then one client.
source benchmarks/gpu_static_kv/device_env.sh >/dev/null; cd "$ROOT"; export PYTHONPATH="$PYTHONPATH:/tmp/site"; t0=$SECONDS
export TORCHINDUCTOR_CACHE_DIR=/tmp/kiln_inductor TRITON_CACHE_DIR=/tmp/kiln_triton
timeout 170 env -u TORCHINDUCTOR_CACHE_DIR -u TRITON_CACHE_DIR python3 -m benchmarks.gpu_static_kv.serving_steps --out "$OUT" --rounds 3 > "$OUT/steps.log" 2>&1; echo "steps rc $? at $((SECONDS-t0)) s"; grep -v "━" "$OUT/steps.log" | tail -25
engine=$(ls -d /tmp/kiln-bench/gpt2-small/engines/torch-cuda-fp16-* | grep -v compile-cache | head -1)
serve() { (cd "$1" && PYTHONPATH="$1:/tmp/site" timeout 150 env -u TORCHINDUCTOR_CACHE_DIR -u TRITON_CACHE_DIR python3 -m flows.cli bench serving --engine "$engine" --clients "$2" --new-tokens "$3" --seconds 8 --json "$OUT/$4.json" > "$OUT/$4.log" 2>&1); echo "$4 at $((SECONDS-t0)) s"; grep "│" "$OUT/$4.log"; }
serve "$ROOT" 16 32 after_c16
serve "$ROOT/.before" 16 32 before_c16
serve "$ROOT" 1 128 after_c1
