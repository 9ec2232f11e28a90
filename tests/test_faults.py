"""Faults a hostile but fair user provokes: tampered or missing registry artifacts, runs
killed mid-stage or mid-registration, registrations racing from two processes, params
that cannot work, an unreachable tracking server. Each leaves nothing wrong behind."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from components.errors import ConfigError, RegistryError, VersionRefused
from components.files import file_sha256
from registry import CHALLENGER, CHAMPION, RegistryTarget, Signing, promote, register_engine, resolve_alias
from serving import loader

from .conftest import SIGNING, make_project, new_mlflow_store, new_project_store, tiny_params
from .test_registry import record, versions

KILN = str(Path(sys.executable).parent / "kiln")


def kiln(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([KILN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


def stored_engine(target: RegistryTarget, version: str) -> Path:
    """The engine directory inside the registry's own artifact store (what a tamperer edits)."""
    source = MlflowClient(target.tracking_uri).get_model_version(target.model_name, version).source
    return Path(source.removeprefix("file://"))


def tamper(engine: Path, also_manifest: bool) -> None:
    """Change bytes of the engine file; optionally make engine.json agree with them."""
    model = engine / "model.onnx"
    model.write_bytes(model.read_bytes() + b"\0tampered")
    if also_manifest:
        manifest = json.loads((engine / "engine.json").read_text())
        manifest["engine_sha256"] = file_sha256(model)
        (engine / "engine.json").write_text(json.dumps(manifest))


# ---------------------------------------------------------------- tampered and missing artifacts


@pytest.mark.parametrize("also_manifest", [False, True], ids=["engine-file-only", "with-matching-engine-json"])
def test_promote_refuses_a_version_whose_engine_file_was_changed_in_the_store(registry_target, engine_dir, also_manifest):
    version = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record()).version
    tamper(stored_engine(registry_target, version), also_manifest)
    changed = "engine.json, model.onnx" if also_manifest else "model.onnx"
    with pytest.raises(VersionRefused, match=f"version {version} is refused: its files are not the ones signed: changed {changed}"):
        promote(registry_target, CHAMPION, version=version)
    with pytest.raises(RegistryError, match="does not resolve"):
        resolve_alias(registry_target, CHAMPION)


def test_without_signatures_the_loader_still_refuses_a_tampered_engine_with_a_matching_engine_json(registry_target, engine_dir, tmp_path):
    """registry.require_signature false (a store migrating to signatures): the version's
    engine_sha256 tag is still checked against the file, not only engine.json."""
    unsigned = replace(registry_target, signing=Signing(tmp_path / "no-key.pem", SIGNING.trusted, required=False))
    version = register_engine(unsigned, engine_dir.path, engine_dir.sha256, record()).version
    tamper(stored_engine(unsigned, version), also_manifest=True)
    with pytest.raises(VersionRefused, match=r"engine file has sha256 .*engine_sha256 tag says " + engine_dir.sha256[:12]):
        loader.pull_version(unsigned, version, tmp_path / "cache")


def test_the_loader_refuses_a_tampered_copy_in_its_own_cache(registry_target, engine_dir, tmp_path):
    version = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record()).version
    pulled = loader.pull_version(registry_target, version, tmp_path / "cache")
    tamper(pulled.engine_dir.path, also_manifest=True)
    with pytest.raises(VersionRefused, match="its files are not the ones signed: changed engine.json, model.onnx"):
        loader.pull_version(registry_target, version, tmp_path / "cache")


def test_the_loader_refuses_a_version_with_no_engine_sha256_tag_naming_it(registry_target, engine_dir, tmp_path):
    version = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record()).version
    MlflowClient(registry_target.tracking_uri).delete_model_version_tag(registry_target.model_name, version, "engine_sha256")
    with pytest.raises(VersionRefused, match=f"kiln-test version {version} is refused: it has no engine_sha256 tag"):
        loader.pull_version(registry_target, version, tmp_path / "cache")


