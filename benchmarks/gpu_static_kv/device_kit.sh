#!/bin/bash
# kiln's whole stack for a GPU machine with no package index, run here (where PyPI answers):
#   bash benchmarks/gpu_static_kv/device_kit.sh   ->   .devicekit/site.tar.xz
# requirements.txt resolved by uv for that machine's Python (3.12, x86-64 manylinux), less the
# packages its image has (image_packages.txt), installed into one folder and packed; MLflow's
# and Prefect's web apps are left out (40 MB that a GPU run never serves). device_env.sh
# unpacks it into /tmp/site and puts `kiln` and `dvc` beside the image's python3, so the GPU
# tests that need a DVC project, MLflow and Prefect run there too (a `kiln build` on the GPU).
set -euo pipefail
cd "$(dirname "$0")/../.."
UV=${UV:-.venv/bin/uv}
HERE=benchmarks/gpu_static_kv
PLATFORM=(--python-version 3.12 --python-platform x86_64-manylinux_2_39)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
grep -vE '^(torch|transformers|tokenizers|onnx|onnxruntime|onnxscript|onnx-ir|polygraphy|mkdocs|mkdocs-material|playwright|ray\[serve\]|lm-eval\[api\]|tritonclient\[http\]|psycopg\[binary\]|accelerate|pytest|pytest-timeout|pytest-xdist)([=<> ]|$)' requirements.txt > "$work/wanted.txt"
"$UV" pip compile --quiet "${PLATFORM[@]}" "$work/wanted.txt" -o "$work/locked.txt"
# typer, click and rich at kiln's versions (the CLI's help depends on them), the rest only where the image lacks them
python3 - "$work/locked.txt" "$HERE/image_packages.txt" > "$work/missing.txt" <<'PY'
import re, sys
image = {l.strip().lower().replace("_", "-") for l in open(sys.argv[2]) if l.strip() and not l.startswith("#")} - {"typer", "click", "rich"}
for line in open(sys.argv[1]):
    if (m := re.match(r"^([A-Za-z0-9_.\-]+)(\[.*\])?==(\S+)", line)) and m.group(1).lower().replace("_", "-") not in image:
        print(f"{m.group(1)}=={m.group(3)}")
PY
"$UV" pip install --quiet --no-deps --target "$work/site" "${PLATFORM[@]}" -r "$work/missing.txt"
rm -rf "$work/site/mlflow/server/js" "$work/site/prefect/server/ui" "$work/site/prefect/server/ui-v2"
mkdir -p .devicekit
(cd "$work/site" && XZ_OPT="-T0 -6" tar -cJf - --exclude=__pycache__ .) > .devicekit/site.tar.xz
echo "$(wc -l < "$work/missing.txt") packages, $(du -h .devicekit/site.tar.xz | cut -f1) in .devicekit/site.tar.xz"
