"""The gates: an engine measured against the PyTorch model it came from (next-token quality
and the text it writes) and timed on generation (latency). Results are values: numbers,
thresholds, pass/fail."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import numpy as np

from components.config import GateParams, LatencyGateParams, QualityGateParams, QualityLimits, ServingScenario, TextGateParams, TextLimits
from components.data import DataVersion, split_texts
from components.engine_dir import EngineDir, load_engine_dir
from components.errors import ConfigError, DataError
from components.evidence import Evidence, Measure, sequential_evidence
from components.metrics import load_metric
from components.model_dir import TrainedModel
from components.progress import stage_progress
from components.reference import QUALITY_BATCH, LiveReference, Reference, as_reference, record, target_nll
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
    """One gate: what was measured, against which limits, and whether it passed. A gate that
    compares on a sample of sequences (components.evidence) also gives each measure's
    interval, decides by it, and says which measures it left undecided or out."""

    name: str
    passed: bool
    measured: dict[str, float]
    thresholds: dict[str, float]
    samples_ms: tuple[float, ...] = field(default=(), repr=False)
    # How a timing gate ran (runtime, threads, process): its numbers mean nothing without it.
    conditions: dict[str, str] = field(default_factory=dict)
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    inconclusive: dict[str, str] = field(default_factory=dict)  # measure → how many sequences would settle it
    excluded: dict[str, str] = field(default_factory=dict)  # measure → why it is left out of the verdict
    confidence: float | None = None  # of each interval

    def __bool__(self) -> bool:
        return self.passed

    @property
    def verdict(self) -> str:
        """passed, failed, or inconclusive (an interval straddles a limit, none lies beyond)."""
        if self.passed:
            return "passed"
        return "inconclusive" if self.inconclusive and not any(map(self.beyond_limit, self.measured)) else "failed"

    def beyond_limit(self, measure: str) -> bool:
        """Whether `measure` breaks its limit: its whole interval where it has one, else its value."""
        bound = _bound(measure, self.thresholds)
        if bound is None or measure in self.excluded:
            return False
        key, direction = bound
        low, high = self.intervals.get(measure, (self.measured[measure],) * 2)
        return low > self.thresholds[key] if direction == "<=" else high < self.thresholds[key]

    def interval_text(self, measure: str) -> str:
        """`[0.912, 0.937]`, or "" for a measure without an interval."""
        return "[{:.4g}, {:.4g}]".format(*self.intervals[measure]) if measure in self.intervals else ""

    def shown(self, measure: str) -> str:
        """The value, with its interval where it has one: `0.9234 [0.912, 0.937]`."""
        return f"{self.measured[measure]:.4g} {self.interval_text(measure)}".rstrip()

    def failures(self) -> list[str]:
        if self.passed:
            return []
        broken = [f"{m} {self.shown(m)} (limit {limit_text(m, self.thresholds)})" for m in self.measured if self.beyond_limit(m)]
        unsettled = [f"{m} {self.shown(m)} straddles its limit {limit_text(m, self.thresholds)}: {why}" for m, why in self.inconclusive.items()]
        return [f"{self.name}: " + ", ".join(broken + (["inconclusive: " + "; ".join(unsettled)] if unsettled else []))]


@dataclass(frozen=True)
class GateReport:
    gates: tuple[GateResult, ...]
    machine: str = ""  # where it was measured (availability.machine_description); "" unknown

    @property
    def passed(self) -> bool:
        return all(self.gates)

    @property
    def verdict(self) -> str:
        """passed; failed when a gate failed; else inconclusive (blocks the alias all the same)."""
        verdicts = {gate.verdict for gate in self.gates}
        return "failed" if "failed" in verdicts else "inconclusive" if "inconclusive" in verdicts else "passed"

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
        """`gates.<gate>.<measure>` → value, and `<measure>_low` / `_high` → its interval:
        the registry's tag and metric names."""
        numbers = {}
        for g in self.gates:
            numbers |= {f"gates.{g.name}.{k}": v for k, v in g.measured.items()}
            numbers |= {f"gates.{g.name}.{k}_{side}": bound for k, pair in g.intervals.items() for side, bound in zip(("low", "high"), pair, strict=True)}
        return numbers

    def flat_conditions(self) -> dict[str, str]:
        """`gates.<gate>.<condition>` → how it was measured (`gates.latency.threads`: "1"),
        and why a measure was left out of its gate's verdict (`gates.text.bleu_drop_pct.excluded`)."""
        named = {f"gates.{g.name}.{k}": v for g in self.gates for k, v in g.conditions.items()}
        return named | {f"gates.{g.name}.{k}.excluded": why for g in self.gates for k, why in g.excluded.items()}

    def to_dict(self) -> dict:
        return {"passed": self.passed, "verdict": self.verdict, "machine": self.machine, "gates": [asdict(g) | {"samples_ms": list(g.samples_ms), "intervals": {k: list(v) for k, v in g.intervals.items()}} for g in self.gates]}

    def to_markdown(self) -> str:
        lines = [f"# Gate report: {self.verdict.upper()}", "", "| gate | measure | value | interval | limit | result |", "|---|---|---|---|---|---|"]
        for gate in self.gates:
            for measure, value in gate.measured.items():
                lines.append(f"| {gate.name} | {measure} | {value:.6g} | {gate.interval_text(measure)} | {limit_text(measure, gate.thresholds)} | {_mark(gate, measure)} |")
        notes = [f"{gate.name}: {m} left out of the verdict: {why}." for gate in self.gates for m, why in gate.excluded.items()]
        notes += [f"{gate.name}: {m} inconclusive: {why}." for gate in self.gates for m, why in gate.inconclusive.items()]
        levels = sorted({f"{g.confidence:.4g}" for g in self.gates if g.confidence})
        if levels:
            notes.append(f"Intervals: paired bootstrap over the sequences, at {' / '.join(levels)} confidence each (the gates' confidence shared over their looks).")
        measured_with = [f"{gate.name}: " + ", ".join(f"{k} {v}" for k, v in gate.conditions.items()) for gate in self.gates if gate.conditions]
        if measured_with:
            notes.append("Timed as served: " + "; ".join(measured_with) + ".")
        if self.machine:
            notes.append(f"Measured on {self.machine}.")
        return "\n".join(lines + [line for note in notes for line in ("", note)]) + "\n"


