"""A kiln server on a real socket (uvicorn in a thread of the test process), so clients —
the `openai` package, httpx, MLflow's webhook delivery — reach it over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    def __init__(self, app, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self._server.run()
        except SystemExit:  # uvicorn's answer to a failed startup; __enter__ reports it
            pass

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server did not start: {getattr(self.app.state, 'startup_error', None)}")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start within 60 s")
            time.sleep(0.05)
        return self

    def __exit__(self, *_exc) -> None:
        self._server.should_exit = True
        self._thread.join(30)

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)


@contextmanager
def mlflow_server(tracking_uri: str, artifact_root: Path) -> Iterator[str]:
    """`mlflow server` on a store, set up to deliver webhooks to a local receiver (flows.servers.webhook_environment);
    yields its URL once /health answers.

    One worker: MLflow's default four each import mlflow (7–20 s of CPU apiece here), which
    on a 2-core CI machine running two test workers took the start past a minute. Its output
    goes to a log beside the store, whose tail a failed start reports."""
    from cryptography.fernet import Fernet

    port = free_port()
    env = os.environ | {
        "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
        "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
        "MLFLOW_WEBHOOK_CACHE_TTL": "1",
        "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY": Fernet.generate_key().decode(),
    }
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", tracking_uri,
               "--default-artifact-root", str(artifact_root), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]  # fmt: skip
    with server_process("mlflow server", command, artifact_root.parent / f"mlflow-server-{port}.log", f"http://127.0.0.1:{port}", "/health", 180, env) as url:
        yield url


@contextmanager
def prometheus(root: Path, params, serve_port: int) -> Iterator[str]:
    """Debian's Prometheus as `kiln up --monitoring` runs it (kiln's config and rules for
    `params`), scraping a kiln serve on `serve_port`; yields its URL once it is ready."""
    from flows.monitoring import prometheus_command

    port = free_port()
    with server_process("prometheus", prometheus_command(root, params, port, serve_port), root / f"prometheus-{port}.log", f"http://127.0.0.1:{port}", "/-/ready", 60) as url:
        yield url


@contextmanager
def server_process(name: str, command: list[str], log_path: Path, url: str, ready_path: str, timeout_s: float, env: dict | None = None) -> Iterator[str]:
    """A server started as a process of its own (output in `log_path`), yielding `url` once
    `ready_path` answers 200; a failed start reports the log's tail. Terminated at the end."""
    with log_path.open("w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: answers(f"{url}{ready_path}") or process.poll() is not None, timeout_s, f"{name} answering {ready_path}", log_path)
        assert process.poll() is None, f"{name} exited with {process.returncode}:\n{log_path.read_text()[-4000:]}"
        yield url
    finally:
        process.terminate()
        process.wait(30)


KILN = str(Path(sys.executable).parent / "kiln")
READY = "Ctrl-C stops them all"  # kiln up's last line once every server answers


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def kiln_up(root: Path, *flags: str, prometheus: bool = False) -> Iterator[SimpleNamespace]:
    """`kiln up` in a project, as a user starts it: its servers must answer (Prometheus too
    with `prometheus`: `--monitoring`); yields their URLs and an environment whose kiln verbs
    talk to its Prefect server (so no run starts a temporary one); SIGTERM on the way out
    must stop them all."""
    mlflow_port, prefect_port, prometheus_port = free_port(), free_port(), free_port()
    monitoring = ["--monitoring", "--prometheus-port", str(prometheus_port)] if prometheus else []
    log = (root / "kiln-up.log").open("w")  # a file, not a pipe nobody reads: the servers are chatty
    up = subprocess.Popen(
        [KILN, "up", "--mlflow-port", str(mlflow_port), "--prefect-port", str(prefect_port), *monitoring, *flags],
        cwd=root, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    health = {"mlflow": f"http://127.0.0.1:{mlflow_port}/health", "prefect": f"http://127.0.0.1:{prefect_port}/api/health"}
    if prometheus:
        health["prometheus"] = f"http://127.0.0.1:{prometheus_port}/-/ready"
    deadline = time.monotonic() + 120
    while not all(map(answers, health.values())) and time.monotonic() < deadline and up.poll() is None:
        time.sleep(0.5)
    # Ready when it says so: the webhook to kiln serve is registered after MLflow answers.
    while READY not in (root / "kiln-up.log").read_text() and time.monotonic() < deadline and up.poll() is None:
        time.sleep(0.5)
    if not all(map(answers, health.values())) or READY not in (root / "kiln-up.log").read_text():
        up.kill()
        raise RuntimeError(f"kiln up did not bring its servers up (exit {up.wait()}): {(root / 'kiln-up.log').read_text()[-3000:]}")
    env = os.environ | {"PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api"}
    yield SimpleNamespace(
        root=root, env=env, mlflow=f"http://127.0.0.1:{mlflow_port}", prefect=f"http://127.0.0.1:{prefect_port}",
        prometheus=f"http://127.0.0.1:{prometheus_port}" if prometheus else None,
    )  # fmt: skip

    up.send_signal(signal.SIGTERM)
    assert up.wait(timeout=60) == 143
    time.sleep(1)
    assert not any(map(answers, health.values())), "a server outlived kiln up's SIGTERM"


def postgres_bin() -> Path | None:
    """Debian's PostgreSQL programs (`apt-get install postgresql`), if installed."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


@contextmanager
def postgres_server() -> Iterator[str]:
    """A throwaway PostgreSQL cluster (trust auth, loopback only) with a database `mlflow`;
    yields its SQLAlchemy URI. PostgreSQL refuses to run as root, so as root the cluster
    runs as Debian's `postgres` user, in a folder of its own under /tmp (pytest's folders
    are closed to other users)."""
    import pwd
    import shutil
    import tempfile

    bin_dir = postgres_bin()
    assert bin_dir is not None, "PostgreSQL is not installed"
    directory = Path(tempfile.mkdtemp(prefix="kiln-postgres-"))
    run_as: list[str] = []
    if os.geteuid() == 0:
        account = pwd.getpwnam("postgres")
        shutil.chown(directory, account.pw_uid, account.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    data, port = directory / "data", free_port()

    def pg(*command: str) -> None:
        done = subprocess.run([*run_as, *command], capture_output=True, text=True, cwd=directory)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(command[0]).name} failed: {done.stderr.strip()[-2000:]}")

    pg(str(bin_dir / "initdb"), "-D", str(data), "-U", "kiln", "--auth=trust", "-E", "UTF8")
    options = f"-p {port} -k {directory} -c listen_addresses=127.0.0.1"
    pg(str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(directory / "postgres.log"), "-w", "start")
    try:
        pg(str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "kiln", "mlflow")
        yield f"postgresql://kiln@127.0.0.1:{port}/mlflow"
    finally:
        pg(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(directory, ignore_errors=True)


def prefect_api(method: str, url: str, **kwargs) -> httpx.Response:
    """A request to a Prefect server's REST API that, like Prefect's own client, retries a
    503: the server's answer to a busy SQLite database (a write from a worker, a flow run
    or the event pipeline in the same instant), which a loaded CI machine meets."""
    for attempt in range(10):
        response = httpx.request(method, url, timeout=10, **kwargs)
        if response.status_code != 503:
            return response
        time.sleep(0.5 * (attempt + 1))
    return response


def flow_runs(prefect: str, flow: str) -> list[dict]:
    """A flow's runs on a Prefect server (its REST API), oldest first."""
    body = {"flows": {"name": {"any_": [flow]}}, "sort": "EXPECTED_START_TIME_ASC"}
    answer = prefect_api("POST", f"{prefect}/api/flow_runs/filter", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def wait_for(condition, timeout_s: float, what: str, log: Path | None = None, every_s: float = 0.5, stacks_of: subprocess.Popen | None = None):
    """`condition()`'s first truthy value; fails naming `what`, with the log's tail, on timeout.
    With `stacks_of` (a kiln process writing to `log`), the tail holds its threads' stacks
    (kiln prints them on SIGUSR1), so a hang says where it waits."""
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        if time.monotonic() > deadline:
            if stacks_of is not None and stacks_of.poll() is None:
                stacks_of.send_signal(signal.SIGUSR1)
                time.sleep(1)
            tail = log.read_text()[-12000 if stacks_of else -4000 :] if log else ""
            raise AssertionError(f"{what} did not happen within {timeout_s:.0f} s\n{tail}")
        time.sleep(every_s)
    return found
