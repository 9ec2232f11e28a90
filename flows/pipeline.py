"""The retrain-and-rebuild flow: Prefect wiring around the components, the registry and
the serving loader. Nothing here computes; it names tasks and passes values along.

Stages are cached on content (data md5, model / ONNX / engine sha256, params) and on each
stage's STAGE_VERSION, so a run with nothing changed reuses every stage and registers
nothing new.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from components.build import engine_from_model, engine_from_onnx, resolve_backend
from components.calibrate import CalibrationSet, calibration_set_from_pool
from components.champion_gate import Contender, champion_gate
from components.config import GateParams, Params, SampleParams
from components.data import DataVersion, data_version_from_source
from components.engine_dir import EngineDir
from components.errors import GateFailed, KilnError
from components.export import ExportedOnnx, onnx_from_model
from components.gates import GateReport, GateResult, fastest_passing, gated_engine, write_report
from components.model_dir import TrainedModel, check_fits_model, model_from_directory, pretrained_directory
from components.precision import PrecisionOnnx, precision_onnx
from components.runtime import open_engine
from components.runtime.sampling import Sampling
from components.runtime.tokenizer import EngineTokenizer
from components.train import model_from_data, write_loss_plot
from components.workspace import Workspace
from flows.caching import CachedStage
from flows.data_changes import record_run_data
from flows.lineage import git_commit, run_record, training_record
from flows.serving_gate import serving_gate
from registry import (
    CHALLENGER,
    CHAMPION,
    Registration,
    RegistryTarget,
    RunLink,
    VersionInfo,
    alias_version,
    aliases_of,
    log_training,
    preflight,
    promote,
    register_engine,
    registry_target,
    tags,
)
from serving import loader


def sample_from_registry(target: RegistryTarget, version: str, wanted: SampleParams, cache_root: Path) -> str:
    """The prompt and a seeded completion by the registered engine, pulled back from the
    registry through the serving loader (verified against the version's tags)."""
    pulled = loader.pull_version(target, version, cache_root)
    sampling = Sampling(max_new_tokens=wanted.max_tokens, temperature=wanted.temperature, top_p=wanted.top_p, seed=wanted.seed)
    tokenizer = EngineTokenizer(pulled.engine_dir.path)
    with loader.load(pulled) as engine:
        ids = engine.generate([tokenizer.encode_prompt(wanted.prompt)], sampling)[0]
    return wanted.prompt + tokenizer.decode(ids)


def compare_with_champion(
    engine_dir: EngineDir, champion: VersionInfo, data: DataVersion, params: GateParams, target: RegistryTarget, cache_root: Path
) -> GateResult | None:
    """The champion gate of a new engine (components.champion_gate), the champion pulled
    through the serving loader. None, with a warning, when the champion cannot be pulled:
    a broken champion must not block the engine that may replace it."""
    try:
        pulled = loader.pull_version(target, champion.version, cache_root)
        served = loader.load(pulled)
    except KilnError as err:
        get_run_logger().warning(f"no champion gate: champion version {champion.version} cannot be loaded here ({err})")
        return None
    with open_engine(engine_dir) as candidate, served:
        return champion_gate(
            Contender(candidate, EngineTokenizer(engine_dir.path)), Contender(served, EngineTokenizer(pulled.engine_dir.path)),
            champion.version, data.texts("eval"), params,
        )  # fmt: skip


version_data = task(name="version-data", retries=1)(data_version_from_source)
train_model = CachedStage(model_from_data, "train-model")
load_pretrained = task(name="load-model")(model_from_directory)
check_params_against_model = task(name="check-params-against-model")(check_fits_model)
export_onnx = CachedStage(onnx_from_model, "export-onnx")
curate_calibration = CachedStage(calibration_set_from_pool, "curate-calibration-set")
convert_precision = CachedStage(precision_onnx, "precision-onnx")
build_engine = CachedStage(engine_from_onnx, "build-engine")
build_from_model = CachedStage(engine_from_model, "build-engine")  # torch-cuda's engines
gate_engine = CachedStage(gated_engine, "gate-engine")
register = task(name="register-engine", retries=1, retry_delay_seconds=2)(register_engine)
set_challenger = task(name="alias-challenger", retries=1, retry_delay_seconds=2)(promote)
sample = task(name="sample-completion")(sample_from_registry)
champion_check = task(name="champion-gate")(compare_with_champion)  # not cached: the champion moves
serving_check = task(name="serving-gate")(serving_gate)  # under a second: timing is not worth caching


@task(name="log-training-run", retries=1, retry_delay_seconds=2)
def log_training_run(target: RegistryTarget, params: Params, model: TrainedModel, data: DataVersion, scratch: Path) -> RunLink | None:
    """The model's own MLflow run, logged once per model; None for a model kiln did not train."""
    if not model.loss_curve:
        return None
    plot = write_loss_plot(model, scratch / f"loss-{model.sha256[:12]}" / "loss.png")
    return log_training(target, model.sha256, training_record(params, model, data.md5, plot.parent))


@dataclass(frozen=True)
class EngineOutcome:
    """One precision's engine: what was built, how it gated, where it was registered."""

    precision: str
    engine: EngineDir
    report: GateReport
    registration: Registration
    against_champion: GateResult | None = None  # the champion gate; None without a champion to compare

    @property
    def may_be_challenger(self) -> bool:
        """Its own gates passed — in this run and in its version's record (an engine
        registered before keeps its first record) — and it is not worse than the champion
        beyond the limits."""
        return self.report.passed and self.registration.gates_passed and (self.against_champion is None or self.against_champion.passed)

    @property
    def record_disagrees(self) -> bool:
        """This run's gates say otherwise than the version it found already registered."""
        return not self.registration.created and self.registration.gates_passed != self.report.passed


def choose_challenger(outcomes: tuple[EngineOutcome, ...]) -> EngineOutcome | None:
    """The fastest engine that passed its gates and is not worse than the champion."""
    return fastest_passing([o for o in outcomes if o.may_be_challenger], lambda outcome: outcome.report)


@dataclass(frozen=True)
class PipelineResult:
    outcomes: tuple[EngineOutcome, ...]
    challenger: EngineOutcome | None  # the engine this run chose
    aliases: dict[str, str]  # alias → version as the registry has them after the run
    model: TrainedModel
    data: DataVersion
    calibration: CalibrationSet | None
    sample: str | None

    @property
    def failed(self) -> tuple[EngineOutcome, ...]:
        return tuple(o for o in self.outcomes if not o.report.passed)


@flow(name="retrain-and-rebuild")
def retrain_and_rebuild(params: Params, root: Path, model_dir: Path | None = None, choose: bool = True) -> PipelineResult:
    """data → train → export → calibrate → (precision → build → gates → register) per
    precision → challenger on the fastest engine that passed → sample. `model_dir` skips
    training; `choose=False` leaves the challenger to the caller (a build on one target of
    several: flows.deployments)."""
    workspace = Workspace(root)
    target = registry_target(params.registry, root)
    preflight(target, registering=True)
    data = version_data(params.data, root)
    record_run_data(root, data.md5)  # what `kiln deploy` compares data.dvc with
    model = _model_for(params, data, workspace, model_dir)
    check_params_against_model(model, params.build.profiles, params.sample)
    training = log_training_run(target, params, model, data, workspace.stage_dir("reports"))
    onnx = None
    if any(not _from_the_model(precision, params) for precision in params.precision.build):
        onnx = export_onnx(model, params.export, workspace.stage_dir("onnx"))
    else:
        get_run_logger().info("no ONNX export: torch-cuda builds every engine of this run from the model")
    calibration = None
    if params.precision.calibrates(int8_backend(params)):  # int8 built, as Q/DQ
        calibration = curate_calibration(data, model.path, params.build.profiles, params.calibration, workspace.stage_dir("calibration"))
    outcomes = tuple(
        _engine_for(precision, params, model, onnx, data, calibration, workspace, target, training) for precision in params.precision.build
    )
    challenger = choose_challenger(outcomes) if choose else None
    if challenger is not None:
        set_challenger(target, CHALLENGER, version=challenger.registration.version)
    text = sample(target, challenger.registration.version, params.sample, workspace.serving_cache) if challenger else None
    # Read back, not assumed: a concurrent run may have moved an alias since.
    result = PipelineResult(outcomes, challenger, aliases_of(target), model, data, calibration, text)
    if result.failed:
        failures = "; ".join(f"{o.precision} (version {o.registration.version}): " + ", ".join(o.report.failures()) for o in result.failed)
        verdict = "failed" if any(o.report.verdict == "failed" for o in result.failed) else "inconclusive"
        raise GateFailed(f"gates {verdict} for {failures}", result)
    return result


def _model_for(params: Params, data: DataVersion, workspace: Workspace, model_dir: Path | None) -> TrainedModel:
    """The model the engines are built from: a given directory, a pretrained model as it is,
    or one trained (or fine-tuned) here; the run's log says which."""
    log = get_run_logger()
    if model_dir is not None:
        log.info("model: %s, built as it is (kiln build)", model_dir)
        return load_pretrained(model_dir)
    log.info(params.model.plan())
    if params.model.pretrained and params.data.source.kind == "cpython-docs":
        log.info("data: the gates score %s on CPython's docs (data.source); text like your users' measures what they will see", params.model.pretrained)
    if params.model.schedule is None:
        return load_pretrained(pretrained_directory(params.model.pretrained, workspace.root))
    return train_model(data, params.model, workspace.stage_dir("models"))


def int8_backend(params: Params) -> str:
    """The backend an int8 engine is built for: it decides int8's scheme (blocks on ONNX
    Runtime, Q/DQ for TensorRT) and so whether a calibration set is curated."""
    return resolve_backend(params.build.backend, "int8", ort_only=params.precision.int8.scheme == "blocks")


def _engine_for(
    precision: str,
    params: Params,
    model: TrainedModel,
    onnx: ExportedOnnx | None,
    data: DataVersion,
    calibration: CalibrationSet | None,
    workspace: Workspace,
    target: RegistryTarget,
    training: RunLink | None,
) -> EngineOutcome:
    if _from_the_model(precision, params):
        engine = build_from_model(model, precision, data, params.build, workspace.stage_dir("engines"))
    else:
        graph = _precision_graph(precision, params, onnx, calibration, workspace)
        engine = build_engine(graph, model, data, params.build, workspace.stage_dir("engines"), workspace.root)
    gated = gate_engine(engine, model, data, params.gates, workspace.stage_dir("gates"), params.serving.threads)
    report = gated.report.plus(serving_check(engine, data.texts("eval"), params.gates, params.serving.threads))
    champion = alias_version(target, CHAMPION)
    is_champion = champion is not None and (champion.tags.get(tags.ENGINE_SHA256), champion.tags.get(tags.PROFILES_SHA256)) == (
        engine.sha256, engine.manifest.profiles_sha256
    )
    compared = None
    if champion is not None and not is_champion:
        compared = champion_check(engine, champion, data, params.gates, target, workspace.serving_cache)
    report_dir = _publish_report(precision, report, compared, workspace.stage_dir("reports") / f"gates-{precision}-{engine.sha256[:16]}")
    record = run_record(params, model, onnx, engine, report, report_dir, calibration, git_commit(workspace.root), champion, compared, training)
    registration = register(target, engine.path, engine.sha256, record)
    return EngineOutcome(precision, engine, report, registration, compared)


def _from_the_model(precision: str, params: Params) -> bool:
    """torch-cuda builds the engine, from the model itself: no ONNX graph of any precision
    (an int4 MatMulNBits graph, or the export, would be made for nothing)."""
    return precision != "int8" and resolve_backend(params.build.backend, precision) == "torch-cuda"


def _precision_graph(precision: str, params: Params, onnx: ExportedOnnx, calibration: CalibrationSet | None, workspace: Workspace) -> PrecisionOnnx:
    """The precision's graph, for the backend that builds it from ONNX."""
    settings = params.precision.for_backend(int8_backend(params)) if precision == "int8" else params.precision
    return convert_precision(onnx, precision, calibration, settings, workspace.stage_dir("precision"))


def _publish_report(precision: str, report: GateReport, against_champion: GateResult | None, directory: Path) -> Path:
    """Every gate of this run (the cached gate stage's and those measured in the run) as
    Prefect artifacts and as the report files the registered run keeps; returns their folder."""
    everything = report.plus(against_champion) if against_champion else report
    write_report(everything, directory)
    create_markdown_artifact(everything.to_markdown(), key=f"gate-report-{precision}", description=f"Gates of the {precision} engine")
    rows = [
        {"gate": gate.name, "measure": measure, "value": round(value, 6), "interval": [round(b, 6) for b in gate.intervals.get(measure, ())], "verdict": gate.verdict}
        for gate in everything.gates
        for measure, value in gate.measured.items()
    ]
    create_table_artifact(rows, key=f"gate-numbers-{precision}", description=f"Every number the gates measured, {precision}")
    get_run_logger().info("%s gates %s", precision, "passed" if report.passed else f"{report.verdict.upper()}: " + "; ".join(report.failures()))
    if against_champion is not None and not against_champion.passed:
        get_run_logger().info("%s is not a challenger: %s", precision, "; ".join(GateReport((against_champion,)).failures()))
    return directory
