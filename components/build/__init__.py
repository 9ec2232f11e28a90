"""The build stage: the precision ONNX → an engine directory for the chosen backend."""

from __future__ import annotations

from pathlib import Path

from components.build.packaging import STAGE_VERSION
from components.config import BuildParams
from components.data import DataVersion
from components.engine_dir import EngineDir, Lineage
from components.errors import BackendUnavailable
from components.model_dir import TrainedModel
from components.precision import PrecisionOnnx

__all__ = ["STAGE_VERSION", "engine_from_onnx", "lineage_of", "resolve_backend", "timing_cache_of"]


def lineage_of(model: TrainedModel, graph: PrecisionOnnx, data: DataVersion) -> Lineage:
    return Lineage(
        source_model_path=str(model.path.resolve()),
        source_model_sha256=model.sha256,
        onnx_sha256=graph.fp32_sha256,
        precision_onnx_sha256=graph.onnx.sha256,
        data_md5=data.md5,
        calibration_digest=graph.calibration_digest,
    )


def timing_cache_of(params: BuildParams, project_root: Path) -> Path:
    """The TensorRT timing cache: relative to the project, not to wherever kiln was started."""
    return project_root / params.tensorrt.timing_cache


def resolve_backend(requested: str) -> str:
    """`auto` is TensorRT where it imports and an NVIDIA GPU is present, else ONNX Runtime."""
    from components.runtime.availability import tensorrt_ready

    ready, why_not = tensorrt_ready()
    if requested == "tensorrt" and not ready:
        raise BackendUnavailable(f"build.backend is tensorrt, but {why_not}")
    if requested == "auto":
        return "tensorrt" if ready else "onnxruntime"
    return requested


def engine_from_onnx(
    graph: PrecisionOnnx, model: TrainedModel, data: DataVersion, params: BuildParams, out_root: Path, project_root: Path
) -> EngineDir:
    """Build one engine; the directory carries its lineage back to model, ONNX and data.
    Relative paths in `params` (the TensorRT timing cache) are relative to `project_root`."""
    lineage = lineage_of(model, graph, data)
    if resolve_backend(params.backend) == "tensorrt":
        from components.build.tensorrt import trt_engine_from_onnx

        return trt_engine_from_onnx(graph, model.path, lineage, params, out_root, timing_cache_of(params, project_root))
    from components.build.onnxruntime import ort_engine_from_onnx

    return ort_engine_from_onnx(graph, model.path, lineage, params, out_root)
