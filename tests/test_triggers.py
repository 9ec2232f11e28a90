"""Retrain-and-rebuild by itself: `kiln deploy` against `kiln up`'s real Prefect and MLflow
servers, in a project with a DVC remote. The tests run in order and share the project:
each starts from the registry the one before left.

Fast checks of the pieces (config, the data watcher's comparison, the webhook receiver,
the deployments' shape) come first and need no server.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from components.config import ConfigError, TriggerParams, load_params
from components.errors import DataError
from components.files import file_sha256

from .conftest import DVC, make_project, new_project_store, tiny_params
from .live_server import KILN, flow_runs, free_port, kiln_up, prefect_api, wait_for
from .test_faults import tamper

MODEL = "kiln-tiny"


# ---------------------------------------------------------------- pieces, no servers


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"triggers": {"schedule": "0 3 * *"}}, "triggers.schedule: '0 3 * *' is not a cron expression"),
        ({"triggers": {"timezone": "Mars/Olympus"}}, "triggers.timezone: 'Mars/Olympus' is not an IANA time zone"),
        ({"triggers": {"overlap": "pile-up"}}, "triggers.overlap"),
        ({"triggers": {"webhook_port": 0}}, "triggers.webhook_port"),
        ({"pool": {"targets": {"control": {"precisions": ["fp32"]}}}}, "pool.targets: 'control' names the queue every worker takes"),
        ({"pool": {"targets": {"gpu": {"backend": "tensorrt", "precisions": []}}}}, "pool.targets.gpu.precisions"),
    ],
)
def test_bad_trigger_and_pool_settings_are_config_errors_naming_the_key(tmp_path, sections, message):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(sections))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("*", r"\*")):
        load_params(path)


def test_a_build_target_narrows_the_backend_and_precisions_and_nothing_else(tmp_path):
    from components.config import BuildTarget, PoolParams
    from flows.deployments import for_target

    params = tiny_params(tmp_path, pool=PoolParams(targets={"gpu": BuildTarget(backend="tensorrt", precisions=["fp16", "int8"])}))
    narrowed = for_target(params, "gpu")
    assert (narrowed.build.backend, narrowed.precision.build) == ("tensorrt", ["fp16", "int8"])
    assert narrowed.model_dump(exclude={"build": {"backend"}, "precision": {"build"}}) == params.model_dump(exclude={"build": {"backend"}, "precision": {"build"}})


def test_a_cron_schedule_becomes_the_request_deployments_schedule_in_its_timezone(tmp_path):
    from flows.deployments import deployments

    params = tiny_params(tmp_path, triggers=TriggerParams(schedule="30 2 * * 1-5", timezone="Europe/Berlin", on_promotion=False))
    served, described = deployments(tmp_path, "params.yaml", params)
    by_name = {d.name: d for d in described}
    assert set(by_name) == {f"rebuild/{MODEL}", f"request-rebuild/{MODEL}"}
    assert "cron 30 2 * * 1-5 (Europe/Berlin)" in by_name[f"request-rebuild/{MODEL}"].starts_on
    request = next(d for d in served if d.flow_name == "request-rebuild")
    (schedule,) = request.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone) == ("30 2 * * 1-5", "Europe/Berlin")
    rebuild = next(d for d in served if d.flow_name == "rebuild")
    assert rebuild.concurrency_limit == 1 and not rebuild.schedules and not rebuild.triggers  # starts only through request-rebuild


def test_the_data_watcher_announces_a_moved_data_dvc_once_and_only_after_a_run(tmp_path):
    from flows.data_changes import record_run_data, unseen_data_change

    params = tiny_params(tmp_path)
    (tmp_path / "data.dvc").write_text(yaml.safe_dump({"outs": [{"md5": "aaa.dir", "path": "data"}]}))
    assert unseen_data_change(tmp_path, params) is None  # no run yet: nothing to compare with
    record_run_data(tmp_path, "aaa.dir")
    assert unseen_data_change(tmp_path, params) is None
    (tmp_path / "data.dvc").write_text(yaml.safe_dump({"outs": [{"md5": "bbb.dir", "path": "data"}]}))
    change = unseen_data_change(tmp_path, params)
    assert (change.md5, change.previous, change.how) == ("bbb.dir", "aaa.dir", "data.dvc changed")
    (tmp_path / ".kiln" / "triggers" / "announced-data.json").write_text(json.dumps({"md5": "bbb.dir"}))
    assert unseen_data_change(tmp_path, params) is None  # announced once


def test_the_watcher_leaves_a_change_to_kiln_data_add_until_it_is_announced(tmp_path):
    """`kiln data add` (another process, holding the data-change lock) has versioned new
    data but not yet recorded its announcement: the watcher must not announce it again."""
    import fcntl

    from flows.data_changes import DataWatcher, data_change_lock, record_run_data

    def data_dvc(md5: str) -> None:
        (tmp_path / "data.dvc").write_text(yaml.safe_dump({"outs": [{"md5": md5, "path": "data"}]}))

    data_dvc("aaa.dir")
    record_run_data(tmp_path, "aaa.dir")
    seen = []
    watcher = DataWatcher(tmp_path, tiny_params(tmp_path), 0.05, seen.append).start()
    with data_change_lock(tmp_path).open("w") as held:  # a description of its own: flock conflicts as across processes
        fcntl.flock(held, fcntl.LOCK_EX)
        data_dvc("bbb.dir")
        time.sleep(0.5)
        assert seen == []
        (tmp_path / ".kiln" / "triggers" / "announced-data.json").write_text(json.dumps({"md5": "bbb.dir"}))
        fcntl.flock(held, fcntl.LOCK_UN)
    data_dvc("ccc.dir")  # a change nobody announces: the watcher's
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    watcher.stop()
    assert seen and {change.md5 for change in seen} == {"ccc.dir"}


def test_kiln_data_add_refuses_what_the_corpus_would_not_read(tmp_path):
    from components.config import CPythonDocsSource, TextFilesSource
    from components.data import add_to_corpus

    source = TextFilesSource(kind="text-files", glob="corpus/**/*.txt")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("first")
    new, other, binary, markdown = (tmp_path / name for name in ("new.txt", "src/a.txt", "b.txt", "c.md"))
    new.write_text("second")
    other.parent.mkdir()
    other.write_text("not the first")
    binary.write_bytes(b"\xff\xfe\x00broken")
    markdown.write_text("# a heading")
    with pytest.raises(DataError, match="data.source is 'cpython-docs' with none"):
        add_to_corpus([new], CPythonDocsSource(glob=None), tmp_path)
    with pytest.raises(DataError, match="already exists with other content"):
        add_to_corpus([other], source, tmp_path)
    with pytest.raises(DataError, match="not a readable UTF-8 text file"):
        add_to_corpus([binary], source, tmp_path)
    with pytest.raises(DataError, match=r"c.md does not match '\*.txt'"):
        add_to_corpus([markdown], source, tmp_path)
    assert add_to_corpus([new], source, tmp_path) == [tmp_path / "corpus" / "new.txt"]
    assert add_to_corpus([new], source, tmp_path) == []  # the same file again: nothing to add


def test_the_webhook_receiver_hands_on_signed_alias_events_and_refuses_the_rest():
    from fastapi.testclient import TestClient

    from serving.hook_receiver import alias_hook_app
    from serving.webhooks import signature_of

    seen = []
    client = TestClient(alias_hook_app("s3cret", 300, lambda event: seen.append(event) or True))
    body = json.dumps(
        {"entity": "model_version_alias", "action": "created", "timestamp": 0, "data": {"name": MODEL, "alias": "champion", "version": "3"}}
    ).encode()
    now = str(int(time.time()))

    def post(secret: str, timestamp: str) -> httpx.Response:
        headers = {"x-mlflow-delivery-id": "d1", "x-mlflow-timestamp": timestamp, "x-mlflow-signature": signature_of(secret, "d1", timestamp, body)}
        return client.post("/hooks/mlflow", content=body, headers=headers)

    assert post("wrong", now).status_code == 401
    assert post("s3cret", str(int(time.time()) - 3600)).status_code == 401  # a replay
    assert client.post("/hooks/mlflow", content=body).status_code == 401  # unsigned
    assert seen == []
    answer = post("s3cret", now)
    assert answer.status_code == 200 and answer.json() == {"accepted": True, "handled": True}
    assert [(e.model, e.alias, e.action, e.version) for e in seen] == [(MODEL, "champion", "created", "3")]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["deploy", "--prefect-url", "http://127.0.0.1:9/api"], "no Prefect server answers at http://127.0.0.1:9/api: start one with `kiln up`"),
        (["worker", "gpu", "--prefect-url", "http://127.0.0.1:9/api"], "no build target 'gpu' in pool.targets (params.yaml has cpu)"),
        (["data", "add", "notes.md"], "notes.md does not match '*.txt' of data.source.glob 'corpus/**/*.txt'"),
    ],
)
def test_trigger_verbs_refuse_what_cannot_work_with_one_line_and_exit_2(tmp_path, monkeypatch, arguments, message):
    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("{}\n")  # every default: the Python docs corpus, pool target cpu
    (tmp_path / "notes.md").write_text("a note")
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 2
    assert " ".join(result.output.split()).startswith(f"error: {message}")


# ---------------------------------------------------------------- kiln deploy under kiln up


def finished(prefect: str, flow: str, after: int) -> list[dict]:
    """The flow's runs beyond the first `after`, once all of them have reached a final state."""
    runs = flow_runs(prefect, flow)[after:]
    return runs if runs and all(r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for r in runs) else []


