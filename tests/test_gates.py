"""The gates measure an engine against the PyTorch model it came from, and can fail."""

import json

import numpy as np
import pytest

from components.config import LatencyGateParams, QualityGateParams, QualityLimits
from components.gates import eval_windows, gate_report, latency_gate, quality_gate, write_report
from components.metrics import load_metric
from components.runtime.engine import Engine
from components.runtime.tokenizer import EngineTokenizer


@pytest.fixture(scope="module")
def windows(engine_dir, data_version, params):
    return eval_windows(EngineTokenizer(engine_dir.path), data_version.texts("eval"), params.gates.quality)


def test_the_metrics_are_evaluate_modules_loaded_from_the_repo():
    assert load_metric("top1_agreement").compute(predictions=[1, 2, 3, 4], references=[1, 2, 3, 5]) == {"top1_agreement": 0.75}
    assert load_metric("perplexity_from_nll").compute(predictions=[np.log(8.0)] * 3)["perplexity"] == pytest.approx(8.0)


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

    def forward(self, input_ids, attention_mask, position_ids, cache):
        logits, present = self.inner.forward(input_ids, attention_mask, position_ids, cache)
        return logits * self.scale, present


def test_a_perplexity_rise_past_the_limit_fails(engine, reference, windows):
    strict = QualityGateParams(
        sequences=8, sequence_length=32, limits={"fp32": QualityLimits(min_top1_agreement=0.99, max_ppl_increase_pct=0.5)}
    )
    result = quality_gate(FlattenedEngine(engine, 0.7), reference, windows, strict)
    assert not result.passed
    assert result.measured["top1_agreement"] == 1.0
    assert result.measured["ppl_increase_pct"] > 0.5
    assert "ppl_increase_pct" in result.failures()[0]


def test_the_latency_gate_reports_percentiles_and_fails_past_its_limit(engine, windows):
    prompt = windows.ravel()[:8].tolist()
    result = latency_gate(engine, prompt, LatencyGateParams(prompt_tokens=8, new_tokens=4, warmup=1, runs=4, max_p95_ms=1e-6))
    assert not result.passed
    assert 0 < result.measured["p50_ms"] <= result.measured["p95_ms"]
    assert len(result.samples_ms) == 4
    assert "p95_ms" in result.failures()[0]


def test_a_report_is_written_as_json_markdown_and_a_plot(tmp_path, engine, reference, data_version, params):
    report = gate_report(engine, reference, data_version.texts("eval"), params.gates)
    assert report.passed
    paths = write_report(report, tmp_path)
    assert [p.name for p in paths] == ["report.json", "report.md", "latency.png"]
    saved = json.loads(paths[0].read_text())
    assert saved["passed"] is True and {g["name"] for g in saved["gates"]} == {"quality", "latency"}
    assert "| quality | top1_agreement |" in paths[1].read_text()
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(report.flat_numbers()) >= {"gates.quality.top1_agreement", "gates.quality.ppl_increase_pct", "gates.latency.p95_ms"}
