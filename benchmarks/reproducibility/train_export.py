"""Train and export the default GPT-2 of /tmp/exp/fresh's data, print each stage's digest."""
import os, sys, time
from pathlib import Path
from components.config import load_params
from components.data import DataVersion, dvc_md5
from components.train import model_from_data
from components.export import onnx_from_model
from components.files import file_sha256

root = Path("/tmp/exp/fresh")
out = Path(sys.argv[1])
params = load_params(root / "params.yaml")
data = DataVersion(path=root / "data", md5=dvc_md5(root / "data.dvc"))
t = time.time()
model = model_from_data(data, params.model, out / "models")
onnx = onnx_from_model(model, params.export, out / "onnx")
print("env", {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")})
print("model sha256", model.sha256, "eval ppl", model.eval_perplexity, "s", round(time.time() - t))
print("onnx sha256", file_sha256(onnx.path))
