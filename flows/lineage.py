"""What a registered engine records about where it came from: the run's params, metrics,
artifacts and the version tags of DESIGN.md's registry contract."""

from __future__ import annotations

import subprocess
from pathlib import Path

from components.calibrate import CalibrationSet
from components.config import Params
from components.engine_dir import EngineDir
from components.export import ExportedOnnx
from components.gates import GateReport, GateResult
from components.model_dir import TrainedModel
from registry import DatasetRecord, RunLink, RunRecord, VersionInfo, tags


def version_tags(params: Params, engine: EngineDir, report: GateReport, git_commit: str, against_champion: GateResult | None = None) -> dict[str, str]:
    manifest = engine.manifest
    named = {
        tags.ENGINE_SHA256: manifest.engine_sha256,
        tags.BACKEND: manifest.backend,
        tags.BACKEND_VERSION: manifest.backend_version,
        tags.PRECISION: manifest.precision,
        tags.TARGET: manifest.target,
        tags.MODEL_FAMILY: manifest.model_family,
        tags.KV_HEADS: str(manifest.kv_heads),
        tags.CHAT_TEMPLATE_SHA256: manifest.chat_template_sha256 or "none",
        tags.DATA_MD5: manifest.lineage.data_md5,
        tags.CALIBRATION_DIGEST: manifest.lineage.calibration_digest or "none",
        tags.SOURCE_MODEL_SHA256: manifest.lineage.source_model_sha256,
        tags.ONNX_SHA256: manifest.lineage.onnx_sha256,
        # Engines from before precisions were built from the fp32 export; torch-cuda's from the model.
        tags.PRECISION_ONNX_SHA256: manifest.lineage.precision_onnx_sha256 or ("none" if manifest.backend == "torch-cuda" else manifest.lineage.onnx_sha256),
        tags.GIT_COMMIT: git_commit,
        tags.PARAMS_SHA256: params.digest(),
        tags.GATES_PASSED: tags.flag(report.passed),
        tags.GATES_VERDICT: report.verdict,
    } | ({tags.PARAMETER_COUNT: str(manifest.parameter_count)} if manifest.parameter_count else {}) | ({tags.GATES_MEASURED_ON: report.machine} if report.machine else {}) | {tags.runtime(name): value for name, value in manifest.runtime.items() if name != "shape"}  # torch, CUDA, GPU
    if against_champion is not None:  # its own gate: it decides `challenger`, not gates.passed
        named[tags.CHAMPION_GATE_PASSED] = tags.flag(against_champion.passed)
        named |= {name: f"{value:.6g}" for name, value in GateReport((against_champion,)).flat_numbers().items()}
    return named | {name: f"{value:.6g}" for name, value in report.flat_numbers().items()} | report.flat_conditions()


def run_record(
    params: Params,
    model: TrainedModel,
    onnx: ExportedOnnx,
    engine: EngineDir,
    report: GateReport,
    report_dir: Path,
    calibration: CalibrationSet | None,
    git_commit: str,
    champion: VersionInfo | None = None,
    against_champion: GateResult | None = None,
    training: RunLink | None = None,
) -> RunRecord:
    metrics = dict(report.flat_numbers()) | (GateReport((against_champion,)).flat_numbers() if against_champion else {})
    metrics["export.parity.prefill_max_abs_diff"] = onnx.parity.prefill_max_abs_diff
    metrics["export.parity.decode_max_abs_diff"] = onnx.parity.decode_max_abs_diff
    if model.eval_perplexity is not None:
        metrics["train.eval_perplexity"] = model.eval_perplexity
        metrics["train.uniform_perplexity"] = model.uniform_perplexity or 0.0
    artifacts = {"gates": report_dir}
    datasets = [DatasetRecord("corpus", engine.manifest.lineage.data_md5, str(Path(params.data.path).with_suffix(".dvc")), "training")]
    if engine.manifest.lineage.calibration_digest and calibration is not None:
        artifacts["calibration"] = calibration.path
        manifest = calibration.manifest()
        profile = {k: manifest[k] for k in ("samples", "buckets", "tokens", "decode_steps", "near_duplicates_removed")}
        datasets.append(DatasetRecord("calibration", calibration.digest, str(calibration.path), "calibration", profile))
    return RunRecord(
        params=_flatten(params.model_dump(mode="json")),
        metrics=metrics,
        version_tags=version_tags(params, engine, report, git_commit, against_champion) | {tags.TRAINING_KERNELS: model.kernels_text} | ({tags.TRAINING_RUN_ID: training.run_id} if training else {}),
        description=version_description(params, model, engine, report, calibration, git_commit, champion, against_champion, training),
        artifacts=artifacts,
        datasets=tuple(datasets),
        run_tags={tags.RUN_TRAINING_RUN_ID: training.run_id} if training else {},
    )


def training_record(params: Params, model: TrainedModel, data_md5: str, plot: Path) -> RunRecord:
    """The training run: the data and model sections of params.yaml, the loss by step, the
    eval perplexity, the corpus as a dataset input and the loss plot."""
    metrics = {"train.eval_perplexity": model.eval_perplexity or 0.0, "train.uniform_perplexity": model.uniform_perplexity or 0.0}
    return RunRecord(
        params=_flatten({"data": params.data.model_dump(mode="json"), "model": params.model.model_dump(mode="json")}),
        metrics=metrics,
        version_tags={},
        artifacts={"plots": plot},
        step_metrics={"train.loss": list(model.loss_curve)},
        datasets=(DatasetRecord("corpus", data_md5, str(Path(params.data.path).with_suffix(".dvc")), "training"),),
    )


