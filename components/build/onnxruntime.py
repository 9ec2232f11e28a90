"""Building for ONNX Runtime: the precision ONNX is the engine file, packaged as an engine directory."""

from __future__ import annotations

import shutil
from pathlib import Path

from components.build.packaging import BackendBuild, engine_folder, package_engine
from components.config import BuildParams, section_digest
from components.engine_dir import EngineDir, Lineage
from components.precision import PrecisionOnnx

BACKEND = "onnxruntime"
ENGINE_FILE = "model.onnx"


def ort_engine_from_onnx(
    graph: PrecisionOnnx, tokenizer_dir: Path, lineage: Lineage, params: BuildParams, out_root: Path
) -> EngineDir:
    """An ONNX Runtime engine directory: the precision ONNX is the engine file."""
    import onnxruntime as ort

    build = BackendBuild(BACKEND, ort.__version__, "cpu", ENGINE_FILE)
    target = engine_folder(out_root, build, graph.precision, section_digest(params.profiles)[:8], graph.onnx.sha256[:12])
    copy = lambda path: shutil.copyfile(graph.onnx.path, path)  # noqa: E731
    return package_engine(target, copy, build, graph, tokenizer_dir, lineage, params.profiles)
