"""`kiln deploy`: the Prefect deployments that run retrain-and-rebuild by themselves, and
the verify-promotion flow.

    schedule (cron) ─┐
    kiln.data.changed ┼→ request-rebuild ──→ rebuild (one at a time) → retrain-and-rebuild
                      │   (coalesces)
    MLflow webhook → kiln.registry.alias-set → verify-promotion → verification.* tags

Every trigger goes through `request-rebuild`, whose runs decide in turn (holding a one-slot
Prefect concurrency limit): start a rebuild, or join the one already waiting (it starts
after the running one ends, so it sees every change made before it starts). A burst of
triggers therefore yields one running rebuild and at most one queued. `rebuild` itself
allows one run at a time (Prefect's deployment concurrency limit), so two rebuilds never
share the stage folders or race to register; the registry's own lock and sha256 check keep
an engine registered once.

On a work pool (`kiln deploy --pool`) the rebuild prepares data, model and ONNX, then starts
one `build-engines` run per build target on that target's work queue (`kiln worker
TARGET`) and gives `challenger` to the fastest version that passed, from the registry.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Failed, State

from components.config import CONTROL_QUEUE, Params, load_params
from components.errors import GateFailed, KilnError
from flows.events import ALIAS_SET, DATA_CHANGED, data_resource, registry_resource
from registry import RegistryTarget, VersionInfo

REBUILD, REQUEST_REBUILD, VERIFY_PROMOTION, BUILD_ENGINES = "rebuild", "request-rebuild", "verify-promotion", "build-engines"
WAITING = ("SCHEDULED", "PENDING")  # AwaitingConcurrencySlot is a SCHEDULED state


def _project(project: str, params_file: str) -> tuple[Path, Params]:
    """A flow run's project root and params, with kiln's environment set for that project."""
    from flows.environment import prepare_environment
    from flows.logs import hide_kiln_tracebacks, show_stage_notes

    root = Path(project)
    prepare_environment(root)
    hide_kiln_tracebacks()  # in the flow run's process: its failures print as their one-line messages
    show_stage_notes()
    from components.model_fit import fit_for_run

    params, notes = fit_for_run(load_params(root / params_file), root / params_file, root)
    for note in notes:
        get_run_logger().info(note)
    return root, params


@flow(name=REBUILD)
def rebuild(project: str, params_file: str = "params.yaml", reason: str = "started by hand", dispatch: bool = False) -> str:
    """retrain-and-rebuild on the project's params.yaml, as `kiln run` does; with
    `dispatch` (a work pool), the engines are built by one build-engines run per target."""
    from flows.pipeline import retrain_and_rebuild

    root, params = _project(project, params_file)
    if _is_main_thread():
        # A stopped `kiln deploy` or worker sends TERM: unwind, so a registration in progress rolls back.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    get_run_logger().info("rebuild: %s", reason)
    if dispatch:
        return _rebuild_on_targets(root, project, params_file, params)
    try:
        result = retrain_and_rebuild.fn(params, root)  # its tasks run in this flow run: one run to read, not two
    except GateFailed as err:
        return gates_failed(err)
    chosen = result.challenger
    return f"data {result.data.md5[:12]}: " + (f"version {chosen.registration.version} @challenger" if chosen else "no challenger")


def gates_failed(err: GateFailed) -> State:
    """A failed gate is a rebuild's outcome, not a crash: the run ends Failed with the
    failing numbers as its one state message, instead of a traceback for every flow it
    passed through (the failing engine is registered, never aliased)."""
    return Failed(message=str(err))


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def request_lock(model_name: str) -> str:
    """The Prefect global concurrency limit (one slot) that request-rebuild runs take in turn."""
    return f"kiln-rebuild-requests-{model_name}"


@flow(name=REQUEST_REBUILD)
def request_rebuild(project: str, params_file: str = "params.yaml", reason: str = "requested", overlap: str = "queue-one") -> str:
    """Start a rebuild, or join the one already waiting to start ("queue-one"); with "drop",
    a trigger while a rebuild runs or waits is dropped. The decision is taken holding a
    one-slot lock, so two triggers cannot both find no rebuild waiting and start two."""
    from prefect.concurrency.sync import concurrency

    _, params = _project(project, params_file)
    with concurrency(request_lock(params.registry.model_name), occupy=1, strict=True, timeout_seconds=600):
        return _start_or_join(project, params_file, params.registry.model_name, reason, overlap)


def _start_or_join(project: str, params_file: str, model_name: str, reason: str, overlap: str) -> str:
    from prefect.deployments import run_deployment

    deployment = f"{REBUILD}/{model_name}"
    waiting, running = _rebuild_runs(deployment)
    logger = get_run_logger()
    if waiting:
        logger.info("joined rebuild %s, waiting to start: it will see this change (%s)", waiting[0].name, reason)
        return f"joined {waiting[0].name}"
    if overlap == "drop" and running:
        logger.info("dropped (%s): rebuild %s is running and triggers.overlap is drop", reason, running[0].name)
        return f"dropped while {running[0].name} runs"
    requested_by = flow_run.get_name() or "a trigger"
    started = run_deployment(
        deployment, parameters={"project": project, "params_file": params_file, "reason": f"{reason} (via {requested_by})"},
        timeout=0, as_subflow=False, tags=["kiln-trigger"],
    )  # fmt: skip
    logger.info("started rebuild %s%s: %s", started.name, f" (queued behind {running[0].name})" if running else "", reason)
    return f"started {started.name}"


def ensure_request_lock(model_name: str) -> None:
    """Create the one-slot limit request-rebuild takes (kept if it exists)."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    name = request_lock(model_name)
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=1, active=True))
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))


