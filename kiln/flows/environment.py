"""Process environment for a kiln command, set at the entry point before heavy imports.

Run state stays in the project, not the user's home: Prefect, Hugging Face, matplotlib,
ONNX Runtime and the telemetry ids of DVC and MLflow all write under `.kiln/` instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from kiln.workspace import Workspace


def prepare_environment(root: Path) -> None:
    state = Workspace(root)
    defaults = {
        "PREFECT_HOME": state.prefect_home,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "HF_HOME": state.hf_home,
        "XDG_CACHE_HOME": state.state / "cache",
        "XDG_CONFIG_HOME": state.state / "config",
        "MPLCONFIGDIR": state.state / "config" / "matplotlib",
        "TOKENIZERS_PARALLELISM": "false",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "DO_NOT_TRACK": "true",  # mlflow reads "true", not "1"
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DVC_NO_ANALYTICS": "1",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, str(value))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # prefect makes only the leaf
