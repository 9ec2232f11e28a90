"""The int8 precision stage alone, on the same fp32 ONNX and calibration set: its output's
sha256, the calibration feeds' greedy tokens and the calibrated ranges, to compare CPUs:
`python -m benchmarks.reproducibility.int8_stage OUT` from a repo root holding .repro/
(inputs.pkl: the pickled ExportedOnnx and CalibrationSet; their folders; params.yaml)."""

from __future__ import annotations

import hashlib
import json
import pickle
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx as onnx_lib
import onnxruntime

from components.config import load_params
from components.precision import CalibrationFeeds, int8_qdq_onnx


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    fp32, cal = pickle.load(open(".repro/inputs.pkl", "rb"))
    params = load_params(Path(".repro/params.yaml"))
    cpu = subprocess.run(["bash", "-c", "grep -m1 'model name' /proc/cpuinfo; grep -m1 -o -w 'avx512_vnni\\|avx_vnni\\|amx_int8' /proc/cpuinfo | sort -u | tr '\\n' ' '"], capture_output=True, text=True).stdout
    report = {"cpu": cpu.strip(), "python": platform.python_version(), "onnxruntime": onnxruntime.__version__, "onnx": onnx_lib.__version__, "numpy": np.__version__}
    feeds = CalibrationFeeds(fp32, cal)
    tokens, digest = [], hashlib.sha256()
    while (feed := feeds.get_next()) is not None:
        tokens.append(feed["input_ids"].ravel().tolist())
        for name in sorted(feed):
            digest.update(np.ascontiguousarray(feed[name]).tobytes())
    report["calibration_feeds_sha256"] = digest.hexdigest()
    report["decode_tokens_sha256"] = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
    int8_qdq_onnx(fp32, cal, params.precision.int8, out / "model.onnx")
    report["int8_onnx_sha256"] = hashlib.sha256((out / "model.onnx").read_bytes()).hexdigest()
    model = onnx_lib.load(str(out / "model.onnx"))
    scales = {i.name: onnx_lib.numpy_helper.to_array(i).tolist() for i in model.graph.initializer if i.name.endswith("_scale") and "weight" not in i.name.lower()}
    report["activation_scales"] = scales
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "activation_scales"}, indent=1))


if __name__ == "__main__":
    main()
