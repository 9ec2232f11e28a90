"""`kiln deploy`: serve the project's deployments (flows.deployments) against a running
Prefect server until Ctrl-C or SIGTERM, with the two listeners that turn outside changes
into Prefect events: the data watcher (data.dvc vs the last run) and the MLflow webhook
receiver (an alias set → verify-promotion)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

from components.config import Params
from components.errors import KilnError
from flows import render
from flows.servers import answers, reachable_host


@dataclass(frozen=True)
class DeploySettings:
    prefect_api_url: str  # a running server (kiln up's): schedules and triggers live there
    mlflow_url: str  # an `mlflow server` on the project's store: only it delivers webhooks


def _prefect_answers(api_url: str) -> bool:
    """Whether the Prefect server behind an API URL (`.../api`) answers its health check."""
    return answers(f"{api_url.rstrip('/')}/health")


def check_servers(settings: DeploySettings, params: Params) -> None:
    """Both servers answer, before anything is registered or served."""
    if not _prefect_answers(settings.prefect_api_url):
        raise KilnError(f"no Prefect server answers at {settings.prefect_api_url}: start one with `kiln up` (or point PREFECT_API_URL at yours)")
    if params.triggers.on_promotion and not answers(f"{settings.mlflow_url.rstrip('/')}/health"):
        raise KilnError(
            f"no MLflow server answers at {settings.mlflow_url}, and only an MLflow server delivers the alias webhooks that start "
            "verify-promotion: start `kiln up`, pass --mlflow-url, or set triggers.on_promotion: false"
        )  # fmt: skip


def serve_deployments(root: Path, params_file: str, params: Params, settings: DeploySettings, pool: bool = False) -> None:
    """Serve the deployments here (a Runner in this process), or with `pool` register them on
    the params' work pool for `kiln worker`s to run; either way the listeners run here."""
    check_servers(settings, params)
    os.environ["PREFECT_API_URL"] = settings.prefect_api_url  # before prefect is imported
    os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", "2")  # a local server: seconds, not the default 10
    from flows.deployments import apply_to_pool, deployments, ensure_request_lock

    ensure_request_lock(params.registry.model_name)
    served, descriptions = deployments(root, params_file, params, pool=pool)
    where = f"work pool {params.pool.name!r} (kiln worker {'|'.join(params.pool.targets)})" if pool else "this process"
    listeners: list[tuple[str, object]] = []

    def open_for_triggers() -> None:
        """Once the server holds the deployments (and their triggers): the listeners that
        feed them, then the table. In that order, no event arrives before its automation
        and nobody reads the table before the server has what it lists."""
        listeners.extend(_start_listeners(root, params, settings))
        render.deployments(descriptions, [name for name, _ in listeners], settings.prefect_api_url, where)

    try:
        if pool:
            apply_to_pool(served, params.pool.name)
            open_for_triggers()
            threading.Event().wait()  # until Ctrl-C or SIGTERM (SystemExit from the CLI's handler)
        else:
            asyncio.run(_serve_here(params, served, open_for_triggers, settings.prefect_api_url))
    finally:
        for _, listener in listeners:
            listener.stop()


async def _serve_here(params: Params, served: list, registered: Callable[[], None], api_url: str) -> None:
    """A Runner in this process. Registered from this loop (`aadd_deployment`) rather than
    through `add_deployment`, which hands each one to Prefect's global loop thread."""
    from prefect.runner import Runner

    # Pausing on the way out is ours (`_pause`), not the Runner's: it would retry against a
    # server that is already gone (kiln up stopped first) for a minute, then fail.
    runner = Runner(name=f"kiln-deploy-{params.registry.model_name}", pause_on_shutdown=False)
    ids = [await runner.aadd_deployment(deployment) for deployment in served]
    registered()
    try:
        await runner.start()
    finally:
        await _pause(ids, api_url)


async def _pause(deployment_ids: list[UUID], api_url: str) -> None:
    """Pause the deployments this process served, so that their schedules stop piling up
    runs that nobody here will execute; with the server gone there is nothing to pause."""
    if not _prefect_answers(api_url):
        render.note(f"the Prefect server at {api_url} is gone: the deployments stay as they were")
        return
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        for deployment_id in deployment_ids:
            await client.pause_deployment(deployment_id)
    render.console.print(f"paused {len(deployment_ids)} deployments; kiln deploy stopped")