def versions(root: Path) -> list[dict]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlruns' / 'mlflow.db'}")
    return [{"version": v.version, "run_id": v.run_id, **v.tags} for v in sorted(client.search_model_versions(f"name='{MODEL}'"), key=lambda v: int(v.version))]


def data_md5(root: Path) -> str:
    return yaml.safe_load((root / "data.dvc").read_text())["outs"][0]["md5"]


def corpus_file(directory: Path, name: str, *topic_names: str) -> Path:
    """A new text file of real prose: pydoc topics not in the test corpus, long enough that
    every split gets passages of it (so the model and its engine change too)."""
    from pydoc_data.topics import topics

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("\n\n".join(topics[topic] for topic in topic_names))
    return path


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A project (no run yet) under `kiln up`, with `kiln deploy` serving its deployments;
    stopping kiln deploy with SIGTERM must end it cleanly."""
    root = make_project(tmp_path_factory.mktemp("triggers") / "p")
    new_project_store(root)
    # A schedule that is valid but never due during a test (29 February).
    params = tiny_params(root, triggers=TriggerParams(schedule="0 0 29 2 *", data_poll_interval_s=1, webhook_port=free_port()))
    (root / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    with kiln_up(root) as up:
        log = root / "kiln-deploy.log"
        env = up.env | {"PREFECT_RUNNER_POLL_FREQUENCY": "1"}
        deploy = subprocess.Popen(
            [KILN, "deploy", "--mlflow-url", up.mlflow], cwd=root, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        wait_for(lambda: "stops it" in log.read_text() or deploy.poll() is not None, 120, "kiln deploy starting", log, stacks_of=deploy)
        assert deploy.poll() is None, log.read_text()[-3000:]
        deploy.send_signal(signal.SIGUSR1)  # where a running kiln waits, printed without stopping it
        wait_for(lambda: "most recent call first" in log.read_text(), 30, "kiln deploy printing its stacks on SIGUSR1", log)
        assert deploy.poll() is None, log.read_text()[-3000:]
        up.deploy_log, up.deploy = log, deploy
        yield up
        deploy.send_signal(signal.SIGTERM)
        assert deploy.wait(timeout=60) in (0, 143), log.read_text()[-3000:]
        # stopped, it pauses what it served: no schedule piles up runs nobody will execute
        served = prefect_api("GET", f"{up.prefect}/api/deployments/name/request-rebuild/{MODEL}").json()
        assert served["paused"] is True and "paused 3 deployments" in log.read_text()


@pytest.mark.slow
def test_kiln_data_add_announces_the_new_version_and_the_triggered_rebuild_registers_engines_of_it(deployed):
    root, prefect = deployed.root, deployed.prefect
    for name in ("rebuild", "request-rebuild"):
        assert flow_runs(prefect, name) == []
    answer = prefect_api("GET", f"{prefect}/api/deployments/name/request-rebuild/{MODEL}")
    assert answer.status_code == 200, f"kiln deploy printed its table before the server had the deployment: {answer.text}"
    request = answer.json()
    assert [(s["schedule"]["cron"], s["active"]) for s in request["schedules"]] == [("0 0 29 2 *", True)]
    new = corpus_file(root.parent / "incoming", "with-statement.txt", "with", "types")
    added = subprocess.run([KILN, "data", "add", str(new)], cwd=root, env=deployed.env, capture_output=True, text=True, timeout=300)
    assert added.returncode == 0, added.stderr[-3000:]
    md5 = data_md5(root)
    assert f"data version {md5}" in added.stdout and "announced kiln.data.changed" in added.stdout
    assert (root / "corpus" / "with-statement.txt").read_text() == new.read_text()

    (run,) = wait_for(lambda: finished(prefect, "rebuild", 0), 400, "the triggered rebuild", deployed.deploy_log, every_s=2, stacks_of=deployed.deploy)
    assert run["state_type"] == "COMPLETED", deployed.deploy_log.read_text()[-4000:]
    assert md5 in run["parameters"]["reason"] and "kiln data add" in run["parameters"]["reason"]
    registered = versions(root)
    assert [v["data_md5"] for v in registered] == [md5]
    assert registered[0]["gates.passed"] == "true"
    (root.parent / "data-v1.dvc").write_text((root / "data.dvc").read_text())  # for the dvc checkout below


@pytest.mark.slow
def test_a_burst_of_five_triggers_yields_one_rebuild_and_never_more_than_one_waiting(deployed):
    from flows.events import DATA_CHANGED, announce, data_resource

    prefect, before = deployed.prefect, len(flow_runs(deployed.prefect, "rebuild"))
    requests_before = len(flow_runs(prefect, "request-rebuild"))
    for burst in range(5):
        announce(DATA_CHANGED, data_resource(MODEL), {"md5": f"burst-{burst}", "previous": None, "how": "a test's burst"}, api_url=f"{prefect}/api")
    most_waiting = most_running = 0

    def all_handled() -> bool:
        nonlocal most_waiting, most_running
        runs = flow_runs(prefect, "rebuild")[before:]
        most_waiting = max(most_waiting, sum(r["state_type"] in ("SCHEDULED", "PENDING") for r in runs))
        most_running = max(most_running, sum(r["state_type"] == "RUNNING" for r in runs))
        return len(finished(prefect, "request-rebuild", requests_before)) == 5 and len(finished(prefect, "rebuild", before)) == len(runs)

    wait_for(all_handled, 300, "five requests handled and their rebuilds finished", deployed.deploy_log, every_s=0.3, stacks_of=deployed.deploy)
    rebuilds = flow_runs(prefect, "rebuild")[before:]
    assert 1 <= len(rebuilds) <= 2 and most_waiting <= 1 and most_running <= 1
    assert all(r["state_type"] == "COMPLETED" for r in rebuilds)
    shas = [v["engine_sha256"] for v in versions(deployed.root)]
    assert len(shas) == len(set(shas)) == 1  # the same data and params: the same engine, registered once


@pytest.mark.slow
def test_data_versions_that_change_without_an_event_are_noticed_by_the_watcher(deployed):
    """`kiln data add` with no Prefect server to tell, then a `dvc checkout` of the older
    data.dvc: kiln deploy notices each by comparing data.dvc with the last run's version."""
    root, prefect = deployed.root, deployed.prefect
    before = len(flow_runs(prefect, "rebuild"))
    quiet = {k: v for k, v in deployed.env.items() if k != "PREFECT_API_URL"}
    new = corpus_file(root.parent / "incoming", "strings.txt", "try", "string-methods", "typesmapping")
    added = subprocess.run([KILN, "data", "add", str(new)], cwd=root, env=quiet, capture_output=True, text=True, timeout=300)
    assert added.returncode == 0, added.stderr[-3000:]
    assert "PREFECT_API_URL is not set" in added.stderr and "kiln deploy` notices the new data.dvc" in added.stderr
    grown = data_md5(root)
    (run,) = wait_for(lambda: finished(prefect, "rebuild", before), 400, "a rebuild of the unannounced version", deployed.deploy_log, every_s=2, stacks_of=deployed.deploy)
    assert run["state_type"] == "COMPLETED" and f"data changed to {grown} (data.dvc changed)" in run["parameters"]["reason"]
    assert versions(root)[-1]["data_md5"] == grown

    (root / "data.dvc").write_text((root.parent / "data-v1.dvc").read_text())
    subprocess.run([DVC, "checkout", "-q", "--force"], cwd=root, check=True)
    older = data_md5(root)
    (run,) = wait_for(lambda: finished(prefect, "rebuild", before + 1), 400, "a rebuild after dvc checkout", deployed.deploy_log, every_s=2, stacks_of=deployed.deploy)
    assert run["state_type"] == "COMPLETED" and f"data changed to {older} (data.dvc changed)" in run["parameters"]["reason"]
    assert [v["data_md5"] for v in versions(root)] == [older, grown]  # the older data's engine was already registered


