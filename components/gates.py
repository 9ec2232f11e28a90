"""The gates: an engine measured against the PyTorch model it came from (next-token quality
and the text it writes) and timed on generation (latency). Results are values: numbers,
thresholds, pass/fail."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import numpy as np

from components.config import GateParams, LatencyGateParams, QualityGateParams, QualityLimits, TextGateParams, TextLimits
from components.data import DataVersion, split_texts
from components.engine_dir import EngineDir, load_engine_dir
from components.errors import ConfigError, DataError
from components.model_dir import TrainedModel
from components.progress import stage_progress
from components.runtime.availability import machine_description
from components.runtime.engine import Engine
from components.runtime.sampling import Sampling
from components.runtime.tokenizer import EngineTokenizer

# Part of the report folder's name and of the Prefect cache key (flows.caching): bump it when
# the gates' code changes what they measure, and every engine is gated again.
STAGE_VERSION = "3"  # 2: the text gate; 3: latency measured as the engine is served
T = TypeVar("T")


@dataclass(frozen=True)
class GateResult:
    """One gate: what was measured, against which limits, and whether it passed."""

    name: str
    passed: bool
    measured: dict[str, float]
    thresholds: dict[str, float]
    samples_ms: tuple[float, ...] = field(default=(), repr=False)
    # How a timing gate ran (runtime, threads, process): its numbers mean nothing without it.
    conditions: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.passed

    def failures(self) -> list[str]:
        return [] if self.passed else [_failure_line(self.name, self.measured, self.thresholds)]


@dataclass(frozen=True)
class GateReport:
    gates: tuple[GateResult, ...]
    machine: str = ""  # where it was measured (availability.machine_description); "" unknown

    @property
    def passed(self) -> bool:
        return all(self.gates)

    def __bool__(self) -> bool:
        return self.passed

    def plus(self, gate: GateResult) -> GateReport:
        """This report with one more gate, measured in the run that adds it (the serving and
        champion gates beside the cached gate stage's); `machine` stays the stage's."""
        return replace(self, gates=(*self.gates, gate))

    def gate(self, name: str) -> GateResult:
        return next(g for g in self.gates if g.name == name)

    def failures(self) -> list[str]:
        return [line for gate in self.gates for line in gate.failures()]

    def flat_numbers(self) -> dict[str, float]:
        """`gates.<gate>.<measure>` → value: the registry's tag and metric names."""
        return {f"gates.{g.name}.{k}": v for g in self.gates for k, v in g.measured.items()}

    def flat_conditions(self) -> dict[str, str]:
        """`gates.<gate>.<condition>` → how it was measured (`gates.latency.threads`: "1")."""
        return {f"gates.{g.name}.{k}": v for g in self.gates for k, v in g.conditions.items()}

    def to_dict(self) -> dict:
        return {"passed": self.passed, "machine": self.machine, "gates": [asdict(g) | {"samples_ms": list(g.samples_ms)} for g in self.gates]}

    def to_markdown(self) -> str:
        lines = [f"# Gate report: {'PASSED' if self.passed else 'FAILED'}", "", "| gate | measure | value | limit | gate result |", "|---|---|---|---|---|"]
        for gate in self.gates:
            for measure, value in gate.measured.items():
                limit = limit_text(measure, gate.thresholds)
                # Words, not emoji: the MLflow UI shows this table and a browser without an
                # emoji font draws ✅ as an empty box.
                mark = "" if not limit else ("pass" if gate.passed else "**FAIL**")
                lines.append(f"| {gate.name} | {measure} | {value:.6g} | {limit} | {mark} |")
        measured_with = [f"{gate.name}: " + ", ".join(f"{k} {v}" for k, v in gate.conditions.items()) for gate in self.gates if gate.conditions]
        if measured_with:
            lines += ["", "Timed as served: " + "; ".join(measured_with) + "."]
        if self.machine:
            lines += ["", f"Measured on {self.machine}."]
        return "\n".join(lines) + "\n"


# Which threshold bounds which measure, and in which direction.
_LIMITS = {
    "top1_agreement": ("min_top1_agreement", ">="),
    "ppl_increase_pct": ("max_ppl_increase_pct", "<="),
    "p95_ms": ("max_p95_ms", "<="),
    "rouge_l_drop_pct": ("max_rouge_l_drop_pct", "<="),
    "bleu_drop_pct": ("max_bleu_drop_pct", "<="),
    "nll_increase_vs_champion_pct": ("max_nll_increase_vs_champion_pct", "<="),
    "rouge_l_drop_vs_champion_pct": ("max_rouge_l_drop_vs_champion_pct", "<="),
    "p50_increase_vs_champion_pct": ("max_p50_increase_vs_champion_pct", "<="),
}


def limit_text(measure: str, thresholds: dict[str, float]) -> str:
    bound = _bound(measure, thresholds)
    return "" if bound is None else f"{bound[1]} {thresholds[bound[0]]:g}"


def _bound(measure: str, thresholds: dict[str, float]) -> tuple[str, str] | None:
    """The threshold key that bounds `measure` and its direction: from _LIMITS, else the
    convention that `max_<measure>` is an upper bound (the serving gate's per-scenario
    budgets)."""
    key, direction = _LIMITS.get(measure, (f"max_{measure}", "<="))
    return (key, direction) if key in thresholds else None


def _failure_line(name: str, measured: dict[str, float], thresholds: dict[str, float]) -> str:
    broken = []
    for measure, value in measured.items():
        bound = _bound(measure, thresholds)
        if bound is None:
            continue
        key, direction = bound
        if not (value >= thresholds[key] if direction == ">=" else value <= thresholds[key]):
            broken.append(f"{measure} {value:.4g} (limit {direction} {thresholds[key]:g})")
    return f"{name}: " + ", ".join(broken)


# ---------------------------------------------------------------- quality


def eval_windows(tokenizer: EngineTokenizer, texts: list[str], params: QualityGateParams) -> np.ndarray:
    """(sequences, sequence_length) token windows cut from the eval split, in order."""
    return token_windows(tokenizer, texts, params.sequences, params.sequence_length)


def token_windows(tokenizer: EngineTokenizer, texts: list[str], count: int, length: int) -> np.ndarray:
    """Up to `count` windows of `length` tokens cut from the texts' token stream, in order."""
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer.encode(text))
        if len(stream) >= count * length:
            break
    usable = len(stream) // length
    if usable == 0:
        raise DataError(f"the eval split has {len(stream)} tokens, fewer than one window of {length}")
    windows = np.array(stream[: usable * length], np.int64).reshape(usable, length)
    return windows[:count]


