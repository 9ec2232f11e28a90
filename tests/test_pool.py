"""Beyond one machine, on one machine: MLflow on PostgreSQL with a shared artifact store, a
Prefect server, `kiln deploy --pool` and two `kiln worker`s, one per build target."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import yaml

from components.config import BuildTarget, PoolParams, PrecisionParams, RegistryParams, TriggerParams
from registry.signing import create_key, fingerprint

from .conftest import int8_registers, make_project, tiny_params, with_trained_model
from .live_server import KILN, answers, flow_runs, free_port, postgres_bin, postgres_server, prefect_api, wait_for

MODEL = "kiln-tiny"


def test_the_pools_challenger_is_the_fastest_version_of_the_model_and_data_that_passed_everything(registry_target, engine_dir, tmp_path):
    """Engines built on several machines meet only in the registry: the rebuild picks among
    this model's and data's versions, skipping failed gates and a failed champion gate."""
    from flows.deployments import fastest_passing_version
    from registry import RunRecord, register_engine

    from .conftest import engine_with_more_rows

    candidates = [  # (source model, gates passed, champion gate passed, p50 ms)
        ("model-a", "true", None, 9.0),
        ("model-a", "true", "false", 5.0),  # faster, but worse than the champion
        ("model-a", "false", None, 1.0),  # fastest, but failed its gates
        ("model-b", "true", None, 7.0),  # another model's engine
        ("model-a", "true", "true", 8.0),  # the one
    ]
    for index, (model, passed, champion, p50) in enumerate(candidates):
        path = engine_dir.path if index == 0 else engine_with_more_rows(engine_dir, tmp_path / f"engine-{index}", index)
        tags = {"source_model_sha256": model, "data_md5": "d.dir", "gates.passed": passed, "gates.latency.p50_ms": str(p50)}
        if champion:
            tags["gates.champion.passed"] = champion
        register_engine(registry_target, path, engine_dir.sha256, RunRecord(params={}, metrics={}, version_tags=tags))
    chosen = fastest_passing_version(registry_target, "model-a", "d.dir")
    assert (chosen.version, chosen.tags["gates.latency.p50_ms"]) == ("5", "8.0")
    assert fastest_passing_version(registry_target, "model-a", "other.dir") is None


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model, exported):
    """The multi-machine setup on one machine: MLflow on PostgreSQL with its artifacts in a
    shared folder, a Prefect server, `kiln deploy --pool`, and two `kiln worker`s, one per
    build target (fp32, int8). The project holds the session's trained model: what is
    tested starts after training."""
    if postgres_bin() is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run installs it)")
    base = tmp_path_factory.mktemp("pool")
    root = with_trained_model(make_project(base / "p"), tiny_model, exported)
    with postgres_server() as database, _processes(base) as start:
        mlflow, prefect = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        # One worker: four each import mlflow, which on a busy 2-core CI machine is most of a minute.
        start("mlflow", ["mlflow", "server", "--backend-store-uri", database, "--artifacts-destination", str(base / "shared-artifacts"),
                         "--host", "127.0.0.1", "--port", mlflow.rsplit(":", 1)[1], "--workers", "1"])  # fmt: skip
        start("prefect", ["prefect", "server", "start", "--host", "127.0.0.1", "--port", prefect.rsplit(":", 1)[1]], PREFECT_HOME=str(base / "prefect-server"))
        wait_for(lambda: answers(f"{mlflow}/health") and answers(f"{prefect}/api/health"), 180, "MLflow and Prefect servers answering")
        # Each worker signs with the key its machine was given; the project trusts both.
        keys = {target: base / f"keys-{target}" / "signing-key.pem" for target in ("fp32", "int8")}
        publics = {target: create_key(key) for target, key in keys.items()}
        registry = RegistryParams(tracking_uri=mlflow, model_name=MODEL, trusted_keys=[str(p) for p in publics.values()])
        params = tiny_params(
            root, registry=registry, precision=PrecisionParams(build=["fp32", "int8"]), gates=int8_registers(tiny_params(root).gates),
            triggers=TriggerParams(on_promotion=False, data_poll_interval_s=0),
            pool=PoolParams(name="kiln-test", targets={"fp32": BuildTarget(precisions=["fp32"]), "int8": BuildTarget(precisions=["int8"])}),
        )  # fmt: skip
        (root / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
        env = {"PREFECT_API_URL": f"{prefect}/api", "PREFECT_WORKER_QUERY_SECONDS": "1"}
        deploy_log = start("deploy", [KILN, "deploy", "--pool"], cwd=root, **env)
        wait_for(lambda: "stops it" in deploy_log.read_text(), 120, "kiln deploy --pool registering", deploy_log)
        logs = [start(f"worker-{target}", [KILN, "worker", target], cwd=root, **env, KILN_SIGNING_KEY=str(keys[target])) for target in ("fp32", "int8")]
        wait_for(lambda: all("started!" in log.read_text() for log in logs), 120, "two workers polling", logs[-1])
        yield SimpleNamespace(root=root, mlflow=mlflow, prefect=prefect, artifacts=base / "shared-artifacts", logs=[deploy_log, *logs], publics=publics)


@contextmanager
def _processes(directory: Path):
    """Starts named processes (logs in `directory`); SIGTERM to each at the end, then waits."""
    started: list[subprocess.Popen] = []

    def start(name: str, command: list[str], cwd: Path | None = None, **env: str) -> Path:
        log = directory / f"{name}.log"
        program = command[0] if command[0].startswith("/") else str(Path(sys.executable).parent / command[0])
        started.append(
            subprocess.Popen(
                [program, *command[1:]], cwd=cwd or directory, env=os.environ | env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        return log

    try:
        yield start
    finally:
        for process in reversed(started):
            os.killpg(process.pid, signal.SIGTERM)
        for process in reversed(started):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.slow
def test_two_workers_on_a_pool_build_one_model_versions_engines_into_mlflow_on_postgresql(pool):
    deployment = prefect_api("GET", f"{pool.prefect}/api/deployments/name/rebuild/{MODEL}").json()
    created = prefect_api("POST", f"{pool.prefect}/api/deployments/{deployment['id']}/create_flow_run", json={"parameters": {"reason": "a test"}})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]

    def rebuild_finished():
        run = prefect_api("GET", f"{pool.prefect}/api/flow_runs/{run_id}").json()
        return run if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

    run = wait_for(rebuild_finished, 600, "the pool's rebuild", pool.logs[1], every_s=2)
    assert run["state_type"] == "COMPLETED", "\n".join(log.read_text()[-2500:] for log in pool.logs)
    builds = flow_runs(pool.prefect, "build-engines")
    assert sorted((b["work_queue_name"], b["parameters"]["target"], b["state_type"]) for b in builds) == [
        ("fp32", "fp32", "COMPLETED"), ("int8", "int8", "COMPLETED")
    ]  # fmt: skip

    found = httpx.get(f"{pool.mlflow}/api/2.0/mlflow/model-versions/search", params={"filter": f"name='{MODEL}'"}, timeout=10).json()["model_versions"]
    tags = [{t["key"]: t["value"] for t in v["tags"]} for v in found]
    assert sorted(t["precision"] for t in tags) == ["fp32", "int8"]
    assert len({t["source_model_sha256"] for t in tags}) == 1 and len({t["data_md5"] for t in tags}) == 1  # one model version
    assert all(t["gates.passed"] == "true" for t in tags)
    signers = {t["precision"]: t["signing_key"] for t in tags}  # signed on the worker that built it, with that worker's key
    assert signers == {target: fingerprint(public.read_bytes()) for target, public in pool.publics.items()}
    model = httpx.get(f"{pool.mlflow}/api/2.0/mlflow/registered-models/get", params={"name": MODEL}, timeout=10).json()["registered_model"]
    assert [a["alias"] for a in model["aliases"]] == ["challenger"]
    stored = {p.name for p in pool.artifacts.rglob("*.onnx")}
    assert stored == {"model.onnx"} and len(list(pool.artifacts.rglob("model.onnx"))) == 2  # both engines in the shared store
