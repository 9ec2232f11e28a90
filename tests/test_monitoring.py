"""The dashboard and the Prometheus rules kiln ships (deploy/): generated, parsed and unit
tested by Prometheus's own promtool (Debian's `prometheus` package; skipped without it).
That every metric they query is one kiln serve exports is checked against a live server's
/metrics in test_serving.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from PIL import Image

from components.config import load_params
from flows import monitoring
from flows.dashboard_render import render
from registry import CHAMPION, RegistryTarget, promote, register_engine
from serving.app import ServerSettings, create_app
from serving.sources import AliasSource

from .conftest import SIGNING, new_mlflow_store
from .live_server import LiveServer, prometheus, wait_for
from .test_registry import record

ROOT = Path(__file__).resolve().parents[1]
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`; .ci/run installs it)")
needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (Debian package `prometheus`; .ci/run installs it)")


@pytest.fixture(scope="module")
def shipped():
    return load_params(ROOT / "params.yaml")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def dashboard_expressions(board: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets, variables, annotations."""
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets") or []]
    exprs += [a["expr"] for a in board["annotations"]["list"] if "expr" in a]
    exprs += [re.fullmatch(r"label_values\((.*), \w+\)", v["query"]).group(1) for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def as_promql(expr: str) -> str:
    """Grafana's variables as Prometheus sees them once Grafana has filled them in."""
    return expr.replace("$__rate_interval", "5m").replace("$version", ".*")


def test_the_checked_in_dashboard_and_rules_are_what_kiln_monitoring_makes(shipped):
    for relative, text in monitoring.rendered(shipped).items():
        assert (ROOT / relative).read_text() == text, f"{relative} is stale: run `kiln monitoring`"


def test_the_dashboard_has_the_panels_and_variables_a_person_on_call_needs(shipped):
    board = monitoring.dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "kiln_served_engine_info" in variables["version"]["query"]
    titles = {p["title"] for p in board["panels"]}
    assert {"Requests / s by outcome", "Error ratio", "Whole requests", "Time to first token", "Time per output token", "Swaps by result", "GPU memory"} <= titles
    whole = next(p for p in board["panels"] if p["title"] == "Whole requests")
    assert [t["legendFormat"] for t in whole["targets"]] == ["p50", "p95", "p99", "p99.9"]
    assert all("[$__rate_interval]" in t["expr"] for t in whole["targets"])
    assert all(t["datasource"]["uid"] == "${datasource}" for p in board["panels"] for t in p.get("targets") or [])


@needs_promtool
def test_every_expression_of_the_rules_and_the_dashboard_parses(shipped, tmp_path):
    rules = tmp_path / "rules.yml"
    rules.write_text(monitoring.rendered(shipped)[monitoring.RULES_FILE])
    assert promtool("check", "rules", str(rules)).returncode == 0
    as_rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:expr_{i}", "expr": as_promql(e)} for i, e in enumerate(dashboard_expressions(monitoring.dashboard()))]}]}
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(as_rules))
    checked = promtool("check", "rules", str(tmp_path / "dashboard.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    broken = {"groups": [{"name": "broken", "rules": [{"record": "broken:x", "expr": "sum(rate(kiln_requests_total[5m]"}]}]}
    (tmp_path / "broken.yml").write_text(yaml.safe_dump(broken))
    assert promtool("check", "rules", str(tmp_path / "broken.yml")).returncode != 0  # the check can fail


def _histogram(name: str, instance: str, counts: dict[str, str]) -> list[dict]:
    """Series of a histogram's buckets; `counts` maps `le` to promtool's value notation."""
    return [{"series": f'{name}_bucket{{job="kiln-serve",instance="{instance}",le="{le}"}}', "values": values} for le, values in counts.items()]


def _series(name: str, instance: str, values: str, **labels: str) -> dict:
    extra = "".join(f',{k}="{v}"' for k, v in labels.items())
    return {"series": f'{name}{{job="kiln-serve",instance="{instance}"{extra}}}', "values": values}


RISING, FLAT = "0+10x40", "0+0x40"
# alert → (series where instance "bad" breaks it and "good" does not, when to look, the bad alert's labels)
ALERT_CASES = {
    "KilnRequestLatencyOverBudget": (
        _histogram("kiln_request_duration_seconds", "bad", {"0.1": FLAT, "1": FLAT, "2.5": FLAT, "5": RISING, "+Inf": RISING})
        + _histogram("kiln_request_duration_seconds", "good", {"0.1": RISING, "1": RISING, "2.5": RISING, "5": RISING, "+Inf": RISING}),
        "25m", {"instance": "bad"},
    ),
    "KilnTimeToFirstTokenOverBudget": (
        _histogram("kiln_time_to_first_token_seconds", "bad", {"0.1": FLAT, "1": FLAT, "2.5": RISING, "+Inf": RISING})
        + _histogram("kiln_time_to_first_token_seconds", "good", {"0.1": RISING, "1": RISING, "2.5": RISING, "+Inf": RISING}),
        "25m", {"instance": "bad"},
    ),
    "KilnErrorRatioHigh": (
        [_series("kiln_requests_total", "bad", "0+5x40", outcome="error"), _series("kiln_requests_total", "bad", RISING, outcome="ok"),
         _series("kiln_requests_total", "good", FLAT, outcome="error"), _series("kiln_requests_total", "good", RISING, outcome="ok")],
        "20m", {"instance": "bad"},
    ),
    "KilnNoReadyEngine": ([_series("kiln_ready", "bad", "0x20"), _series("kiln_ready", "good", "1x20")], "10m", {"job": "kiln-serve", "instance": "bad"}),
    "KilnSwapRefused": (
        [_series("kiln_engine_swaps_total", "bad", "0x3 1x10", result="refused"), _series("kiln_engine_swaps_total", "good", "0x3 1x10", result="swapped"),
         _series("kiln_engine_swaps_total", "good", "0x13", result="refused")],
        "6m", {"job": "kiln-serve", "instance": "bad", "result": "refused"},
    ),
    "KilnEngineProcessRestarted": (
        [_series("kiln_engine_process_start_time_seconds", "bad", "1000x3 2000x10"), _series("kiln_engine_process_start_time_seconds", "good", "1000x13")],
        "6m", {"job": "kiln-serve", "instance": "bad"},
    ),
    "KilnWaitingLineNearFull": ([_series("kiln_queue_depth", "bad", "60x20"), _series("kiln_queue_depth", "good", "3x20")], "12m", {"job": "kiln-serve", "instance": "bad"}),
    "KilnScrapeTargetDown": ([_series("up", "bad", "0x10"), _series("up", "good", "1x10")], "5m", {"job": "kiln-serve", "instance": "bad"}),
    "KilnServingUnsignedEngine": (
        [_series("kiln_served_engine_info", "bad", "1x10", version="3", signing_key="unsigned"), _series("kiln_served_engine_info", "good", "1x10", version="3", signing_key="ab12")],
        "5m", {"job": "kiln-serve", "instance": "bad", "version": "3", "signing_key": "unsigned"},
    ),
}  # fmt: skip


def test_every_alert_has_a_unit_test(shipped):
    assert {rule["alert"] for group in monitoring.rules(shipped)["groups"] for rule in group["rules"] if "alert" in rule} == set(ALERT_CASES)


@needs_promtool
def test_each_alert_fires_on_the_series_that_breaks_it_and_stays_silent_on_the_one_that_does_not(shipped, tmp_path):
    alerts = {rule["alert"]: rule for group in monitoring.rules(shipped)["groups"] for rule in group["rules"] if "alert" in rule}
    tests = []
    for name, (series, at, labels) in ALERT_CASES.items():
        fired = {"exp_labels": labels | alerts[name]["labels"], "exp_annotations": alerts[name]["annotations"]}
        healthy = [s for s in series if 'instance="good"' in s["series"]]
        tests.append({"interval": "1m", "input_series": series, "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": [fired]}]})
        tests.append({"interval": "1m", "input_series": healthy, "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": []}]})
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(monitoring.rules(shipped)))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}))
    result = promtool("test", "rules", str(tmp_path / "tests.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_a_budget_from_params_moves_the_alert(shipped, tmp_path):
    """The latency alert's threshold is the params' budget: a slow instance that breaks the
    default 2 s budget passes a 10 s one."""
    scenarios = [s.model_copy(update={"max_request_p99_ms": 10_000}) for s in shipped.gates.serving.scenarios]
    gates = shipped.gates.model_copy(update={"serving": shipped.gates.serving.model_copy(update={"scenarios": scenarios})})
    relaxed = shipped.model_copy(update={"gates": gates})
    series, at, _ = ALERT_CASES["KilnRequestLatencyOverBudget"]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(monitoring.rules(relaxed)))
    test = {"interval": "1m", "input_series": series, "alert_rule_test": [{"eval_time": at, "alertname": "KilnRequestLatencyOverBudget", "exp_alerts": []}]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [test]}))
    result = promtool("test", "rules", str(tmp_path / "tests.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- a real Prometheus watching a real kiln serve


def watched(shipped, budget_ms: int):
    """The shipped params with one request budget, an alert that fires as soon as the budget
    is broken (the shipped rule waits 10 minutes) and a 1 s scrape, so a test sees it."""
    scenarios = [s.model_copy(update={"max_request_p99_ms": budget_ms}) for s in shipped.gates.serving.scenarios]
    gates = shipped.gates.model_copy(update={"serving": shipped.gates.serving.model_copy(update={"scenarios": scenarios})})
    now = shipped.monitoring.model_copy(update={"latency_alert_after": "0s", "scrape_interval": "1s"})
    return shipped.model_copy(update={"gates": gates, "monitoring": now})


def alerts_named(url: str, name: str) -> list[dict]:
    return [a for a in httpx.get(f"{url}/api/v1/alerts").json()["data"]["alerts"] if a["labels"]["alertname"] == name]


@needs_prometheus
def test_a_real_prometheus_fires_the_latency_alert_once_the_engine_slows_past_the_budget(shipped, engine_dir, tmp_path):
    """kiln serve under requests within a 500 ms budget: the recorded p99 stays under it and
    the alert is silent. Then the engine process is stopped for 1.5 s under three requests
    (SIGSTOP, as a stalled GPU or a swapping host would): the alert fires for that server."""
    target = RegistryTarget(new_mlflow_store(tmp_path / "mlflow.db"), "kiln-watched", "kiln-watched", tmp_path / "artifacts", SIGNING)
    promote(target, CHAMPION, version=register_engine(target, engine_dir.path, engine_dir.sha256, record()).version)
    app = create_app(AliasSource(target, CHAMPION, tmp_path / "cache"), ServerSettings(poll_interval_s=0, max_tokens=8))
    body = {"model": "kiln-watched", "prompt": "The list", "max_tokens": 4}
    with LiveServer(app) as live, prometheus(tmp_path, watched(shipped, budget_ms=500), live.port) as url, live.client() as client:
        instance = f"127.0.0.1:{live.port}"
        p99 = f'kiln:request_duration_seconds:p99_5m{{instance="{instance}"}}'

        def recorded_p99() -> float | None:
            result = httpx.get(f"{url}/api/v1/query", params={"query": p99}).json()["data"]["result"]
            return float(result[0]["value"][1]) if result and result[0]["value"][1] != "NaN" else None

        wait_for(lambda: httpx.get(f"{url}/api/v1/query", params={"query": f'up{{instance="{instance}"}} == 1'}).json()["data"]["result"], 30, "the first scrape")
        for _ in range(10):  # counted between scrapes: rates see them
            assert client.post("/v1/completions", json=body).status_code == 200
        healthy = wait_for(recorded_p99, 30, "the recorded p99 of the healthy requests", every_s=0.5)
        assert healthy <= 0.5 and alerts_named(url, "KilnRequestLatencyOverBudget") == []

        engine = live.app.state.follower.current.scheduler.pid
        os.kill(engine, signal.SIGSTOP)
        try:
            slow = [threading.Thread(target=client.post, args=("/v1/completions",), kwargs={"json": body}) for _ in range(3)]
            for request in slow:
                request.start()
            time.sleep(1.5)
        finally:
            os.kill(engine, signal.SIGCONT)
        for request in slow:
            request.join(30)
        (fired,) = wait_for(lambda: [a for a in alerts_named(url, "KilnRequestLatencyOverBudget") if a["state"] == "firing"], 60, "the latency alert firing")
        assert fired["labels"]["instance"] == instance and fired["labels"]["severity"] == "warning"
        assert float(fired["value"]) > 0.5 and "over 0.5 s" in fired["annotations"]["summary"]

        # What a person without Grafana sees: the dashboard's panels drawn from this Prometheus.
        drawn = render(monitoring.dashboard(), url, tmp_path / "dashboard.png", minutes=2)
    empty = {title for title, series in drawn.items() if not series}
    assert empty == {"GPU utilisation", "GPU memory"}, f"panels without data on a CPU machine: {empty}"
    assert Image.open(tmp_path / "dashboard.png").size[0] > 1000
