# Sourced by run_device.sh: the repository root as the working folder, kiln's packages on
# PYTHONPATH, and the wheels in .whl/ when there is one (what kiln needs and the machine's
# image lacks, for a machine with no package index: see README.md) installed into /tmp/site;
# the machine's GPU and versions in $OUT/env.txt.
: "${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ]; then
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ -f .devicekit/site.tar.xz ]; then  # kiln's whole stack (device_kit.sh), with `kiln` and `dvc` beside python3
  mkdir -p /tmp/site && { [ -f /tmp/site/.unpacked ] || { tar -xJf .devicekit/site.tar.xz -C /tmp/site && touch /tmp/site/.unpacked; }; } && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  bin=$(dirname "$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')")
  printf '#!/bin/sh\nexec %s -m dvc "$@"\n' "$bin/python3" > "$bin/dvc"
  printf '#!/bin/sh\nexec %s -m flows.cli "$@"\n' "$bin/python3" > "$bin/kiln"
  chmod +x "$bin/dvc" "$bin/kiln"
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm --format=csv
  "${PYTHON:-python3}" -c "import torch, transformers, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
