"""The `kiln` command line as a user runs it: exit codes, one-line errors, the whole run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app

from .conftest import make_project, tiny_params

KILN = str(Path(sys.executable).parent / "kiln")
VERBS = ["run", "build", "gate", "promote", "doctor", "up"]


def kiln(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([KILN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


def write_params(path: Path, params) -> Path:
    path.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    return path


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help(verb):
    result = CliRunner().invoke(app, [verb, "--help"])
    assert result.exit_code == 0
    assert "Usage" in result.output


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


def test_a_corrupt_model_directory_exits_2_naming_it(tmp_path):
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
    assert "all gates passed" in passed.output

    strict = params.gates.model_copy(update={"latency": params.gates.latency.model_copy(update={"max_p95_ms": 1e-6})})
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


@pytest.mark.slow
def test_kiln_run_registers_a_challenger_prints_a_sample_and_a_second_run_registers_nothing(tmp_path):
    root = make_project(tmp_path / "p")
    write_params(root / "params.yaml", tiny_params(root))
    first = kiln("run", cwd=root)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "kiln-tiny version 1 @challenger (fp32) — registered" in first.stdout
    assert "sample completion" in first.stdout and "'The list" in first.stdout

    second = kiln("run", cwd=root)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "kiln-tiny version 1 @challenger (fp32) — unchanged" in second.stdout
    assert second.stderr.count("Cached(type=COMPLETED)") >= 4

    promoted = kiln("promote", cwd=root)
    assert promoted.returncode == 0 and "kiln-tiny@champion → version 1" in promoted.stdout


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
