"""The MLflow model registry as kiln uses it.

One engine is one model version, its source the engine directory logged as a run artifact
(`create_model_version`: in MLflow 3, `register_model("runs:/…")` wants a logged model).
Registration is idempotent by the engine's identity (its file's sha256 and the profiles it
accepts, both version tags) and all-or-nothing: a failure after the version exists deletes
it again, so no half-registered version is left behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from components.engine_dir import MANIFEST, EngineManifest
from components.errors import KilnError, RegistryError
from components.files import exclusive_lock, process_alive
from registry.records import DatasetRecord, Registration, RegistryTarget, RunLink, RunRecord, Signing, VersionInfo
from registry.signing import SIGNATURE_FILE, check_signer, sign
from registry.tags import ENGINE_SHA256, GATES_PASSED, PROFILES_SHA256, RUN_HOST, RUN_KIND, RUN_MODEL_SHA256, RUN_PID, SIGNING_KEY
from registry.target import is_embedded

CHALLENGER = "challenger"
CHAMPION = "champion"
ENGINE_ARTIFACT = "engine"
log = logging.getLogger("kiln.registry")


def _client(target: RegistryTarget):
    """A client for the target, after a health check: MLflow's own client retries an
    unreachable server for minutes, so every verb that talks to the store fails fast here."""
    import logging

    from mlflow import MlflowClient

    preflight(target)
    # "Creating initial MLflow database tables..." on every new client says nothing to users.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    with store_lock(target):  # a new client may create the schema: one process at a time
        return MlflowClient(tracking_uri=target.tracking_uri, registry_uri=target.tracking_uri)


def preflight(target: RegistryTarget, timeout_s: float = 5.0, registering: bool = False) -> None:
    """Fail fast, before any training, when the tracking store cannot be reached (MLflow's
    own client retries an unreachable server for minutes before it gives up), and, for a
    run that will register, when it has no usable signing key.
    """
    if registering:
        check_signer(target.signing)
    uri = target.tracking_uri
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s) as response:
                if response.status != 200:
                    raise RegistryError(f"MLflow tracking server {uri} answered /health with {response.status}")
        except (urllib.error.URLError, OSError) as err:
            raise RegistryError(f"MLflow tracking server {uri} is unreachable: {getattr(err, 'reason', err)}") from err
    elif uri.startswith("sqlite:///"):
        database = Path(uri.removeprefix("sqlite:///"))
        try:
            database.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RegistryError(f"cannot create the MLflow store folder {database.parent}: {err}") from err


def _experiment_id(client, target: RegistryTarget) -> str:
    experiment = client.get_experiment_by_name(target.experiment)
    if experiment is not None:
        return experiment.experiment_id
    location = target.artifact_root.resolve().as_uri() if target.artifact_root else None
    return client.create_experiment(target.experiment, artifact_location=location)


def engine_identity(engine_dir: Path, engine_sha256: str) -> dict[str, str]:
    """The tags that name one engine in the registry: the engine file's sha256 and the
    digest of the shapes it accepts (a rebuild with a larger batch profile can leave an
    ONNX Runtime engine file byte-identical, yet it serves differently)."""
    try:
        manifest = EngineManifest.model_validate_json((engine_dir / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise RegistryError(f"cannot read {engine_dir / MANIFEST} to register the engine: {err}") from err
    return {ENGINE_SHA256: engine_sha256, PROFILES_SHA256: manifest.profiles_sha256}


def find_version(target: RegistryTarget, identity: dict[str, str]) -> VersionInfo | None:
    """The version already registered for this engine (`engine_identity`), if any."""
    return min(versions_tagged(target, identity), key=lambda v: int(v.version), default=None)


def versions_tagged(target: RegistryTarget, tags: dict[str, str]) -> list[VersionInfo]:
    """Every version of the model whose tags hold these values, oldest first."""
    from mlflow.exceptions import MlflowException

    client = _client(target)
    query = " and ".join([f"name='{target.model_name}'"] + [f"tags.`{tag}`='{value}'" for tag, value in tags.items()])
    try:
        found = client.search_model_versions(query)
    except MlflowException as err:
        raise RegistryError(f"cannot search the registry at {target.tracking_uri}: {err.message}") from err
    return [_version_info(client, target.model_name, v.version) for v in sorted(found, key=lambda v: int(v.version))]


def version_tags_by_version(target: RegistryTarget) -> dict[str, tuple[dict[str, str], float]]:
    """Every version of the model: its tags and when it was registered (Unix seconds), in
    one search (no aliases: read those per version with `resolve_alias`)."""
    from mlflow.exceptions import MlflowException

    try:
        found = _client(target).search_model_versions(f"name='{target.model_name}'")
    except MlflowException as err:
        raise RegistryError(f"cannot search the registry at {target.tracking_uri}: {err.message}") from err
    return {str(v.version): (dict(v.tags), v.creation_timestamp / 1000) for v in found}


def _version_info(client, name: str, version: str) -> VersionInfo:
    # search_model_versions() returns empty aliases (MLflow bug): read them from the model.
    mv = client.get_model_version(name, version)
    aliases = tuple(a for a, v in client.get_registered_model(name).aliases.items() if str(v) == str(version))
    return VersionInfo(name=name, version=str(mv.version), tags=dict(mv.tags), aliases=aliases, run_id=mv.run_id)


def register_engine(target: RegistryTarget, engine_dir: Path, engine_sha256: str, record: RunRecord) -> Registration:
    """Log a run and create the model version (no alias: see `promote`).

    Idempotent by `engine_identity` and all-or-nothing: a failure (or SIGTERM) after
    the run or version exists rolls both back, and a registration killed outright is
    cleaned up by the next one (`_end_abandoned_runs`). Concurrent registrations of one
    model are serialised (`store_lock`), and one that still finds a twin afterwards
    (a tracking server the lock cannot reach) keeps the oldest version.
    """
    from mlflow.exceptions import MlflowException

    identity = engine_identity(engine_dir, engine_sha256)
    client = _client(target)
    with store_lock(target), tempfile.TemporaryDirectory(prefix="kiln-signature-") as scratch:
        _end_abandoned_runs(client, target)
        existing = find_version(target, identity)
        if existing is not None:
            return Registration(target.model_name, existing.version, existing.run_id, False, existing.aliases, _passed(existing.tags))
        signature = Path(scratch) / SIGNATURE_FILE
        signed_by = _sign(target.signing, engine_dir, signature)  # before anything is written: a key problem loses nothing
        run_id = None
        try:
            run_id = _create_run(client, target, engine_sha256)
            _log_run(client, run_id, engine_dir, record)
            if signed_by is not None:
                client.log_artifact(run_id, str(signature), ENGINE_ARTIFACT)
            _ensure_registered_model(client, target.model_name)
            source = f"{client.get_run(run_id).info.artifact_uri}/{ENGINE_ARTIFACT}"
            signer = {SIGNING_KEY: signed_by} if signed_by else {}
            version = client.create_model_version(
                target.model_name, source=source, run_id=run_id, tags=record.version_tags | identity | signer, description=_with_run_link(client, record.description, run_id)
            ).version
            client.set_terminated(run_id, "FINISHED")
        except (MlflowException, OSError) as err:
            _roll_back(client, target.model_name, run_id, "FAILED")
            message = err.message if isinstance(err, MlflowException) else str(err)
            raise RegistryError(f"registering {engine_dir} in {target.tracking_uri} failed, nothing kept: {message}") from err
        except BaseException:  # KeyboardInterrupt, SystemExit from SIGTERM
            _roll_back(client, target.model_name, run_id, "KILLED")
            raise
    return _keep_oldest_twin(client, target, identity, str(version), run_id, _passed(record.version_tags))


def _sign(signing: Signing, engine_dir: Path, signature: Path) -> str | None:
    """Sign the engine directory into `signature`: the key's fingerprint. Unsigned (None, with
    a warning) only where signatures are not required and this machine has no key."""
    if not check_signer(signing):
        log.warning("registering %s unsigned: registry.require_signature is false and there is no signing key at %s", engine_dir.name, signing.key)
        return None
    try:
        return sign(engine_dir, signing.key, signature)
    except KilnError as err:
        raise RegistryError(f"cannot sign {engine_dir.name}, nothing registered: {err}") from err


def _passed(tags: dict[str, str]) -> bool:
    return tags.get(GATES_PASSED) == "true"


@contextmanager
def store_lock(target: RegistryTarget) -> Iterator[None]:
    """Serialise writes to the embedded store: an advisory file lock beside the SQLite
    database covers every process on the machine (MLflow's own schema creation and alias
    updates race otherwise). Re-entrant within a process. A tracking server serialises
    nothing, so there `_keep_oldest_twin` reconciles registrations after the fact."""
    if not is_embedded(target):
        yield
        return
    with exclusive_lock(Path(target.tracking_uri.removeprefix("sqlite:///")).with_suffix(".kiln-lock")):
        yield


def _with_run_link(client, description: str, run_id: str) -> str:
    """The version page links to the run that registered it (a fragment link, so it works
    wherever the UI is served)."""
    run = RunLink(run_id, client.get_run(run_id).info.experiment_id)
    return f"{description.rstrip()}\n\nRegistered by [run {run_id[:12]}]({run.ui_fragment}/artifacts).\n"


def _create_run(client, target: RegistryTarget, engine_sha256: str) -> str:
    """A run tagged with who is registering, so a later registration can tell a run whose
    process was killed from one still in progress."""
    tags = {RUN_HOST: socket.gethostname(), RUN_PID: str(os.getpid())}
    return client.create_run(_experiment_id(client, target), run_name=f"engine-{engine_sha256[:12]}", tags=tags).info.run_id


def _end_abandoned_runs(client, target: RegistryTarget) -> None:
    """Runs left RUNNING by a registration killed on this host (its process is gone) end
    KILLED, and any version they created is deleted: the UI shows no run stuck RUNNING and
    the registry no version without a finished run."""
    experiment = client.get_experiment_by_name(target.experiment)
    if experiment is None:
        return
    query = f"attributes.status = 'RUNNING' and tags.`{RUN_HOST}` = '{socket.gethostname()}'"
    for run in client.search_runs([experiment.experiment_id], filter_string=query):
        pid = run.data.tags.get(RUN_PID, "")
        if pid.isdigit() and not process_alive(int(pid)):
            _roll_back(client, target.model_name, run.info.run_id, "KILLED")


def _keep_oldest_twin(client, target: RegistryTarget, identity: dict[str, str], version: str, run_id: str, passed: bool) -> Registration:
    """If another process registered the same engine meanwhile, the oldest version stays and
    this one is deleted: one engine is one version whatever the interleaving."""
    oldest = find_version(target, identity)
    if oldest is not None and oldest.version != version:
        _roll_back(client, target.model_name, run_id, "FAILED")
        return Registration(target.model_name, oldest.version, oldest.run_id, False, oldest.aliases, _passed(oldest.tags))
    return Registration(target.model_name, version, run_id, True, (), passed)


def log_training(target: RegistryTarget, model_sha256: str, record: RunRecord) -> RunLink:
    """The training run of one model (hyperparameters, loss curve, eval perplexity, its
    data), logged once: a model logged before is found by its `kiln.model_sha256` tag.
    Each engine run then points to it."""
    from mlflow.exceptions import MlflowException

    client = _client(target)
    with store_lock(target):
        experiment_id = _experiment_id(client, target)
        query = f"tags.`{RUN_MODEL_SHA256}` = '{model_sha256}' and attributes.status = 'FINISHED'"
        try:
            found = client.search_runs([experiment_id], filter_string=query, max_results=1)
            if found:
                return RunLink(found[0].info.run_id, experiment_id)
            tags = {RUN_MODEL_SHA256: model_sha256, RUN_KIND: "training"}
            run_id = client.create_run(experiment_id, run_name=f"train-{model_sha256[:12]}", tags=tags).info.run_id
        except MlflowException as err:
            raise RegistryError(f"cannot log the training run in {target.tracking_uri}: {err.message}") from err
        try:
            _log_record(client, run_id, record)
            client.set_terminated(run_id, "FINISHED")
        except (MlflowException, OSError) as err:
            client.set_terminated(run_id, "FAILED")
            raise RegistryError(f"logging the training run in {target.tracking_uri} failed: {err}") from err
    return RunLink(run_id, experiment_id)


def _log_run(client, run_id: str, engine_dir: Path, record: RunRecord) -> None:
    _log_record(client, run_id, record)
    client.log_artifacts(run_id, str(engine_dir), ENGINE_ARTIFACT)


def _log_record(client, run_id: str, record: RunRecord) -> None:
    import time

    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, 0) for k, v in record.metrics.items()]
    metrics += [Metric(k, float(v), now, step) for k, points in record.step_metrics.items() for step, v in points]
    params = [Param(k, str(v)[:6000]) for k, v in record.params.items()]
    for start in range(0, max(len(metrics), len(params)), 100):  # log_batch takes ≤ 100 params a call
        client.log_batch(run_id, metrics=metrics[start : start + 100], params=params[start : start + 100])
    if record.datasets:
        client.log_inputs(run_id, datasets=[_dataset_input(d) for d in record.datasets])
    for key, value in record.run_tags.items():
        client.set_tag(run_id, key, value)
    for artifact_path, local in record.artifacts.items():
        if local.is_dir():
            client.log_artifacts(run_id, str(local), artifact_path)
        else:
            client.log_artifact(run_id, str(local), artifact_path)


def _dataset_input(record: DatasetRecord):
    import json

    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT  # MLflow's own tag, not one of kiln's

    dataset = Dataset(
        name=record.name,
        digest=record.digest[:36],  # MLflow's digest column holds 36 characters
        source_type="local",
        source=json.dumps({"uri": record.source}),
        profile=json.dumps(record.profile),
    )
    return DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, record.context)])


def _ensure_registered_model(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="Engines built and gated by kiln.")


def _roll_back(client, name: str, run_id: str | None, status: str) -> None:
    """Undo a partial registration: delete every version the run created, end the run with
    `status`. Best effort, since the store itself may be what failed."""
    from mlflow.exceptions import MlflowException

    if run_id is None:
        return
    try:
        for version in client.search_model_versions(f"name='{name}' and run_id='{run_id}'"):
            client.delete_model_version(name, version.version)
        client.set_terminated(run_id, status)
    except MlflowException:
        pass


# ---------------------------------------------------------------- aliases and downloads


def alias_version(target: RegistryTarget, alias: str) -> VersionInfo | None:
    """The version `alias` names, or None while the model or the alias does not exist yet."""
    from mlflow.exceptions import MlflowException

    client = _client(target)
    try:
        version = client.get_registered_model(target.model_name).aliases.get(alias)
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise RegistryError(f"cannot read {target.model_name} in {target.tracking_uri}: {err.message}") from err
    return None if version is None else _version_info(client, target.model_name, str(version))


def resolve_alias(target: RegistryTarget, alias: str) -> VersionInfo:
    from mlflow.exceptions import MlflowException

    client = _client(target)
    try:
        version = client.get_model_version_by_alias(target.model_name, alias).version
    except MlflowException as err:
        raise RegistryError(f"{target.model_name}@{alias} does not resolve in {target.tracking_uri}: {err.message}") from err
    return _version_info(client, target.model_name, version)


def aliases_of(target: RegistryTarget) -> dict[str, str]:
    """Every alias of the registered model and the version it names, as the store has them
    now; none before the model exists."""
    from mlflow.exceptions import MlflowException

    try:
        return {alias: str(version) for alias, version in _client(target).get_registered_model(target.model_name).aliases.items()}
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":  # nothing registered yet (a run that built no engine)
            return {}
        raise RegistryError(f"cannot read the aliases of {target.model_name}: {err.message}") from err


def get_version(target: RegistryTarget, version: str) -> VersionInfo:
    """One version's tags and aliases; RegistryError naming it when there is no such version."""
    from mlflow.exceptions import MlflowException

    try:
        return _version_info(_client(target), target.model_name, version)
    except MlflowException as err:
        raise RegistryError(f"{target.model_name} has no version {version}: {err.message}") from err


