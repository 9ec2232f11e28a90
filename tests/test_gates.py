"""The gates measure an engine against the PyTorch model it came from, and can fail."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from components.config import LatencyGateParams, QualityGateParams, QualityLimits
from components.errors import ConfigError
from components.gates import drop_pct, eval_windows, gate_report, latency_gate, quality_gate, text_gate, text_windows, write_report
from components.metrics import load_metric
from components.runtime.engine import Engine
from components.runtime.tokenizer import EngineTokenizer


@pytest.fixture(scope="module")
def windows(engine_dir, data_version, params):
    return eval_windows(EngineTokenizer(engine_dir.path), data_version.texts("eval"), params.gates.quality)


def test_the_text_metrics_are_evaluate_modules_loaded_from_the_repo():
    """Top-1 agreement and perplexity are sums over the windows (the gate resamples them);
    ROUGE-L and BLEU are `evaluate` modules kept in components/metrics/, loaded offline."""
    assert load_metric("rouge_l").compute(predictions=["a b"], references=["a b"])["rouge_l_scores"] == [1.0]
    assert load_metric("bleu").compute(predictions=["a b c d"], references=["a b c d"])["bleu"] == pytest.approx(1.0)


def test_an_fp32_engine_agrees_with_its_reference(engine, reference, windows, params):
    result = quality_gate(engine, reference, windows, params.gates.quality)
    assert result.passed and bool(result)
    assert result.measured["top1_agreement"] == 1.0
    assert abs(result.measured["ppl_increase_pct"]) < 0.01


def test_the_quality_gate_fails_against_a_model_it_did_not_come_from(engine, reference, windows, params):
    other = type(reference)(reference.config).eval()  # same shape, freshly initialised weights
    result = quality_gate(engine, other, windows, params.gates.quality)
    assert not result.passed
    assert result.measured["top1_agreement"] < 0.5
    assert "top1_agreement" in result.failures()[0]


class FlattenedEngine(Engine):
    """A worse engine: the real one with its logits scaled down (same argmax, higher perplexity)."""

    def __init__(self, inner: Engine, scale: float) -> None:
        super().__init__(inner.engine_dir)
        self.inner, self.scale = inner, scale

    def forward(self, input_ids, attention_mask, position_ids, cache, logits_positions=None):
        logits, present = self.inner.forward(input_ids, attention_mask, position_ids, cache, logits_positions)
        return logits * self.scale, present


class ClaimsPrecision(FlattenedEngine):
    """The flattened engine, its manifest naming another precision: the gate picks its
    limits by the manifest, as it does for a real fp16 or int8 engine."""

    def __init__(self, inner: Engine, scale: float, precision: str) -> None:
        super().__init__(inner, scale)
        self.manifest = self.manifest.model_copy(update={"precision": precision})


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_a_perplexity_rise_past_the_limit_fails(precision, engine, reference, windows):
    limits = QualityLimits(min_top1_agreement=0.99, max_ppl_increase_pct=0.5)
    strict = QualityGateParams(sequences=8, sequence_length=32, limits={p: limits for p in ("fp32", "fp16", "int8")})
    result = quality_gate(ClaimsPrecision(engine, 0.7, precision), reference, windows, strict)
    assert not result.passed
    assert result.measured["top1_agreement"] == 1.0
    assert result.measured["ppl_increase_pct"] > 0.5
    assert "ppl_increase_pct" in result.failures()[0]


def test_an_undecided_quality_gate_stops_at_its_time_budget_saying_so(engine, reference, windows):
    """Its limit set at the engine's own perplexity rise, the interval straddles it: without a
    time budget the gate doubles its sample up to max_sequences; with one that the first
    sample already spent, it stops there, inconclusive, and the report says why."""
    flatter = FlattenedEngine(engine, 0.97)
    probe = quality_gate(flatter, reference, windows, QualityGateParams(sequences=8, max_sequences=8, sequence_length=32))
    limits = QualityLimits(min_top1_agreement=0.5, max_ppl_increase_pct=probe.measured["ppl_increase_pct"] * 1.01)
    undecided = QualityGateParams(sequences=8, max_sequences=16, sequence_length=32, limits={"fp32": limits}, max_minutes=None)
    unbounded = quality_gate(flatter, reference, windows, undecided)
    assert unbounded.measured["sequences"] == 16  # undecided at 8
    bounded = quality_gate(flatter, reference, windows, undecided.model_copy(update={"max_minutes": 1e-9}))
    assert bounded.measured["sequences"] == 8 and not bounded.passed
    assert "would settle it (measured 8, budget 16); stopped at its time budget: 8 more would take it to about" in bounded.inconclusive["ppl_increase_pct"]
    assert bounded.inconclusive["ppl_increase_pct"].endswith("over its 1e-09 (max_minutes)")


def test_the_latency_gate_reports_percentiles_and_fails_past_its_limit(engine, windows):
    prompt = windows.ravel()[:8].tolist()
    result = latency_gate(engine, prompt, LatencyGateParams(prompt_tokens=8, new_tokens=4, warmup=1, runs=4, max_p95_ms=1e-6, max_p95_over_floor=None))
    assert not result.passed
    assert 0 < result.measured["p50_ms"] <= result.measured["p95_ms"]
    assert len(result.samples_ms) == 4
    assert "p95_ms" in result.failures()[0]


def test_a_report_is_written_as_json_markdown_and_a_plot(tmp_path, engine, reference, data_version, params):
    report = gate_report(engine, reference, data_version.texts("eval"), params.gates, params.serving.threads)
    assert report.passed
    paths = write_report(report, tmp_path)
    assert [p.name for p in paths] == ["report.json", "report.md", "latency.png"]
    saved = json.loads(paths[0].read_text())
    assert saved["passed"] is True and {g["name"] for g in saved["gates"]} == {"quality", "text", "latency"}
    # What the engine was compared against: the model in fp32 here (bf16 where fp32 does not fit).
    assert {g["name"]: g["conditions"].get("reference") for g in saved["gates"]} == {"quality": "PyTorch, float32", "text": "PyTorch, float32", "latency": None}
    assert "| quality | top1_agreement |" in paths[1].read_text()
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(report.flat_numbers()) >= {"gates.quality.top1_agreement", "gates.quality.ppl_increase_pct", "gates.text.rouge_l_drop_pct", "gates.latency.p95_ms"}
    # Where it was measured: latency (and int8's kernels) depend on the CPU.
    assert saved["machine"] == report.machine and f"Measured on {report.machine}." in paths[1].read_text()
    assert f"{len(os.sched_getaffinity(0))} cores" in report.machine
    model_name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), None)
    assert model_name is None or report.machine.startswith(model_name)


def test_where_the_model_and_the_engine_do_not_fit_together_the_model_is_computed_first_and_gates_alike(
    monkeypatch, engine, engine_dir, tiny_model, reference, data_version, params
):
    """An 8B model's bf16 weights beside its int4 engine do not fit 24 GB: the gates compute
    the model first, free it, then load the engine, and measure what they measure beside it."""
    import gc

    import components.runtime
    from components.gates import compared_gates, gate_engine_dir, gate_windows
    from components.resources import GIB

    def models_alive() -> int:
        from transformers import PreTrainedModel

        gc.collect()
        return sum(isinstance(o, PreTrainedModel) for o in gc.get_objects())

    before, at_engine_load = models_alive(), []
    real_load_engine = components.runtime.load_engine
    monkeypatch.setattr(components.runtime, "load_engine", lambda *a, **k: at_engine_load.append(models_alive()) or real_load_engine(*a, **k))
    monkeypatch.setattr("components.resources.machine_memory", lambda: 2 * GIB + 1024)  # either fits alone, not both
    texts = data_version.texts("eval")
    report = gate_engine_dir(engine_dir.path, tiny_model.path, texts, params.gates, params.serving.threads)
    assert at_engine_load == [before]  # the model it computed was freed before the engine loaded
    beside = compared_gates(engine, reference, gate_windows(engine_dir.path, texts, params.gates), params.gates)
    for first, alike in zip((report.gate("quality"), report.gate("text")), beside, strict=True):
        assert first.conditions["reference"] == "PyTorch, float32, computed before the engine was loaded"
        assert (first.measured, first.intervals, first.verdict) == (alike.measured, alike.intervals, alike.verdict)


def test_a_recorded_reference_refuses_what_it_did_not_record(tiny_model, engine_dir, data_version, params):
    from components.gates import eval_windows, gate_windows, recorded_reference

    recorded = recorded_reference(engine_dir, tiny_model.path, "float32", gate_windows(engine_dir.path, data_version.texts("eval"), params.gates), params.gates)
    windows = eval_windows(EngineTokenizer(engine_dir.path), data_version.texts("eval"), params.gates.quality)
    assert recorded.scores(windows[:2]).top1.shape == (2, windows.shape[1] - 1)
    with pytest.raises(ValueError, match="1 of 1 windows were not recorded"):
        recorded.scores(windows[:1] + 1)


def model_written_windows(engine_dir, reference, data_version, params, count: int | None = None) -> np.ndarray:
    """`count` held-out prompts (default: the gate's) followed by what the PyTorch model
    writes after them: text on which the model scores 1.0 (the tiny test model shares
    hardly a word with real held-out text, so real text would leave both scores at 0 and
    the gate nothing to compare). Prompts after which the model writes no word are passed
    over: ROUGE scores an empty text 0 even against itself (the model trained on an AVX2-only
    CPU wrote 16 spaces after one of the first eight)."""
    from components.reference import greedy_continuations

    tokenizer, text = EngineTokenizer(engine_dir.path), params.gates.text
    count = count or text.sequences
    prompts = text_windows(tokenizer, data_version.texts("eval"), text.model_copy(update={"max_sequences": 4 * count}))[:, : text.prompt_tokens]
    written = np.array(greedy_continuations(reference, prompts, text.new_tokens))
    has_words = [i for i, ids in enumerate(written) if re.search(r"[a-z0-9]", tokenizer.decode(ids.tolist()).lower())][:count]
    assert len(has_words) == count, f"the model writes words after only {len(has_words)} of {len(prompts)} prompts"
    return np.concatenate([prompts[has_words], written[has_words]], axis=1)


def test_the_models_continuations_are_its_argmax_at_every_step_end_of_text_included(engine, reference, params):
    """As the engine generates them: a model whose argmax is end-of-text writes end-of-text.
    Forbidding it (`generate`'s min_new_tokens) made the reference write something else,
    and an engine identical to its model lose BLEU on every such row."""
    import torch

    from components.reference import greedy_continuations
    from components.runtime.sampling import Sampling

    eos = engine.manifest.eos_token_id

    class EndsAtOnce(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = reference

        def forward(self, **kwargs):
            out = self.model(**kwargs)
            out.logits[..., eos] += 1e4
            return out

    prompts = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    assert greedy_continuations(EndsAtOnce(), prompts, 3) == [[eos] * 3, [eos] * 3]
    plain = greedy_continuations(reference, prompts, 6)
    assert plain == engine.generate(prompts.tolist(), Sampling(max_new_tokens=6, stop_at_eos=False))  # fp32: the same tokens


def test_the_text_gate_scores_the_engines_continuations_like_the_models_when_they_agree(engine, engine_dir, reference, data_version, params):
    windows = model_written_windows(engine_dir, reference, data_version, params)
    result = text_gate(engine, reference, EngineTokenizer(engine_dir.path), windows, params.gates.text)
    measured = result.measured
    assert result.passed and measured["sequences"] == params.gates.text.sequences
    assert measured["rouge_l"] == measured["rouge_l_reference"] == measured["rouge_l_vs_reference"] == 1.0  # fp32: the same greedy text
    assert measured["bleu"] == measured["bleu_reference"] > 0  # not 1: the tiny model writes few spaces, so few 4-grams
    assert measured["rouge_l_drop_pct"] == measured["bleu_drop_pct"] == 0
    assert result.intervals == {"rouge_l_drop_pct": (0.0, 0.0), "bleu_drop_pct": (0.0, 0.0)}  # the same text: no spread
    assert result.thresholds == {"max_rouge_l_drop_pct": 2.0, "max_bleu_drop_pct": 2.0}
    assert set(result.excluded) == {"bleu_drop_pct"} and "4-grams" in result.excluded["bleu_drop_pct"]  # the tiny model writes few
    real = text_gate(engine, reference, EngineTokenizer(engine_dir.path), text_windows(EngineTokenizer(engine_dir.path), data_version.texts("eval"), params.gates.text), params.gates.text)
    assert real.passed and real.measured["rouge_l"] == real.measured["rouge_l_reference"]


def test_the_text_gate_fails_an_engine_that_writes_other_text_naming_the_scores(engine, engine_dir, reference, data_version, params):
    """An engine that agrees with its model on the first tokens, then repeats one token (not
    EOS: the tiny model itself writes EOS often)."""
    from .conftest import EosAfter

    windows = model_written_windows(engine_dir, reference, data_version, params)
    stuck = EosAfter(engine, after=2, token=engine.manifest.vocab_size - 1)
    result = text_gate(stuck, reference, EngineTokenizer(engine_dir.path), windows, params.gates.text)
    assert not result.passed
    assert result.measured["rouge_l_vs_reference"] < 0.5 and result.measured["rouge_l_drop_pct"] > 50
    low, high = result.intervals["rouge_l_drop_pct"]
    assert 2.0 < low <= result.measured["rouge_l_drop_pct"] <= high  # the whole interval past the limit: failed, not inconclusive
    assert result.verdict == "failed" and GateReport((result,)).failures()[0].startswith("text: rouge_l_drop_pct")


def test_the_text_metrics_are_rouge_l_and_smoothed_corpus_bleu():
    from components.metrics import load_metric

    rouge, bleu = load_metric("rouge_l"), load_metric("bleu")
    text = "the engine writes what the model it came from writes"
    assert rouge.compute(predictions=[text], references=[text])["rouge_l"] == 1.0
    assert bleu.compute(predictions=[text], references=[text])["bleu"] == pytest.approx(1.0)
    assert rouge.compute(predictions=["a b c d"], references=["a x c y"])["rouge_l"] == pytest.approx(0.5)  # LCS "a c"
    assert 0 < bleu.compute(predictions=["a b c d e"], references=["a b x y z"])["bleu"] < 0.2


def test_a_precision_without_text_limits_is_a_config_error(engine, engine_dir, reference, data_version, params):
    without_fp32 = params.gates.text.model_copy(update={"limits": {"int8": params.gates.text.limits["int8"]}})
    with pytest.raises(ConfigError, match="gates.text.limits has no entry for precision 'fp32'"):
        text_gate(engine, reference, EngineTokenizer(engine_dir.path), np.zeros((1, 24), np.int64), without_fp32)


# ---------------------------------------------------------------- the report people read (literal expectations)

from components.gates import GateReport, GateResult, fastest_passing, limit_text  # noqa: E402

QUALITY_OK = GateResult(
    "quality", True, {"top1_agreement": 0.995, "ppl_increase_pct": 0.25}, {"min_top1_agreement": 0.99, "max_ppl_increase_pct": 1.0},
    intervals={"top1_agreement": (0.99, 0.998), "ppl_increase_pct": (0.1, 0.4)}, confidence=0.975,
)  # fmt: skip
LATENCY_SLOW = GateResult("latency", False, {"p50_ms": 12.0, "p95_ms": 31.5}, {"max_p95_ms": 30.0}, (11.0, 12.0, 31.5), {"runtime": "onnxruntime 1.32.0", "threads": "1"})


def test_a_passing_gate_has_no_failure_lines_and_a_failing_one_names_each_broken_limit():
    assert QUALITY_OK.failures() == [] and bool(QUALITY_OK)
    assert LATENCY_SLOW.failures() == ["latency: p95_ms 31.5 (limit <= 30)"] and not LATENCY_SLOW
    both_broken = GateResult("quality", False, {"top1_agreement": 0.9, "ppl_increase_pct": 3.0}, {"min_top1_agreement": 0.97, "max_ppl_increase_pct": 2.0})
    assert both_broken.failures() == ["quality: top1_agreement 0.9 (limit >= 0.97), ppl_increase_pct 3 (limit <= 2)"]
    unmeasured = GateResult("latency", False, {"p50_ms": 5.0}, {"max_p95_ms": 1.0, "min_top1_agreement": 0.5})
    assert unmeasured.failures() == ["latency: "]  # a limit with nothing measured against it names nothing


def test_a_report_passes_only_when_every_gate_does_and_flattens_to_registry_names():
    report = GateReport((QUALITY_OK, LATENCY_SLOW))
    assert not report.passed and not report
    assert GateReport((QUALITY_OK,)).passed
    assert report.gate("latency") is LATENCY_SLOW
    assert report.failures() == ["latency: p95_ms 31.5 (limit <= 30)"]
    assert report.flat_numbers() == {
        "gates.quality.top1_agreement": 0.995,
        "gates.quality.ppl_increase_pct": 0.25,
        "gates.quality.top1_agreement_low": 0.99,
        "gates.quality.top1_agreement_high": 0.998,
        "gates.quality.ppl_increase_pct_low": 0.1,
        "gates.quality.ppl_increase_pct_high": 0.4,
        "gates.latency.p50_ms": 12.0,
        "gates.latency.p95_ms": 31.5,
    }


def test_the_json_report_keeps_every_number_limit_and_latency_sample():
    saved = GateReport((QUALITY_OK, LATENCY_SLOW)).to_dict()
    assert saved["passed"] is False and saved["verdict"] == "failed"
    assert saved["gates"][1] == {
        "name": "latency",
        "passed": False,
        "measured": {"p50_ms": 12.0, "p95_ms": 31.5},
        "thresholds": {"max_p95_ms": 30.0},
        "samples_ms": [11.0, 12.0, 31.5],
        "conditions": {"runtime": "onnxruntime 1.32.0", "threads": "1"},  # what the timings mean
        "intervals": {},  # a timing budget, not a sample of sequences
        "inconclusive": {},
        "excluded": {},
        "confidence": None,
    }
    assert saved["gates"][0]["intervals"] == {"top1_agreement": [0.99, 0.998], "ppl_increase_pct": [0.1, 0.4]}
    assert json.loads(json.dumps(saved)) == saved


def test_the_markdown_report_is_a_table_with_each_limit_and_its_verdict():
    assert GateReport((QUALITY_OK, LATENCY_SLOW)).to_markdown() == (
        "# Gate report: FAILED\n"
        "\n"
        "| gate | measure | value | interval | limit | result |\n"
        "|---|---|---|---|---|---|\n"
        "| quality | top1_agreement | 0.995 | [0.99, 0.998] | >= 0.99 | pass |\n"
        "| quality | ppl_increase_pct | 0.25 | [0.1, 0.4] | <= 1 | pass |\n"
        "| latency | p50_ms | 12 |  |  |  |\n"
        "| latency | p95_ms | 31.5 |  | <= 30 | **FAIL** |\n"
        "\n"
        "Intervals: paired bootstrap over the sequences, at 0.975 confidence each (the gates' confidence shared over their looks).\n"
        "\n"
        "Timed as served: latency: runtime onnxruntime 1.32.0, threads 1.\n"
    )
    assert GateReport((QUALITY_OK,)).to_markdown().startswith("# Gate report: PASSED\n")


def test_limit_text_says_the_direction_or_nothing():
    assert limit_text("top1_agreement", {"min_top1_agreement": 0.97}) == ">= 0.97"
    assert limit_text("p95_ms", {"max_p95_ms": 500.0}) == "<= 500"
    assert limit_text("p50_ms", {"max_p95_ms": 500.0}) == ""
    assert limit_text("p95_ms", {}) == ""


def test_challenger_goes_to_the_fastest_engine_that_passed_every_gate():
    def gated(p50: float, passed: bool) -> GateReport:
        return GateReport((QUALITY_OK, GateResult("latency", passed, {"p50_ms": p50, "p95_ms": p50}, {"max_p95_ms": 100.0})))

    reports = {"fp32": gated(5.0, True), "int8": gated(3.0, False), "fp16": gated(7.0, True)}
    assert fastest_passing(list(reports), reports.get) == "fp32"  # not "fp16", which sorts first
    assert fastest_passing(["int8"], reports.get) is None


def test_only_the_broken_measure_is_named_and_a_value_on_its_limit_passes():
    mixed = GateResult("quality", False, {"top1_agreement": 0.97, "ppl_increase_pct": 2.5}, {"min_top1_agreement": 0.97, "max_ppl_increase_pct": 2.0})
    assert mixed.failures() == ["quality: ppl_increase_pct 2.5 (limit <= 2)"]


def test_the_latency_prompt_may_use_every_token_of_the_windows():
    from components.errors import DataError
    from components.gates import latency_prompt

    windows = np.arange(12).reshape(3, 4)
    assert latency_prompt(windows, 12) == list(range(12))
    with pytest.raises(DataError, match="need 13 prompt tokens"):
        latency_prompt(windows, 13)


def test_a_report_is_written_into_a_folder_that_does_not_exist_yet(tmp_path):
    latency = GateResult("latency", False, {"p50_ms": 12.0, "p95_ms": 31.5, "new_tokens": 32.0}, {"max_p95_ms": 30.0}, (11.0, 12.0, 31.5))
    paths = write_report(GateReport((QUALITY_OK, latency)), tmp_path / "gates" / "abc")
    assert [p.name for p in paths] == ["report.json", "report.md", "latency.png"]
    assert json.loads(paths[0].read_text())["passed"] is False
    assert paths[2].read_bytes()[:4] == b"\x89PNG"


def test_the_latency_gate_times_full_generations_after_warm_up_and_reports_percentiles(engine):
    """A controlled clock: each timed generation's start and end are read once, so the gate
    sees the durations below. An engine that would stop at EOS still generates every token."""
    from .conftest import EosAfter

    durations_ms = [10.0, 20.0, 30.0, 40.0, 50.0]  # of the timed runs; the warm-up is not timed
    ticks = iter([t for d in durations_ms for t in (1.0, 1.0 + d / 1000.0)])
    eos_early = EosAfter(engine, after=1)
    params = LatencyGateParams(prompt_tokens=3, new_tokens=4, warmup=1, runs=5, max_p95_ms=45.0, max_p95_over_floor=None)
    result = latency_gate(eos_early, [5, 17, 42], params, clock=lambda: next(ticks))
    assert eos_early.calls == 6 * 4  # prefill and three decode steps per generation, EOS notwithstanding
    assert result.samples_ms == pytest.approx((10.0, 20.0, 30.0, 40.0, 50.0))
    assert result.measured == pytest.approx({"p50_ms": 30.0, "p95_ms": 48.0, "ms_per_token": 7.5, "new_tokens": 4.0})
    assert not result.passed and result.thresholds == {"max_p95_ms": 45.0}


def test_the_quality_gate_measures_every_window_reports_its_numbers_and_passes_on_its_limits(engine, reference, windows):
    flatter = FlattenedEngine(engine, 0.9)  # same argmax, a little more perplexity
    first = quality_gate(flatter, reference, windows, QualityGateParams(sequences=8, max_sequences=8, sequence_length=32))
    measured = first.measured
    assert set(measured) == {"top1_agreement", "ppl_engine", "ppl_reference", "ppl_increase_pct", "tokens", "sequences"}
    assert measured["tokens"] == measured["sequences"] * (windows.shape[1] - 1)  # every next-token position of every window scored
    assert measured["ppl_increase_pct"] == pytest.approx(100.0 * (measured["ppl_engine"] / measured["ppl_reference"] - 1.0))
    low, high = first.intervals["ppl_increase_pct"]
    assert 0 < low < measured["ppl_increase_pct"] < high  # windows differ: the increase spreads
    gate = lambda ppl_limit: quality_gate(flatter, reference, windows, QualityGateParams(sequences=8, max_sequences=8, sequence_length=32, limits={"fp32": QualityLimits(min_top1_agreement=1.0, max_ppl_increase_pct=ppl_limit)}))  # noqa: E731
    assert gate(high).passed  # the whole interval within its (inclusive) limit
    assert gate(low - 1e-9).verdict == "failed"  # the whole interval beyond
    unsettled = gate((measured["ppl_increase_pct"] + high) / 2)  # straddled: blocks like a failure, and says what would settle it
    assert unsettled.verdict == "inconclusive" and not unsettled.passed
    needed = int(re.search(r"about (\d+) sequences would settle it \(measured 8, budget 8\)", unsettled.inconclusive["ppl_increase_pct"]).group(1))
    assert needed > 8 and "inconclusive: ppl_increase_pct" in unsettled.failures()[0]
    on_it = gate(measured["ppl_increase_pct"])
    assert on_it.inconclusive == {"ppl_increase_pct": "no sample size settles it: the estimate lies on the limit"}


def test_eval_windows_are_cut_in_order_and_too_little_text_is_named(engine_dir):
    from components.errors import DataError

    tokenizer = EngineTokenizer(engine_dir.path)
    text = "The list type is a mutable sequence of items. " * 40
    stream = tokenizer.encode(text)
    one = eval_windows(tokenizer, [text], QualityGateParams(sequences=1, max_sequences=1, sequence_length=len(stream)))
    assert one.tolist() == [stream]
    two = eval_windows(tokenizer, [text, text], QualityGateParams(sequences=1, max_sequences=2, sequence_length=16))  # the budget's windows
    assert two.tolist() == [stream[:16], stream[16:32]] and two.dtype == np.int64
    with pytest.raises(DataError, match=f"the eval split has {len(stream)} tokens, fewer than one window of {len(stream) + 1}"):
        eval_windows(tokenizer, [text], QualityGateParams(sequences=1, sequence_length=len(stream) + 1))


# ---------------------------------------------------------------- the serving gate


def test_the_serving_gate_measures_each_scenario_through_the_scheduler_against_its_budgets(engine_dir, data_version, params, monkeypatch):
    from components.config import ServingGateParams, ServingScenario
    from components.runtime.engine import Engine
    from flows.serving_gate import serving_gate

    # Each scenario's engine is prepared as kiln serve prepares it, before the scheduler runs it
    # (torch-cuda's graphs captured during the first turns set an H100's TTFT p95 at 8 s).
    prepared = []
    monkeypatch.setattr(Engine, "prepare_to_serve", lambda engine: prepared.append(engine))

    scenarios = [
        ServingScenario(name="single", clients=1, requests=3, prompt_tokens=8, new_tokens=6, max_ttft_p95_ms=1e4, max_tpot_p95_ms=1e4, max_request_p99_ms=1e4),
        ServingScenario(
            name="busy", clients=4, requests=2, prompt_tokens=8, new_tokens=6, max_ttft_p95_ms=1e4, max_tpot_p95_ms=1e4, max_request_p99_ms=1e-3, max_over_floor=None
        ),
    ]
    gates = params.gates.model_copy(update={"serving": ServingGateParams(scenarios=scenarios)})
    result = serving_gate(engine_dir, data_version.texts("eval"), gates, threads=1)
    measured = result.measured
    for name in ("single", "busy"):
        assert 0 < measured[f"{name}.ttft_p50_ms"] <= measured[f"{name}.ttft_p95_ms"] < measured[f"{name}.request_p99_ms"]
        assert 0 < measured[f"{name}.tpot_p50_ms"] <= measured[f"{name}.tpot_p95_ms"]
    assert result.thresholds["max_busy.request_p99_ms"] == 1e-3
    assert not result.passed  # the busy scenario's 1 µs budget
    assert GateReport((result,)).failures() == [f"serving: busy.request_p99_ms {measured['busy.request_p99_ms']:.4g} (limit <= 0.001)"]
    assert limit_text("single.ttft_p95_ms", result.thresholds) == "<= 10000"
    assert 0 < measured["single.tpot_floor_ms"] < measured["single.request_floor_ms"] and "busy.tpot_floor_ms" not in measured
    assert result.conditions["single.budget"].startswith("ttft 1e+04 ms (max_ttft_p95_ms), tpot 1e+04 ms (max_tpot_p95_ms)")
    assert result.conditions["busy.budget"] == "the milliseconds alone (max_over_floor: null)"
    assert len(prepared) == 2 and prepared[0] is not prepared[1]  # one engine per scenario


def test_serving_budgets_scale_with_the_floors_where_those_allow_more(engine, monkeypatch):
    """Each budget is max(its milliseconds, max_over_floor × its floor): per output token a
    step's read floor with every client's row, to first token the prompt's own first token
    unloaded once per client, a request both. On a machine whose memory reads 1 MB/s the
    tiny engine's step floor sets the token and request budgets; the first token's stays."""
    import components.read_floor
    from components.config import ServingScenario
    from components.read_floor import onnx_read_bytes
    from components.gates import scenario_budgets

    scenario = ServingScenario(name="s", clients=4, requests=1, prompt_tokens=3, new_tokens=5, max_ttft_p95_ms=1e4, max_tpot_p95_ms=20, max_request_p99_ms=500)
    here = scenario_budgets(engine, [5, 17, 42], scenario)
    assert here.limits == {"ttft_p95_ms": 1e4, "tpot_p95_ms": 20, "request_p99_ms": 500}  # the tiny engine's floors are far below
    monkeypatch.setattr(components.read_floor, "memory_bandwidth", lambda: 1e6)
    slow = scenario_budgets(engine, [5, 17, 42], scenario)
    step = (onnx_read_bytes(engine.engine_dir.engine_file) + engine.manifest.kv_bytes_per_token * 4 * (3 + 5 / 2)) / 1e6 * 1000.0
    first = slow.floors["ttft_p95_ms"]
    assert slow.floors["tpot_p95_ms"] == pytest.approx(step) and 0 < first < 1e4 / 6
    assert slow.limits == {"ttft_p95_ms": 1e4, "tpot_p95_ms": pytest.approx(6 * step), "request_p99_ms": pytest.approx(6 * (first + 4 * step))}
    assert slow.text.startswith("ttft 1e+04 ms (max_ttft_p95_ms), tpot ") and "(6 × its floor)" in slow.text and "(4 × one unloaded)" in slow.text
    alone = scenario_budgets(engine, [5, 17, 42], scenario.model_copy(update={"max_over_floor": None}))
    assert alone.limits == here.limits and alone.floors == {}


def test_the_latency_budget_scales_with_the_read_floor_where_that_allows_more(engine, monkeypatch):
    """max(max_p95_ms, max_p95_over_floor × the generation's read floor): on a machine whose
    memory reads 1 MB/s the tiny engine's floor is seconds and sets the limit; on this one
    the absolute budget does; either way the report says which and why."""
    import components.read_floor
    from components.read_floor import onnx_read_bytes

    def gate(over_floor, ms_per_run: float = 10.0):
        ticks = iter([t for i in range(4) for t in (i, i + ms_per_run / 1000.0)])
        params = LatencyGateParams(prompt_tokens=3, new_tokens=4, warmup=0, runs=4, max_p95_ms=45.0, max_p95_over_floor=over_floor)
        return latency_gate(engine, [5, 17, 42], params, clock=lambda: next(ticks))

    here = gate(6.0)
    assert here.thresholds == {"max_p95_ms": 45.0} and 0 < here.measured["read_floor_ms"] < 45.0 / 6
    assert here.conditions["budget"].startswith("45 ms (gates.latency.max_p95_ms), above 6 × the read floor of ")
    monkeypatch.setattr(components.read_floor, "memory_bandwidth", lambda: 1e6)
    step = onnx_read_bytes(engine.engine_dir.engine_file) + engine.manifest.kv_bytes_per_token * (3 + 2)
    floor_ms = 4 * step / 1e6 * 1000.0
    slow = gate(6.0, ms_per_run=5 * floor_ms)  # 5x its floor: within 6x, far beyond 45 ms
    assert slow.passed and slow.thresholds["max_p95_ms"] == pytest.approx(6 * floor_ms) and slow.measured["read_floor_ms"] == pytest.approx(floor_ms)
    assert slow.measured["p95_over_floor"] == pytest.approx(5.0)
    assert slow.conditions["budget"].startswith(f"6 × the read floor of {floor_ms:.3g} ms (") and "above 45 ms" in slow.conditions["budget"]
    assert not gate(6.0, ms_per_run=7 * floor_ms).passed
    absolute = gate(None, ms_per_run=5 * floor_ms)  # null: the absolute budget alone
    assert not absolute.passed and "read_floor_ms" not in absolute.measured and absolute.conditions == {"budget": "45 ms (gates.latency.max_p95_ms)"}


def test_a_p95_exactly_at_its_limit_passes_and_one_tick_above_fails(engine):
    """Every limit in params.yaml is inclusive ("≤ 500 ms"). Exact binary ticks (2⁻⁷ s) make
    each timed generation exactly 7.8125 ms."""
    import itertools

    def gate(limit_ms: float):
        clock = itertools.count(0.0, 2.0**-7).__next__
        return latency_gate(engine, [5, 17, 42], LatencyGateParams(new_tokens=1, warmup=0, runs=4, max_p95_ms=limit_ms), clock=clock)

    at_limit = gate(7.8125)
    assert at_limit.measured["p95_ms"] == 7.8125 and at_limit.passed
    assert not gate(7.8124).passed


def test_a_precision_without_quality_limits_is_a_config_error_naming_it():
    from components.gates import quality_limits

    with pytest.raises(ConfigError, match="gates.quality.limits has no entry for precision 'fp16'"):
        quality_limits(QualityGateParams(limits={"fp32": QualityLimits(min_top1_agreement=0.99, max_ppl_increase_pct=1.0)}), "fp16")


def test_a_failure_line_names_each_broken_limit_in_its_direction_and_not_a_value_at_its_limit():
    failed = GateResult("quality", False, {"top1_agreement": 0.9, "ppl_increase_pct": 1.0, "tokens": 64.0}, {"min_top1_agreement": 0.99, "max_ppl_increase_pct": 1.0})
    assert failed.failures() == ["quality: top1_agreement 0.9 (limit >= 0.99)"]  # ppl at its limit is within it


def test_text_drops_are_percent_of_the_references_score_and_zero_against_a_reference_that_scored_nothing():
    from components.gates import drop_pct

    assert drop_pct(0.4, 0.5) == pytest.approx(20.0)
    assert drop_pct(0.6, 0.5) == pytest.approx(-20.0)  # the engine wrote closer to the reference text
    assert drop_pct(0.3, 0.0) == 0.0


def test_the_text_gate_needs_both_drops_within_their_inclusive_limits_over_several_batches(engine, engine_dir, reference, data_version, params):
    """More held-out prompts than the engine's batch (two chunks); an engine that drifts from
    its model (repeats one token after two) fails when a drop is past its limit, whatever the other."""
    from components.config import TextLimits

    from .conftest import EosAfter

    tokenizer = EngineTokenizer(engine_dir.path)
    text = params.gates.text.model_copy(update={"sequences": 20, "max_sequences": 20})
    windows = model_written_windows(engine_dir, reference, data_version, params, count=20)
    assert len(windows) == 20 > engine.manifest.profiles["context"].batch.max

    def gate(rouge_limit: float, bleu_limit: float):
        limits = {"fp32": TextLimits(max_rouge_l_drop_pct=rouge_limit, max_bleu_drop_pct=bleu_limit)}
        stuck = EosAfter(engine, after=2, token=engine.manifest.vocab_size - 1)  # counts its calls: one per gate
        return text_gate(stuck, reference, tokenizer, windows, text.model_copy(update={"limits": limits}))

    first = gate(1000.0, 1000.0)
    (rouge_low, rouge_high), (bleu_low, bleu_high) = first.intervals["rouge_l_drop_pct"], first.intervals["bleu_drop_pct"]
    assert first.measured["sequences"] == 20 and rouge_low > 1 and bleu_low > 1 and not first.excluded
    assert gate(rouge_high, bleu_high).passed  # both whole intervals within their inclusive limits
    assert gate(rouge_low - 0.5, 1000.0).verdict == "failed"  # BLEU within its limit does not save it
    assert gate(1000.0, bleu_low - 0.5).verdict == "failed"  # nor ROUGE-L within its


def test_an_eval_split_shorter_than_one_window_is_a_data_error_naming_both_lengths(engine_dir):
    from components.errors import DataError

    tokenizer = EngineTokenizer(engine_dir.path)
    short = "a few words"
    with pytest.raises(DataError, match=f"the eval split has {len(tokenizer.encode(short))} tokens, fewer than one window of 64"):
        eval_windows(tokenizer, [short], QualityGateParams(sequences=2, sequence_length=64))
    windows = eval_windows(tokenizer, [short * 40], QualityGateParams(sequences=2, max_sequences=2, sequence_length=8))
    assert windows.shape == (2, 8) and windows.dtype == np.int64


@pytest.mark.parametrize("threads", [1, 2])
def test_the_latency_gate_times_the_engine_with_the_servers_threads_in_a_process_of_its_own(engine_dir, params, threads):
    """What the version page says about latency is what kiln serve gets: the engine opened with
    serving.threads intra-op threads in a process of its own, and that is recorded with the
    numbers (the report's table, the version's tags)."""
    from components.gates import latency_gate_as_served
    from flows.lineage import version_tags

    quick = LatencyGateParams(prompt_tokens=8, new_tokens=4, warmup=1, runs=2, max_p95_ms=10_000)
    timed = latency_gate_as_served(engine_dir.path, list(range(1, 9)), quick, threads)
    runs = {"runtime": f"onnxruntime {engine_dir.manifest.backend_version}", "threads": str(threads), "process": "its own, as kiln serve runs it"}
    assert timed.conditions == runs | {"budget": timed.conditions["budget"]} and timed.conditions["budget"].startswith("10000 ms (gates.latency.max_p95_ms), above ")
    assert timed.passed and len(timed.samples_ms) == 2
    report = GateReport((timed,))
    assert f"threads {threads}, process its own" in report.to_markdown()
    tagged = version_tags(params, engine_dir, report, git_commit="abc")
    assert tagged["gates.latency.threads"] == str(threads) and tagged["gates.latency.process"] == "its own, as kiln serve runs it"