def set_alias(mlflow: str, alias: str, version: str) -> None:
    """What the MLflow UI's alias editor sends."""
    answer = httpx.post(f"{mlflow}/api/2.0/mlflow/registered-models/alias", json={"name": MODEL, "alias": alias, "version": version}, timeout=10)
    assert answer.status_code == 200, answer.text


@pytest.mark.slow
def test_an_alias_set_in_mlflow_starts_verify_promotion_whose_result_lands_on_the_version(deployed):
    prefect, before = deployed.prefect, len(flow_runs(deployed.prefect, "verify-promotion"))
    set_alias(deployed.mlflow, "champion", "2")
    (run,) = wait_for(lambda: finished(prefect, "verify-promotion", before), 300, "verify-promotion", deployed.deploy_log, stacks_of=deployed.deploy)
    assert run["state_type"] == "COMPLETED" and run["parameters"]["version"] == "2"
    tags = versions(deployed.root)[1]
    assert tags["verification.passed"] == "true" and tags["verification.alias"] == "champion"
    assert tags["verification.flow_run"] == run["id"]
    assert float(tags["verification.quality.top1_agreement"]) >= 0.99
    assert "cores" in tags["verification.measured_on"]  # the machine it was verified on
    set_alias(deployed.mlflow, "staging", "2")  # an alias triggers.verify_aliases does not name
    time.sleep(5)
    assert len(flow_runs(prefect, "verify-promotion")) == before + 1