def _rebuild_runs(deployment: str):
    """The deployment's runs waiting to start, and those running."""
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        deployment_id = client.read_deployment_by_name(deployment).id

        def runs(*types: str):
            state = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType(t) for t in types]))
            return client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])), flow_run_filter=FlowRunFilter(state=state)
            )

        return runs(*WAITING), runs("RUNNING")


def for_target(params: Params, target: str) -> Params:
    """The params narrowed to one build target's backend and precisions."""
    row = params.pool.targets[target]
    return params.model_copy(update={
        "build": params.build.model_copy(update={"backend": row.backend}),
        "precision": params.precision.model_copy(update={"build": row.precisions}),
    })  # fmt: skip


@flow(name=BUILD_ENGINES)
def build_engines(project: str, target: str, params_file: str = "params.yaml") -> str:
    """One target's engines of the model its rebuild prepared (found in the shared stage
    cache, not trained again): built, gated and registered; the rebuild picks the challenger."""
    from flows.pipeline import retrain_and_rebuild

    root, params = _project(project, params_file)
    try:
        result = retrain_and_rebuild.fn(for_target(params, target), root, choose=False)
    except GateFailed as err:
        return gates_failed(err)
    return "; ".join(f"{o.precision}: version {o.registration.version}" for o in result.outcomes)


def _rebuild_on_targets(root: Path, project: str, params_file: str, params: Params) -> str:
    """Data, model, ONNX once, here; then every target's build-engines run on its own work
    queue, at once; then the challenger: the fastest version of this model and data that
    passed its gates and is not worse than the champion, whichever machine built it."""
    from prefect.deployments import run_deployment

    from flows.pipeline import retrain_and_rebuild
    from registry import CHALLENGER, promote, registry_target

    shared = retrain_and_rebuild(params.model_copy(update={"precision": params.precision.model_copy(update={"build": []})}), root)
    runs = [
        run_deployment(f"{BUILD_ENGINES}/{params.registry.model_name}", parameters={"project": project, "params_file": params_file, "target": name},
                       work_queue_name=name, timeout=0, tags=[f"target:{name}"])
        for name in params.pool.targets
    ]  # fmt: skip
    finals = _wait_until_final([run.id for run in runs])
    registry = registry_target(params.registry, root)
    chosen = fastest_passing_version(registry, shared.model.sha256, shared.data.md5)
    if chosen is not None:
        promote(registry, CHALLENGER, version=chosen.version)
    failed = [f"{run.name} ({', '.join(run.tags)}): {run.state.message}" for run in finals if not run.state.is_completed()]
    if failed:
        raise KilnError("builds failed: " + "; ".join(failed))
    return f"data {shared.data.md5[:12]}, model {shared.model.sha256[:12]}: " + (f"version {chosen.version} @challenger" if chosen else "no challenger")


def _wait_until_final(run_ids: list, poll_s: float = 2.0) -> list:
    import time

    from prefect import get_client

    with get_client(sync_client=True) as client:
        while True:
            runs = [client.read_flow_run(run_id) for run_id in run_ids]
            if all(run.state is not None and run.state.is_final() for run in runs):
                return runs
            time.sleep(poll_s)


def fastest_passing_version(registry: RegistryTarget, model_sha256: str, data_md5: str) -> VersionInfo | None:
    """The pool's challenger: of this model's and data's versions, whichever machine built
    them, the one with the lowest median latency that passed its gates and is not worse
    than the champion (the same rule as `flows.pipeline.choose_challenger`)."""
    from registry import tags, versions_tagged

    versions = versions_tagged(registry, {tags.SOURCE_MODEL_SHA256: model_sha256, tags.DATA_MD5: data_md5, tags.GATES_PASSED: tags.TRUE})
    eligible = [v for v in versions if v.tags.get(tags.CHAMPION_GATE_PASSED) != tags.FALSE]
    return min(eligible, key=lambda v: float(v.tags[tags.gate_number("latency", "p50_ms")]), default=None)