def _mark(gate: GateResult, measure: str) -> str:
    """A measure's own result, in words: the MLflow UI shows this table and a browser without
    an emoji font draws ✅ as an empty box."""
    if _bound(measure, gate.thresholds) is None:
        return ""
    if measure in gate.excluded:
        return "left out"
    if measure in gate.inconclusive:
        return "*inconclusive*"
    return "**FAIL**" if gate.beyond_limit(measure) else "pass"


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


def evidence_result(name: str, decided: Sequence[tuple[Evidence, Sequence[Measure]]], thresholds: dict[str, float], extra: dict[str, float], extra_passed: bool = True) -> GateResult:
    """A gate's result from its sampled evidence (one or more samples, each with its
    measures) and `extra` numbers measured otherwise, which pass or not by `extra_passed`."""
    measured, intervals, unsettled, excluded = {}, {}, {}, {}
    for evidence, measures in decided:
        for measure in measures:
            estimate = evidence.estimates[measure.name]
            measured[measure.name], intervals[measure.name] = estimate.value, (estimate.low, estimate.high)
            if estimate.verdict == "inconclusive" and measure.name not in evidence.excluded:
                unsettled[measure.name] = evidence.to_settle(measure.name, measure.limit)
        excluded |= evidence.excluded
    passed = extra_passed and all(evidence.verdict == "passed" for evidence, _ in decided)
    confidence = min(evidence.level for evidence, _ in decided)
    return GateResult(name, passed, measured | extra, thresholds, intervals=intervals, inconclusive=unsettled, excluded=excluded, confidence=confidence)


# ---------------------------------------------------------------- quality


def eval_windows(tokenizer: EngineTokenizer, texts: list[str], params: QualityGateParams) -> np.ndarray:
    """Up to the gate's budget (`max_sequences`) of `sequence_length` token windows cut from
    the eval split, in order."""
    return token_windows(tokenizer, texts, params.max_sequences, params.sequence_length)


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


