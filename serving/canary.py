"""A canary's analysis, as Flagger and Argo Rollouts run one: the new version gets a growing
share of the fleet's requests, each share held for an interval and then checked against
live Prometheus (the canary's success rate and p99 latency, beside the stable version's);
`threshold` failed checks roll it back, passing the last step promotes it.

The loop is `run_canary`, driven through the actions a fleet gives it (HAProxy's weight,
the check, promotion and rollback), so that what it decides reads apart from how.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import httpx

from components.errors import KilnError

PROMOTED, ROLLED_BACK = "promoted", "rolled_back"
# Answers that count against a version, as Flagger's request-success-rate counts 5xx: a bad
# request (4xx) is the client's.
FAILED_OUTCOMES = "error|rejected_busy"


@dataclass(frozen=True)
class CanaryPolicy:
    """params.yaml's `canary` section, in seconds and fractions."""

    interval_s: float
    threshold: int
    weights: tuple[int, ...]  # each step's percentage of requests
    min_success_rate: float  # percent
    max_p99_ms: float
    max_p99_ratio: float  # of the stable version's p99


@dataclass(frozen=True)
class StepCheck:
    """One step's measurements over its interval, and the verdict."""

    step: int
    weight: int
    at: str  # when it was checked (UTC, ISO 8601)
    canary_requests: float
    stable_requests: float
    success_rate: float | None  # percent
    p99_ms: float | None
    stable_p99_ms: float | None
    failures: list[str] = field(default_factory=list)  # empty: passed

    @property
    def passed(self) -> bool:
        return not self.failures


@dataclass(frozen=True)
class CanaryOutcome:
    version: str
    outcome: str  # PROMOTED or ROLLED_BACK
    steps: list[StepCheck]
    reason: str  # why it was rolled back, or "every step passed"


class PrometheusUnreachable(KilnError):
    """canary.prometheus_url does not answer queries."""


class Prometheus:
    """Instant queries against a Prometheus server's HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def scalar(self, expr: str) -> float | None:
        """The query's one value; None where it has none (no series, or NaN: nothing counted)."""
        try:
            answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
            answer.raise_for_status()
        except httpx.HTTPError as err:
            raise PrometheusUnreachable(f"Prometheus at {self.url} did not answer `{expr}`: {err}") from None
        result = answer.json()["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if math.isnan(value) else value


def check_step(prometheus: Prometheus, policy: CanaryPolicy, step: int, weight: int) -> StepCheck:
    """The canary and stable applications' requests, success rate and p99 request duration
    over the last interval (series labelled `app` by the fleet's service discovery), and
    what failed of the policy's limits."""
    window = f"{max(1, round(policy.interval_s))}s"

    def requests(app: str, outcomes: str = ".*") -> float:
        return prometheus.scalar(f'sum(increase(kiln_requests_total{{app="{app}",outcome=~"{outcomes}"}}[{window}]))') or 0.0

    def p99_ms(app: str) -> float | None:
        seconds = prometheus.scalar(f'histogram_quantile(0.99, sum by (le) (increase(kiln_request_duration_seconds_bucket{{app="{app}"}}[{window}])))')
        return None if seconds is None else seconds * 1000

    canary, stable = requests("canary"), requests("stable")
    success = None if canary == 0 else 100.0 * (1 - requests("canary", FAILED_OUTCOMES) / canary)
    check = StepCheck(step, weight, datetime.now(UTC).isoformat(timespec="seconds"), canary, stable, success, p99_ms("canary"), p99_ms("stable"))
    return replace(check, failures=failures_of(check, policy))


def failures_of(check: StepCheck, policy: CanaryPolicy) -> list[str]:
    """What a step's measurements break of the policy; nothing measured is a failure too (a
    canary that got no requests proved nothing)."""
    if check.canary_requests == 0 or check.success_rate is None or check.p99_ms is None:
        return [f"no requests reached the canary in {policy.interval_s:g} s at {check.weight} %"]
    failures = []
    if check.success_rate < policy.min_success_rate:
        failures.append(f"success rate {check.success_rate:.2f} % < {policy.min_success_rate:g} %")
    if check.p99_ms > policy.max_p99_ms:
        failures.append(f"p99 {check.p99_ms:.0f} ms > the budget of {policy.max_p99_ms:g} ms")
    if check.stable_p99_ms is not None and check.p99_ms > policy.max_p99_ratio * check.stable_p99_ms:
        failures.append(f"p99 {check.p99_ms:.0f} ms > {policy.max_p99_ratio:g} × the stable version's {check.stable_p99_ms:.0f} ms")
    return failures


@dataclass(frozen=True)
class CanaryActions:
    """What the loop does to the world."""

    set_weight: Callable[[int], None]
    check: Callable[[int, int], StepCheck]  # (step, weight) → its measurements over the interval
    promote: Callable[[], None]  # champion to the canary, then the canary's traffic back to stable
    roll_back: Callable[[str], None]  # weight 0, the canary drained and gone; the reason
    on_step: Callable[[StepCheck], None] = lambda _check: None
    sleep: Callable[[float], None] = time.sleep


def run_canary(version: str, policy: CanaryPolicy, act: CanaryActions) -> CanaryOutcome:
    """Each weight in turn, held for the interval then checked; `threshold` failed checks
    (counted over the whole analysis, as Flagger counts them) roll back at once. A failed
    check holds the weight for another interval rather than advancing."""
    steps: list[StepCheck] = []
    failed = 0
    weights = list(policy.weights)
    while weights:
        weight = weights[0]
        act.set_weight(weight)
        act.sleep(policy.interval_s)
        check = _checked(act, len(steps) + 1, weight)
        steps.append(check)
        act.on_step(check)
        if check.passed:
            weights.pop(0)
            continue
        failed += 1
        if failed >= policy.threshold:
            reason = f"{failed} failed checks (threshold {policy.threshold}); the last at {weight} %: {'; '.join(check.failures)}"
            act.roll_back(reason)
            return CanaryOutcome(version, ROLLED_BACK, steps, reason)
    act.promote()
    return CanaryOutcome(version, PROMOTED, steps, "every step passed")


def _checked(act: CanaryActions, step: int, weight: int) -> StepCheck:
    """The step's check; one that cannot run (Prometheus unreachable, say) is a failed check,
    as Flagger counts a metric it cannot read."""
    try:
        return act.check(step, weight)
    except Exception as err:  # httpx's, or a malformed answer: the canary is not judged safe
        at = datetime.now(UTC).isoformat(timespec="seconds")
        return StepCheck(step, weight, at, 0.0, 0.0, None, None, None, [f"the check could not run: {type(err).__name__}: {err}"])