def download_version(target: RegistryTarget, version: str, destination: Path) -> Path:
    """Download `models:/<name>/<version>` (a pinned version, so no alias can move mid-way)."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    shutil.rmtree(destination, ignore_errors=True)
    destination.mkdir(parents=True)
    try:
        # The version's own source URI: `models:/` URIs would resolve through the global
        # registry URI rather than this target's.
        source = _client(target).get_model_version_download_uri(target.model_name, version)
        path = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(destination), tracking_uri=target.tracking_uri)
    except (MlflowException, OSError) as err:
        raise RegistryError(f"cannot download {target.model_name} version {version}: {err}") from err
    return Path(path)


# ---------------------------------------------------------------- webhooks

ALIAS_EVENTS = ["model_version_alias.created", "model_version_alias.deleted"]


def register_alias_webhook(target: RegistryTarget, url: str, secret: str, purpose: str = "serve") -> str:
    """Have the tracking server POST alias changes to `url`, signed with `secret`; one
    webhook per URL (registering again updates it), named `kiln-<purpose>-<model>`. Only an
    `mlflow server` delivers them: a client writing to a SQLite file directly
    fires nothing."""
    from mlflow.exceptions import MlflowException

    client = _client(target)
    try:
        for hook in client.list_webhooks():
            if hook.url == url:
                return client.update_webhook(hook.webhook_id, events=ALIAS_EVENTS, secret=secret, status="ACTIVE").webhook_id
        name = f"kiln-{purpose}-{target.model_name}"
        return client.create_webhook(name=name, url=url, events=ALIAS_EVENTS, secret=secret).webhook_id
    except MlflowException as err:
        raise RegistryError(f"cannot register the webhook {url} with {target.tracking_uri}: {err.message}") from err


def tag_version(target: RegistryTarget, version: str, tags: dict[str, str]) -> VersionInfo:
    """Set tags on one version (evidence recorded after registration, such as a
    verification); returns the version as the store has it then."""
    from mlflow.exceptions import MlflowException

    client = _client(target)
    try:
        for key, value in tags.items():
            client.set_model_version_tag(target.model_name, version, key, value)
        return _version_info(client, target.model_name, version)
    except MlflowException as err:
        raise RegistryError(f"cannot tag {target.model_name} version {version}: {err.message}") from err


def log_version_report(target: RegistryTarget, version: str, path: str, report: dict) -> None:
    """A JSON report (a canary's steps, say) among the artifacts of the run that registered
    the version, at `path` (`canary/3.json`); the version's engine is not touched."""
    from mlflow.exceptions import MlflowException

    client = _client(target)
    try:
        run_id = client.get_model_version(target.model_name, version).run_id
        client.log_dict(run_id, report, path)
    except MlflowException as err:
        raise RegistryError(f"cannot record {path} on {target.model_name} version {version}: {err.message}") from err


def add_signature(target: RegistryTarget, version: str, signature: Path, signed_by: str) -> VersionInfo:
    """Put a signature beside a registered version's engine (into its run's `engine/`
    artifacts, which are the version's source) and record its key: `kiln keys sign-existing`."""
    from mlflow.exceptions import MlflowException

    client = _client(target)
    try:
        run_id = client.get_model_version(target.model_name, version).run_id
        client.log_artifact(run_id, str(signature), ENGINE_ARTIFACT)
        client.set_model_version_tag(target.model_name, version, SIGNING_KEY, signed_by)
        return _version_info(client, target.model_name, version)
    except (MlflowException, OSError) as err:
        raise RegistryError(f"cannot sign {target.model_name} version {version}: {err}") from err