@pytest.mark.slow
def test_verify_promotion_fails_a_version_whose_engine_was_swapped_in_the_store_with_its_tags_rewritten(deployed):
    """The attack of someone who can write to the store: new engine bytes, engine.json and the
    engine_sha256 tag made to agree. Only the signature tells."""
    from mlflow import MlflowClient

    prefect, before = deployed.prefect, len(flow_runs(deployed.prefect, "verify-promotion"))
    run_id = versions(deployed.root)[0]["run_id"]
    (engine_file,) = [p for p in (deployed.root / "mlruns" / "artifacts").rglob("model.onnx") if run_id in p.parts]
    tamper(engine_file.parent, also_manifest=True)
    MlflowClient(f"sqlite:///{deployed.root / 'mlruns' / 'mlflow.db'}").set_model_version_tag(MODEL, "1", "engine_sha256", file_sha256(engine_file))
    set_alias(deployed.mlflow, "champion", "1")
    (run,) = wait_for(lambda: finished(prefect, "verify-promotion", before), 300, "verify-promotion", deployed.deploy_log, stacks_of=deployed.deploy)
    assert run["state_type"] == "FAILED"
    tags = versions(deployed.root)[0]
    assert tags["verification.passed"] == "false"
    assert tags["verification.failure"] == f"{MODEL} version 1 is refused: its files are not the ones signed: changed engine.json, model.onnx"
    assert "verification.quality.top1_agreement" not in tags
