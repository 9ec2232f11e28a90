"""What watches `kiln serve` in production, as code: the Grafana dashboard (built with
Grafana's foundation SDK) and the Prometheus recording and alerting rules (their budgets
from params.yaml). `kiln monitoring` writes both into deploy/; tests check the checked-in
files are what this module makes, that every expression parses and every metric exists."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from components.config import Params
from components.errors import KilnError

DASHBOARD_FILE = Path("deploy/grafana/kiln-serve.json")
RULES_FILE = Path("deploy/prometheus/rules.yml")
DATASOURCE = "${datasource}"
JOB = 'job=~"kiln.*"'  # the scrape jobs of `kiln up --monitoring`'s config (and any named kiln-*)
# Request quantiles a person on call reads; the recording rules precompute them over 5 m.
QUANTILES = (0.5, 0.95, 0.99, 0.999)


# ---------------------------------------------------------------- rules


def rules(params: Params) -> dict:
    """Recording rules for the dashboard's quantiles and the alerts, budgets from `params`."""
    return {"groups": [{"name": "kiln-serve-recording", "rules": _recording_rules()}, {"name": "kiln-serve-alerts", "rules": _alerts(params)}]}


def _recording_rules() -> list[dict]:
    recorded = []
    for histogram in ("request_duration", "time_to_first_token", "time_per_output_token"):
        for q in QUANTILES:
            recorded.append({
                "record": f"kiln:{histogram}_seconds:p{_percent(q)}_5m",
                "expr": f"histogram_quantile({q}, sum by (le, instance) (rate(kiln_{histogram}_seconds_bucket{{{JOB}}}[5m])))",
            })  # fmt: skip
    recorded.append({"record": "kiln:requests:error_ratio_5m", "expr": _error_ratio("5m")})
    return recorded


def _alerts(params: Params) -> list[dict]:
    scenarios = params.gates.serving.scenarios
    p99_s = max(s.max_request_p99_ms for s in scenarios) / 1000
    ttft_s = max(s.max_ttft_p95_ms for s in scenarios) / 1000
    near_full = int(params.serving.max_waiting * 0.8)
    hold = params.monitoring.latency_alert_after
    return [
        _alert("KilnRequestLatencyOverBudget", f"kiln:request_duration_seconds:p99_5m > {p99_s:g}", hold, "warning",
               f"p99 of whole requests over {p99_s:g} s (the largest max_request_p99_ms of gates.serving) for {hold}"),
        _alert("KilnTimeToFirstTokenOverBudget", f"kiln:time_to_first_token_seconds:p95_5m > {ttft_s:g}", hold, "warning",
               f"p95 time to first token over {ttft_s:g} s (the largest max_ttft_p95_ms of gates.serving) for {hold}"),
        _alert("KilnErrorRatioHigh", "kiln:requests:error_ratio_5m > 0.05", "5m", "critical",
               "more than 5 % of requests end in a server error"),
        _alert("KilnNoReadyEngine", f"kiln_ready{{{JOB}}} == 0", "2m", "critical",
               "kiln serve has no warm engine (/readyz answers 503): requests are refused"),
        _alert("KilnSwapRefused", f'increase(kiln_engine_swaps_total{{{JOB},result="refused"}}[15m]) > 0', "0m", "warning",
               "an alias moved to a version kiln serve refused to load (it keeps serving the one before)"),
        _alert("KilnEngineProcessRestarted", f"changes(kiln_engine_process_start_time_seconds{{{JOB}}}[15m]) > 0", "0m", "warning",
               "the engine process started again: a crash or an engine swap"),
        _alert("KilnWaitingLineNearFull", f"max_over_time(kiln_queue_depth{{{JOB}}}[5m]) >= {near_full}", "5m", "warning",
               f"{near_full} or more requests wait (serving.max_waiting is {params.serving.max_waiting}; beyond it, 503)"),
        _alert("KilnScrapeTargetDown", f"up{{{JOB}}} == 0", "2m", "critical", "Prometheus cannot scrape a kiln serve process"),
        _alert("KilnServingUnsignedEngine", f'kiln_served_engine_info{{{JOB},signing_key="unsigned"}} == 1', "0m", "warning",
               "kiln serve serves a version nobody signed (registry.require_signature is false): `kiln keys sign-existing`, or rebuild it"),
    ]  # fmt: skip


def _alert(name: str, expr: str, for_: str, severity: str, summary: str) -> dict:
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity}, "annotations": {"summary": summary}}


def _error_ratio(window: str) -> str:
    """Server errors over all requests; 0, not "no data", while there are none."""
    every = f"sum by (instance) (rate(kiln_requests_total{{{JOB}}}[{window}]))"
    return f'(sum by (instance) (rate(kiln_requests_total{{{JOB},outcome="error"}}[{window}])) or {every} * 0) / {every}'