def quality_gate(engine: Engine, reference, windows: np.ndarray, params: QualityGateParams, batch_size: int = QUALITY_BATCH, confidence: float = 0.95) -> GateResult:
    """Top-1 next-token agreement and perplexity of the engine vs the PyTorch reference (a
    components.reference Reference, or the model itself), both scoring the same windows;
    each measure decided by its paired interval over the windows (components.evidence), more
    windows scored while one straddles its limit."""
    reference = as_reference(reference)
    limits = quality_limits(params, engine.manifest.precision)
    measures = (
        Measure("top1_agreement", lambda s: s[..., 0] / s[..., 1], limits.min_top1_agreement, ">="),
        Measure("ppl_increase_pct", lambda s: 100.0 * np.expm1((s[..., 2] - s[..., 3]) / s[..., 1]), limits.max_ppl_increase_pct, "<="),
    )
    budget = min(len(windows), params.max_sequences)
    with stage_progress("quality gate", total=budget) as advance:
        rows = lambda start, stop: _quality_rows(engine, reference, windows[start:stop], batch_size, advance)  # noqa: E731
        evidence = sequential_evidence(rows, params.sequences, budget, measures, confidence, params.max_minutes)
    agreed, positions, engine_nll, reference_nll = evidence.totals
    extra = {"ppl_engine": float(np.exp(engine_nll / positions)), "ppl_reference": float(np.exp(reference_nll / positions)), "tokens": float(positions), "sequences": float(evidence.sequences)}
    thresholds = {"min_top1_agreement": limits.min_top1_agreement, "max_ppl_increase_pct": limits.max_ppl_increase_pct}
    return evidence_result("quality", [(evidence, measures)], thresholds, extra)


def _quality_rows(engine: Engine, reference: Reference, windows: np.ndarray, batch_size: int, advance: Callable[[int, str], None]) -> np.ndarray:
    """Per window: top-1 agreements, positions scored, the engine's and the model's summed NLL."""
    rows = []
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        engine_logits, model = engine.score(batch, np.ones_like(batch)), reference.scores(batch)
        agreed = (engine_logits[:, :-1].argmax(-1) == model.top1).sum(-1)
        engine_nll = target_nll(engine_logits, batch).reshape(len(batch), -1).sum(-1)
        rows.append(np.stack([agreed, np.full(len(batch), batch.shape[1] - 1), engine_nll, model.nll], axis=-1).astype(np.float64))
        advance(len(batch), "")
    return np.concatenate(rows)


def quality_limits(params: QualityGateParams, precision: str) -> QualityLimits:
    if precision not in params.limits:
        raise ConfigError(f"gates.quality.limits has no entry for precision {precision!r}")
    return params.limits[precision]


# ---------------------------------------------------------------- text


def text_windows(tokenizer: EngineTokenizer, texts: list[str], params: TextGateParams) -> np.ndarray:
    """Up to the gate's budget (`max_sequences`) of prompt_tokens + new_tokens windows of
    held-out text: prompt, then what followed."""
    return token_windows(tokenizer, texts, params.max_sequences, params.prompt_tokens + params.new_tokens)


