"""The engine directory contract: engine file, tokenizer files and `engine.json`.

The serving side needs nothing but this folder; loading one checks it is what it says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from components.errors import EngineError
from components.files import file_sha256, text_sha256
from components.onnx_files import files_sha256

MANIFEST = "engine.json"
FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# The chat template the server renders, as transformers names the file (in a model
# directory it may instead live in tokenizer_config.json; an engine directory has it here).
CHAT_TEMPLATE = "chat_template.jinja"
# The graph input naming the positions (shared by every row) whose logits it computes: a
# prefill needs the last one only, scoring every one (components.export).
LOGITS_POSITIONS = "logits_positions"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DimRange(_Frozen):
    min: int
    opt: int
    max: int

    def admits(self, value: int) -> bool:
        return self.min <= value <= self.max


class ShapeProfile(_Frozen):
    """One optimization profile: ranges of batch, new tokens per call, and past length."""

    batch: DimRange
    sequence: DimRange
    past: DimRange


class Lineage(_Frozen):
    source_model_path: str
    source_model_sha256: str
    onnx_sha256: str  # the fp32 export
    # The graph the engine was built from; absent in engines made before precisions
    # existed, which were built from the fp32 export itself.
    precision_onnx_sha256: str | None = None
    data_md5: str
    calibration_digest: str | None = None


class ParityRecord(_Frozen):
    prefill_max_abs_diff: float
    decode_max_abs_diff: float
    tolerance: float
    layers: int | None = None  # the first layers alone, where the model in fp32 did not fit the export's machine


class EngineManifest(_Frozen):
    format_version: int = FORMAT_VERSION
    backend: str
    backend_version: str
    precision: str
    target: str
    opset: int | None = None  # the ONNX opset; None for a program that never was ONNX (torch-cuda)
    engine_file: str
    # The engine file's weights beside it (an ONNX graph's external data past protobuf's
    # 2 GB); None: all in engine_file. engine_sha256 covers both (components.onnx_files).
    engine_data_file: str | None = None
    engine_sha256: str
    inputs: list[str]
    outputs: list[str]
    num_layers: int
    num_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    eos_token_id: int  # also the padding of left-padded batches
    profiles: dict[str, ShapeProfile]
    lineage: Lineage
    parity: ParityRecord
    # What the engine file depends on beyond the backend's version (torch-cuda: torch, CUDA, GPU).
    runtime: dict[str, str] = {}
    # Defaults describe engines made before other families than GPT-2 were built.
    model_family: str = "gpt2"
    num_kv_heads: int | None = None  # fewer than num_heads: grouped-query attention; None: num_heads
    eos_token_ids: list[int] = []  # every id that ends generation (Llama 3 has several); []: eos_token_id
    parameter_count: int | None = None
    chat_template_sha256: str | None = None  # of CHAT_TEMPLATE; None: the model has no chat template
    # The graph appends to its cache in place where past and present share a buffer
    # (components.build.ort_attention); False: every call returns a grown copy.
    kv_in_place: bool = False

    @cached_property
    def kv_heads(self) -> int:
        """Heads of the KV cache, (batch, kv_heads, past, head_dim) per tensor."""
        return self.num_kv_heads or self.num_heads

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """One sequence's KV cache per token: keys and values of every layer. fp32 but in the
        torch-cuda program of a 16-bit precision or fp8, whose cache is bf16 (ONNX graphs keep
        fp32 inputs and outputs)."""
        element = 2 if self.backend == "torch-cuda" and self.precision in ("fp16", "bf16", "fp8") else 4
        return 2 * self.num_layers * self.kv_heads * self.head_dim * element

    @cached_property
    def stop_ids(self) -> frozenset[int]:
        """The token ids that end a generation."""
        return frozenset(self.eos_token_ids or [self.eos_token_id])

    # Cached: the runtimes read both on every decode step, and the manifest is frozen.
    @cached_property
    def past_names(self) -> list[str]:
        return [name for name in self.inputs if name.startswith("past_key_values.")]

    @cached_property
    def takes_logits_positions(self) -> bool:
        """Whether the graph computes logits only where asked (components.export's
        LOGITS_POSITIONS); engines exported before it compute them everywhere."""
        return LOGITS_POSITIONS in self.inputs

    @property
    def profiles_sha256(self) -> str:
        """The shapes the engine accepts, as a digest: with `engine_sha256` it names an engine
        in the registry (an ONNX Runtime engine rebuilt with a larger batch profile has the
        same file but serves differently)."""
        return text_sha256(json.dumps({name: p.model_dump(mode="json") for name, p in self.profiles.items()}, sort_keys=True))


@dataclass(frozen=True)
class EngineDir:
    path: Path
    manifest: EngineManifest

    @property
    def engine_file(self) -> Path:
        return self.path / self.manifest.engine_file

    @property
    def engine_files(self) -> list[Path]:
        """The engine file, then its weights where they lie beside it: what engine_sha256 covers."""
        data = self.manifest.engine_data_file
        return [self.engine_file, *([self.path / data] if data else [])]

    @property
    def sha256(self) -> str:
        return self.manifest.engine_sha256

    @property
    def content_digest(self) -> str:
        return self.sha256

    @property
    def output_dir(self) -> Path:
        return self.path

    def is_intact(self) -> bool:
        """Still on disk and unchanged since it was made (a cached result may outlive its files)."""
        try:
            return load_engine_dir(self.path).sha256 == self.sha256
        except EngineError:
            return False


def write_manifest(path: Path, manifest: EngineManifest) -> None:
    (path / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")


def load_engine_dir(path: Path, files_verified: bool = False) -> EngineDir:
    """Read an engine directory and verify it: manifest valid, files present, sha256 matches.
    `files_verified`: a signature over every file of the directory was verified just now, so
    the engine files (gigabytes at size) are not read a second time to hash them."""
    if not (path / MANIFEST).is_file():
        raise EngineError(f"{path} is not an engine directory: no {MANIFEST}")
    try:
        manifest = EngineManifest.model_validate(json.loads((path / MANIFEST).read_text()))
    except (ValueError, ValidationError) as err:
        raise EngineError(f"{path / MANIFEST} is not a valid engine manifest: {err}".replace("\n", " ")) from err
    if manifest.format_version != FORMAT_VERSION:
        raise EngineError(f"{path}: engine format {manifest.format_version}, this kiln reads {FORMAT_VERSION}")
    engine = EngineDir(path=path, manifest=manifest)
    missing = [file.name for file in (*engine.engine_files, *(path / name for name in TOKENIZER_FILES)) if not file.is_file()]
    if missing:
        raise EngineError(f"engine directory {path} lacks {', '.join(missing)}")
    actual = manifest.engine_sha256 if files_verified else files_sha256(engine.engine_files)
    if actual != manifest.engine_sha256:
        what = "engine file " + " and ".join(str(f) for f in engine.engine_files)
        raise EngineError(f"{what} is corrupt: sha256 {actual[:12]}…, engine.json says {manifest.engine_sha256[:12]}…")
    _check_chat_template(path, manifest)
    return engine


def _check_chat_template(path: Path, manifest: EngineManifest) -> None:
    """The chat template is what the engine was built with, or absent as it was then."""
    template = path / CHAT_TEMPLATE
    if manifest.chat_template_sha256 is None:
        if template.exists():
            raise EngineError(f"engine directory {path} holds a {CHAT_TEMPLATE} that engine.json does not record")
        return
    if not template.is_file():
        raise EngineError(f"engine directory {path} lacks {CHAT_TEMPLATE} (engine.json records one)")
    actual = file_sha256(template)
    if actual != manifest.chat_template_sha256:
        raise EngineError(f"{template} has sha256 {actual[:12]}…, engine.json says {manifest.chat_template_sha256[:12]}…")