def _percent(q: float) -> str:
    return f"{q * 100:g}".replace(".", "")  # 0.999 -> "999", 0.5 -> "50"


# ---------------------------------------------------------------- dashboard


def dashboard() -> dict:
    """The kiln serve dashboard as Grafana's JSON model (imports into Grafana 10.4+)."""
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    board = (
        dash.Dashboard("kiln serve")
        .uid("kiln-serve")
        .tags(["kiln", "generated"])
        .description("Generated by flows/monitoring.py (`kiln monitoring`): edit that, not this file.")
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(dash.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(_version_variable())
        .annotation(_swap_annotations())
    )
    for row, panels in _rows():
        board = board.with_row(dash.Row(row))
        for panel in panels:
            board = board.with_panel(panel)
    return json.loads(JSONEncoder(sort_keys=True).encode(board.build()))


def _version_variable():
    from grafana_foundation_sdk.builders import dashboard as dash

    return (
        dash.QueryVariable("version")
        .label("served version")
        .datasource(_datasource())
        .query(f"label_values(kiln_served_engine_info{{{JOB}}}, version)")
        .include_all(True)
        .multi(True)
    )


def _swap_annotations():
    from grafana_foundation_sdk.builders import dashboard as dash

    return (
        dash.AnnotationQuery()
        .name("engine swaps")
        .datasource(_datasource())
        .enable(True)
        .icon_color("orange")
        # A served version's series in its first minute: one mark per swap, labelled with it.
        .expr(f'kiln_served_engine_info{{{JOB},version=~"$version"}} unless kiln_served_engine_info{{{JOB}}} offset 1m')
    )


def _rows() -> list[tuple[str, list]]:
    rate = "$__rate_interval"
    return [
        ("Traffic", [
            _timeseries("Requests / s by outcome", "reqps", [(f"sum by (outcome) (rate(kiln_requests_total{{{JOB}}}[{rate}]))", "{{outcome}}")]),
            _timeseries("Error ratio", "percentunit", [(_error_ratio(rate), "{{instance}}")]),
            _timeseries("Tokens / s", "short", [
                (f"sum(rate(kiln_generated_tokens_total{{{JOB}}}[{rate}]))", "generated (out)"),
                (f"sum(rate(kiln_prompt_tokens_total{{{JOB}}}[{rate}]))", "prompt (in)"),
            ]),
        ]),
        ("Latency", [
            _quantiles("Whole requests", "kiln_request_duration_seconds"),
            _quantiles("Time to first token", "kiln_time_to_first_token_seconds"),
            _quantiles("Time per output token", "kiln_time_per_output_token_seconds"),
        ]),
        ("Batching", [
            _timeseries("Waiting line and running batch", "short", [
                (f"sum(kiln_queue_depth{{{JOB}}})", "waiting"),
                (f"sum(kiln_running_batch_size{{{JOB}}})", "running"),
            ]),
            _timeseries("Mean rows a decode turn served", "short", [
                (f"sum(rate(kiln_decoded_rows_total{{{JOB}}}[{rate}])) / sum(rate(kiln_decode_steps_total{{{JOB}}}[{rate}]))", "rows / turn"),
            ]),
            _timeseries("Prefix cache hit rate", "percentunit", [
                (f"sum(rate(kiln_prefix_cache_cached_tokens_total{{{JOB}}}[{rate}])) / sum(rate(kiln_prefix_cache_queried_tokens_total{{{JOB}}}[{rate}]))", "prompt tokens"),
                (f"sum(rate(kiln_prefix_cache_hits_total{{{JOB}}}[{rate}])) / sum(rate(kiln_prefix_cache_queries_total{{{JOB}}}[{rate}]))", "prompts"),
            ]),
            _timeseries("Prefix cache memory", "bytes", [(f"sum by (instance) (kiln_prefix_cache_bytes{{{JOB}}})", "{{instance}}")]),
            _timeseries("Prefix cache evictions / s", "short", [(f"sum(rate(kiln_prefix_cache_evictions_total{{{JOB}}}[{rate}]))", "blocks / s")]),
        ]),
        ("Engine", [
            _served_engine(),
            _timeseries("Swaps by result", "short", [(f"sum by (result) (increase(kiln_engine_swaps_total{{{JOB}}}[{rate}]))", "{{result}}")]),
            _timeseries("Engine process restarts", "short", [(f"changes(kiln_engine_process_start_time_seconds{{{JOB}}}[{rate}])", "{{instance}}")]),
            _timeseries("Engine load (pull, verify, load, warm-up), mean since start", "s", [
                (f"kiln_engine_load_seconds_sum{{{JOB}}} / kiln_engine_load_seconds_count{{{JOB}}}", "{{instance}}"),
            ]),
        ]),
        ("Pipeline", [
            _timeseries("Engines registered (each rebuild adds its precisions)", "short", [
                (f"max by (precision) (sum by (instance, precision) (kiln_registry_versions{{{JOB}}}))", "{{precision}}"),
            ]),
            _timeseries("Registered engines by gate result", "short", [
                (f"max by (gates_passed) (sum by (instance, gates_passed) (kiln_registry_versions{{{JOB}}}))", "gates passed: {{gates_passed}}"),
            ]),
            _timeseries("Hours since the last registration", "h", [
                (f"(time() - max(kiln_registry_last_registered_timestamp_seconds{{{JOB}}})) / 3600", "since the last engine"),
            ]),
        ]),
        ("Resources", [
            _timeseries("Memory (resident)", "bytes", [
                (f"process_resident_memory_bytes{{{JOB}}}", "server {{instance}}"),
                (f"kiln_engine_process_resident_memory_bytes{{{JOB}}}", "engine process {{instance}}"),
            ]),
            _timeseries("CPU (cores)", "short", [
                (f"rate(process_cpu_seconds_total{{{JOB}}}[{rate}])", "server {{instance}}"),
                (f"rate(kiln_engine_process_cpu_seconds_total{{{JOB}}}[{rate}])", "engine process {{instance}}"),
            ]),
            _timeseries("GPU utilisation", "percentunit", [(f"kiln_gpu_utilization_ratio{{{JOB}}}", "GPU {{gpu}}")]),
            _timeseries("GPU memory", "bytes", [
                (f"kiln_gpu_memory_used_bytes{{{JOB}}}", "used, GPU {{gpu}}"),
                (f"kiln_gpu_memory_total_bytes{{{JOB}}}", "total, GPU {{gpu}}"),
                (f"kiln_gpu_engine_process_memory_used_bytes{{{JOB}}}", "engine process, GPU {{gpu}}"),
            ]),
        ]),
    ]  # fmt: skip


def _quantiles(title: str, histogram: str):
    queries = [
        (f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{{{JOB}}}[$__rate_interval])))", f"p{q * 100:g}")
        for q in QUANTILES
    ]
    return _timeseries(title, "s", queries)


