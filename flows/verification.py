"""`verify-promotion`: when an alias is set in MLflow, the promoted version is checked again
on this machine and the evidence lands on the version as `verification.*` tags.

The checks: the version downloads and its engine file matches its `engine_sha256` tag; its
`gates.passed` tag is true (or a person forced it with a recorded reason); it loads with
this machine's runtime; and the quality gate, run again here against the PyTorch model it
was built from, passes its limits. The serving loader refuses a bad version on its own;
this records why, where a person looks (the version page).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from components.config import Params
from components.data import dvc_md5, split_texts
from components.errors import KilnError
from components.gates import GateResult, quality_gate_against
from components.model_dir import model_from_directory
from components.runtime.availability import machine_description
from flows.environment import person
from registry import RegistryTarget, tag_version, tags
from serving import loader


@dataclass(frozen=True)
class Verification:
    """What was checked for one version, here and now."""

    version: str
    passed: bool
    failure: str | None = None  # the first check that failed, in words
    quality: GateResult | None = None
    data_md5: str | None = None  # the data version whose eval split the quality gate used
    notes: tuple[str, ...] = field(default=())
    machine: str | None = None  # where the quality gate ran (int8 kernels differ across CPUs)

    def tags(self, alias: str, run: str | None) -> dict[str, str]:
        checks = {
            "passed": tags.flag(self.passed),
            "alias": alias,
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
            "by": person(),
        }
        if run:
            checks["flow_run"] = run
        if self.failure:
            checks["failure"] = self.failure[:4000]  # MLflow's tag value limit is 8000
        if self.data_md5:
            checks[tags.DATA_MD5] = self.data_md5
        if self.notes:
            checks["notes"] = "; ".join(self.notes)[:4000]
        if self.machine:
            checks["measured_on"] = self.machine
        if self.quality is not None:
            checks.update({f"quality.{name}": f"{value:.6g}" for name, value in self.quality.measured.items()})
        return {tags.verification(key): value for key, value in checks.items()}


def verify_version(target: RegistryTarget, version: str, params: Params, root: Path) -> Verification:
    """Every check, in order; the first failure ends the verification and is named. The
    version is downloaded afresh (not taken from the serving cache), so what is checked
    is what the registry holds now."""
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as scratch:
        try:
            pulled = loader.pull_version(target, version, Path(scratch))  # sha256 + gates tags
            engine = loader.load(pulled, params.serving.threads)  # runs on this machine's runtime
        except KilnError as err:
            return Verification(version, False, str(err))
        with engine:
            return _quality_here(version, engine, pulled.engine_dir.manifest.lineage, params, root)


def _quality_here(version: str, engine, lineage, params: Params, root: Path) -> Verification:
    """The quality gate against the model the engine was built from, on the project's data."""
    try:
        model = model_from_directory(Path(lineage.source_model_path))
    except KilnError as err:
        return Verification(version, False, f"the model it was built from is not readable on this machine: {err}")
    if model.sha256 != lineage.source_model_sha256:
        return Verification(
            version, False, f"the model at {model.path} has sha256 {model.sha256[:12]}…, the engine was built from {lineage.source_model_sha256[:12]}…"
        )
    data_dir = root / params.data.path
    data_md5 = dvc_md5(data_dir.with_suffix(".dvc"))
    notes = () if data_md5 == lineage.data_md5 else (f"gated on data {lineage.data_md5[:12]}…, verified on the project's current data {data_md5[:12]}…",)
    quality = quality_gate_against(engine, model.path, split_texts(data_dir, "eval"), params.gates.quality, params.gates.confidence)
    failure = None if quality.passed else "quality gate failed here: " + "; ".join(quality.failures())
    return Verification(version, quality.passed, failure, quality, data_md5, notes, machine_description(engine.manifest.target))


def record_verification(target: RegistryTarget, verification: Verification, alias: str, run: str | None) -> None:
    tag_version(target, verification.version, verification.tags(alias, run))