def quality_gate(engine: Engine, reference, windows: np.ndarray, params: QualityGateParams, batch_size: int = 4) -> GateResult:
    """Top-1 next-token agreement and perplexity of the engine vs the PyTorch reference."""
    from components.metrics import load_metric

    engine_argmax, reference_argmax, engine_nll, reference_nll = [], [], [], []
    with stage_progress("quality gate", total=len(windows)) as advance:
        for start in range(0, len(windows), batch_size):
            batch = windows[start : start + batch_size]
            engine_logits = engine.score(batch, np.ones_like(batch))
            reference_logits = _reference_logits(reference, batch)
            engine_argmax.append(engine_logits[:, :-1].argmax(-1).ravel())
            reference_argmax.append(reference_logits[:, :-1].argmax(-1).ravel())
            engine_nll.append(target_nll(engine_logits, batch))
            reference_nll.append(target_nll(reference_logits, batch))
            advance(len(batch), "")
    agreement = load_metric("top1_agreement").compute(
        predictions=np.concatenate(engine_argmax), references=np.concatenate(reference_argmax)
    )["top1_agreement"]
    perplexity = load_metric("perplexity_from_nll")
    ppl_engine = perplexity.compute(predictions=np.concatenate(engine_nll))["perplexity"]
    ppl_reference = perplexity.compute(predictions=np.concatenate(reference_nll))["perplexity"]
    measured = {
        "top1_agreement": agreement,
        "ppl_engine": ppl_engine,
        "ppl_reference": ppl_reference,
        "ppl_increase_pct": 100.0 * (ppl_engine / ppl_reference - 1.0),
        "tokens": float(sum(map(len, engine_argmax))),
    }
    limits = quality_limits(params, engine.manifest.precision)
    thresholds = {"min_top1_agreement": limits.min_top1_agreement, "max_ppl_increase_pct": limits.max_ppl_increase_pct}
    passed = agreement >= limits.min_top1_agreement and measured["ppl_increase_pct"] <= limits.max_ppl_increase_pct
    return GateResult("quality", passed, measured, thresholds)


