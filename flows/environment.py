"""Process environment for a kiln command, set at the entry point before heavy imports.

Run state stays in the project, not the user's home: Prefect, Hugging Face, matplotlib,
ONNX Runtime and the telemetry ids of DVC and MLflow all write under `.kiln/` instead.
The test suite uses the same variables, pointed at its own temporary state folder.
"""

from __future__ import annotations

import getpass
import os
import socket
from pathlib import Path

from components.workspace import Workspace


def kiln_environment(state: Path) -> dict[str, str]:
    """The variables every kiln process runs with, for a state folder (a project's `.kiln/`)."""
    return {
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # avoids a harmless "database is locked" log
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",  # a busy 2-core machine needs it
        # A rebuild queued behind a running one retries for its slot this often (default 30 s).
        "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "5",
        "HF_HOME": str(state / "huggingface"),
        "XDG_CACHE_HOME": str(state / "cache"),
        "XDG_CONFIG_HOME": str(state / "config"),
        "MPLCONFIGDIR": str(state / "config" / "matplotlib"),
        "TOKENIZERS_PARALLELISM": "false",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "DO_NOT_TRACK": "true",  # mlflow reads "true", not "1"
        "MLFLOW_DISABLE_TELEMETRY": "true",
        # `mlflow server` otherwise starts its job runners (huey consumers: four processes,
        # ~1 GB together) for features kiln does not use.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "DVC_NO_ANALYTICS": "1",
    }


def prepare_environment(root: Path) -> None:
    """Set kiln's variables for the project at `root`, keeping any the user already set."""
    for name, value in kiln_environment(Workspace(root).state).items():
        os.environ.setdefault(name, value)
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # prefect makes only the leaf


def person() -> str:
    """Who is acting (`user@host`), as alias moves and verifications record it."""
    return f"{getpass.getuser()}@{socket.gethostname()}"
