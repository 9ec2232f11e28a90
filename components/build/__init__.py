"""The build stage: the precision ONNX → an engine directory for the chosen backend."""

from __future__ import annotations

from pathlib import Path

from components.build.packaging import STAGE_VERSION
from components.config import NOT_TENSORRT_PRECISIONS, NOT_TORCH_CUDA, TORCH_CUDA_ONLY_PRECISIONS, TORCH_CUDA_PRECISIONS, BuildParams
from components.data import DataVersion
from components.engine_dir import EngineDir, Lineage
from components.errors import BackendUnavailable, BuildError
from components.model_dir import TrainedModel
from components.precision import PrecisionOnnx

__all__ = ["NO_ONNX", "STAGE_VERSION", "engine_from_model", "engine_from_onnx", "lineage_of", "resolve_backend", "timing_cache_of"]

NO_ONNX = "none"  # the lineage of an engine torch-cuda built from the model, with no ONNX export


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


def resolve_backend(requested: str, precision: str = "fp32", ort_only: bool = False) -> str:
    """The backend that builds `precision`. `auto` is TensorRT where it imports and an NVIDIA
    GPU is present; else torch-cuda where torch sees a CUDA GPU, for the precisions it has
    (fp32, fp16, bf16, fp8, int4; int8 stays on ONNX Runtime); else ONNX Runtime. Graphs of
    ONNX Runtime's own operators (`ort_only`: int4's MatMulNBits, int8 blocks) are ONNX
    Runtime's alone; int4 is torch-cuda's on a GPU (TensorRT has no 4-bit form), else ONNX
    Runtime's; bf16 and fp8 are torch-cuda's alone, with TensorRT present too."""
    from components.runtime.availability import tensorrt_ready, torch_cuda_ready

    if ort_only:
        if requested not in ("auto", "onnxruntime"):
            raise BuildError(f"{precision} engines run ONNX Runtime's MatMulNBits; build.backend {requested} cannot build them (use auto or onnxruntime)")
        return "onnxruntime"
    if precision in TORCH_CUDA_ONLY_PRECISIONS:
        if requested in NOT_TORCH_CUDA:
            raise BuildError(f"{precision} engines are built by torch-cuda alone; build.backend {requested} cannot build them: {NOT_TORCH_CUDA[requested]} (use auto or torch-cuda)")
        if not (answer := torch_cuda_ready())[0]:
            raise BackendUnavailable(f"{precision} engines are built by torch-cuda alone, but {answer[1]}")
        return "torch-cuda"
    if precision in NOT_TENSORRT_PRECISIONS:
        if requested == "tensorrt":
            raise BuildError(f"{precision} engines run ONNX Runtime's MatMulNBits or torch-cuda's 4-bit kernel; build.backend tensorrt cannot build them (use auto, onnxruntime or torch-cuda)")
        if requested == "auto":
            return "torch-cuda" if torch_cuda_ready()[0] else "onnxruntime"
    if requested == "auto":
        if tensorrt_ready()[0]:
            return "tensorrt"
        return "torch-cuda" if torch_cuda_ready()[0] and precision in TORCH_CUDA_PRECISIONS else "onnxruntime"
    for backend, ready in (("tensorrt", tensorrt_ready), ("torch-cuda", torch_cuda_ready)):
        if requested == backend and not (answer := ready())[0]:
            raise BackendUnavailable(f"build.backend is {backend}, but {answer[1]}")
    return requested


def engine_from_onnx(
    graph: PrecisionOnnx, model: TrainedModel, data: DataVersion, params: BuildParams, out_root: Path, project_root: Path
) -> EngineDir:
    """Build one engine; the directory carries its lineage back to model, ONNX and data.
    Relative paths in `params` (the TensorRT timing cache) are relative to `project_root`.
    A torch-cuda engine is built from the model itself (its lineage names no precision ONNX)."""
    lineage = lineage_of(model, graph, data)
    backend = resolve_backend(params.backend, graph.precision, graph.ort_only)
    if backend == "tensorrt":
        from components.build.tensorrt import trt_engine_from_onnx

        return trt_engine_from_onnx(graph, model.path, lineage, params, out_root, timing_cache_of(params, project_root))
    if backend == "torch-cuda":
        return engine_from_model(model, graph.precision, data, params, out_root)
    from components.build.onnxruntime import ort_engine_from_onnx

    return ort_engine_from_onnx(graph, model.path, lineage, params, out_root)


def engine_from_model(model: TrainedModel, precision: str, data: DataVersion, params: BuildParams, out_root: Path) -> EngineDir:
    """A torch-cuda engine: built from the model itself in its own dtype, so no ONNX graph is
    part of its lineage (an 8B model's fp32 export alone is 32 GB of disk and of memory)."""
    from components.build.torch_cuda import torch_engine_from_model

    lineage = Lineage(source_model_path=str(model.path.resolve()), source_model_sha256=model.sha256, onnx_sha256=NO_ONNX, data_md5=data.md5)
    return torch_engine_from_model(model.path, precision, lineage, params.profiles, out_root, memory_utilization=params.gpu_memory_utilization)
