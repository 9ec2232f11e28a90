"""The ONNX Runtime backend: build an engine directory from the precision ONNX, and run it."""

from __future__ import annotations

import shutil
from pathlib import Path

from kiln.components.engine_dir import EngineDir, Lineage
from kiln.components.engines.base import Engine
from kiln.components.engines.packaging import BackendBuild, package_engine
from kiln.components.precision import PrecisionOnnx
from kiln.config import BuildParams, section_digest
from kiln.errors import BuildError

# ORT can fuse a quantized MatMul + Add into a float Gemm with no int8 kernel, dequantizing
# the weights on every step (slower than fp32). kiln's export emits Gemm for linear layers,
# so today it changes nothing measurable (kiln bench: 903 vs 878 ms); it guards graphs
# that do carry MatMul + Add (other exporters, ORT's transformer optimizer).
QDQ_DISABLED_OPTIMIZERS = ["MatMulAddFusion"]

BACKEND = "onnxruntime"
ENGINE_FILE = "model.onnx"


def ort_engine_from_onnx(
    graph: PrecisionOnnx, tokenizer_dir: Path, lineage: Lineage, params: BuildParams, out_root: Path
) -> EngineDir:
    """An ONNX Runtime engine directory: the precision ONNX is the engine file."""
    import onnxruntime as ort

    target = out_root / f"{BACKEND}-{graph.precision}-{section_digest(params.profiles)[:8]}-{graph.onnx.sha256[:12]}"
    build = BackendBuild(BACKEND, ort.__version__, "cpu", ENGINE_FILE)
    copy = lambda path: shutil.copyfile(graph.onnx.path, path)  # noqa: E731
    return package_engine(target, copy, build, graph, tokenizer_dir, lineage, params.profiles)


class OrtEngine(Engine):
    """Generation on an ONNX Runtime CPU session."""

    def __init__(self, engine_dir: EngineDir, threads: int | None = None) -> None:
        import onnxruntime as ort

        super().__init__(engine_dir)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        options.log_severity_level = 3
        disabled = QDQ_DISABLED_OPTIMIZERS if self.manifest.precision == "int8" else []
        try:
            self.session = ort.InferenceSession(
                str(engine_dir.engine_file), options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
            )
        except Exception as err:  # ORT raises its own Fail/InvalidGraph types
            raise BuildError(f"ONNX Runtime cannot load {engine_dir.engine_file}: {err}") from err

    def forward(self, input_ids, attention_mask, position_ids, cache):
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        feeds |= dict(zip(self.manifest.past_names, cache))
        logits, *present = self.session.run(None, feeds)
        return logits, present
