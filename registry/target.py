"""Which registry a project uses: the tracking URI in params.yaml, or the embedded store.

The embedded store is MLflow's SQLite database and a local artifact folder under
`mlruns/` in the project; this module is the one place that knows that layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from registry.records import RegistryTarget

EMBEDDED_STORE = "mlruns"


class RegistrySettings(Protocol):
    """The `registry` section of params.yaml (components.config.RegistryParams), as the
    registry reads it: the registry depends on no config module."""

    @property
    def tracking_uri(self) -> str | None: ...

    @property
    def model_name(self) -> str: ...

    @property
    def experiment(self) -> str: ...


def registry_target(settings: RegistrySettings, project_root: Path) -> RegistryTarget:
    """The configured tracking URI, or the embedded SQLite store under the project's mlruns/.
    A SQLite store, embedded or named, keeps its artifacts in `artifacts/` beside it."""
    uri = settings.tracking_uri or f"sqlite:///{project_root / EMBEDDED_STORE / 'mlflow.db'}"
    if not uri.startswith("sqlite:///"):
        return RegistryTarget(uri, settings.model_name, settings.experiment)  # the server decides
    artifacts = Path(uri.removeprefix("sqlite:///")).parent / "artifacts"
    return RegistryTarget(uri, settings.model_name, settings.experiment, artifacts)


def is_embedded(target: RegistryTarget) -> bool:
    return target.tracking_uri.startswith("sqlite:///")