def text_gate(engine: Engine, reference, tokenizer: EngineTokenizer, windows: np.ndarray, params: TextGateParams, confidence: float = 0.95) -> GateResult:
    """ROUGE-L and BLEU of the engine's greedy continuations of held-out prompts, against the
    text that really followed each prompt (`text_windows`), beside the same scores of the
    PyTorch model it came from; the engine may fall at most the precision's limit below
    them, each drop decided by its paired interval over the prompts (components.evidence).
    BLEU is left out of the verdict where its sample holds too few 4-gram matches to resolve
    its limit, ROUGE-L where the model's own scores are too near 0 to (a random or barely
    trained model). Also reported: ROUGE-L of the engine's continuations against the model's."""
    from components.metrics.bleu import COLUMNS, bleu_from_counts

    reference = as_reference(reference)
    limits = text_limits(params, engine.manifest.precision)  # a bad config fails before measuring
    bleu_ours, bleu_theirs = slice(2, 2 + COLUMNS), slice(2 + COLUMNS, 2 + 2 * COLUMNS)
    measures = (
        Measure(
            "rouge_l_drop_pct",
            lambda s: drop_pct(s[..., 0], s[..., 1]),
            limits.max_rouge_l_drop_pct,
            "<=",
            unresolvable=lambda s, limit: rouge_l_unresolvable(float(s[1]), params.new_tokens, limit),
        ),
        Measure(
            "bleu_drop_pct",
            lambda s: drop_pct(bleu_from_counts(s[..., bleu_ours]), bleu_from_counts(s[..., bleu_theirs])),
            limits.max_bleu_drop_pct,
            "<=",
            unresolvable=lambda s, limit: bleu_unresolvable(s[bleu_theirs], limit),
        ),
    )
    written: list[tuple[str, str]] = []
    budget = min(len(windows), params.max_sequences)
    with stage_progress("text gate", total=budget) as advance:
        rows = lambda start, stop: _text_rows(engine, reference, tokenizer, windows[start:stop], params, written, advance)  # noqa: E731
        evidence = sequential_evidence(rows, params.sequences, budget, measures, confidence, params.max_minutes)
    totals = evidence.totals
    extra = {
        "rouge_l": totals[0] / evidence.sequences,
        "rouge_l_reference": totals[1] / evidence.sequences,
        "bleu": float(bleu_from_counts(totals[bleu_ours])),
        "bleu_reference": float(bleu_from_counts(totals[bleu_theirs])),
        "rouge_l_vs_reference": load_metric("rouge_l").compute(predictions=[o for o, _ in written], references=[t for _, t in written])["rouge_l"],
        "sequences": float(evidence.sequences),
    }
    thresholds = {"max_rouge_l_drop_pct": limits.max_rouge_l_drop_pct, "max_bleu_drop_pct": limits.max_bleu_drop_pct}
    return evidence_result("text", [(evidence, measures)], thresholds, extra)


def _text_rows(engine: Engine, reference: Reference, tokenizer: EngineTokenizer, windows: np.ndarray, params: TextGateParams, written: list[tuple[str, str]], advance) -> np.ndarray:
    """Per prompt: the engine's and the model's ROUGE-L against the held-out text, then each
    one's BLEU counts (components.metrics.bleu). Appends (engine's, model's) text to `written`."""
    prompts, held_out = windows[:, : params.prompt_tokens], [tokenizer.decode(w[params.prompt_tokens :].tolist()) for w in windows]
    batch = engine.manifest.profiles["context"].batch.max
    sampling = Sampling(max_new_tokens=params.new_tokens, stop_at_eos=False)
    ours, theirs = [], []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        ours += [tokenizer.decode(ids) for ids in engine.generate(chunk.tolist(), sampling)]
        theirs += [tokenizer.decode(ids) for ids in reference.continuations(chunk, params.new_tokens).tolist()]
        advance(len(chunk), "")
    written += zip(ours, theirs, strict=True)
    rouge, bleu = load_metric("rouge_l"), load_metric("bleu")
    scores = [rouge.compute(predictions=texts, references=held_out)["rouge_l_scores"] for texts in (ours, theirs)]
    counts = [bleu.compute(predictions=texts, references=held_out)["counts"] for texts in (ours, theirs)]
    return np.concatenate([np.array(scores, np.float64).T, *counts], axis=1)


def bleu_unresolvable(reference_counts: np.ndarray, limit: float) -> str | None:
    """Why BLEU cannot resolve `limit` on this sample: one 4-gram match more moves it by more
    than the limit (BLEU is a geometric mean, its 4-gram precision rests on few matches)."""
    from components.metrics.bleu import MATCHED_4GRAMS, bleu_from_counts

    base = float(bleu_from_counts(reference_counts))
    if base == 0:
        return "the model's continuations share no word with the held-out text: its BLEU is 0, and a drop from 0 means nothing"
    more = reference_counts.copy()
    more[MATCHED_4GRAMS] += 1
    step = 100.0 * (float(bleu_from_counts(more)) / base - 1.0)
    if step <= limit:
        return None
    matches = int(reference_counts[MATCHED_4GRAMS])
    return f"the model's continuations share {matches} 4-grams with the held-out text: one match more moves BLEU by {step:.3g} %, more than its limit of {limit:g} %"


