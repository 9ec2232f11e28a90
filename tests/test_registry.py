"""The MLflow registry on a temporary SQLite store: versions, tags, aliases, downloads."""

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from components.errors import RegistryError
from components.files import file_sha256
from registry import (
    CHALLENGER,
    CHAMPION,
    RegistryTarget,
    RunRecord,
    aliases_of,
    download_version,
    engine_identity,
    find_version,
    get_version,
    preflight,
    promote,
    register_engine,
    resolve_alias,
)

from .conftest import engine_with_more_rows


def record(passed: bool = True, **tags) -> RunRecord:
    return RunRecord(
        params={"model.training.steps": "40"},
        metrics={"gates.quality.top1_agreement": 1.0},
        version_tags={"backend": "onnxruntime", "gates.passed": str(passed).lower(), "data_md5": "abc.dir"} | tags,
        step_metrics={"train.loss": [(0, 6.0), (10, 5.0)]},
    )


def versions(target: RegistryTarget) -> list:
    return MlflowClient(target.tracking_uri).search_model_versions(f"name='{target.model_name}'")


def test_a_passing_engine_becomes_a_tagged_version_that_can_be_aliased_challenger(registry_target, engine_dir):
    registration = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record())
    assert registration.created and registration.aliases == ()
    promote(registry_target, CHALLENGER, version=registration.version)
    info = resolve_alias(registry_target, CHALLENGER)
    assert info.version == registration.version
    assert info.tags["engine_sha256"] == engine_dir.sha256
    assert info.tags["data_md5"] == "abc.dir"
    run = MlflowClient(registry_target.tracking_uri).get_run(registration.run_id)
    assert run.data.params["model.training.steps"] == "40"
    assert run.data.metrics["gates.quality.top1_agreement"] == 1.0
    assert run.info.status == "FINISHED"


def test_registering_the_same_engine_twice_creates_no_second_version(registry_target, engine_dir):
    first = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record(passed=False))
    second = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record())
    assert not second.created and second.version == first.version
    assert not first.gates_passed and not second.gates_passed  # the first record stands: a later pass moves nothing
    assert len(versions(registry_target)) == 1
    assert find_version(registry_target, engine_identity(engine_dir.path, engine_dir.sha256)).version == first.version
    client = MlflowClient(registry_target.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(registry_target.experiment).experiment_id])
    assert len(runs) == 1  # found before any work: no second run, not even a FAILED one


def test_the_same_engine_file_with_another_batch_profile_is_a_new_version(registry_target, engine_dir, tmp_path):
    """An ONNX Runtime engine rebuilt with a larger batch profile keeps its file byte for
    byte; registering it must not answer "unchanged" with the old version, whose engine.json
    would keep the server at the old batch."""
    first = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record())
    wider = engine_with_more_rows(engine_dir, tmp_path / "wider", extra_rows=engine_dir.manifest.profiles["generation"].batch.max)
    second = register_engine(registry_target, wider, engine_dir.sha256, record())
    assert second.created and second.version != first.version
    profiles = {v: get_version(registry_target, v).tags["profiles_sha256"] for v in (first.version, second.version)}
    assert profiles[first.version] != profiles[second.version]
    assert not register_engine(registry_target, wider, engine_dir.sha256, record()).created


def test_when_two_registrations_of_one_engine_interleave_the_oldest_version_stays(registry_target, engine_dir):
    """On a tracking server (no file lock) two processes can each create a version of one
    engine before either sees the other's; the later one deletes its own version, ends its
    run FAILED and reports the older version as not created. The embedded store's lock keeps
    this from happening in a real race here, so the step is driven directly."""
    from registry import Registration
    from registry.store import _keep_oldest_twin

    first = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record())
    promote(registry_target, CHALLENGER, version=first.version)
    client = MlflowClient(registry_target.tracking_uri)
    run_id = client.create_run(client.get_experiment_by_name(registry_target.experiment).experiment_id).info.run_id
    source = client.get_model_version(registry_target.model_name, first.version).source
    identity = engine_identity(engine_dir.path, engine_dir.sha256)
    twin = client.create_model_version(registry_target.model_name, source, run_id=run_id, tags=identity).version

    kept = _keep_oldest_twin(client, registry_target, identity, twin, run_id, False)
    assert kept == Registration(registry_target.model_name, first.version, first.run_id, created=False, aliases=(CHALLENGER,), gates_passed=True)
    assert [str(v.version) for v in versions(registry_target)] == [first.version]
    assert client.get_run(run_id).info.status == "FAILED"
    alone = _keep_oldest_twin(client, registry_target, identity, first.version, first.run_id, True)  # no twin: kept as created
    assert alone == Registration(registry_target.model_name, first.version, first.run_id, created=True, aliases=())


