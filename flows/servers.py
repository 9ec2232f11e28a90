"""`kiln up`: the MLflow UI on the project's store and a Prefect server (and with
--monitoring a Prometheus scraping `kiln serve`), until Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
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
            # One person's UI on their own machine: MLflow's default four workers each
            # import mlflow (7–20 s of CPU apiece), which on 2 cores held the UI back ~40 s.
            "--workers", "1",
        ],
        "prefect": [str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
    }


def serve_uis(
    root: Path, params: Params, mlflow_port: int, prefect_port: int, serve_port: int | None = None, prometheus_port: int | None = None
) -> None:
    """`serve_port`: where `kiln serve` will listen (default serving.port), which the
    MLflow server's webhook is sent to and Prometheus (where `prometheus_port` is given)
    scrapes."""
    from flows.monitoring import DASHBOARD_FILE, prometheus_command

    console = Console(soft_wrap=True)  # addresses and commands to copy whole, whatever the width
    serve_port = serve_port or params.serving.port
    commands = server_commands(root, params, mlflow_port, prefect_port)
    if prometheus_port is not None:
        commands["prometheus"] = prometheus_command(root, params, prometheus_port, serve_port)
    registry_target(params.registry, root).artifact_root.mkdir(parents=True, exist_ok=True)
    # A TERM (from a supervisor, or `timeout`) must still stop both servers below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    environments = {"mlflow": os.environ | webhook_environment(root)}
    processes = {
        name: subprocess.Popen(command, cwd=root, env=environments.get(name, os.environ.copy()), start_new_session=True)
        for name, command in commands.items()
    }
    console.print(f"MLflow UI  http://127.0.0.1:{mlflow_port}   (models → {params.registry.model_name})")
    console.print(f"Prefect UI http://127.0.0.1:{prefect_port}")
    if prometheus_port is not None:
        console.print(f"Prometheus http://127.0.0.1:{prometheus_port}   (scrapes kiln serve on port {serve_port}; rules .kiln/monitoring/rules.yml)")
        console.print(f"Grafana: import {root / DASHBOARD_FILE} (Dashboards → New → Import) with this Prometheus as its data source")
    try:
        hook = register_serving_webhook(root, params, f"http://127.0.0.1:{mlflow_port}", processes["mlflow"], serve_port)
        console.print(f"alias changes made in the MLflow UI → {hook} (kiln serve)")
        console.print(next_steps(mlflow_port, prefect_port, serve_port, params.serving.port), highlight=False)
        console.print("Ctrl-C stops them all.")
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


def webhook_environment(root: Path) -> dict[str, str]:
    """What `mlflow server` needs to deliver registry webhooks to a local `kiln serve`
    (MLflow 3 refuses them otherwise): http and private addresses allowed, a kept key for the stored secrets, and
    a short cache so that a new webhook takes effect within seconds."""
    from flows.serving import mlflow_encryption_key

    return {
        "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
        "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
        "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY": mlflow_encryption_key(root),
        "MLFLOW_WEBHOOK_CACHE_TTL": "5",
    }


def next_steps(mlflow_port: int, prefect_port: int, serve_port: int, default_serve_port: int) -> str:
    """What another shell of the project needs to use these servers: Prefect's address for
    `kiln deploy`, `kiln data add` and `kiln worker` (without it each would start a
    temporary server of its own and announce to nobody), and the flags whose defaults
    these ports are not."""
    mlflow_flag = "" if mlflow_port == 5000 else f" --mlflow-url http://127.0.0.1:{mlflow_port}"
    port_flag = "" if serve_port == default_serve_port else f" --port {serve_port}"
    lines = {
        f"export PREFECT_API_URL=http://127.0.0.1:{prefect_port}/api": "kiln deploy, kiln data add and kiln worker reach Prefect here",
        f"kiln serve{port_flag}": "serves @champion and hears the alias changes above",
        f"kiln deploy{mlflow_flag}": "rebuilds on schedule and data changes, verifies promotions",
    }
    width = max(map(len, lines))
    return "\n".join(["in another shell of this project:", *(f"  {line.ljust(width)}  # {why}" for line, why in lines.items())])


def register_serving_webhook(root: Path, params: Params, mlflow_url: str, process: subprocess.Popen, serve_port: int, timeout_s: float = 120) -> str:
    """Once the MLflow server answers, have it POST alias changes to `kiln serve`'s
    /hooks/mlflow on `serve_port`, signed with the project's webhook secret."""
    from flows.serving import ensure_webhook_secret
    from registry import RegistryTarget, register_alias_webhook

    deadline = time.monotonic() + timeout_s
    while not answers(f"{mlflow_url}/health"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise KilnError(f"the MLflow server at {mlflow_url} did not start; see its output above")
        time.sleep(0.5)
    hook = f"http://{reachable_host(params.serving.host)}:{serve_port}/hooks/mlflow"
    target = RegistryTarget(mlflow_url, params.registry.model_name, params.registry.experiment)
    register_alias_webhook(target, hook, ensure_webhook_secret(root))
    return hook


def answers(url: str, timeout_s: float = 3.0) -> bool:
    """Whether a server's health URL answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def reachable_host(host: str) -> str:
    """Where a local client reaches a server bound to `host`: loopback for one listening everywhere."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
