"""`kiln promote --canary`: a Prefect flow run that moves a version through the fleet's traffic
steps (serving.canary's loop), with each step, its measurements and the outcome recorded on
the MLflow version (tags, and a JSON report among its run's artifacts) and as a Prefect table.

Before any traffic the version passes `kiln promote`'s checks (gates, artifacts, signature):
a refused version never reaches a client. Promotion moves `champion` (the stable replicas
follow it), waits until they serve it, then takes the canary's share back to 0 and drains it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.artifacts import create_table_artifact

from components.config import Params
from components.errors import KilnError
from components.workspace import Workspace
from flows.fleet import fleet_haproxy, fleet_options
from flows.serving import server_settings
from registry import CHAMPION, check_promotable, log_version_report, promote, registry_target, tag_version
from serving.canary import ROLLED_BACK, CanaryActions, CanaryOutcome, CanaryPolicy, Prometheus, StepCheck, check_step, run_canary

TAG_PREFIX = "canary."


class CanaryError(KilnError):
    """The canary could not be put on the fleet (or taken off it)."""


@dataclass(frozen=True)
class CanaryRun:
    """What the flow needs besides params.yaml (picklable: Prefect hands it to tasks)."""

    root: Path
    version: str
    by: str
    address: str


def policy_of(params: Params) -> CanaryPolicy:
    config = params.canary
    return CanaryPolicy(config.interval_s, config.threshold, config.weights, config.min_success_rate, config.max_p99_ms, config.max_p99_ratio)


@flow(name="canary-promotion", log_prints=False)
def canary_promotion(params: Params, run: CanaryRun) -> CanaryOutcome:
    target = registry_target(params.registry, run.root)
    check_promotable(target, run.version)  # before any traffic
    started = datetime.now(UTC).isoformat(timespec="seconds")
    task(name="deploy-canary", cache_policy=NO_CACHE)(_deploy_canary)(params, run)
    files, prometheus, policy = fleet_haproxy(run.root), Prometheus(params.canary.prometheus_url), policy_of(params)

    def roll_back(reason: str) -> None:
        _retire_canary(files, run.address)
        get_run_logger().warning("canary of version %s rolled back: %s", run.version, reason)

    def promote_it() -> None:
        promote(target, CHAMPION, version=run.version, by=run.by, reason=f"canary passed {len(policy.weights)} steps")
        _wait_for_stable(run, params)
        _retire_canary(files, run.address)

    actions = CanaryActions(
        set_weight=lambda weight: _set_weight(files, weight),
        check=task(name="canary-step-check", cache_policy=NO_CACHE)(lambda step, weight: check_step(prometheus, policy, step, weight)),
        promote=promote_it,
        roll_back=roll_back,
        on_step=lambda check: _record_step(target, run.version, check),
    )
    try:
        _wait_until_watched(files, prometheus)
        outcome = run_canary(run.version, policy, actions)
    except BaseException as err:  # a broken analysis must not leave the canary with traffic
        reason = f"the analysis stopped: {type(err).__name__}: {err}"
        roll_back(reason)
        _record_outcome(target, run.version, CanaryOutcome(run.version, ROLLED_BACK, [], reason), started)
        raise
    _record_outcome(target, run.version, outcome, started)
    return outcome


def _deploy_canary(params: Params, run: CanaryRun) -> None:
    from serving.fleet import CANARY, deploy
    from serving.sources import VersionSource

    target = registry_target(params.registry, run.root)
    source = VersionSource(target, run.version, Workspace(run.root).serving_cache, keep_versions=params.serving.keep_versions)
    options = replace(fleet_options(params.serving.fleet), replicas=params.canary.replicas)
    try:
        deploy(source, server_settings(run.root, params, follows_alias=False), options, run.address, app=CANARY)
    except (ConnectionError, RuntimeError) as err:
        raise CanaryError(f"version {run.version} could not be deployed as the canary: {err}") from err


def _wait_until_watched(files, prometheus: Prometheus, timeout_s: float = 120.0) -> None:
    """Before any traffic: HAProxy's checks pass on the canary (else its share would be
    answered 503) and Prometheus scrapes it (else the first check would count nothing)."""
    from serving.haproxy import CANARY_BACKEND, servers_up

    deadline = time.monotonic() + timeout_s
    while not (servers_up(files, CANARY_BACKEND) and prometheus.scalar('count(up{app="canary"} == 1)')):
        if time.monotonic() > deadline:
            raise CanaryError(f"the canary was not both up in HAProxy and scraped by Prometheus ({prometheus.url}) within {timeout_s:g} s")
        time.sleep(1.0)


def _set_weight(files, weight: int) -> None:
    from serving.haproxy import set_canary_weight

    set_canary_weight(files, weight)
    get_run_logger().info("canary at %d %% of requests", weight)


def _retire_canary(files, address: str) -> None:
    """No more new requests to the canary, then its replicas drained (their streams finish) and removed."""
    from serving.fleet import CANARY, remove
    from serving.haproxy import set_canary_weight

    try:
        set_canary_weight(files, 0)
    finally:  # HAProxy unreachable: the canary still goes, and its share with it
        remove(CANARY, address)


def _wait_for_stable(run: CanaryRun, params: Params, timeout_s: float = 600.0) -> None:
    """Until every stable replica serves the promoted version (each follows the alias)."""
    from serving.fleet import STABLE, replicas

    deadline = time.monotonic() + timeout_s
    while True:
        stable = [r for r in replicas(run.address) if r.app == STABLE]
        if stable and all(r.version == run.version for r in stable):
            return
        if time.monotonic() > deadline:
            raise CanaryError(f"the stable replicas did not take version {run.version} within {timeout_s:g} s: {[(r.replica_id, r.version) for r in stable]}")
        time.sleep(min(2.0, params.serving.poll_interval_s or 2.0))


def _record_step(target, version: str, check: StepCheck) -> None:
    tag_version(target, version, {f"{TAG_PREFIX}step.{check.step}": json.dumps(asdict(check) | {"passed": check.passed})})


def _record_outcome(target, version: str, outcome: CanaryOutcome, started: str) -> None:
    finished = datetime.now(UTC).isoformat(timespec="seconds")
    tag_version(target, version, {f"{TAG_PREFIX}outcome": outcome.outcome, f"{TAG_PREFIX}reason": outcome.reason, f"{TAG_PREFIX}started": started, f"{TAG_PREFIX}finished": finished})
    report = {"version": version, "outcome": outcome.outcome, "reason": outcome.reason, "started": started, "finished": finished, "steps": [asdict(s) | {"passed": s.passed} for s in outcome.steps]}
    log_version_report(target, version, f"canary/{started.replace(':', '')}.json", report)
    create_table_artifact(
        key=f"canary-{target.model_name.lower()}-{version}".replace("_", "-"),
        table=[{"step": s.step, "weight %": s.weight, "canary requests": s.canary_requests, "success %": s.success_rate, "p99 ms": s.p99_ms, "stable p99 ms": s.stable_p99_ms, "failures": "; ".join(s.failures)} for s in outcome.steps],
        description=f"Canary of version {version}: {outcome.outcome} ({outcome.reason})",
    )
