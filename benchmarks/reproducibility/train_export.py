"""Train and export the model of a project's params.yaml and data version; print each
stage's digest: `python -m benchmarks.reproducibility.train_export OUT [PROJECT]` (with and
without ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from components.config import load_params
from components.data import DataVersion, dvc_md5
from components.export import onnx_from_model
from components.files import file_sha256
from components.train import model_from_data


def main() -> None:
    root = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(".")
    out = Path(sys.argv[1])
    params = load_params(root / "params.yaml")
    data = DataVersion(path=root / "data", md5=dvc_md5(root / "data.dvc"))
    t = time.time()
    model = model_from_data(data, params.model, out / "models")
    onnx = onnx_from_model(model, params.export, out / "onnx")
    print("env", {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")})
    print("model sha256", model.sha256, "eval ppl", model.eval_perplexity, "s", round(time.time() - t))
    print("onnx sha256", file_sha256(onnx.path))


if __name__ == "__main__":
    main()
