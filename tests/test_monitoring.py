"""The dashboard and the Prometheus rules kiln ships (deploy/): generated, parsed and unit
tested by Prometheus's own promtool (Debian's `prometheus` package; skipped without it).
That every metric they query is one kiln serve exports is checked against a live server's
/metrics in test_serving.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from components.config import load_params
from flows import monitoring

ROOT = Path(__file__).resolve().parents[1]
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`; .ci/run installs it)")


@pytest.fixture(scope="module")
def params():
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


def test_the_checked_in_dashboard_and_rules_are_what_kiln_monitoring_makes(params):
    for relative, text in monitoring.rendered(params).items():
        assert (ROOT / relative).read_text() == text, f"{relative} is stale: run `kiln monitoring`"


def test_the_dashboard_has_the_panels_and_variables_a_person_on_call_needs(params):
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
def test_every_expression_of_the_rules_and_the_dashboard_parses(params, tmp_path):
    rules = tmp_path / "rules.yml"
    rules.write_text(monitoring.rendered(params)[monitoring.RULES_FILE])
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
}  # fmt: skip


def test_every_alert_has_a_unit_test(params):
    assert {rule["alert"] for group in monitoring.rules(params)["groups"] for rule in group["rules"] if "alert" in rule} == set(ALERT_CASES)


@needs_promtool
def test_each_alert_fires_on_the_series_that_breaks_it_and_stays_silent_on_the_one_that_does_not(params, tmp_path):
    alerts = {rule["alert"]: rule for group in monitoring.rules(params)["groups"] for rule in group["rules"] if "alert" in rule}
    tests = []
    for name, (series, at, labels) in ALERT_CASES.items():
        fired = {"exp_labels": labels | alerts[name]["labels"], "exp_annotations": alerts[name]["annotations"]}
        healthy = [s for s in series if 'instance="good"' in s["series"]]
        tests.append({"interval": "1m", "input_series": series, "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": [fired]}]})
        tests.append({"interval": "1m", "input_series": healthy, "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": []}]})
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(monitoring.rules(params)))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}))
    result = promtool("test", "rules", str(tmp_path / "tests.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_a_budget_from_params_moves_the_alert(params, tmp_path):
    """The latency alert's threshold is the params' budget: a slow instance that breaks the
    default 2 s budget passes a 10 s one."""
    scenarios = [s.model_copy(update={"max_request_p99_ms": 10_000}) for s in params.gates.serving.scenarios]
    gates = params.gates.model_copy(update={"serving": params.gates.serving.model_copy(update={"scenarios": scenarios})})
    relaxed = params.model_copy(update={"gates": gates})
    series, at, _ = ALERT_CASES["KilnRequestLatencyOverBudget"]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(monitoring.rules(relaxed)))
    test = {"interval": "1m", "input_series": series, "alert_rule_test": [{"eval_time": at, "alertname": "KilnRequestLatencyOverBudget", "exp_alerts": []}]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [test]}))
    result = promtool("test", "rules", str(tmp_path / "tests.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
