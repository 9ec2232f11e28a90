"""The ONNX Runtime backend: build an engine directory from the precision ONNX, and run it."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from kiln.components.engine_dir import (
    TOKENIZER_FILES,
    DimRange,
    EngineDir,
    EngineManifest,
    Lineage,
    ParityRecord,
    ShapeProfile,
    load_engine_dir,
    write_manifest,
)
from kiln.components.engines.base import Engine
from kiln.components.precision import PrecisionOnnx
from kiln.components.files import atomic_directory, file_sha256
from kiln.config import BuildParams, ProfileParams, section_digest

# ORT can fuse a quantized MatMul + Add into a float Gemm with no int8 kernel, dequantizing
# the weights on every step (slower than fp32). kiln's export emits Gemm for linear layers,
# so today it changes nothing measurable (kiln bench: 903 vs 878 ms); it guards graphs
# that do carry MatMul + Add (other exporters, ORT's transformer optimizer).
QDQ_DISABLED_OPTIMIZERS = ["MatMulAddFusion"]

BACKEND = "onnxruntime"
ENGINE_FILE = "model.onnx"


def profiles_from_params(params: ProfileParams) -> dict[str, ShapeProfile]:
    """Context phase (past 0, the whole prompt) and generation phase (1 token, growing past)."""
    batch = DimRange(**params.batch.model_dump())
    return {
        "context": ShapeProfile(
            batch=batch, sequence=DimRange(**params.prompt.model_dump()), past=DimRange(min=0, opt=0, max=0)
        ),
        "generation": ShapeProfile(
            batch=batch,
            sequence=DimRange(min=1, opt=1, max=1),
            past=DimRange(min=max(params.context.min - 1, 1), opt=params.context.opt - 1, max=params.context.max - 1),
        ),
    }


def ort_engine_from_onnx(
    graph: PrecisionOnnx, tokenizer_dir: Path, lineage: Lineage, params: BuildParams, out_root: Path
) -> EngineDir:
    """An ONNX Runtime engine directory: the precision ONNX as the engine file."""
    import onnxruntime as ort

    onnx = graph.onnx
    target = out_root / f"{BACKEND}-{graph.precision}-{section_digest(params.profiles)[:8]}-{onnx.sha256[:12]}"
    if not (target / "engine.json").is_file():
        with atomic_directory(target) as staging:
            shutil.copyfile(onnx.path, staging / ENGINE_FILE)
            for name in TOKENIZER_FILES:
                shutil.copyfile(tokenizer_dir / name, staging / name)
            layout = onnx.layout
            manifest = EngineManifest(
                backend=BACKEND,
                backend_version=ort.__version__,
                precision=graph.precision,
                target="cpu",
                opset=onnx.opset,
                engine_file=ENGINE_FILE,
                engine_sha256=file_sha256(staging / ENGINE_FILE),
                inputs=layout.input_names,
                outputs=layout.output_names,
                num_layers=layout.num_layers,
                num_heads=layout.num_heads,
                head_dim=layout.head_dim,
                vocab_size=layout.vocab_size,
                max_positions=layout.max_positions,
                eos_token_id=eos_id(tokenizer_dir),
                profiles=profiles_from_params(params.profiles),
                lineage=lineage,
                parity=ParityRecord(**vars(onnx.parity)),
            )
            write_manifest(staging, manifest)
    return load_engine_dir(target)


def eos_id(tokenizer_dir: Path) -> int:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    return eos if eos is not None else tokenizer.get_vocab_size() - 1


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
            from kiln.errors import BuildError

            raise BuildError(f"ONNX Runtime cannot load {engine_dir.engine_file}: {err}") from err

    def forward(self, input_ids, attention_mask, position_ids, cache):
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        feeds |= dict(zip(self.manifest.past_names, cache))
        logits, *present = self.session.run(None, feeds)
        return logits, present
