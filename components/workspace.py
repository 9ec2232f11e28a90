"""Where kiln keeps things inside a project folder. Nothing here touches the disk."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Workspace:
    """A project root (the folder holding params.yaml, data.dvc and .dvc/) and its run state.

    Run state stays inside the project and is ignored by git: `.kiln/` holds stage outputs,
    the serving cache and the libraries' homes (flows.environment); the embedded MLflow
    store under `mlruns/` is the registry's (registry.target).
    """

    root: Path

    @property
    def state(self) -> Path:
        return self.root / ".kiln"

    def stage_dir(self, stage: str) -> Path:
        return self.state / "stages" / stage

    @property
    def serving_cache(self) -> Path:
        return self.state / "serving"
