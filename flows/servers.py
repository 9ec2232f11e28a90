"""`kiln up`: the MLflow UI on the project's store and a Prefect server, until Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from components.config import Params
from components.errors import KilnError
from registry import registry_target
from registry.target import is_embedded


def server_commands(root: Path, params: Params, mlflow_port: int, prefect_port: int) -> dict[str, list[str]]:
    target = registry_target(params.registry, root)
    if not is_embedded(target):
        raise KilnError(f"kiln up serves the embedded store; registry.tracking_uri is {target.tracking_uri}, open that instead")
    bin_dir = Path(sys.executable).parent
    return {
        "mlflow": [
            str(bin_dir / "mlflow"), "server",
            "--backend-store-uri", target.tracking_uri,
            "--default-artifact-root", str(target.artifact_root),
            "--host", "127.0.0.1", "--port", str(mlflow_port),
        ],
        "prefect": [str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
    }


def serve_uis(root: Path, params: Params, mlflow_port: int, prefect_port: int) -> None:
    console = Console()
    commands = server_commands(root, params, mlflow_port, prefect_port)
    registry_target(params.registry, root).artifact_root.mkdir(parents=True, exist_ok=True)
    # A TERM (from a supervisor, or `timeout`) must still stop both servers below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    processes = {
        name: subprocess.Popen(command, cwd=root, env=os.environ.copy(), start_new_session=True)
        for name, command in commands.items()
    }
    console.print(f"MLflow UI  http://127.0.0.1:{mlflow_port}   (models → {params.registry.model_name})")
    console.print(f"Prefect UI http://127.0.0.1:{prefect_port}")
    console.print("Ctrl-C stops both.")
    try:
        while all(p.poll() is None for p in processes.values()):
            time.sleep(1)
        dead = [name for name, p in processes.items() if p.poll() is not None]
        raise KilnError(f"the {', '.join(dead)} server exited; see its output above")
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes.values():
            process.wait(timeout=30)