def test_a_failing_engine_is_registered_but_never_aliased(registry_target, engine_dir):
    registration = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record(passed=False))
    assert registration.created and registration.aliases == ()
    with pytest.raises(RegistryError, match="did not pass its gates"):
        promote(registry_target, CHALLENGER, version=registration.version)
    with pytest.raises(RegistryError, match=f"@{CHALLENGER} does not resolve"):
        resolve_alias(registry_target, CHALLENGER)


def test_promote_on_an_empty_registry_says_to_run_kiln_run_first(registry_target):
    with pytest.raises(RegistryError, match="has no registered version .* yet: run `kiln run` first"):
        promote(registry_target, CHAMPION, by="someone")


def test_promote_from_an_alias_that_names_nothing_says_how_to_choose_a_version(registry_target, engine_dir):
    register_engine(registry_target, engine_dir.path, engine_dir.sha256, record(passed=False))
    with pytest.raises(RegistryError, match=f"@{CHALLENGER} names no version: pass --version N"):
        promote(registry_target, CHAMPION, by="someone")
    assert aliases_of(registry_target) == {}


def test_promote_refuses_a_version_whose_gates_were_inconclusive_and_names_the_verdict(registry_target, engine_dir):
    registration = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record(passed=False, **{"gates.verdict": "inconclusive"}))
    with pytest.raises(RegistryError, match="did not pass its gates \\(gates.passed tag 'false', gates.verdict 'inconclusive'\\)"):
        promote(registry_target, CHAMPION, version=registration.version)
    assert aliases_of(registry_target) == {}


def test_promote_refuses_a_version_whose_gates_failed(registry_target, engine_dir):
    registration = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record(passed=False))
    with pytest.raises(RegistryError, match="did not pass its gates \\(gates.passed tag 'false'\\)"):
        promote(registry_target, CHAMPION, version=registration.version)
    with pytest.raises(RegistryError):
        resolve_alias(registry_target, CHAMPION)


def test_promote_points_champion_at_the_challenger(registry_target, engine_dir):
    registration = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record())
    promote(registry_target, CHALLENGER, version=registration.version)
    promoted = promote(registry_target)
    assert promoted.version == registration.version
    assert set(promoted.aliases) == {CHALLENGER, CHAMPION}
    assert aliases_of(registry_target) == {CHALLENGER: registration.version, CHAMPION: registration.version}


def test_a_downloaded_version_is_the_engine_that_was_registered(registry_target, engine_dir, tmp_path):
    registration = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record())
    stored = MlflowClient(registry_target.tracking_uri).get_model_version(registry_target.model_name, registration.version).source
    assert Path(stored.removeprefix("file://")).is_relative_to(registry_target.artifact_root.resolve())  # not ./mlruns of the cwd
    destination = tmp_path / "not" / "yet" / "there"
    destination.mkdir(parents=True)
    (destination / "stale.txt").write_text("left by an earlier, interrupted download")
    local = download_version(registry_target, registration.version, destination)
    assert local.is_relative_to(destination) and not (destination / "stale.txt").exists()
    assert file_sha256(local / "model.onnx") == engine_dir.sha256
    assert (local / "engine.json").read_text() == (engine_dir.path / "engine.json").read_text()
    fresh = download_version(registry_target, registration.version, tmp_path / "a" / "b" / "c")  # parents made
    assert file_sha256(fresh / "model.onnx") == engine_dir.sha256


def test_a_failure_mid_registration_leaves_no_version_and_no_alias(registry_target, engine_dir, tmp_path):
    missing_artifact = RunRecord(params={}, metrics={}, version_tags={}, artifacts={"gates": tmp_path / "absent.json"})
    with pytest.raises(RegistryError, match="nothing kept"):
        register_engine(registry_target, engine_dir.path, engine_dir.sha256, missing_artifact)
    assert versions(registry_target) == []
    with pytest.raises(RegistryError):
        resolve_alias(registry_target, CHALLENGER)


