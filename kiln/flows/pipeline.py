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
from kiln.components.calibrate import CalibrationSet, calibration_set_from_pool
from kiln.components.data import DataVersion, data_version_from_source
from kiln.components.engine_dir import EngineDir
from kiln.components.engines import load_engine
from kiln.components.engines.base import EngineTokenizer, Sampling
from kiln.components.export import ExportedOnnx, onnx_from_model
from kiln.components.gates import GateReport, gate_engine_dir, write_report
from kiln.components.precision import precision_onnx
from kiln.components.train import TrainedModel, model_from_data, model_from_directory
from kiln.config import GateParams, Params
from kiln.errors import GateFailed
from kiln.flows.caching import task_cache_key
from kiln.flows.lineage import registry_target, run_record
from kiln.registry import CHALLENGER, Registration, RegistryTarget, download_version, preflight, promote, register_engine
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
    return wanted.prompt + tokenizer.decode(ids)


version_data = task(name="version-data", retries=1)(data_version_from_source)
train_model = _cached(model_from_data, "train-model")
load_pretrained = task(name="load-model")(model_from_directory)
export_onnx = _cached(onnx_from_model, "export-onnx")
curate_calibration = _cached(calibration_set_from_pool, "curate-calibration-set")
convert_precision = _cached(precision_onnx, "precision-onnx")
build_engine = _cached(engine_from_onnx, "build-engine")
gate_engine = _cached(gate_and_report, "gate-engine")
register = task(name="register-engine", retries=1, retry_delay_seconds=2)(register_engine)
set_challenger = task(name="alias-challenger", retries=1, retry_delay_seconds=2)(promote)
sample = task(name="sample-completion")(sample_from_registry)


@dataclass(frozen=True)
class EngineOutcome:
    """One precision's engine: what was built, how it gated, where it was registered."""

    precision: str
    engine: EngineDir
    report: GateReport
    registration: Registration


@dataclass(frozen=True)
class PipelineResult:
    outcomes: tuple[EngineOutcome, ...]
    challenger: EngineOutcome | None
    model: TrainedModel
    data: DataVersion
    calibration: CalibrationSet | None
    sample: str | None

    @property
    def failed(self) -> tuple[EngineOutcome, ...]:
        return tuple(o for o in self.outcomes if not o.report.passed)


@flow(name="retrain-and-rebuild")
def retrain_and_rebuild(params: Params, root: Path, model_dir: Path | None = None) -> PipelineResult:
    """data → train → export → calibrate → (precision → build → gates → register) per
    precision → challenger on the fastest engine that passed → sample. `model_dir` skips training."""
    workspace = Workspace(root)
    target = registry_target(params.registry, workspace)
    preflight(target)
    data = version_data(params.data, root)
    if model_dir is not None:
        model = load_pretrained(model_dir)
    else:
        model = train_model(data, params.model, workspace.stage_dir("models"))
    onnx = export_onnx(model, params.export, workspace.stage_dir("onnx"))
    calibration = None
    if "int8" in params.precision.build:
        calibration = curate_calibration(data, model.path, params.build.profiles, params.calibration, workspace.stage_dir("calibration"))
    outcomes = tuple(
        _engine_for(precision, params, model, onnx, data, calibration, workspace, target) for precision in params.precision.build
    )
    challenger = fastest_passing(outcomes)
    if challenger is not None:
        set_challenger(target, CHALLENGER, version=challenger.registration.version)
    text = sample(challenger.registration, params, workspace) if challenger else None
    result = PipelineResult(outcomes, challenger, model, data, calibration, text)
    if result.failed:
        failures = "; ".join(f"{o.precision} (version {o.registration.version}): " + ", ".join(o.report.failures()) for o in result.failed)
        raise GateFailed(f"gates failed for {failures}", result)
    return result


def _engine_for(
    precision: str,
    params: Params,
    model: TrainedModel,
    onnx: ExportedOnnx,
    data: DataVersion,
    calibration: CalibrationSet | None,
    workspace: Workspace,
    target: RegistryTarget,
) -> EngineOutcome:
    graph = convert_precision(onnx, precision, calibration, params.precision, workspace.stage_dir("precision"))
    engine = build_engine(graph, model, data, params.build, workspace.stage_dir("engines"))
    report, report_dir = gate_engine(engine, model, data, params.gates, workspace.stage_dir("gates"))
    _publish_report(precision, report)
    record = run_record(params, model, onnx, engine, report, report_dir, calibration, git_commit(workspace.root))
    registration = register(target, engine.path, engine.sha256, record)
    return EngineOutcome(precision, engine, report, registration)


def fastest_passing(outcomes: tuple[EngineOutcome, ...]) -> EngineOutcome | None:
    """The engine that passed every gate with the lowest median generation latency."""
    passed = [o for o in outcomes if o.report.passed]
    return min(passed, key=lambda o: o.report.gate("latency").measured["p50_ms"], default=None)


def _publish_report(precision: str, report: GateReport) -> None:
    create_markdown_artifact(report.to_markdown(), key=f"gate-report-{precision}", description=f"Gates of the {precision} engine")
    rows = [
        {"gate": gate.name, "measure": measure, "value": round(value, 6), "passed": gate.passed}
        for gate in report.gates
        for measure, value in gate.measured.items()
    ]
    create_table_artifact(rows, key=f"gate-numbers-{precision}", description=f"Every number the gates measured, {precision}")
    get_run_logger().info("%s gates %s", precision, "passed" if report.passed else "FAILED: " + "; ".join(report.failures()))


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"