def rouge_l_unresolvable(reference_total: float, new_tokens: int, limit: float) -> str | None:
    """Why ROUGE-L cannot resolve `limit` on this sample: the model's scores summed over the
    sequences are so near 0 that one word more in one continuation's longest common
    subsequence (about 1/`new_tokens` of its score) moves the mean by more than the limit."""
    if reference_total == 0:
        return "the model's continuations share no word with the held-out text: its ROUGE-L is 0, and a drop from 0 means nothing"
    step = 100.0 / new_tokens / reference_total
    if step <= limit:
        return None
    return (
        f"the model's continuations score ROUGE-L {reference_total:.3g} in all against the held-out text: one word more in one continuation "
        f"moves it by about {step:.3g} %, more than its limit of {limit:g} %"
    )


def text_limits(params: TextGateParams, precision: str) -> TextLimits:
    if precision not in params.limits:
        raise ConfigError(f"gates.text.limits has no entry for precision {precision!r}")
    return params.limits[precision]


def drop_pct(engine_scores, reference_scores) -> np.ndarray:
    """How far the engine's score is below the reference's, in percent (negative: above; 0
    against a reference that scored nothing); element-wise over the bootstrap's resamples."""
    engine_scores, reference_scores = np.asarray(engine_scores, np.float64), np.asarray(reference_scores, np.float64)
    safe = np.where(reference_scores > 0, reference_scores, 1.0)
    return np.where(reference_scores > 0, 100.0 * (reference_scores - engine_scores) / safe, 0.0)


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
    limit, budget = latency_budget(engine, params)
    if budget.floor_ms is not None:
        measured |= {"read_floor_ms": budget.floor_ms, "p95_over_floor": p95 / budget.floor_ms}
    return GateResult("latency", p95 <= limit, measured, {"max_p95_ms": limit}, tuple(samples), {"budget": budget.text})


@dataclass(frozen=True)
class Budget:
    text: str
    floor_ms: float | None = None


def latency_budget(engine: Engine, params: LatencyGateParams) -> tuple[float, Budget]:
    """The p95 limit: `max_p95_ms`, or `max_p95_over_floor` times the generation's read floor
    where that is larger (a 1B model's floor alone is seconds on a CPU); and how it was set."""
    from components.read_floor import read_floor

    absolute = f"{params.max_p95_ms:g} ms (gates.latency.max_p95_ms)"
    if params.max_p95_over_floor is None:
        return params.max_p95_ms, Budget(absolute)
    floor = read_floor(engine, rows=1, mean_length=params.prompt_tokens + params.new_tokens / 2)
    if floor is None:
        return params.max_p95_ms, Budget(f"{absolute}; no read floor for a {engine.manifest.backend} engine")
    floor_ms = floor.ms(params.new_tokens)
    relative = params.max_p95_over_floor * floor_ms
    scaled = f"{params.max_p95_over_floor:g} × the read floor of {floor_ms:.3g} ms ({floor.text()}) = {relative:.3g} ms (gates.latency.max_p95_over_floor)"
    if relative > params.max_p95_ms:
        return relative, Budget(f"{scaled}, above {absolute}", floor_ms)
    return params.max_p95_ms, Budget(f"{absolute}, above {scaled}", floor_ms)


# ---------------------------------------------------------------- serving budgets

SERVING_BUDGETS = ("ttft_p95_ms", "tpot_p95_ms", "request_p99_ms")


@dataclass(frozen=True)
class ScenarioBudgets:
    limits: dict[str, float]  # SERVING_BUDGETS' limits in ms
    floors: dict[str, float]  # each budget's floor in ms, where the relative budgets apply
    text: str  # which budget applied to each measure, and why


