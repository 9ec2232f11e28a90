"""The build stage: the precision ONNX → an engine directory for the chosen backend."""

from __future__ import annotations

from pathlib import Path

from kiln.components.data import DataVersion
from kiln.components.engine_dir import EngineDir, Lineage
from kiln.components.export import ExportedOnnx
from kiln.components.train import TrainedModel
from kiln.config import BuildParams


def lineage_of(model: TrainedModel, onnx: ExportedOnnx, data: DataVersion) -> Lineage:
    return Lineage(
        source_model_path=str(model.path.resolve()),
        source_model_sha256=model.sha256,
        onnx_sha256=onnx.sha256,
        data_md5=data.md5,
    )


def engine_from_onnx(onnx: ExportedOnnx, model: TrainedModel, data: DataVersion, params: BuildParams, out_root: Path) -> EngineDir:
    """Build one engine; the directory carries its lineage back to model, ONNX and data."""
    from kiln.components.engines.onnxruntime import ort_engine_from_onnx

    return ort_engine_from_onnx(onnx, model.path, lineage_of(model, onnx, data), params, out_root)