def quality_limits(params: QualityGateParams, precision: str) -> QualityLimits:
    if precision not in params.limits:
        raise ConfigError(f"gates.quality.limits has no entry for precision {precision!r}")
    return params.limits[precision]


def _reference_logits(reference, batch: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        ids = torch.from_numpy(batch)
        return reference(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().numpy()


def target_nll(logits: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """-log p(next token) at every position but the last, computed stably in float64."""
    scores = logits[:, :-1].astype(np.float64)
    log_norm = np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1)) + scores.max(-1)
    target = np.take_along_axis(scores, batch[:, 1:, None], axis=-1)[..., 0]
    return (log_norm - target).ravel()


# ---------------------------------------------------------------- text


def text_windows(tokenizer: EngineTokenizer, texts: list[str], params: TextGateParams) -> np.ndarray:
    """(sequences, prompt_tokens + new_tokens) windows of held-out text: prompt, then what followed."""
    return token_windows(tokenizer, texts, params.sequences, params.prompt_tokens + params.new_tokens)


def text_gate(engine: Engine, reference, tokenizer: EngineTokenizer, windows: np.ndarray, params: TextGateParams) -> GateResult:
    """ROUGE-L and BLEU of the engine's greedy continuations of held-out prompts, against the
    text that really followed each prompt (`text_windows`), beside the same scores of the
    PyTorch model it came from; the engine may fall at most the precision's limit below
    them. Also reported: ROUGE-L of the engine's continuations against the model's (1.0
    when they agree)."""
    from components.metrics import load_metric

    limits = text_limits(params, engine.manifest.precision)  # a bad config fails before measuring
    prompts, held_out = windows[:, : params.prompt_tokens], [tokenizer.decode(w[params.prompt_tokens :].tolist()) for w in windows]
    ours, theirs = [], []
    batch = engine.manifest.profiles["context"].batch.max
    sampling = Sampling(max_new_tokens=params.new_tokens, stop_at_eos=False)
    with stage_progress("text gate", total=len(prompts)) as advance:
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            ours += [tokenizer.decode(ids) for ids in engine.generate(chunk.tolist(), sampling)]
            theirs += [tokenizer.decode(ids) for ids in _reference_continuations(reference, chunk, params.new_tokens)]
            advance(len(chunk), "")
    rouge, bleu = load_metric("rouge_l"), load_metric("bleu")
    rouge_ours, rouge_theirs = rouge.compute(predictions=ours, references=held_out), rouge.compute(predictions=theirs, references=held_out)
    measured = {
        "rouge_l": rouge_ours["rouge_l"],
        "rouge_l_reference": rouge_theirs["rouge_l"],
        "bleu": bleu.compute(predictions=ours, references=held_out)["bleu"],
        "bleu_reference": bleu.compute(predictions=theirs, references=held_out)["bleu"],
        "rouge_l_vs_reference": rouge.compute(predictions=ours, references=theirs)["rouge_l"],
        "sequences": float(len(prompts)),
    }
    measured["rouge_l_drop_pct"] = drop_pct(measured["rouge_l"], measured["rouge_l_reference"])
    measured["bleu_drop_pct"] = drop_pct(measured["bleu"], measured["bleu_reference"])
    low, high = drop_interval(np.array(rouge_ours["rouge_l_scores"]), np.array(rouge_theirs["rouge_l_scores"]))
    measured |= {"rouge_l_drop_pct_ci95_low": low, "rouge_l_drop_pct_ci95_high": high}
    thresholds = {"max_rouge_l_drop_pct": limits.max_rouge_l_drop_pct, "max_bleu_drop_pct": limits.max_bleu_drop_pct}
    passed = measured["rouge_l_drop_pct"] <= limits.max_rouge_l_drop_pct and measured["bleu_drop_pct"] <= limits.max_bleu_drop_pct
    return GateResult("text", passed, measured, thresholds)


def text_limits(params: TextGateParams, precision: str) -> TextLimits:
    if precision not in params.limits:
        raise ConfigError(f"gates.text.limits has no entry for precision {precision!r}")
    return params.limits[precision]


def drop_pct(engine_score: float, reference_score: float) -> float:
    """How far the engine's score is below the reference's, in percent (negative: above)."""
    return 100.0 * (reference_score - engine_score) / reference_score if reference_score > 0 else 0.0


def drop_interval(engine_scores: np.ndarray, reference_scores: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95 % paired-bootstrap interval of `drop_pct` over the sequences: how far the
    sample alone moves the drop. Shown beside the verdict, which stays the measured drop
    against the limit (docs/performance.md#the-text-gates-noise)."""
    picks = np.random.default_rng(seed).integers(0, len(engine_scores), (resamples, len(engine_scores)))
    ours, theirs = engine_scores[picks].mean(axis=1), reference_scores[picks].mean(axis=1)
    drops = 100.0 * (theirs - ours) / np.where(theirs > 0, theirs, np.inf)
    low, high = np.percentile(drops, [2.5, 97.5])
    return float(low), float(high)


def _reference_continuations(reference, prompts: np.ndarray, new_tokens: int) -> list[list[int]]:
    """Greedy continuations by the PyTorch model (the prompts share one length: no padding),
    as the engine makes them: the argmax at every step, an end-of-text token like any
    other. `generate` with `min_new_tokens` forbade end-of-text instead, so a row whose
    argmax was one diverged from the engine's (a Llama's fp32 engine lost 6 % BLEU so)."""
    import torch

    picked = []
    with torch.no_grad():
        out = reference(input_ids=torch.from_numpy(prompts), use_cache=True)
        for _ in range(new_tokens):
            picked.append(out.logits[:, -1:].argmax(-1))
            out = reference(input_ids=picked[-1], cache=out.past_key_values, use_cache=True)
    return torch.cat(picked, dim=1).tolist()


# ---------------------------------------------------------------- latency


def latency_gate(
    engine: Engine, prompt: list[int], params: LatencyGateParams, clock: Callable[[], float] = time.perf_counter
) -> GateResult:
    """p50 / p95 of generating `new_tokens` after a `prompt_tokens` prompt, after warm-up.
    `clock` (seconds) reads the start and end of each timed generation."""
    sampling = Sampling(max_new_tokens=params.new_tokens, stop_at_eos=False)
    samples = []
    with stage_progress("latency gate", total=params.warmup + params.runs) as advance:
        for _ in range(params.warmup):
            engine.generate([prompt], sampling)
            advance(1, "warm-up")
        for _ in range(params.runs):
            start = clock()
            engine.generate([prompt], sampling)
            samples.append((clock() - start) * 1000.0)
            advance(1, "")
    p50, p95 = (float(np.percentile(samples, q)) for q in (50, 95))
    measured = {"p50_ms": p50, "p95_ms": p95, "ms_per_token": p50 / params.new_tokens, "new_tokens": float(params.new_tokens)}
    return GateResult("latency", p95 <= params.max_p95_ms, measured, {"max_p95_ms": params.max_p95_ms}, tuple(samples))


def latency_prompt(windows: np.ndarray, length: int) -> list[int]:
    flat = windows.ravel()
    if len(flat) < length:
        raise DataError(f"need {length} prompt tokens for the latency gate, the eval windows hold {len(flat)}")
    return flat[:length].tolist()


# ---------------------------------------------------------------- together


def gate_report(engine: Engine, reference, eval_texts: list[str], params: GateParams, served_threads: int | None) -> GateReport:
    """Quality and text on `engine` (any threads: they count tokens, not time); latency on
    the engine as kiln serve runs it, with `served_threads` (serving.threads)."""
    tokenizer = EngineTokenizer(engine.engine_dir.path)
    windows = eval_windows(tokenizer, eval_texts, params.quality)
    quality = quality_gate(engine, reference, windows, params.quality)
    text = text_gate(engine, reference, tokenizer, text_windows(tokenizer, eval_texts, params.text), params.text)
    latency = latency_gate_as_served(engine.engine_dir.path, latency_prompt(windows, params.latency.prompt_tokens), params.latency, served_threads)
    return GateReport((quality, text, latency), machine_description(engine.manifest.target))


def latency_gate_as_served(engine_path: Path, prompt: list[int], params: LatencyGateParams, threads: int | None) -> GateResult:
    """The latency gate on the engine opened as the server opens it, in a process of its own
    as the server runs it, with `threads` (serving.threads): timed on all cores in the gating
    process instead, its numbers were not the served engine's. The result records how."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
        return process.submit(_latency_in_this_process, engine_path, prompt, params, threads).result()


def _latency_in_this_process(engine_path: Path, prompt: list[int], params: LatencyGateParams, threads: int | None) -> GateResult:
    from components.runtime import load_engine

    with load_engine(engine_path, threads=threads) as engine:
        timed = latency_gate(engine, prompt, params)
        return replace(timed, conditions=engine.runtime_settings() | {"process": "its own, as kiln serve runs it"})


def write_report(report: GateReport, directory: Path) -> list[Path]:
    """report.json, report.md and latency.png in `directory`; returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "report.json", directory / "report.md", directory / "latency.png"]
    paths[0].write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    paths[1].write_text(report.to_markdown())
    _plot_latency(report.gate("latency"), paths[2])
    return paths


def _plot_latency(gate: GateResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.hist(gate.samples_ms, bins=min(20, max(5, len(gate.samples_ms))), color="#4c72b0")
    for label, key, style in (("p50", "p50_ms", "--"), ("p95", "p95_ms", "-")):
        axes.axvline(gate.measured[key], color="k", linestyle=style, label=f"{label} {gate.measured[key]:.1f} ms")
    limit = gate.thresholds["max_p95_ms"]
    right = max(gate.samples_ms) * 1.3
    if limit <= right * 2:
        axes.axvline(limit, color="#c44e52", label=f"limit {limit:g} ms")
        right = max(right, limit * 1.05)
    else:  # far off to the right: drawing it would squash the samples into one bar
        axes.plot([], [], color="#c44e52", label=f"limit {limit:g} ms (off scale)")
    axes.set_xlim(0, right)
    axes.set_xlabel(f"ms to generate {int(gate.measured['new_tokens'])} tokens")
    axes.set_ylabel("runs")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def gate_engine_dir(engine_path: Path, reference_path: Path, eval_texts: list[str], params: GateParams, served_threads: int | None) -> GateReport:
    """Gate one engine directory against the PyTorch model directory it came from; its
    latency as served with `served_threads` (serving.threads)."""
    from components.model_dir import load_model
    from components.runtime import load_engine

    with load_engine(engine_path) as engine:
        return gate_report(engine, load_model(reference_path), eval_texts, params, served_threads)


def quality_gate_against(engine: Engine, reference_path: Path, eval_texts: list[str], params: QualityGateParams) -> GateResult:
    """The quality gate alone, for an engine already open (what `verify-promotion` re-runs
    on the machine it runs on)."""
    from components.model_dir import load_model

    windows = eval_windows(EngineTokenizer(engine.engine_dir.path), eval_texts, params)
    return quality_gate(engine, load_model(reference_path), windows, params)


@dataclass(frozen=True)
class GatedEngine:
    """The gate stage's output: the report and the folder holding its files."""

    report: GateReport
    directory: Path

    @property
    def output_dir(self) -> Path:
        return self.directory

    def is_intact(self) -> bool:
        return (self.directory / "report.json").is_file()


def gated_engine(engine: EngineDir, model: TrainedModel, data: DataVersion, params: GateParams, out_root: Path, served_threads: int | None) -> GatedEngine:
    """The pipeline's gate stage: an engine against the model it was built from on the data's
    eval split, timed as served with `served_threads`; the report (JSON, markdown, latency
    plot) lands in a folder named by the engine and those threads."""
    report = gate_engine_dir(engine.path, model.path, data.texts("eval"), params, served_threads)
    directory = out_root / f"v{STAGE_VERSION}-{engine.sha256[:16]}-threads-{served_threads or 'all'}"
    write_report(report, directory)
    return GatedEngine(report, directory)


def gate_against_lineage(
    engine_path: Path, params: GateParams, data_dir: Path, served_threads: int | None, reference: Path | None = None
) -> tuple[GateReport, str | None]:
    """`kiln gate`: an engine directory against `reference` (default: the model its lineage
    names) on the eval split under `data_dir`; and a note when the reference is not the
    model the engine was built from."""
    from components.model_dir import model_from_directory

    engine = load_engine_dir(engine_path)
    model = model_from_directory(reference or Path(engine.manifest.lineage.source_model_path))
    note = None
    if model.sha256 != engine.manifest.lineage.source_model_sha256:
        note = f"reference {model.path} is not the model this engine was built from"
    return gate_engine_dir(engine.path, model.path, split_texts(data_dir, "eval"), params, served_threads), note


def fastest_passing(candidates: Sequence[T], report_of: Callable[[T], GateReport]) -> T | None:
    """The candidate that passed every gate with the lowest median generation latency: the
    pipeline's choice for `challenger`."""
    passed = [c for c in candidates if report_of(c).passed]
    return min(passed, key=lambda c: report_of(c).gate("latency").measured["p50_ms"], default=None)
