# Run 14 (on the device, from the repo root, .whl and .before carried): the closed-loop scheduler
# without HTTP (serve_loop.py) and kiln bench serving at 16 clients, this code and .before (a
# git archive of the previous commit) interleaved; SmolLM2's generate at batch 1 in both.
source benchmarks/gpu_static_kv/device_env.sh >/dev/null; cd "$ROOT"; export PYTHONPATH="$PYTHONPATH:/tmp/site"; t0=$SECONDS
loop() { (cd "$1" && PYTHONPATH="$1:/tmp/site" timeout 200 python3 -m benchmarks.gpu_static_kv.serve_loop --out "$OUT/$2" --rounds 2 --seconds 4 --prefill-shapes smollm2-135m --no-prefill-ab > "$OUT/$2.log" 2>&1); echo "$2 rc $? at $((SECONDS-t0)) s"; grep -E "of generate|_prefill|^smollm2" "$OUT/$2.log"; }
serve() { (cd "$1" && PYTHONPATH="$1:/tmp/site" timeout 200 python3 -m flows.cli bench serving --engine "$engine" --clients 16 --new-tokens 32 --seconds 8 --json "$OUT/$2.json" > "$OUT/$2.log" 2>&1); echo "$2 rc $? at $((SECONDS-t0)) s"; grep "│" "$OUT/$2.log" | tail -3; }
loop "$ROOT" after_loop
loop "$ROOT/.before" before_loop
engine=$(ls -d /tmp/kiln-bench/gpt2-small/engines/torch-cuda-fp16-* | grep -v compile-cache | head -1)
serve "$ROOT" after_c16
serve "$ROOT/.before" before_c16
serve "$ROOT" after_c16_2
