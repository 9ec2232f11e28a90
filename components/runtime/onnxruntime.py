"""The ONNX Runtime runner: generation on a CPU session over the engine's ONNX file."""

from __future__ import annotations

import os

from components.engine_dir import EngineDir
from components.errors import EngineError
from components.runtime.engine import Engine

# Both rewrites turn int8 MatMuls back into float ones over weights dequantized every step:
# MatMulAddFusion makes a float Gemm of a quantized MatMul + Add, and common-subexpression
# elimination merges the Q/DQ pairs components.precision gives each reader of an activation
# (measured: docs/performance.md, "Measured choices in the code").
QDQ_DISABLED_OPTIMIZERS = ["MatMulAddFusion", "CommonSubexpressionElimination"]


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
            raise EngineError(f"ONNX Runtime cannot load {engine_dir.engine_file}: {err}") from err

    def forward(self, input_ids, attention_mask, position_ids, cache, logits_positions=None):
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        feeds |= self._logits_positions_feed(input_ids, logits_positions)
        feeds |= dict(zip(self.manifest.past_names, cache))
        logits, *present = self.session.run(None, feeds)
        return logits, present

    def runtime_settings(self) -> dict[str, str]:
        threads = self.session.get_session_options().intra_op_num_threads  # 0: ONNX Runtime's default, one per core
        return super().runtime_settings() | {"threads": str(threads) if threads else f"all cores ({os.cpu_count()})"}

    def close(self) -> None:
        self.session = None