def _model_line(manifest) -> str:
    """The model the engine runs, in the terms a person compares models by."""
    size = f"{manifest.parameter_count / 1e6:.2f} M parameters · " if manifest.parameter_count else ""
    chat = f"chat template `{manifest.chat_template_sha256[:12]}`" if manifest.chat_template_sha256 else "no chat template"
    return f"Model: **{manifest.model_family}** · {size}{manifest.num_layers} layers · {manifest.num_heads} heads, {manifest.kv_heads} KV heads · vocabulary {manifest.vocab_size} · {chat}"


def version_description(
    params: Params,
    model: TrainedModel,
    engine: EngineDir,
    report: GateReport,
    calibration: CalibrationSet | None,
    git_commit: str,
    champion: VersionInfo | None,
    against_champion: GateResult | None = None,
    training: RunLink | None = None,
) -> str:
    """The version page in the MLflow UI (it renders markdown): the gates with their limits,
    the champion of the moment beside them, and the lineage. The registry adds the run."""
    m = engine.manifest
    verdict = {"passed": "passed", "inconclusive": "**INCONCLUSIVE** (not aliased: the sample did not settle a limit)"}.get(report.verdict, "**FAILED**")
    lines = [
        f"**{m.precision} engine** of `{params.registry.model_name}` · {m.backend} {m.backend_version} · `{m.target}` · gates {verdict}",
        "",
        _model_line(m),
        "",
        "### Gates",
        "",
        *report.to_markdown().splitlines()[2:],
        "",
        *_champion_gate_section(against_champion),
        *_champion_section(report, champion),
        "### Lineage",
        "",
        f"- data version `{m.lineage.data_md5}` ({Path(params.data.path).with_suffix('.dvc')})",
    ]
    if calibration is not None and m.lineage.calibration_digest:
        lines.append(f"- calibration set `{calibration.digest[:16]}` ({len(calibration.prompts)} prompts, {calibration.decode_steps} decode steps)")
    perplexity = f", eval perplexity {model.eval_perplexity:.2f}" if model.eval_perplexity is not None else ""
    perplexity += f" ([training run]({training.ui_fragment}))" if training else ""
    lines += [
        f"- model sha256 `{model.sha256[:16]}`{perplexity}, trained with {model.kernels_text} kernels",
        _built_from(m) + f" → engine `{m.engine_sha256[:16]}` (profiles `{m.profiles_sha256[:16]}`)",
        f"- git commit `{git_commit[:12]}`, params sha256 `{params.digest()[:16]}`",
        "",
        "### Reports",
        "",
        "The gate report (`gates/report.md`, `gates/report.json`) and the latency plot (`gates/latency.png`) are artifacts of the run below.",
    ]
    return "\n".join(lines) + "\n"


def _built_from(m) -> str:
    """What the engine file was made from: the precision ONNX, or (torch-cuda) the model itself."""
    if m.backend == "torch-cuda":
        return f"- model → {m.precision} `torch.export` program over a static KV cache ({', '.join(f'{k} {v}' for k, v in m.runtime.items() if k != 'shape')})"
    return f"- ONNX `{m.lineage.onnx_sha256[:16]}` → {m.precision} ONNX `{(m.lineage.precision_onnx_sha256 or m.lineage.onnx_sha256)[:16]}`"


def _champion_gate_section(against_champion: GateResult | None) -> list[str]:
    """The champion gate: measured beside the champion in this run, on this run's data."""
    if against_champion is None:
        return []
    version = int(against_champion.measured["champion_version"])
    verdict = "may become `challenger`" if against_champion.passed else "**not a challenger**: worse than the champion beyond the limits"
    table = GateReport((against_champion,)).to_markdown().splitlines()[2:]
    return [f"### Against the champion (version {version}, measured in this run): {verdict}", "", *table, ""]


def _champion_section(report: GateReport, champion: VersionInfo | None) -> list[str]:
    """This engine's gate numbers beside the champion's, as each version recorded them."""
    if champion is None:
        return ["No champion when this version was registered.", ""]
    # As recorded at each one's registration (the champion gate above measured both here).
    rows = []
    for name, value in report.flat_numbers().items():
        theirs = champion.tags.get(name)
        if theirs is None:
            continue
        ours, theirs_value = float(f"{value:.6g}"), float(theirs)  # as the tags hold both
        relative = theirs_value and not name.endswith("_pct")  # a percent of a percent says nothing
        change = f"{ours - theirs_value:+.4g}" + (f" ({(ours - theirs_value) / abs(theirs_value):+.1%})" if relative else "")
        rows.append(f"| {name.removeprefix(tags.GATES_PREFIX)} | {ours:.6g} | {theirs_value:.6g} | {change} |")
    return [
        f"### Beside the champion (version {champion.version}, at registration)",
        "",
        "| measure | this version | champion | change |",
        "|---|---|---|---|",
        *rows,
        "",
    ]


def _flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat |= _flatten(value, f"{name}.")
        else:
            flat[name] = str(value)
    return flat


def git_commit(root: Path) -> str:
    """The project's commit, for the `git_commit` tag; "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"
