"""The registry's vocabulary as plain values: where the registry is, what a registration
logs, and what a version is. Callers build these; only `registry.store` talks to MLflow."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Signing:
    """Who signs what a project registers, and whose signatures its consumers accept
    (registry.signing does both)."""

    key: Path | None = None  # the private key (PEM) registrations are signed with
    trusted: tuple[Path, ...] = ()  # public keys (PEM) whose signatures are accepted
    required: bool = True  # False: unsigned versions load, with a warning (migration)


@dataclass(frozen=True)
class RegistryTarget:
    tracking_uri: str
    model_name: str
    experiment: str
    # Where a new experiment keeps artifacts (the embedded store's local folder); None lets
    # the tracking server decide.
    artifact_root: Path | None = None
    signing: Signing = Signing()


@dataclass(frozen=True)
class DatasetRecord:
    """A dataset the run consumed, logged as an MLflow dataset input."""

    name: str
    digest: str
    source: str
    context: str  # "training", "calibration", ...
    profile: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RunRecord:
    """What one registration logs to its MLflow run besides the engine itself."""

    params: dict[str, str]
    metrics: dict[str, float]
    version_tags: dict[str, str]
    description: str = ""  # markdown for the version page; the registry adds the run's link
    run_tags: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, Path] = field(default_factory=dict)  # artifact path → local dir or file
    step_metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    datasets: tuple[DatasetRecord, ...] = ()


@dataclass(frozen=True)
class Registration:
    name: str
    version: str
    run_id: str | None
    created: bool
    aliases: tuple[str, ...]
    # The version's own `gates.passed`: where the engine was registered before (`created`
    # False), its first record stands, whatever this run measured.
    gates_passed: bool = True


@dataclass(frozen=True)
class VersionInfo:
    name: str
    version: str
    tags: dict[str, str]
    aliases: tuple[str, ...]
    run_id: str | None


@dataclass(frozen=True)
class RunLink:
    """An MLflow run, and where the UI shows it."""

    run_id: str
    experiment_id: str

    @property
    def ui_fragment(self) -> str:
        """A fragment link for markdown in the UI (it works wherever the UI is served)."""
        return f"#/experiments/{self.experiment_id}/runs/{self.run_id}"