def test_promote_refuses_a_version_whose_artifacts_are_gone(registry_target, engine_dir):
    import shutil

    version = register_engine(registry_target, engine_dir.path, engine_dir.sha256, record()).version
    shutil.rmtree(stored_engine(registry_target, version))
    with pytest.raises(VersionRefused, match=f"version {version} is refused"):
        promote(registry_target, CHALLENGER, version=version)
    with pytest.raises(RegistryError, match="does not resolve"):
        resolve_alias(registry_target, CHALLENGER)


# ---------------------------------------------------------------- registration under concurrency and kills

RACER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from registry import RegistryTarget, register_engine, RunRecord, Signing
    key = Path(os.environ["KILN_SIGNING_KEY"])  # the session's, as conftest set it
    target = RegistryTarget(sys.argv[1], "kiln-race", "kiln-race", Path(sys.argv[2]), Signing(key, (key.with_suffix(".pub"),)))
    go = Path(sys.argv[4])
    print("ready", flush=True)  # mlflow imported: the race is the registration, not the imports
    while not go.exists():
        time.sleep(0.005)
    tags = {"gates.passed": "true"}
    reg = register_engine(target, Path(sys.argv[3]), sys.argv[5], RunRecord(params={}, metrics={}, version_tags=tags))
    print(reg.version, reg.created)
    """
)


def test_racing_registrations_of_one_engine_from_three_processes_make_one_version(tmp_path, engine_dir):
    target = RegistryTarget(new_mlflow_store(tmp_path / "mlflow.db"), "kiln-race", "kiln-race", tmp_path / "artifacts", SIGNING)
    go = tmp_path / "go"
    args = [target.tracking_uri, str(target.artifact_root), str(engine_dir.path), str(go), engine_dir.sha256]
    racers = [subprocess.Popen([sys.executable, "-c", RACER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    assert [racer.stdout.readline().strip() for racer in racers] == ["ready"] * 3  # each waits at the line
    go.touch()
    outcomes = [racer.communicate(timeout=180) for racer in racers]
    assert all(racer.returncode == 0 for racer in racers), [err[-2000:] for _, err in outcomes]
    reported = [out.split() for out, _ in outcomes]
    assert len(versions(target)) == 1
    assert {version for version, _ in reported} == {str(versions(target)[0].version)}
    assert sorted(created for _, created in reported) == ["False", "False", "True"]
    runs = MlflowClient(target.tracking_uri).search_runs([MlflowClient(target.tracking_uri).get_experiment_by_name("kiln-race").experiment_id])
    assert {run.info.status for run in runs} == {"FINISHED"}


def test_a_registration_killed_outright_is_cleaned_up_by_the_next_one(registry_target, engine_dir):
    """A run left RUNNING by a killed process (and a version it created) ends KILLED and the
    version is deleted when the next registration starts: nothing stuck in the UI."""
    client = MlflowClient(registry_target.tracking_uri)
    register_engine(registry_target, engine_dir.path, engine_dir.sha256, record())  # experiment and model exist
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    experiment = client.get_experiment_by_name(registry_target.experiment).experiment_id
    import socket

    stuck = client.create_run(experiment, tags={"kiln.host": socket.gethostname(), "kiln.pid": str(dead.pid)}).info.run_id
    orphan = client.create_model_version(registry_target.model_name, source="file:///nowhere", run_id=stuck, tags={"engine_sha256": "0" * 64})

    register_engine(registry_target, engine_dir.path, "1" * 64, record())
    assert client.get_run(stuck).info.status == "KILLED"
    assert orphan.version not in {v.version for v in versions(registry_target)}


@pytest.mark.parametrize("stopped_in", ["log_artifacts", "create_model_version"])
def test_a_registration_stopped_by_sigterm_leaves_no_version_and_no_running_run(tmp_path, engine_dir, stopped_in):
    """SIGTERM during registration (kiln's CLI turns it into SystemExit) rolls it back: while
    the engine's files are logged (the run exists), and once the version exists. The
    registering process waits inside that MLflow call for the signal, so the test does not
    race the registration (on an idle machine it can finish before a signal sent at its start)."""
    target = RegistryTarget(new_mlflow_store(tmp_path / "mlflow.db"), "kiln-term", "kiln-term", tmp_path / "artifacts", SIGNING)
    script = textwrap.dedent(
        f"""
        import signal, sys, time
        from pathlib import Path
        from mlflow import MlflowClient
        from registry import RegistryTarget, RunRecord, Signing, register_engine
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        real = MlflowClient.{stopped_in}

        def then_wait(self, *args, **kwargs):
            result = real(self, *args, **kwargs)
            print("inside", flush=True)
            time.sleep(60)
            return result

        MlflowClient.{stopped_in} = then_wait
        key = Path({str(SIGNING.key)!r})
        target = RegistryTarget({target.tracking_uri!r}, "kiln-term", "kiln-term", Path({str(target.artifact_root)!r}), Signing(key, (key.with_suffix(".pub"),)))
        record = RunRecord(params={{}}, metrics={{}}, version_tags={{"gates.passed": "true"}})
        register_engine(target, Path({str(engine_dir.path)!r}), {engine_dir.sha256!r}, record)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "inside"
    client = MlflowClient(target.tracking_uri)
    if stopped_in == "create_model_version":
        assert len(client.search_model_versions("name='kiln-term'")) == 1  # what the signal must undo
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 143
    assert client.search_model_versions("name='kiln-term'") == []
    experiment = client.get_experiment_by_name("kiln-term")
    statuses = {run.info.status for run in client.search_runs([experiment.experiment_id])}
    assert statuses == {"KILLED"}


# ---------------------------------------------------------------- params that cannot work, an unreachable server


def test_a_profile_longer_than_the_model_context_is_refused_before_any_work(tmp_path):
    root = make_project(tmp_path / "p")
    params = tiny_params(root).model_dump(mode="json")
    params["build"]["profiles"]["context"]["max"] = 512  # the tiny model has 128 positions
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    result = kiln("run", cwd=root, timeout=120)
    assert result.returncode == 2
    assert "build.profiles.context.max (512) is longer than the model's context, model.architecture.n_positions (128)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (root / "mlruns").exists() and not (root / ".kiln" / "stages").exists()


def test_a_profile_longer_than_a_pretrained_models_context_is_refused_before_any_work(tmp_path, tiny_model, project):
    root = make_project(tmp_path / "p")
    params = tiny_params(root).model_dump(mode="json")
    params["model"]["pretrained"] = str(tiny_model.path)
    params["build"]["profiles"]["context"]["max"] = 512
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    result = kiln("build", cwd=root, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "build.profiles.context.max (512) is longer than the context of" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (root / "mlruns").exists() and not (root / ".kiln" / "stages").exists()


def test_config_names_every_length_that_does_not_fit_its_profile(tmp_path):
    from components.config import load_params

    text = "gates:\n  latency: {prompt_tokens: 200, new_tokens: 100}\n"
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"gates\.latency\.prompt_tokens \(200\) exceeds build\.profiles\.prompt\.max \(128\)"):
        load_params(tmp_path / "params.yaml")


def test_promote_against_an_unreachable_tracking_server_fails_in_seconds(tmp_path):
    (tmp_path / "params.yaml").write_text("registry:\n  tracking_uri: http://127.0.0.1:9\n")
    start = time.monotonic()
    result = kiln("promote", cwd=tmp_path, timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 2
    assert "http://127.0.0.1:9 is unreachable" in result.stderr
    assert elapsed < 20, f"took {elapsed:.1f} s"


@pytest.mark.slow
def test_a_run_killed_mid_stage_leaves_no_partial_output_and_the_next_run_succeeds(tmp_path):
    root = make_project(tmp_path / "p")
    new_project_store(root)
    (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(root).model_dump(mode="json")))
    models = root / ".kiln" / "stages" / "models"
    run = subprocess.Popen([KILN, "run"], cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not list(models.glob(".*.partial-*")) and time.time() < deadline:
        time.sleep(0.2)
    assert list(models.glob(".*.partial-*")), "training never started"
    os.killpg(run.pid, signal.SIGKILL)  # the CLI and Prefect's temporary server with it
    run.wait(timeout=30)

    again = kiln("run", cwd=root)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "registered" in again.stdout
    assert list(root.glob(".kiln/stages/**/.*.partial-*")) == []