def run_worker(root: Path, params: Params, target: str, prefect_api_url: str) -> None:
    """`kiln worker TARGET`: a Prefect process worker on the pool, taking the target's build
    runs and the control queue's rebuilds and verifications, until Ctrl-C or SIGTERM."""
    if target not in params.pool.targets:
        raise KilnError(f"no build target {target!r} in pool.targets (params.yaml has {', '.join(params.pool.targets)})")
    if not _prefect_answers(prefect_api_url):
        raise KilnError(f"no Prefect server answers at {prefect_api_url}: start it first (kiln up, or prefect server start)")
    from components.config import CONTROL_QUEUE

    os.environ["PREFECT_API_URL"] = prefect_api_url  # before prefect is imported
    os.chdir(root)  # the worker's flow runs start here
    row = params.pool.targets[target]
    render.console.print(
        f"worker for target {target} ({row.backend}: {', '.join(row.precisions)}) on pool {params.pool.name}, queues {target} and {CONTROL_QUEUE}"
    )
    asyncio.run(_work(params.pool.name, [target, CONTROL_QUEUE], f"kiln-{target}-{socket.gethostname()}"))


async def _work(pool: str, queues: list[str], name: str) -> None:
    """The worker in this process rather than `prefect worker start`, whose SIGTERM handling
    (forwarded to itself as SIGINT) left it running in Prefect 3.9: TERM and INT cancel it."""
    from prefect.workers.process import ProcessWorker

    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, main.cancel)
    try:
        async with ProcessWorker(work_pool_name=pool, work_queues=queues, name=name) as worker:
            await worker.start()
    except asyncio.CancelledError:
        render.console.print(f"worker {name} stopped")


def _start_listeners(root: Path, params: Params, settings: DeploySettings) -> list[tuple[str, object]]:
    listeners: list[tuple[str, object]] = []
    triggers = params.triggers
    if triggers.on_data_change and triggers.data_poll_interval_s > 0:
        from flows.data_changes import DataWatcher

        watcher = DataWatcher(root, params, triggers.data_poll_interval_s, lambda change: _announce_data(root, params, change))
        listeners.append((f"data watcher: {params.data.path}.dvc vs the last run's data, every {triggers.data_poll_interval_s:g} s", watcher.start()))
    if triggers.on_promotion:
        receiver, hook = _start_receiver(root, params, settings)
        listeners.append((f"MLflow webhook receiver {hook} (registered with {settings.mlflow_url})", receiver))
    return listeners


def _announce_data(root: Path, params: Params, change) -> None:
    from flows.data_changes import announce_data_change
    from flows.events import DATA_CHANGED

    announce_data_change(root, params, change)
    render.console.print(f"data.dvc now names {change.md5} (the last run's was {change.previous}): announced {DATA_CHANGED}")


def _start_receiver(root: Path, params: Params, settings: DeploySettings):
    from flows.serving import ensure_webhook_secret
    from registry import RegistryTarget, register_alias_webhook
    from serving.hook_receiver import ReceiverThread, alias_hook_app

    triggers = params.triggers
    secret = ensure_webhook_secret(root)
    app = alias_hook_app(secret, params.serving.webhook_max_age_s, lambda event: _announce_alias(params, event))
    try:
        receiver = ReceiverThread(app, triggers.webhook_host, triggers.webhook_port).start()
    except OSError as err:
        raise KilnError(str(err)) from err
    hook = f"http://{reachable_host(triggers.webhook_host)}:{triggers.webhook_port}/hooks/mlflow"
    register_alias_webhook(RegistryTarget(settings.mlflow_url, params.registry.model_name, params.registry.experiment), hook, secret, purpose="deploy")
    return receiver, hook


def _announce_alias(params: Params, event) -> bool:
    """An alias set on this project's model, for an alias verify-promotion checks → the event."""
    from flows.events import ALIAS_SET, announce, registry_resource

    wanted = event.model == params.registry.model_name and event.alias in params.triggers.verify_aliases
    if not (wanted and event.action == "created" and event.version):
        return False
    announce(ALIAS_SET, registry_resource(event.model), {"model": event.model, "alias": event.alias, "version": event.version})
    return True
