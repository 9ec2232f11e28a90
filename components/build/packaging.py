"""What goes into an engine directory whichever backend made the engine file: the
tokenizer, the optimization profiles, and `engine.json`."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from components.config import ProfileParams
from components.engine_dir import (
    CHAT_TEMPLATE,
    MANIFEST,
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
from components.files import file_sha256, stage_output
from components.model_dir import chat_template_of, eos_token_ids
from components.onnx_files import data_file, has_external_data, onnx_sha256
from components.precision import PrecisionOnnx

# Part of the output folder's name and of the Prefect cache key (flows.caching): bump it when
# this stage's code changes what it makes, and only this stage and those after it rebuild.
STAGE_VERSION = "5"  # 2: torch-cuda programs without stack traces; 3: the chat template; 4: ONNX Runtime attention fused; 5: q, k, v packed, linear layers unflattened, RMSNorm and rotary as single nodes


@dataclass(frozen=True)
class BackendBuild:
    """Who made the engine file, for which target."""

    backend: str
    version: str
    target: str  # "cpu" or the GPU's compute capability, "sm_90"
    engine_file: str


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


def engine_folder(out_root: Path, build: BackendBuild, precision: str, *identity: str) -> Path:
    """Where an engine is packaged: named by backend, precision, target and what it was built from."""
    return out_root / "-".join((build.backend, precision, build.target, f"v{STAGE_VERSION}", *identity))


def package_engine(
    target: Path,
    write_engine_file,  # (path) -> dict | None: writes the backend's engine file there; what it returns goes into the manifest
    build: BackendBuild,
    graph: PrecisionOnnx,
    tokenizer_dir: Path,
    lineage: Lineage,
    profiles: ProfileParams,
) -> EngineDir:
    """The engine directory at `target`, made atomically unless it is already there."""

    def fill(staging: Path) -> None:
        described = write_engine_file(staging / build.engine_file) or {}
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / name, staging / name)
        described["chat_template_sha256"] = write_chat_template(staging, tokenizer_dir)
        write_manifest(staging, _manifest(staging, build, graph, tokenizer_dir, lineage, profiles).model_copy(update=described))

    return load_engine_dir(stage_output(target, MANIFEST, fill))


def _manifest(staging: Path, build: BackendBuild, graph: PrecisionOnnx, tokenizer_dir: Path, lineage: Lineage, profiles: ProfileParams) -> EngineManifest:
    layout = graph.onnx.layout
    return EngineManifest(
        backend=build.backend,
        backend_version=build.version,
        precision=graph.precision,
        target=build.target,
        opset=graph.onnx.opset,
        engine_file=build.engine_file,
        engine_data_file=data_file(staging / build.engine_file).name if has_external_data(staging / build.engine_file) else None,
        engine_sha256=onnx_sha256(staging / build.engine_file),
        inputs=layout.input_names,
        outputs=layout.output_names,
        num_layers=layout.num_layers,
        num_heads=layout.num_heads,
        head_dim=layout.head_dim,
        vocab_size=layout.vocab_size,
        max_positions=layout.max_positions,
        eos_token_id=eos_id(tokenizer_dir),
        profiles=profiles_from_params(profiles),
        lineage=lineage,
        parity=ParityRecord(**vars(graph.onnx.parity)),
        model_family=layout.family,
        num_kv_heads=layout.num_kv_heads,
        eos_token_ids=eos_token_ids(tokenizer_dir),
        parameter_count=layout.parameter_count,
    )


def eos_id(tokenizer_dir: Path) -> int:
    """The end-of-text id that also pads left-padded batches: GPT-2's `<|endoftext|>`, else
    the model's first end-of-sequence id, else the last id of the vocabulary."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    if eos is not None:
        return eos
    ids = eos_token_ids(tokenizer_dir)
    return ids[0] if ids else tokenizer.get_vocab_size() - 1


def write_chat_template(staging: Path, model_dir: Path) -> str | None:
    """Copy the model's chat template (if it has one) into an engine directory being made,
    as the one file the server renders; its sha256 for engine.json."""
    template = chat_template_of(model_dir)
    if template is None:
        return None
    (staging / CHAT_TEMPLATE).write_text(template)
    return file_sha256(staging / CHAT_TEMPLATE)
