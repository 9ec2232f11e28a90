"""`kiln export triton`: a registered version as a Triton Inference Server model repository.

The version is pulled through the serving loader (every check `kiln serve` makes: gates,
signature, sha256) and written as `<repository>/<model>/<version>/` (the registry's version
number is Triton's: re-exporting a newer version beside an older one is a rolling upgrade
under Triton's version policy) with the engine directory, `model.py` (serving/triton_model.py)
and the version's identity, and `<model>/config.pbtxt` for every version present.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from components.errors import KilnError
from registry import RegistryTarget, VersionInfo, tags
from serving import loader

IDENTITY_FILE = "kiln_version.json"
ENGINE_DIR = "engine"
# Triton's generate extension: the inputs a request may carry (all but text_input optional).
INPUTS = [("text_input", "TYPE_STRING"), ("max_tokens", "TYPE_INT32"), ("temperature", "TYPE_FP32"), ("top_p", "TYPE_FP32"), ("seed", "TYPE_UINT64"), ("stream", "TYPE_BOOL"), ("ignore_eos", "TYPE_BOOL")]
OUTPUTS = [("text_output", "TYPE_STRING"), ("finish_reason", "TYPE_STRING")]


@dataclass(frozen=True)
class TritonExport:
    model: str
    version: str
    path: Path  # the version's folder in the repository
    versions: list[str]  # every version the model's folder now holds


def export_version(target: RegistryTarget, info: VersionInfo, repository: Path, threads: int | None, max_waiting: int, instances: int) -> TritonExport:
    """Write `info` into the repository, refusing a version the loader refuses."""
    model_dir = repository / target.model_name
    destination = model_dir / info.version
    if destination.exists():
        raise KilnError(f"{destination} exists: Triton's version folders are immutable; export another version, or delete it first")
    with tempfile.TemporaryDirectory(prefix="kiln-triton-") as scratch:
        pulled = loader.pull(info, target, Path(scratch))
        staging = model_dir / f".{info.version}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(pulled.engine_dir.path, staging / ENGINE_DIR)
        (staging / "model.py").write_text(_model_source())
        (staging / IDENTITY_FILE).write_text(json.dumps(_identity(info, pulled), indent=2) + "\n")
        staging.rename(destination)  # a half-written version never appears
    versions = sorted((p.name for p in model_dir.iterdir() if p.name.isdigit()), key=int)
    (model_dir / "config.pbtxt").write_text(model_config(target.model_name, [json.loads((model_dir / v / IDENTITY_FILE).read_text()) for v in versions], threads, max_waiting, instances))
    return TritonExport(target.model_name, info.version, destination, versions)


def _identity(info: VersionInfo, pulled: loader.PulledVersion) -> dict[str, str]:
    manifest = pulled.engine_dir.manifest
    return {
        "model": info.name, "version": info.version, tags.ENGINE_SHA256: info.tags[tags.ENGINE_SHA256],
        tags.PRECISION: manifest.precision, tags.BACKEND: manifest.backend, tags.TARGET: manifest.target,
        tags.SIGNING_KEY: pulled.signed_by or "unsigned", "exported_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }  # fmt: skip


def _model_source() -> str:
    import serving

    return (Path(serving.__file__).parent / "triton_model.py").read_text()  # not imported: Triton's own module is absent here


def model_config(name: str, identities: list[dict], threads: int | None, max_waiting: int, instances: int) -> str:
    """config.pbtxt: a decoupled Python-backend model with the generate extension's tensors,
    on the CPU or the GPU as the newest version's engine runs, its identities as parameters."""
    newest = identities[-1]
    kind = "KIND_CPU" if newest[tags.TARGET] == "cpu" else "KIND_GPU"
    parameters = {"kiln.threads": str(threads or 1), "kiln.max_waiting": str(max_waiting)}
    for identity in identities:
        for key in (tags.ENGINE_SHA256, tags.PRECISION, tags.BACKEND, tags.SIGNING_KEY):
            parameters[f"kiln.{identity['version']}.{key}"] = identity[key]
    lines = [
        f'name: "{name}"', 'backend: "python"', "max_batch_size: 0",
        "model_transaction_policy { decoupled: true }",
        "version_policy { latest { num_versions: 1 } }",
        "input [", ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ 1 ]{"" if n == "text_input" else " optional: true"} }}' for n, t in INPUTS), "]",
        "output [", ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ -1 ] }}' for n, t in OUTPUTS), "]",
        f"instance_group [ {{ kind: {kind} count: {instances} }} ]",
        *(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in parameters.items()),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"
