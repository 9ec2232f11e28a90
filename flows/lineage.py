"""What a registered engine records about where it came from: the run's params, metrics,
artifacts and the version tags of the registry contract (registry/tags.py); and its gate numbers read
back from those tags, each beside its limit, for `kiln lineage`."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from components.calibrate import CalibrationSet
from components.config import Params
from components.engine_dir import EngineDir
from components.export import ExportedOnnx
from components.gates import GateReport, GateResult, limit_text
from components.model_dir import TrainedModel
from components.train import ADAPTER
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
        named |= {name: f"{value:.6g}" for name, value in GateReport((against_champion,)).flat_numbers().items()} | limit_tags(GateReport((against_champion,)))
    return named | {name: f"{value:.6g}" for name, value in report.flat_numbers().items()} | report.flat_conditions() | limit_tags(report)


def limit_tags(report: GateReport) -> dict[str, str]:
    """Each gated number's limit as its gate applied it (`gates.quality.top1_agreement.limit`:
    ">= 0.9"): the version keeps what it was judged by, whatever params.yaml says later."""
    return {tags.gate_limit(g.name, m): text for g in report.gates for m in g.measured if (text := limit_text(m, g.thresholds))}


def run_record(
    params: Params,
    model: TrainedModel,
    onnx: ExportedOnnx | None,
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
    if onnx is not None:  # none where torch-cuda built every engine from the model
        metrics["export.parity.prefill_max_abs_diff"] = onnx.parity.prefill_max_abs_diff
        metrics["export.parity.decode_max_abs_diff"] = onnx.parity.decode_max_abs_diff
        if onnx.parity.layers is not None:  # checked on the model's first layers alone
            metrics["export.parity.layers"] = onnx.parity.layers
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
    eval perplexity, the corpus as a dataset input, the loss plot, and the LoRA adapter
    where the model was fine-tuned with one (its weights hold it merged)."""
    metrics = {"train.eval_perplexity": model.eval_perplexity or 0.0, "train.uniform_perplexity": model.uniform_perplexity or 0.0}
    adapter = model.path / ADAPTER
    return RunRecord(
        params=_flatten({"data": params.data.model_dump(mode="json"), "model": params.model.model_dump(mode="json")}),
        metrics=metrics,
        version_tags={},
        artifacts={"plots": plot} | ({"adapter": adapter} if adapter.is_dir() else {}),
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


# ---------------------------------------------------------------- the gates as a version's tags hold them (kiln lineage)

# The gates' tags that are no number of one measure.
_VERDICT_TAGS = frozenset({tags.GATES_PASSED, tags.GATES_VERDICT, tags.GATES_MEASURED_ON, tags.CHAMPION_GATE_PASSED})


@dataclass(frozen=True)
class RecordedMeasure:
    """One gate number as the registry holds it, with its interval, limit and exclusion if recorded."""

    gate: str
    measure: str
    value: float
    interval: tuple[float, float] | None = None
    limit: str = ""  # `>= 0.9`, `<= 5`; "" when ungated or registered before limits were recorded
    excluded: str = ""  # why it was left out of the verdict

    @property
    def result(self) -> str:
        """pass, FAIL or inconclusive, decided as the gate did: by the whole interval where there
        is one, else by the value; "left out", or "" for a number without a limit."""
        if self.excluded:
            return "left out"
        direction, _, bound = self.limit.partition(" ")
        if direction not in ("<=", ">=") or not _is_number(bound):
            return ""  # no limit (or one kiln did not write)
        low, high = self.interval or (self.value, self.value)
        beyond, within = (low > float(bound), high <= float(bound)) if direction == "<=" else (high < float(bound), low >= float(bound))
        return "FAIL" if beyond else "pass" if within else "inconclusive"

    @property
    def unit(self) -> str:
        """The unit its name gives: percent (`ppl_increase_pct`), milliseconds (`p95_ms`) or none."""
        return " %" if self.measure.endswith("_pct") else " ms" if self.measure.endswith("_ms") else ""

    def shown(self, value: float) -> str:
        """`value` in this measure's unit, to 4 significant digits (a percent to 4 decimals at most)."""
        return _significant(value, floor=5e-5 if self.unit == " %" else 0.0) + self.unit


def _significant(value: float, floor: float = 0.0) -> str:
    """4 significant digits, thousands grouped from 10,000; below `floor` in size, 0."""
    if abs(value) < floor:
        return "0"
    return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"


def recorded_measures(version_tags: Mapping[str, str], run_metrics: Mapping[str, float]) -> list[RecordedMeasure]:
    """The gate numbers of a version's tags, each with its interval (`<name>_low`/`_high`), its
    limit and its exclusion. The run's metrics say which tags are numbers (a condition such as
    `gates.latency.threads` reads as one too); a version without them, every tag that parses."""
    numbers = {name: float(value) for name, value in version_tags.items() if name.startswith(tags.GATES_PREFIX) and name not in _VERDICT_TAGS and _is_number(value)}
    if any(name.startswith(tags.GATES_PREFIX) for name in run_metrics):
        numbers = {name: value for name, value in numbers.items() if name in run_metrics}
    bounds = {f"{name}_{side}" for name in numbers for side in ("low", "high") if f"{name}_low" in numbers and f"{name}_high" in numbers}
    measures = []
    for name in sorted(numbers.keys() - bounds):
        gate, _, measure = name.removeprefix(tags.GATES_PREFIX).partition(".")
        interval = (numbers[f"{name}_low"], numbers[f"{name}_high"]) if f"{name}_low" in bounds else None
        limit, excluded = version_tags.get(tags.gate_limit(gate, measure), ""), version_tags.get(tags.gate_excluded(gate, measure), "")
        measures.append(RecordedMeasure(gate, measure, numbers[name], interval, limit, excluded))
    return measures


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def recorded_conditions(version_tags: Mapping[str, str], measures: list[RecordedMeasure]) -> dict[str, dict[str, str]]:
    """gate → how it measured (`latency`: runtime, threads, process): its tags that are no
    number, interval, limit or exclusion of a measure, nor a verdict."""
    claimed = set(_VERDICT_TAGS)
    for m in measures:
        name = tags.gate_number(m.gate, m.measure)
        claimed |= {name, f"{name}_low", f"{name}_high", tags.gate_limit(m.gate, m.measure), tags.gate_excluded(m.gate, m.measure)}
    conditions: dict[str, dict[str, str]] = {}
    for name, value in sorted(version_tags.items()):
        if name.startswith(tags.GATES_PREFIX) and name not in claimed:
            gate, _, condition = name.removeprefix(tags.GATES_PREFIX).partition(".")
            conditions.setdefault(gate, {})[condition] = value
    return conditions


def recorded_gates_table(version_tags: Mapping[str, str], run_metrics: Mapping[str, float]) -> Table:
    """`kiln lineage`'s gates: each number beside its interval, limit and result (a broken limit
    in red, an unsettled one in yellow); below, how and where they were measured, and why a
    number was left out of its verdict."""
    measures = recorded_measures(version_tags, run_metrics)
    table = Table(show_edge=False, pad_edge=False, caption_justify="left")
    for column in ("measure", "value", "interval", "limit", "result"):
        # A measure's name is what a reader looks up: it stays whole, the interval wraps.
        table.add_column(column, justify="right" if column in ("value", "interval") else "left", no_wrap=column in ("measure", "value", "limit"))
    gate = None
    for m in measures:
        if m.gate != gate:  # a heading row per gate: one column fewer in an 80-column terminal
            gate = m.gate
            table.add_row(f"[bold]{gate}[/]")
        interval = f"[{m.shown(m.interval[0])}, {m.shown(m.interval[1])}]" if m.interval else ""
        limit = m.limit + m.unit if m.limit else ""
        style = {"FAIL": "red", "inconclusive": "yellow"}.get(m.result, "")
        table.add_row(f"  {m.measure}", m.shown(m.value), interval, limit, m.result, style=style)
    notes = [f"{gate} measured with " + ", ".join(f"{k} {v}" for k, v in found.items()) for gate, found in recorded_conditions(version_tags, measures).items()]
    notes += [f"{m.gate}: {m.measure} left out of the verdict: {m.excluded}" for m in measures if m.excluded]
    if tags.GATES_MEASURED_ON in version_tags:
        notes.append(f"measured on {version_tags[tags.GATES_MEASURED_ON]}")
    table.caption = "\n".join(notes) or None
    return table