@flow(name=VERIFY_PROMOTION)
def verify_promotion(project: str, alias: str, version: str, params_file: str = "params.yaml") -> str:
    """Check a version an alias was just set to, here, and tag the version with the result."""
    from flows.verification import record_verification, verify_version
    from registry import registry_target

    root, params = _project(project, params_file)
    target = registry_target(params.registry, root)
    verification = verify_version(target, version, params, root)
    record_verification(target, verification, alias, flow_run.get_id())
    if not verification.passed:
        raise KilnError(f"{params.registry.model_name} version {version} (@{alias}) failed verification: {verification.failure}")
    quality = verification.quality.measured if verification.quality else {}
    return f"version {version} verified: top1 {quality.get('top1_agreement', float('nan')):.4f}, ppl {quality.get('ppl_increase_pct', float('nan')):+.3f} %"


@dataclass(frozen=True)
class Served:
    """One deployment `kiln deploy` serves, and what starts it, in words."""

    name: str
    starts_on: str


def deployments(root: Path, params_file: str, params: Params, pool: bool = False) -> tuple[list, list[Served]]:
    """The RunnerDeployments for this project, and what each starts on. With `pool`, they
    are meant for a work pool: rebuild dispatches to build-engines, one run per target."""
    from prefect._internal.versioning import VersionType  # to_deployment's own type; not re-exported
    from prefect.types.entrypoint import EntrypointType

    # By module, not file path: loading flows/deployments.py by path puts flows/ first on
    # sys.path, where flows/serving.py then shadows the serving package.
    # A plain version: otherwise each registration runs git five times over (Prefect infers a
    # GitHub, GitLab, ... version from the working directory, which is a project, not kiln).
    common = {"entrypoint_type": EntrypointType.MODULE_PATH, "version_type": VersionType.SIMPLE}
    if pool:
        common["work_queue_name"] = CONTROL_QUEUE
    base = {"project": str(root), "params_file": params_file}
    served, described = _rebuild_deployments(params, base, common, pool)
    if params.triggers.on_promotion:
        served.append(_verify_deployment(params, base, common))
        described.append(
            Served(f"{VERIFY_PROMOTION}/{params.registry.model_name}", f"{ALIAS_SET} events for {', '.join(params.triggers.verify_aliases)} (MLflow webhook)")
        )
    if pool:
        first = next(iter(params.pool.targets))
        served.append(build_engines.to_deployment(params.registry.model_name, **(common | {"work_queue_name": first}), parameters=base,
                                                  description="one build target's engines (its work queue)"))  # fmt: skip
        described.append(Served(f"{BUILD_ENGINES}/{params.registry.model_name}", "rebuild, one run per target: " + ", ".join(params.pool.targets)))
    return served, described


def _rebuild_deployments(params: Params, base: dict, common: dict, pool: bool) -> tuple[list, list[Served]]:
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.events import DeploymentEventTrigger
    from prefect.schedules import Cron

    name, triggers = params.registry.model_name, params.triggers
    events, starts = [], []
    if triggers.on_data_change:
        events.append(DeploymentEventTrigger(
            name=f"{name}: data changed", expect={DATA_CHANGED}, match={"prefect.resource.id": data_resource(name)["prefect.resource.id"]},
            parameters={"reason": "data changed to {{ event.payload.md5 }} ({{ event.payload.how }})"},
        ))  # fmt: skip
        starts.append(f"{DATA_CHANGED} events")
    if triggers.schedule:
        starts.append(f"cron {triggers.schedule} ({triggers.timezone})")
    one_at_a_time = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
    served = [
        rebuild.to_deployment(name, **common, parameters=base | {"dispatch": pool}, concurrency_limit=one_at_a_time, description="retrain-and-rebuild, one at a time"),
        request_rebuild.to_deployment(
            name, **common, parameters=base | {"overlap": triggers.overlap, "reason": "schedule"},
            schedule=Cron(triggers.schedule, timezone=triggers.timezone) if triggers.schedule else None, triggers=events,
            description="starts a rebuild or joins the one waiting",
        ),
    ]  # fmt: skip
    described = [
        Served(f"{REBUILD}/{name}", f"request-rebuild ({triggers.overlap})"),
        Served(f"{REQUEST_REBUILD}/{name}", ", ".join(starts) or "nothing (triggers off)"),
    ]
    return served, described


def _verify_deployment(params: Params, base: dict, common: dict):
    from prefect.events import DeploymentEventTrigger

    name = params.registry.model_name
    trigger = DeploymentEventTrigger(
        name=f"{name}: alias set", expect={ALIAS_SET}, match={"prefect.resource.id": registry_resource(name)["prefect.resource.id"]},
        parameters={"alias": "{{ event.payload.alias }}", "version": "{{ event.payload.version }}"},
    )  # fmt: skip
    return verify_promotion.to_deployment(name, **common, parameters=base, triggers=[trigger], description="re-check a promoted version here")


def apply_to_pool(served: list, pool: str) -> None:
    """Register the deployments on a process work pool (made if missing); its workers run them."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        except ObjectAlreadyExists:
            pass
    for deployment in served:
        deployment.apply(work_pool_name=pool)
