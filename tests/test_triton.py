"""The champion in NVIDIA Triton Inference Server: `kiln export triton` writes a model
repository, and the real `tritonserver` that nvidia-pytriton bundles serves it from the
Triton environment (`make triton-env`; skipped with the reason where it is absent)."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from flows.cli import app
from registry import CHAMPION, RegistryTarget, promote, register_engine
from serving.app import ServerSettings, create_app
from serving.sources import AliasSource

from .conftest import SIGNING, engine_with_more_rows, new_mlflow_store
from .live_server import LiveServer, free_port, server_process
from .test_faults import tamper
from .test_registry import record

ROOT = Path(__file__).resolve().parents[1]
TRITON_PYTHON = ROOT / ".triton-venv" / "bin" / "python"
pytestmark = pytest.mark.skipif(
    subprocess.run([str(TRITON_PYTHON), "-c", "import pytriton, onnxruntime, components"], capture_output=True).returncode != 0 if TRITON_PYTHON.exists() else True,
    reason="the Triton environment is absent: `make triton-env` builds it (.ci/run does)",
)
PROMPT = "The list"


def export(registry_target, repository: Path, version: str, tmp_path: Path) -> subprocess.CompletedProcess:
    params = tmp_path / "params.yaml"
    params.write_text(f"registry: {{tracking_uri: {registry_target.tracking_uri!r}, model_name: {registry_target.model_name}}}\n")
    return CliRunner().invoke(app, ["export", "triton", str(repository), "--version", version, "--params", str(params)])


@pytest.fixture(scope="module")
def triton(tmp_path_factory, engine_dir):
    """A registry whose champion (version 1) is exported and served by a real tritonserver,
    in explicit model control (the rolling upgrade below loads versions by API)."""
    root = tmp_path_factory.mktemp("triton")
    target = RegistryTarget(new_mlflow_store(root / "mlflow.db"), "kiln-test", "kiln-test", root / "artifacts", SIGNING)
    promote(target, CHAMPION, version=register_engine(target, engine_dir.path, engine_dir.sha256, record()).version)
    repository = root / "repository"
    exported = export(target, repository, "1", root)
    assert exported.exit_code == 0, exported.output
    http, grpc, metrics = free_port(), free_port(), free_port()
    command = [str(TRITON_PYTHON), "-m", "flows.triton_server", f"--model-repository={repository}", f"--http-port={http}", f"--grpc-port={grpc}",
               f"--metrics-port={metrics}", "--model-control-mode=explicit", "--load-model=kiln-test", "--exit-timeout-secs=5"]  # fmt: skip
    with server_process("tritonserver", command, root / "tritonserver.log", f"http://127.0.0.1:{http}", "/v2/models/kiln-test/ready", 180) as url:
        yield type("Triton", (), {"url": url, "metrics": f"http://127.0.0.1:{metrics}", "target": target, "repository": repository, "root": root, "log": root / "tritonserver.log"})


def generate(triton, body: dict, version: str | None = None) -> dict:
    path = f"/v2/models/kiln-test{f'/versions/{version}' if version else ''}/generate"
    answer = httpx.post(f"{triton.url}{path}", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_exported_champion_is_ready_in_triton_with_its_registry_identity(triton, engine_dir):
    import tritonclient.http as triton_http

    client = triton_http.InferenceServerClient(triton.url.removeprefix("http://"))
    assert client.is_model_ready("kiln-test")
    assert client.get_model_metadata("kiln-test")["versions"] == ["1"]
    parameters = {k: v["string_value"] for k, v in client.get_model_config("kiln-test")["parameters"].items()}
    assert parameters["kiln.1.engine_sha256"] == engine_dir.sha256 and parameters["kiln.1.precision"] == "fp32"
    identity = json.loads((triton.repository / "kiln-test" / "1" / "kiln_version.json").read_text())
    assert identity["signing_key"] == parameters["kiln.1.signing_key"] != "unsigned"
    client.close()


def test_triton_answers_what_kiln_serve_answers_streamed_or_not(triton):
    app_ = create_app(AliasSource(triton.target, CHAMPION, triton.root / "serve-cache"), ServerSettings(poll_interval_s=0))
    with LiveServer(app_) as live, live.client() as client:
        served = client.post("/v1/completions", json={"model": "kiln-test", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
    answered = generate(triton, {"text_input": PROMPT, "max_tokens": 12})
    assert answered["text_output"] == served and answered["finish_reason"] in ("length", "stop") and answered["model_version"] == "1"
    with httpx.stream("POST", f"{triton.url}/v2/models/kiln-test/generate_stream", json={"text_input": PROMPT, "max_tokens": 12, "stream": True}, timeout=60) as stream:
        events = [json.loads(line.removeprefix("data: ")) for line in stream.iter_lines() if line.startswith("data: ")]
    assert len(events) > 2 and "".join(e["text_output"] for e in events) == served  # the text as it was generated
    assert events[-1]["finish_reason"] == answered["finish_reason"]


def test_sixteen_concurrent_requests_are_all_answered_and_counted_in_tritons_metrics(triton):
    def count() -> float:
        text = httpx.get(f"{triton.metrics}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith('nv_inference_request_success{model="kiln-test"'))

    before = count()
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: generate(triton, {"text_input": f"{PROMPT} {i}", "max_tokens": 8, "temperature": 0.8, "seed": i, "ignore_eos": True}), range(16)))
    # Eight tokens each, end-of-text or not: the count below is exact whatever the model samples.
    assert all(a["finish_reason"] == "length" for a in answers) and len({a["text_output"] for a in answers}) > 1
    assert count() - before == 16
    kiln_series = httpx.get(f"{triton.metrics}/metrics").text
    generated = [float(line.rsplit(" ", 1)[1]) for line in kiln_series.splitlines() if line.startswith('kiln_generated_tokens_total{model="kiln-test"')]
    assert generated and sum(generated) >= 16 * 8  # kiln's own series, beside Triton's


def test_a_rolling_upgrade_loads_the_next_version_and_a_tampered_one_never_becomes_ready(triton, engine_dir):
    import tritonclient.http as triton_http
    from tritonclient.utils import InferenceServerException

    client = triton_http.InferenceServerClient(triton.url.removeprefix("http://"))
    two = register_engine(triton.target, engine_with_more_rows(engine_dir, triton.root / "v2", extra_rows=1), engine_dir.sha256, record()).version
    assert export(triton.target, triton.repository, two, triton.root).exit_code == 0
    client.load_model("kiln-test")  # Triton's model-control API: the newest version replaces the one before
    assert client.get_model_metadata("kiln-test")["versions"] == [two]
    assert generate(triton, {"text_input": PROMPT, "max_tokens": 4})["model_version"] == two

    three = register_engine(triton.target, engine_with_more_rows(engine_dir, triton.root / "v3", extra_rows=2), engine_dir.sha256, record()).version
    assert export(triton.target, triton.repository, three, triton.root).exit_code == 0
    tamper(triton.repository / "kiln-test" / three / "engine", also_manifest=True)  # engine.json made to agree: only the registry's record tells
    with pytest.raises(InferenceServerException):
        client.load_model("kiln-test")
    assert not client.is_model_ready("kiln-test", three)
    assert f"kiln-test version {three} refused: its engine file has sha256" in triton.log.read_text()
    client.close()


def test_a_version_the_loader_refuses_is_never_exported(triton, engine_dir):
    from .test_signing import delete_the_signature

    four = register_engine(triton.target, engine_with_more_rows(engine_dir, triton.root / "v4", extra_rows=3), engine_dir.sha256, record()).version
    refusal = delete_the_signature(triton.target, four)
    exported = export(triton.target, triton.repository, four, triton.root)
    assert exported.exit_code == 2 and refusal in " ".join(exported.stderr.split())
    assert not [p for p in (triton.repository / "kiln-test").iterdir() if four in p.name]  # not even a partial folder