def test_an_unreachable_tracking_server_fails_fast_with_its_address():
    with pytest.raises(RegistryError, match=r"http://127\.0\.0\.1:9 is unreachable"):
        preflight(RegistryTarget("http://127.0.0.1:9", "m", "e"), timeout_s=2)


def test_an_alias_on_a_missing_model_is_a_registry_error(registry_target):
    with pytest.raises(RegistryError, match="does not resolve"):
        resolve_alias(registry_target, CHAMPION)


def test_the_registry_target_is_the_configured_uri_or_the_projects_embedded_store(tmp_path):
    from components.config import Params, RegistryParams
    from registry import registry_target

    def where(target: RegistryTarget) -> tuple:
        return target.tracking_uri, target.model_name, target.experiment, target.artifact_root

    embedded = registry_target(Params().registry, tmp_path)  # the name, where params set none, is the model's
    assert where(embedded) == (f"sqlite:///{tmp_path}/mlruns/mlflow.db", "kiln-gpt2", "kiln", tmp_path / "mlruns" / "artifacts")
    named = registry_target(RegistryParams(tracking_uri="sqlite:////srv/store/db.sqlite", model_name="m", experiment="e"), tmp_path)
    assert where(named) == ("sqlite:////srv/store/db.sqlite", "m", "e", Path("/srv/store/artifacts"))
    server = registry_target(RegistryParams(tracking_uri="http://mlflow.internal:5000", model_name="m", experiment="e"), tmp_path)
    assert where(server) == ("http://mlflow.internal:5000", "m", "e", None)


def test_a_project_signs_with_its_key_and_trusts_the_listed_keys_and_its_own(tmp_path, monkeypatch):
    from components.config import RegistryParams
    from registry import registry_target
    from registry.signing import create_key

    colleague = create_key(tmp_path / "colleague.pem")
    mine = tmp_path / "home" / "mine.pem"
    create_key(mine)
    monkeypatch.setenv("KILN_SIGNING_KEY", str(mine))
    listed = RegistryParams(trusted_keys=["../colleague.pub"])
    signing = registry_target(listed, tmp_path / "project").signing
    assert signing.key == mine and signing.required
    assert signing.trusted == (tmp_path / "project" / "../colleague.pub", mine.with_suffix(".pub"))
    assert colleague.is_file()
    assert registry_target(listed.model_copy(update={"trust_own_key": False}), tmp_path / "project").signing.trusted == (tmp_path / "project" / "../colleague.pub",)
    monkeypatch.delenv("KILN_SIGNING_KEY")
    configured = registry_target(RegistryParams(signing_key=str(mine), require_signature=False), tmp_path).signing
    assert configured.key == mine and not configured.required


def test_a_registration_logs_its_datasets_with_digest_source_context_and_profile(registry_target, engine_dir):
    from registry import DatasetRecord

    datasets = (
        DatasetRecord("corpus", "d" * 40 + ".dir", "data.dvc", "training"),
        DatasetRecord("calibration", "c" * 64, "/stages/calibration/x", "calibration", {"samples": 128}),
    )
    run_record = RunRecord(params={}, metrics={}, version_tags={"gates.passed": "true"}, datasets=datasets)
    registration = register_engine(registry_target, engine_dir.path, engine_dir.sha256, run_record)
    inputs = MlflowClient(registry_target.tracking_uri).get_run(registration.run_id).inputs.dataset_inputs
    logged = {d.dataset.name: d for d in inputs}
    assert set(logged) == {"corpus", "calibration"}
    corpus, calibration = logged["corpus"], logged["calibration"]
    assert corpus.dataset.digest == "d" * 36  # MLflow's digest column holds 36 characters
    assert json.loads(corpus.dataset.source) == {"uri": "data.dvc"} and corpus.dataset.source_type == "local"
    assert {(t.key, t.value) for t in corpus.tags} == {("mlflow.data.context", "training")}
    assert {(t.key, t.value) for t in calibration.tags} == {("mlflow.data.context", "calibration")}
    assert json.loads(calibration.dataset.profile) == {"samples": 128}
