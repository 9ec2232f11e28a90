#!/bin/bash
# kiln serve vs benchmarks/serving_split.py (the scheduler in a process of its own), each at
# --max-batch 1 and with continuous batching, interleaved for ROUNDS rounds; every row is
# driven by `kiln bench serving`'s own clients (16, 32 + 32 tokens, SECONDS s).
#   bash benchmarks/serving_split_ab.sh ENGINE_DIR
set -u
cd "$(dirname "$0")/.."
ENGINE=$1 ROUNDS=${ROUNDS:-2} SECONDS_PER_ROW=${SECONDS_PER_ROW:-8}
VOCAB=$(.venv/bin/python -c "from pathlib import Path; from components.engine_dir import load_engine_dir; print(load_engine_dir(Path('$ENGINE')).manifest.vocab_size)")
row() {  # name port command...
  local name=$1 port=$2; shift 2
  "$@" > /tmp/kiln-split-ab.log 2>&1 & local pid=$!
  for _ in $(seq 120); do curl -sf "localhost:$port/readyz" > /dev/null && break; sleep 1; done
  .venv/bin/python - "$name" "http://127.0.0.1:$port" "$VOCAB" "$SECONDS_PER_ROW" <<'PY'
import sys
from flows import bench_serving as bs
name, url, vocab, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
row = bs._measure(url, name, "", vocab, bs.ServingBenchSetup(seconds=seconds))
print(f"{name:16s} {row.tokens_per_s:8.0f} tok/s  p99 {row.p99_ms:6.1f} ms  TTFT p50 {row.ttft_p50_ms:6.1f} ms  failed {row.failed}")
PY
  kill "$pid"; wait "$pid" 2> /dev/null; sleep 1
}
for _ in $(seq "$ROUNDS"); do
  row "kiln-serve one" 8123 .venv/bin/kiln serve --engine "$ENGINE" --port 8123 --max-batch 1
  row "kiln-serve cb" 8123 .venv/bin/kiln serve --engine "$ENGINE" --port 8123
  row "split one" 8124 .venv/bin/python benchmarks/serving_split.py "$ENGINE" --port 8124 --max-batch 1
  row "split cb" 8124 .venv/bin/python benchmarks/serving_split.py "$ENGINE" --port 8124
done
