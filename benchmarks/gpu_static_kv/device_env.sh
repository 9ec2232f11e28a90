# Sourced by the device run scripts (run_device.sh, run9.sh, run_fused.sh): the repo root as
# the working folder, kiln's packages and the wheels carried in .whl on PYTHONPATH (those kiln
# needs and the image lacks: pydantic, evaluate, ...; see README.md), and the machine's GPU and
# versions in $OUT/env.txt.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm --format=csv
  python3 -c "import torch, transformers, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
