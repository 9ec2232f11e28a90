"""The retrain-and-rebuild flow: Prefect wiring around the components and the registry.

Stages are cached on content (data md5, model / ONNX / engine sha256, params), so a run
with nothing changed reuses every stage and registers nothing new.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from kiln.components.build import engine_from_onnx
from kiln.components.data import DataVersion, data_version_from_source
from kiln.components.engine_dir import EngineDir
from kiln.components.engines import load_engine
from kiln.components.engines.base import EngineTokenizer, Sampling
from kiln.components.export import onnx_from_model
from kiln.components.gates import GateReport, gate_engine_dir, write_report
from kiln.components.train import TrainedModel, model_from_data, model_from_directory
from kiln.config import GateParams, Params
from kiln.errors import GateFailed
from kiln.flows.caching import task_cache_key
from kiln.flows.lineage import registry_target, run_record
from kiln.registry import Registration, download_version, preflight, register_engine
from kiln.workspace import Workspace


def _cached(fn, name: str, **options):
    return task(name=name, cache_key_fn=task_cache_key, persist_result=True, **options)(fn)


def gate_and_report(engine: EngineDir, model: TrainedModel, data: DataVersion, params: GateParams, out_root: Path) -> tuple[GateReport, Path]:
    report = gate_engine_dir(engine.path, model.path, data.texts("eval"), params)
    directory = out_root / engine.sha256[:16]
    write_report(report, directory)
    return report, directory


def sample_from_registry(registration: Registration, params: Params, workspace: Workspace) -> str:
    """A completion from the registered engine, downloaded back from the registry."""
    target = registry_target(params.registry, workspace)
    local = download_version(target, registration.version, workspace.state / "downloads" / f"{registration.name}-{registration.version}")
    engine = load_engine(local)
    tokenizer = EngineTokenizer(local)
    wanted = params.sample
    sampling = Sampling(max_new_tokens=wanted.max_tokens, temperature=wanted.temperature, top_p=wanted.top_p, seed=wanted.seed)
    ids = engine.generate([tokenizer.encode(wanted.prompt)], sampling)[0]
    return params.sample.prompt + tokenizer.decode(ids)


version_data = task(name="version-data", retries=1)(data_version_from_source)
train_model = _cached(model_from_data, "train-model")
load_pretrained = task(name="load-model")(model_from_directory)
export_onnx = _cached(onnx_from_model, "export-onnx")
build_engine = _cached(engine_from_onnx, "build-engine")
gate_engine = _cached(gate_and_report, "gate-engine")
register = task(name="register-engine", retries=1, retry_delay_seconds=2)(register_engine)
sample = task(name="sample-completion")(sample_from_registry)


@dataclass(frozen=True)
class PipelineResult:
    registration: Registration
    report: GateReport
    engine: EngineDir
    model: TrainedModel
    data: DataVersion
    sample: str | None


@flow(name="retrain-and-rebuild")
def retrain_and_rebuild(params: Params, root: Path, model_dir: Path | None = None) -> PipelineResult:
    """data → train → export → build → gates → register → sample. `model_dir` skips training."""
    workspace = Workspace(root)
    target = registry_target(params.registry, workspace)
    preflight(target)
    data = version_data(params.data, root)
    if model_dir is not None:
        model = load_pretrained(model_dir)
    else:
        model = train_model(data, params.model, workspace.stage_dir("models"))
    onnx = export_onnx(model, params.export, workspace.stage_dir("onnx"))
    engine = build_engine(onnx, model, data, params.build, workspace.stage_dir("engines"))
    report, report_dir = gate_engine(engine, model, data, params.gates, workspace.stage_dir("gates"))
    _publish_report(report)
    record = run_record(params, model, onnx, engine, report, report_dir, git_commit(root))
    registration = register(target, engine.path, engine.sha256, report.passed, record)
    if not report.passed:
        raise GateFailed(f"{registration.name} version {registration.version} failed its gates: " + "; ".join(report.failures()), report)
    text = sample(registration, params, workspace)
    return PipelineResult(registration, report, engine, model, data, text)


def _publish_report(report: GateReport) -> None:
    create_markdown_artifact(report.to_markdown(), key="gate-report", description="Gates of the engine built in this run")
    rows = [
        {"gate": gate.name, "measure": measure, "value": round(value, 6), "passed": gate.passed}
        for gate in report.gates
        for measure, value in gate.measured.items()
    ]
    create_table_artifact(rows, key="gate-numbers", description="Every number the gates measured")
    get_run_logger().info("gates %s", "passed" if report.passed else "FAILED: " + "; ".join(report.failures()))


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"