def scenario_budgets(engine: Engine, prompt: list[int], scenario: ServingScenario) -> ScenarioBudgets:
    """Each budget of `scenario`: its milliseconds, or `max_over_floor` times its floor where
    that is larger (a 1B model's step alone takes longer on a CPU than the tiny model's budget)."""
    from components.read_floor import read_floor

    absolute = {budget: getattr(scenario, f"max_{budget}") for budget in SERVING_BUDGETS}
    if scenario.max_over_floor is None:
        return ScenarioBudgets(absolute, {}, "the milliseconds alone (max_over_floor: null)")
    floor = read_floor(engine, rows=scenario.clients, mean_length=scenario.prompt_tokens + scenario.new_tokens / 2)
    if floor is None:
        return ScenarioBudgets(absolute, {}, f"the milliseconds alone: no read floor for a {engine.manifest.backend} engine")
    first, step = scenario.clients * median_generate_ms(engine, prompt, new_tokens=1), floor.ms(1)
    floors = {"ttft_p95_ms": first, "tpot_p95_ms": step, "request_p99_ms": first + (scenario.new_tokens - 1) * step}
    over = scenario.max_over_floor
    limits = {budget: max(absolute[budget], over * floors[budget]) for budget in SERVING_BUDGETS}
    chosen = ", ".join(
        f"{budget.split('_')[0]} {limits[budget]:.4g} ms ({f'max_{budget}' if limits[budget] == absolute[budget] else f'{over:g} × its floor'})"
        for budget in SERVING_BUDGETS
    )
    text = f"{chosen}; floors: first token {first:.3g} ms ({scenario.clients} × one unloaded), a step {step:.3g} ms ({floor.text()})"
    return ScenarioBudgets(limits, floors, text)


def median_generate_ms(engine: Engine, prompt: list[int], new_tokens: int, runs: int = 3) -> float:
    """The median time of the engine's own `generate` of one prompt, with nothing else
    running, after one untimed run."""
    sampling = Sampling(max_new_tokens=new_tokens, stop_at_eos=False)
    engine.generate([prompt], sampling)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        engine.generate([prompt], sampling)
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def latency_prompt(windows: np.ndarray, length: int) -> list[int]:
    flat = windows.ravel()
    if len(flat) < length:
        raise DataError(f"need {length} prompt tokens for the latency gate, the eval windows hold {len(flat)}")
    return flat[:length].tolist()


# ---------------------------------------------------------------- together


def gate_report(engine: Engine, reference, eval_texts: list[str], params: GateParams, served_threads: int | None) -> GateReport:
    """Quality and text on `engine` (any threads: they count tokens, not time) against
    `reference` (a components.reference Reference, or the model itself), on the windows it
    covers; latency on the engine as kiln serve runs it, with `served_threads` (serving.threads)."""
    windows = gate_windows(engine.engine_dir.path, eval_texts, params)
    return with_latency(compared_gates(engine, reference, windows, params), engine.engine_dir, windows, params, served_threads)


@dataclass(frozen=True)
class GateWindows:
    """The eval split as the gates read it, tokenized once: the quality gate's windows, the
    text gate's (prompt, then what followed)."""

    quality: np.ndarray
    text: np.ndarray


def gate_windows(engine_path: Path, eval_texts: list[str], params: GateParams) -> GateWindows:
    tokenizer = EngineTokenizer(engine_path)
    return GateWindows(eval_windows(tokenizer, eval_texts, params.quality), text_windows(tokenizer, eval_texts, params.text))


def compared_gates(engine: Engine, reference, windows: GateWindows, params: GateParams) -> tuple[GateResult, ...]:
    """The quality and text gates: the engine against `reference` on the windows it covers."""
    reference = as_reference(reference)
    quality_windows, text_windows_covered = reference.covering(windows.quality, windows.text)
    tokenizer = EngineTokenizer(engine.engine_dir.path)
    quality = with_reference_described(quality_gate(engine, reference, quality_windows, params.quality, confidence=params.confidence), reference)
    text = with_reference_described(text_gate(engine, reference, tokenizer, text_windows_covered, params.text, params.confidence), reference)
    return quality, text


