"""Trigger latencies of `kiln deploy`: event → run started, as a table.

Run against a project whose `kiln up` and `kiln deploy` are running (PREFECT_API_URL set):

    python benchmarks/trigger_latency.py --model kiln-gpt2 --mlflow http://127.0.0.1:5000 --version 1

Each probe emits one `kiln.data.changed` event (a probe payload: the rebuild it starts
reuses every cached stage) and waits for the rebuild to start; with --version, it also sets
`champion` to that version through the MLflow server (as the UI does) and waits for
verify-promotion. Probes are spaced so that no rebuild is still running when the next
event arrives (otherwise the event would wait in the queue, which is not trigger latency).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import datetime

import httpx
from rich.console import Console
from rich.table import Table

from flows.events import DATA_CHANGED, announce, data_resource


def runs(api: str, flow: str) -> list[dict]:
    body = {"flows": {"name": {"any_": [flow]}}, "sort": "EXPECTED_START_TIME_ASC"}
    return httpx.post(f"{api}/flow_runs/filter", json=body, timeout=10).json()


def started_after(api: str, flow: str, marker: str, key: str, timeout_s: float = 300) -> dict:
    """The run of `flow` whose parameter `key` contains `marker`, once it has started."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for run in runs(api, flow):
            if marker in str(run["parameters"].get(key, "")) and run["start_time"]:
                return run
        time.sleep(0.1)
    raise TimeoutError(f"no {flow} run with {marker} started within {timeout_s} s")


def finished(api: str, run_id: str) -> None:
    while httpx.get(f"{api}/flow_runs/{run_id}", timeout=10).json()["state_type"] not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
        time.sleep(0.5)


def seconds(start: float, stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() - start


def data_probe(api: str, model: str, index: int) -> dict[str, float]:
    marker = f"latency-probe-{os.getpid()}-{index}"
    sent = time.time()
    announce(DATA_CHANGED, data_resource(model), {"md5": marker, "previous": None, "how": "latency probe"}, api_url=api)
    request = started_after(api, "request-rebuild", marker, "reason")
    rebuild = started_after(api, "rebuild", marker, "reason")
    finished(api, rebuild["id"])
    return {"request-rebuild started": seconds(sent, request["start_time"]), "rebuild started": seconds(sent, rebuild["start_time"])}


def alias_probe(api: str, mlflow: str, model: str, version: str) -> dict[str, float]:
    before = len(runs(api, "verify-promotion"))
    sent = time.time()
    httpx.post(f"{mlflow}/api/2.0/mlflow/registered-models/alias", json={"name": model, "alias": "champion", "version": version}, timeout=10).raise_for_status()
    deadline = time.monotonic() + 300
    while len(found := runs(api, "verify-promotion")) <= before or not found[-1]["start_time"]:
        if time.monotonic() > deadline:
            raise TimeoutError("verify-promotion did not start within 300 s")
        time.sleep(0.1)
    finished(api, found[-1]["id"])
    return {"verify-promotion started": seconds(sent, found[-1]["start_time"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--probes", type=int, default=5)
    parser.add_argument("--mlflow")
    parser.add_argument("--version")
    args = parser.parse_args()
    api = os.environ["PREFECT_API_URL"]
    samples: dict[str, list[float]] = {}
    for index in range(args.probes):
        probe = data_probe(api, args.model, index)
        if args.version:
            probe |= alias_probe(api, args.mlflow, args.model, args.version)
        for name, value in probe.items():
            samples.setdefault(name, []).append(value)
    table = Table(title=f"trigger latency, {args.probes} probes (event sent → run started, seconds)")
    for column in ("path", "median", "min", "max"):
        table.add_column(column, justify="left" if column == "path" else "right")
    paths = {"request-rebuild started": "kiln.data.changed → request-rebuild", "rebuild started": "kiln.data.changed → rebuild",
             "verify-promotion started": "alias set in MLflow → verify-promotion"}  # fmt: skip
    for name, values in samples.items():
        table.add_row(paths[name], f"{statistics.median(values):.2f}", f"{min(values):.2f}", f"{max(values):.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