def _timeseries(title: str, unit: str, queries: list[tuple[str, str]]):
    from grafana_foundation_sdk.builders import common, timeseries
    from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, TooltipDisplayMode

    legend = common.VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM).show_legend(True)
    panel = (
        timeseries.Panel().title(title).unit(unit).datasource(_datasource()).min(0).height(8).span(8)
        .legend(legend).tooltip(common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI))
    )  # fmt: skip
    for index, (expr, legend) in enumerate(queries):
        panel = panel.with_target(_query(expr, legend, chr(ord("A") + index)))
    return panel


def _served_engine():
    from grafana_foundation_sdk.builders import common, stat

    expr = f'kiln_served_engine_info{{{JOB},version=~"$version"}}'
    return (
        stat.Panel().title("Served version").datasource(_datasource()).height(8).span(8)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .with_target(_query(expr, "version {{version}} {{precision}} {{backend}}", "A"))
    )  # fmt: skip


def _query(expr: str, legend: str, ref: str):
    from grafana_foundation_sdk.builders import prometheus

    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(_datasource())


def _datasource():
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    return DataSourceRef(type_val="prometheus", uid=DATASOURCE)


# ---------------------------------------------------------------- files


def rendered(params: Params) -> dict[Path, str]:
    """Each file of deploy/ this module makes, as its text."""
    return {
        DASHBOARD_FILE: json.dumps(dashboard(), indent=2, sort_keys=True) + "\n",
        RULES_FILE: "# Generated by flows/monitoring.py (`kiln monitoring`) from params.yaml: edit those.\n" + yaml.safe_dump(rules(params), sort_keys=False, width=200),
    }


def write(params: Params, root: Path) -> list[Path]:
    written = []
    for relative, text in rendered(params).items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


# ---------------------------------------------------------------- `kiln up --monitoring`


def prometheus_command(root: Path, params: Params, port: int, serve_port: int) -> list[str]:
    """Debian's Prometheus scraping the project's `kiln serve` (on `serve_port`) with the
    rules for these params, its config and data under .kiln/monitoring."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise KilnError("kiln up --monitoring needs Prometheus, which is not installed: apt-get install prometheus (Debian's package)")
    folder = root / ".kiln" / "monitoring"
    folder.mkdir(parents=True, exist_ok=True)
    rules_path = folder / "rules.yml"
    rules_path.write_text(rendered(params)[RULES_FILE])
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(rules_path, [f"{_local(params.serving.host)}:{serve_port}"], params.monitoring.scrape_interval), sort_keys=False))
    return [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"]


def prometheus_config(rules_path: Path, serve_targets: list[str], interval: str) -> dict:
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(rules_path)],
        "scrape_configs": [{"job_name": "kiln-serve", "static_configs": [{"targets": serve_targets}]}],
    }


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