def with_latency(compared: tuple[GateResult, ...], engine_dir: EngineDir, windows: GateWindows, params: GateParams, served_threads: int | None) -> GateReport:
    """The report of `compared` and the latency gate, timed in a process of its own."""
    latency = latency_gate_as_served(engine_dir.path, latency_prompt(windows.quality, params.latency.prompt_tokens), params.latency, served_threads)
    return GateReport((*compared, latency), machine_description(engine_dir.manifest.target))


def with_reference_described(result: GateResult, reference: Reference) -> GateResult:
    """`result` saying what the PyTorch model it compared against computed in (fp32, or the
    dtype the model was saved in where fp32 did not fit the machine), and when."""
    return replace(result, conditions=result.conditions | {"reference": reference.description})


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
    from components.runtime.onnxruntime import keep_freed_memory

    keep_freed_memory()  # as kiln serve's engine process does

    with load_engine(engine_path, threads=threads) as engine:
        timed = latency_gate(engine, prompt, params)
        return replace(timed, conditions=timed.conditions | engine.runtime_settings() | {"process": "its own, as kiln serve runs it"})


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
    """Gate one engine directory against the PyTorch model directory it came from (in fp32
    where that fits: components.model_fit.reference_dtype), the model computed beside the
    engine where both fit this machine, else first and freed before the engine loads (on the
    engine's GPU, always first: its cache takes the memory left); its latency as served with
    `served_threads` (serving.threads)."""
    from components.model_dir import load_model
    from components.model_fit import reference_beside_engine, reference_dtype
    from components.runtime import load_engine

    engine_dir = load_engine_dir(engine_path)
    device, memory = reference_place(engine_dir.manifest)
    dtype = reference_dtype(reference_path, memory)
    windows = gate_windows(engine_path, eval_texts, params)
    if device == "cpu" and reference_beside_engine(reference_path, dtype, engine_path, memory):
        with load_engine(engine_path) as engine:
            compared = compared_gates(engine, LiveReference(load_model(reference_path, dtype)), windows, params)
    else:
        reference = recorded_reference(engine_dir, reference_path, dtype, windows, params, device)
        with load_engine(engine_path) as engine:
            compared = compared_gates(engine, reference, windows, params)
    # Timed once the gating process has closed its engine: the served one is loaded again.
    return with_latency(compared, engine_dir, windows, params, served_threads)


def reference_place(manifest) -> tuple[str, int]:
    """Where the gates compute the PyTorch model, and the memory it may take there: the GPU a
    torch-cuda engine was built for (its free memory: an 8B model's reference takes seconds
    there, tens of minutes on the host's cores), else this machine's memory."""
    from components.resources import machine_memory

    if manifest.backend != "torch-cuda" or manifest.target == "cpu":
        return "cpu", machine_memory()
    import torch

    return "cuda", torch.cuda.mem_get_info()[0]


def recorded_reference(engine_dir: EngineDir, reference_path: Path, dtype: str, windows: GateWindows, params: GateParams, device: str = "cpu") -> Reference:
    """The model at `reference_path` computed in `dtype` on `device`, on the windows and
    prompts the quality and text gates of the engine in `engine_dir` will read, before it is loaded."""
    chunk = engine_dir.manifest.profiles["context"].batch.max
    return record(reference_path, dtype, windows.quality, params.quality, windows.text[:, : params.text.prompt_tokens], params.text, chunk, device)


def quality_gate_against(engine: Engine, reference_path: Path, eval_texts: list[str], params: QualityGateParams, confidence: float) -> GateResult:
    """The quality gate alone, for an engine already open (what `verify-promotion` re-runs
    on the machine it runs on)."""
    from components.model_dir import load_model
    from components.model_fit import reference_dtype
    from components.resources import machine_memory

    windows = eval_windows(EngineTokenizer(engine.engine_dir.path), eval_texts, params)
    reference = LiveReference(load_model(reference_path, reference_dtype(reference_path, machine_memory())))
    return with_reference_described(quality_gate(engine, reference, windows, params, confidence=confidence), reference)


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
