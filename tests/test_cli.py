"""The `kiln` command line as a user runs it: exit codes, one-line errors, the whole run."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import shutil
import urllib.parse
import urllib.request
from importlib.metadata import version as installed_version
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, get_args

import pytest
import typer
import yaml
from typer.testing import CliRunner

from components.config import MonitoringParams, ServingParams
from flows.cli import KilnCommand, app

from .conftest import SIGNING, make_project, new_project_store, tiny_params
from .live_server import answers, free_port, kiln_up

PROMETHEUS = shutil.which("prometheus")  # Debian's package; without it kiln up runs without --monitoring

KILN = str(Path(sys.executable).parent / "kiln")
VERBS = ["run", "build", "gate", "promote", "rollback", "lineage", "serve", "doctor", "up", "deploy", "worker", "data add"]


def kiln(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([KILN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


def write_params(path: Path, params) -> Path:
    path.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    return path


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help(verb):
    result = CliRunner().invoke(app, [*verb.split(), "--help"])
    assert result.exit_code == 0
    assert "Usage" in result.output


# ---------------------------------------------------------------- the help: every option said, flags without a placeholder

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # a CI terminal may get colours


def commands(command, path: tuple[str, ...] = ("kiln",)):
    """(the words that invoke it, its click command) for `command` and every verb under it."""
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from commands(sub, (*path, name))


KILN_COMMANDS = list(commands(typer.main.get_command(app)))


def undescribed(command) -> list[str]:
    """Its options and arguments without help text (typer keeps an argument's on TyperArgument.help)."""
    return [param.name for param in command.params if not (getattr(param, "help", None) or "").strip()]


def help_text(typer_app: typer.Typer, words: tuple[str, ...]) -> str:
    """What `--help` prints on a terminal wide enough that no option wraps."""
    result = CliRunner().invoke(typer_app, [*words, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return ANSI.sub("", result.output)


def test_every_option_and_argument_of_every_verb_says_what_it_is():
    missing = {" ".join(path): names for path, command in KILN_COMMANDS if (names := undescribed(command))}
    assert not missing, f"options and arguments without help text: {missing}"
    assert len(KILN_COMMANDS) > 15


def test_an_option_or_argument_without_help_text_is_found():
    planted = typer.Typer()

    @planted.command()
    def verb(target: Annotated[str, typer.Argument()], port: int = 5000, host: Annotated[str, typer.Option(help="address to bind")] = "") -> None:
        pass

    assert undescribed(typer.main.get_command(planted)) == ["target", "port"]


@pytest.mark.parametrize("path", [path for path, _ in KILN_COMMANDS], ids=" ".join)
def test_no_flag_shows_a_value_placeholder_in_help(path):
    assert "<bool>" not in help_text(app, path[1:])


def test_typers_flag_placeholder_is_seen_and_kilns_commands_drop_it():
    """What the test above is worth: typer 0.29 prints `<bool>` for a flag (its own --help
    too); a KilnCommand prints none, while an option's value type stays."""

    def one_verb(cls) -> typer.Typer:
        planted = typer.Typer()

        @planted.command(cls=cls)
        def verb(fresh: Annotated[bool, typer.Option(help="start over")] = False, runs: Annotated[int, typer.Option(help="how many")] = 1) -> None:
            pass

        return planted

    assert "<bool>" in help_text(one_verb(None), ())
    kilns = help_text(one_verb(KilnCommand), ())
    assert "<bool>" not in kilns and "<int>" in kilns


def test_kiln_version_prints_the_installed_version_and_exits_0():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"kiln {installed_version('kiln')}"


def test_every_verb_that_reads_params_takes_the_same_params_option():
    params = {" ".join(path): (tuple(param.opts), param.help) for path, command in KILN_COMMANDS for param in command.params if param.name == "params_file"}
    assert len(set(params.values())) == 1, params
    assert {"kiln doctor", "kiln gate", "kiln bench serving", "kiln promote"} <= params.keys()


def test_doctor_with_params_says_whether_their_backend_builds_here(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("build: {backend: onnxruntime}\n")
    result = CliRunner().invoke(app, ["doctor", "-p", str(params)], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "build.backend onnxruntime → builds here" in result.stdout
    missing = CliRunner().invoke(app, ["doctor", "-p", str(tmp_path / "absent.yaml")])
    assert missing.exit_code == 2 and "absent.yaml" in missing.stderr


# ---------------------------------------------------------------- renamed options: the old spellings, for one release


def test_promotes_old_alias_spellings_still_work_and_warn(monkeypatch):
    import registry
    from registry import tags

    moved = {}

    def promote(target, alias, from_alias, version, **recorded):
        moved.update(alias=alias, from_alias=from_alias)
        return SimpleNamespace(name="kiln-tiny", version="3", tags={tags.GATES_PASSED: tags.TRUE})

    monkeypatch.setattr(registry, "promote", promote)
    monkeypatch.setattr("flows.cli._registry", lambda params_file: None)
    old = CliRunner().invoke(app, ["promote", "--to", "staging", "--from=candidate"])
    assert old.exit_code == 0, old.output
    assert moved == {"alias": "staging", "from_alias": "candidate"} and "kiln-tiny@staging → version 3" in old.stdout
    warnings = " ".join(old.stderr.split())
    assert "--to is deprecated" in warnings and "use --alias" in warnings and "--from is deprecated" in warnings and "use --from-alias" in warnings
    new = CliRunner().invoke(app, ["promote", "--alias", "champion", "--from-alias", "challenger"])
    assert new.exit_code == 0 and moved == {"alias": "champion", "from_alias": "challenger"} and "deprecated" not in new.stderr


def test_the_old_url_spellings_still_work_and_warn(monkeypatch, tmp_path):
    import flows.dashboard_render

    asked = []
    monkeypatch.setattr(flows.dashboard_render, "render", lambda dashboard, url, png, minutes: asked.append(url) or {})
    drawn = CliRunner().invoke(app, ["monitoring", "--render", str(tmp_path / "d.png"), "--prometheus", "http://prometheus:9090/"])
    assert drawn.exit_code == 0, drawn.output
    assert asked == ["http://prometheus:9090"] and "--prometheus is deprecated" in " ".join(drawn.stderr.split())

    monkeypatch.chdir(tmp_path)
    peers = CliRunner().invoke(app, ["bench", "serving", "--url", "http://a", "--triton", "http://b"])
    said = " ".join(peers.stderr.split())
    assert peers.exit_code == 2 and "--triton-url beside --openai-url needs --engine DIR" in said  # both reached their new options
    assert "--url is deprecated" in said and "use --openai-url" in said and "--triton is deprecated" in said


def test_only_options_are_respelled_and_nothing_after_a_double_dash():
    from flows.cli import _respelled

    assert _respelled(["--to", "x", "--to=y", "--top", "--", "--to"], {"--to": "--alias"}) == ["--alias", "x", "--alias=y", "--top", "--", "--to"]


# ---------------------------------------------------------------- kiln bench: choices named


@pytest.mark.parametrize("option, bad, choices", [("--shape", "huge", ["gpt2-small", "smollm2-135m", "tiny"]), ("--device", "tpu", ["cpu", "cuda"]), ("--peer", "vllm", ["llama.cpp"])])
def test_a_bad_bench_choice_is_refused_naming_the_choices(option, bad, choices, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", option, bad], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert all(choice in result.output for choice in choices), result.output
    assert not (tmp_path / ".kiln").exists()  # refused before any work


def test_the_bench_shapes_help_lists_are_the_benchmarks_shapes():
    from benchmarks.generation import SHAPES
    from flows.cli import BenchShape

    assert list(get_args(BenchShape)) == list(SHAPES)


def test_an_unknown_bench_precision_is_refused_naming_the_known_ones_before_any_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", "--precisions", "int8,int9", "--shape", "tiny", "--work", str(tmp_path / "work")])
    assert result.exit_code == 2
    assert "--precisions: 'int9' is not one of fp32, fp16, int8, int4, int8-qdq" in " ".join(result.stderr.split())
    assert not (tmp_path / "work").exists()


def test_bench_help_says_what_bench_alone_and_bench_serving_time():
    text = " ".join(help_text(app, ("bench",)).split())
    assert "bench [OPTIONS] [serving [OPTIONS]]" in text  # the usage line
    assert "`kiln bench` alone times the engines, `kiln bench serving` the server" in text


# ---------------------------------------------------------------- kiln lineage: each gate number beside its limit


def test_lineage_shows_each_gate_number_beside_its_interval_limit_and_result():
    from rich.console import Console

    from components.gates import GateReport, GateResult
    from flows.lineage import limit_tags, recorded_gates_table

    quality = GateResult(
        "quality", True, {"top1_agreement": 0.98765, "ppl_increase_pct": 1.02144e-07}, {"min_top1_agreement": 0.9, "max_ppl_increase_pct": 5.0},
        intervals={"top1_agreement": (0.95, 0.99), "ppl_increase_pct": (-0.25, 0.4)},
    )  # fmt: skip
    latency = GateResult("latency", False, {"p50_ms": 80.25, "p95_ms": 123.456}, {"max_p95_ms": 100.0}, conditions={"threads": "1"})
    report = GateReport((quality, latency), machine="a test machine")
    limits = limit_tags(report)
    assert limits == {"gates.quality.top1_agreement.limit": ">= 0.9", "gates.quality.ppl_increase_pct.limit": "<= 5", "gates.latency.p95_ms.limit": "<= 100"}
    version_tags = {name: f"{value:.6g}" for name, value in report.flat_numbers().items()} | report.flat_conditions() | limits
    version_tags |= {"gates.passed": "false", "gates.verdict": "failed", "gates.measured_on": report.machine}

    console = Console(width=80, record=True)  # a terminal's usual width: every name whole
    console.print(recorded_gates_table(version_tags, report.flat_numbers()))
    shown = [" ".join(line.replace("│", " ").split()) for line in console.export_text().splitlines()]
    under, heading = {}, None  # each row under the gate heading above it
    for line in shown:
        if line in ("quality", "latency"):
            heading = line
        elif line and not line.startswith(("measure", "━")):
            under[line] = heading
    assert under["top1_agreement 0.9877 [0.95, 0.99] >= 0.9 pass"] == "quality"
    assert under["ppl_increase_pct 0 % [-0.25 %, 0.4 %] <= 5 % pass"] == "quality"
    assert under["p95_ms 123.5 ms <= 100 ms FAIL"] == "latency" and under["p50_ms 80.25 ms"] == "latency"
    assert "latency measured with threads 1" in shown and "measured on a test machine" in shown
    assert not any("e-07" in line or line.startswith("threads") for line in shown)


@pytest.mark.parametrize(
    "text, message",
    [
        ("model:\n  trainig: {}\n", "model.trainig: unknown key"),
        ("gates:\n  latency:\n    runs: lots\n", "gates.latency.runs"),
        ("data: [1,\n", "not valid YAML"),
    ],
)
def test_bad_params_end_with_one_line_and_exit_2(tmp_path, text, message):
    (tmp_path / "params.yaml").write_text(text)
    result = kiln("run", cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_corrupt_model_directory_exits_2_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{broken")
    (tmp_path / "params.yaml").write_text("")
    result = CliRunner().invoke(app, ["build", "--model", str(tmp_path / "model")])
    assert result.exit_code == 2
    assert "has no tokenizer.json" in result.output


def test_gate_exits_0_when_the_engine_passes_and_1_when_a_gate_fails(tmp_path, engine_dir, data_version, params, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ok = write_params(tmp_path / "ok.yaml", params)
    passed = CliRunner().invoke(app, ["gate", str(engine_dir.path), "--params", str(ok), "--data", str(data_version.path)])
    assert passed.exit_code == 0, passed.output
    assert "all gates passed" in passed.output and "measured on" in passed.output and "cores" in passed.output

    strict = params.gates.model_copy(update={"latency": params.gates.latency.model_copy(update={"max_p95_ms": 1e-6, "max_p95_over_floor": None})})
    slow = write_params(tmp_path / "strict.yaml", params.model_copy(update={"gates": strict}))
    failed = CliRunner().invoke(app, ["gate", str(engine_dir.path), "--params", str(slow), "--data", str(data_version.path)])
    assert failed.exit_code == 1
    assert "p95_ms" in failed.output


def test_doctor_says_which_backends_run_here_and_why_not():
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0
    assert "onnxruntime" in result.output and "CPUExecutionProvider" in result.output
    assert "tensorrt" in result.output


def test_an_unreachable_tracking_uri_exits_2_before_any_training(tmp_path):
    root = make_project(tmp_path / "p")
    params = tiny_params(root)
    params = params.model_copy(update={"registry": params.registry.model_copy(update={"tracking_uri": "http://127.0.0.1:9"})})
    result = kiln("run", "--params", str(write_params(root / "params.yaml", params)), cwd=root)
    assert result.returncode == 2
    assert "http://127.0.0.1:9 is unreachable" in result.stderr
    assert not (root / ".kiln" / "stages" / "models").exists()


# ---------------------------------------------------------------- a project under `kiln up`, as a user works


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A project under `kiln up` (both servers answering, stopped by SIGTERM at the end)."""
    root = make_project(tmp_path_factory.mktemp("cli") / "p")
    new_project_store(root)
    # Prometheus scrapes every second (params.yaml's 5 s otherwise): the dashboard's rates have their two samples sooner.
    monitoring = MonitoringParams(scrape_interval="1s")
    write_params(root / "params.yaml", tiny_params(root, serving=ServingParams(port=free_port(), poll_interval_s=1), monitoring=monitoring))
    serve_port = free_port()  # not serving.port: `kiln up --serve-port` says where kiln serve will listen
    with kiln_up(root, "--serve-port", str(serve_port), prometheus=PROMETHEUS is not None) as up:
        up.serve_port = serve_port
        yield up


def test_kiln_up_prints_what_another_shell_of_the_project_needs(served):
    log = (served.root / "kiln-up.log").read_text()
    assert f"alias changes made in the MLflow UI → http://127.0.0.1:{served.serve_port}/hooks/mlflow" in log
    assert f"export PREFECT_API_URL={served.prefect}/api" in log
    assert f"kiln serve --port {served.serve_port}" in log and f"kiln deploy --mlflow-url {served.mlflow}" in log


def test_kiln_up_monitoring_without_prometheus_says_which_package_in_one_line(tmp_path):
    root = make_project(tmp_path / "p")
    write_params(root / "params.yaml", tiny_params(root))
    bare = os.environ | {"PATH": str(Path(sys.executable).parent)}  # kiln's own programs, no prometheus
    result = subprocess.run([KILN, "up", "--monitoring"], cwd=root, capture_output=True, text=True, timeout=120, env=bare)
    assert result.returncode == 2 and result.stderr.count("error:") == 1
    assert "apt-get install prometheus" in result.stderr and "Traceback" not in result.stderr


def prometheus_query(served, expr: str) -> list:
    url = f"{served.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    answer = get_json(url)
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def check_prometheus_watches_kiln_serve(served, port: int) -> None:
    """kiln up's Prometheus: the kiln serve target up, kiln's rules loaded, and every panel
    query of the dashboard answering with data (the GPU's aside on a CPU machine)."""
    from flows import monitoring

    deadline = time.monotonic() + 60
    while not any(t["health"] == "up" and t["scrapeUrl"].endswith(f":{port}/metrics") for t in get_json(f"{served.prometheus}/api/v1/targets")["data"]["activeTargets"]):
        assert time.monotonic() < deadline, get_json(f"{served.prometheus}/api/v1/targets")
        time.sleep(1)
    groups = {g["name"]: g for g in get_json(f"{served.prometheus}/api/v1/rules")["data"]["groups"]}
    assert {"kiln-serve-recording", "kiln-serve-alerts"} <= set(groups)
    assert any(r["name"] == "KilnRequestLatencyOverBudget" for r in groups["kiln-serve-alerts"]["rules"])
    exprs = [t["expr"] for p in monitoring.dashboard()["panels"] for t in p.get("targets") or [] if "kiln_gpu_" not in t["expr"]]
    deadline = time.monotonic() + 60  # rates need two scrapes (monitoring.scrape_interval apart) inside their window
    empty = exprs
    while empty and time.monotonic() < deadline:
        time.sleep(1)
        empty = [e for e in exprs if not prometheus_query(served, e.replace("$__rate_interval", "1m").replace("$version", ".*"))]
    assert not empty, f"dashboard queries without data: {empty}"


def kiln_in(served, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KILN, *args], cwd=served.root, capture_output=True, text=True, timeout=600, env=served.env)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def assert_the_private_key_is_only_in_its_file(root: Path, key: Path) -> None:
    """After a signed run: the key's secret (its PEM body, its DER bytes) is in no file of the
    project (MLflow store and artifacts, logs), nor of the session's Prefect home (results,
    database), nor in the version's tags."""
    from cryptography.hazmat.primitives import serialization

    pem = key.read_bytes()
    body = b"".join(line for line in pem.splitlines() if not line.startswith(b"-----"))
    der = serialization.load_pem_private_key(pem, None).private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    secrets = [body, der, *(line for line in pem.splitlines() if len(line) == 64)]
    places = [root, Path(os.environ["PREFECT_HOME"])]
    found = [f for place in places for f in place.rglob("*") if f.is_file() and f != key and any(s in f.read_bytes() for s in secrets)]
    assert not found, f"the private key leaked into {found}"
    assert (root / "mlruns" / "mlflow.db").is_file() and any((root / "mlruns").rglob("model.sig"))  # what was searched holds a signed run


@pytest.mark.slow
def test_kiln_run_registers_a_challenger_prints_a_sample_and_a_second_run_registers_nothing(served):
    first = kiln_in(served, "run")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "kiln-tiny version 1 @challenger (fp32) — registered" in first.stdout
    assert "sample completion" in first.stdout and "'The list" in first.stdout

    second = kiln_in(served, "run")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "kiln-tiny version 1 @challenger (fp32) — unchanged" in second.stdout
    assert second.stderr.count("Cached(type=COMPLETED)") >= 4

    promoted = kiln_in(served, "promote")
    assert promoted.returncode == 0 and "kiln-tiny@champion → version 1" in promoted.stdout
    assert_the_private_key_is_only_in_its_file(served.root, SIGNING.key)
    # What the MLflow UI shows, through kiln up's server.
    model = get_json(f"{served.mlflow}/api/2.0/mlflow/registered-models/get?name=kiln-tiny")["registered_model"]
    assert {a["alias"]: a["version"] for a in model["aliases"]} == {"challenger": "1", "champion": "1"}


@pytest.mark.slow
def test_kiln_serve_answers_with_the_champion_and_hears_alias_changes_from_the_mlflow_server(served):
    """After the run above: `kiln serve` serves the champion; an alias set through kiln up's
    MLflow server (the REST call its UI makes) reaches the server by the webhook kiln up registered."""
    from openai import OpenAI

    assert kiln_in(served, "promote").returncode == 0
    port = served.serve_port
    url = f"http://127.0.0.1:{port}"
    log = (served.root / "kiln-serve.log").open("w")
    server = subprocess.Popen([KILN, "serve", "--port", str(port)], cwd=served.root, env=served.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120  # imports, pull, engine process, warm-up: slow on a busy 2-core CI machine
        while not answers(f"{url}/readyz"):
            assert server.poll() is None and time.monotonic() < deadline, (served.root / "kiln-serve.log").read_text()[-3000:]
            time.sleep(0.3)
        assert "serving kiln-tiny version 1 (onnxruntime fp32)" in (served.root / "kiln-serve.log").read_text()
        second = kiln_in(served, "serve", "--port", str(port))  # the port is taken: said before any engine loads
        assert second.returncode == 2 and second.stderr.count("error:") == 1, second.stderr[-2000:]
        assert f"cannot serve on 127.0.0.1:{port}" in second.stderr and "Traceback" not in second.stderr
        (card,) = get_json(f"{url}/v1/models")["data"]
        version = get_json(f"{served.mlflow}/api/2.0/mlflow/model-versions/get?name=kiln-tiny&version=1")["model_version"]
        assert card["version"] == "1" and card["alias"] == "champion"
        assert card["engine_sha256"] == {t["key"]: t["value"] for t in version["tags"]}["engine_sha256"]
        answer = OpenAI(base_url=f"{url}/v1", api_key="unused").completions.create(model="kiln-tiny", prompt="The list", max_tokens=5)
        assert answer.usage.completion_tokens >= 1
        if served.prometheus is not None:
            check_prometheus_watches_kiln_serve(served, port)

        body = json.dumps({"name": "kiln-tiny", "alias": "champion", "version": "1"}).encode()
        request = urllib.request.Request(f"{served.mlflow}/api/2.0/mlflow/registered-models/alias", data=body, method="POST", headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).close()
        deadline = time.monotonic() + 30
        while 'kiln_webhook_deliveries_total{result="followed"} 1.0' not in urllib.request.urlopen(f"{url}/metrics").read().decode():
            assert time.monotonic() < deadline, "the MLflow server's webhook never reached kiln serve"
            time.sleep(0.3)
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 143  # after a graceful shutdown: uvicorn re-raises the signal
    assert "Application shutdown complete" in (served.root / "kiln-serve.log").read_text()


@pytest.mark.slow
def test_kiln_run_with_a_failing_gate_prints_the_table_and_exits_1(served):
    params = tiny_params(served.root)
    strict = params.gates.model_copy(update={"latency": params.gates.latency.model_copy(update={"max_p95_ms": 1e-6, "max_p95_over_floor": None})})
    registry = params.registry.model_copy(update={"model_name": "kiln-strict"})
    strict_file = write_params(served.root / "strict.yaml", params.model_copy(update={"gates": strict, "registry": registry}))
    failed = kiln_in(served, "run", "--params", str(strict_file))
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "FAILED" in failed.stdout and "1 new" in failed.stdout  # the table, with the version registered
    assert "@challenger" not in failed.stdout
    error = failed.stderr.strip().splitlines()[-1]
    assert error.startswith("error: gates failed for fp32 (version 1): latency: p95_ms")


@pytest.mark.slow
def test_kiln_build_registers_an_engine_from_an_existing_model_directory(served):
    model_dir = next((served.root / ".kiln" / "stages" / "models").glob("v*"))
    params = tiny_params(served.root)
    built = write_params(served.root / "built.yaml", params.model_copy(update={"registry": params.registry.model_copy(update={"model_name": "kiln-built"})}))
    result = kiln_in(served, "build", "--model", str(model_dir), "--params", str(built))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kiln-built version 1 @challenger (fp32) — registered" in result.stdout
    assert "train-model" not in result.stderr  # built from the model as it is


@pytest.mark.slow
def test_kiln_run_fresh_rebuilds_every_stage_instead_of_reusing_the_cache(served):
    stages = served.root / ".kiln" / "stages"
    before = {p.name: p.stat().st_mtime_ns for p in (stages / "models").iterdir()}
    fresh = kiln_in(served, "run", "--fresh")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "Cached(type=COMPLETED)" not in fresh.stderr
    after = {p.name: p.stat().st_mtime_ns for p in (stages / "models").iterdir()}
    assert after.keys() == before.keys() and all(after[name] > before[name] for name in before)


@pytest.fixture(scope="module")
def bench_cache(tmp_path_factory) -> Path:
    """The first `kiln bench` run's --work folder: the tiny shape's random model and its ONNX
    export, which the bench keeps there across invocations (benchmark_engines)."""
    return tmp_path_factory.mktemp("bench-cache")


def test_kiln_bench_prints_the_side_by_side_table_and_writes_json(tmp_path, bench_cache):
    result = kiln("bench", "--shape", "tiny", "--runs", "2", "--json", str(tmp_path / "bench.json"), "--work", str(bench_cache), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hf-eager-fp32" in result.stdout and "kiln-ort-int8" in result.stdout and "kiln-ort-int4" in result.stdout
    every = {row["name"]: row for row in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    rows = {name: row for name, row in every.items() if " floor: " not in name}
    assert set(rows) == {"hf-eager-fp32", "kiln-ort-fp32", "kiln-ort-int8", "kiln-ort-int4"}
    assert all(len(row["runs_ms"]) == 2 and min(row["runs_ms"]) <= row["median_ms"] <= max(row["runs_ms"]) for row in rows.values())
    # Each engine's read floor beside it, computed (no runs), below what the engine took.
    floors = {name.split(" floor: ")[0]: row for name, row in every.items() if " floor: " in name}
    assert set(floors) == {"fp32", "int8", "int4"} and all(not row["runs_ms"] and 0 < row["median_ms"] < rows[f"kiln-ort-{p}"]["median_ms"] for p, row in floors.items())
    assert rows["hf-eager-fp32"]["speedup_vs_hf"] == 1.0
    # What each stage took, built here, and each engine process as `kiln serve` runs it.
    stages = {cost["stage"]: cost for cost in json.loads((tmp_path / "bench.json").read_text())["stages"]}
    assert set(stages) == {"export", "fp32 engine", "int8 precision", "int8 engine", "int4 precision", "int4 engine", "fp32 serve", "int8 serve", "int4 serve"}
    assert all(cost["seconds"] > 0 and 50 << 20 < cost["peak_bytes"] < 8 << 30 for cost in stages.values())
    assert "what each stage took" in result.stdout


def test_kiln_bench_times_tensorrts_int8_form_beside_onnx_runtimes_and_names_an_unknown_precision(tmp_path, bench_cache):
    from components.engine_dir import load_engine_dir

    # The model and its export as the test above's run left them (a second `kiln bench` in
    # the same --work finds them there); the engines are this run's own.
    for stage in ("model", "onnx"):
        if (bench_cache / "tiny" / stage).is_dir():
            shutil.copytree(bench_cache / "tiny" / stage, tmp_path / "work" / "tiny" / stage)
    args = ["--shape", "tiny", "--runs", "1", "--work", str(tmp_path / "work"), "--json", str(tmp_path / "bench.json")]
    result = kiln("bench", "--precisions", "int8,int8-qdq", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    timed = {row["name"] for row in json.loads((tmp_path / "bench.json").read_text())["rows"] if row["runs_ms"]}
    assert timed == {"hf-eager-fp32", "kiln-ort-int8", "kiln-ort-int8-qdq"}
    calibrated = {load_engine_dir(d).manifest.lineage.calibration_digest is not None for d in (tmp_path / "work" / "tiny" / "engines").iterdir() if d.is_dir()}
    assert calibrated == {True, False}  # the Q/DQ engine was calibrated, the blocks engine not
    # The export was reused, not built: a cache hit's seconds never pass for a build's.
    stages = [cost["stage"] for cost in json.loads((tmp_path / "bench.json").read_text())["stages"]]
    assert stages == ["int8 precision", "int8 engine", "int8-qdq precision", "int8-qdq engine", "int8 serve", "int8-qdq serve"]
    unknown = kiln("bench", "--precisions", "int9", *args, cwd=tmp_path)
    assert unknown.returncode == 2 and "--precisions: 'int9' is not one of fp32, fp16, int8, int4, int8-qdq" in unknown.stderr


def test_an_unforeseen_exception_ends_as_one_line_with_exit_2_and_its_traceback_kept(capsys):
    import typer

    from flows.cli import _one_line_errors

    with pytest.raises(typer.Exit) as stopped, _one_line_errors():
        raise FileNotFoundError("/project/.kiln/stages/models/x/config.json")
    assert stopped.value.exit_code == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1
    assert "unexpected FileNotFoundError: /project/.kiln/stages/models/x/config.json (traceback in" in line
    kept = Path(line.rsplit("traceback in ", 1)[1].rstrip(")"))
    assert "FileNotFoundError" in kept.read_text()
