"""Where kiln keeps things inside a project folder. Nothing here touches the disk."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Workspace:
    """A project root (the folder holding params.yaml, data.dvc and .dvc/) and its run state.

    Run state stays inside the project and is ignored by git: `.kiln/` holds stage outputs
    and Prefect's home, `mlruns/` the embedded MLflow store.
    """

    root: Path

    @property
    def state(self) -> Path:
        return self.root / ".kiln"

    def stage_dir(self, stage: str) -> Path:
        return self.state / "stages" / stage

    @property
    def prefect_home(self) -> Path:
        return self.state / "prefect"

    @property
    def hf_home(self) -> Path:
        return self.state / "huggingface"

    @property
    def mlruns(self) -> Path:
        return self.root / "mlruns"

    @property
    def embedded_tracking_uri(self) -> str:
        return f"sqlite:///{self.mlruns / 'mlflow.db'}"

    @property
    def artifact_root(self) -> Path:
        return self.mlruns / "artifacts"

    def resolve(self, path: str | Path) -> Path:
        """A path from params.yaml: relative ones are relative to the project root."""
        path = Path(path).expanduser()
        return path if path.is_absolute() else self.root / path
