"""The champion gate: a new engine against the engine being served, on this run's data."""

import pytest

from components.champion_gate import Contender, champion_gate
from components.gates import GateReport
from components.runtime.tokenizer import EngineTokenizer

from .conftest import EosAfter


@pytest.fixture()
def lenient_latency(params):
    """Limits whose latency budget no scheduling noise can break: these tests are about
    what is compared, not about timing (interleaved timing is what the flow test uses)."""
    return params.gates.model_copy(update={"champion": params.gates.champion.model_copy(update={"max_p50_increase_pct": 1e6})})


def test_an_engine_equal_to_the_champion_passes_with_every_number_side_by_side(engine, engine_dir, data_version, lenient_latency):
    contender = Contender(engine, EngineTokenizer(engine_dir.path))
    result = champion_gate(contender, contender, "7", data_version.texts("eval"), lenient_latency)
    measured = result.measured
    assert result.passed and result.name == "champion" and measured["champion_version"] == 7
    assert measured["nll_per_char"] == measured["nll_per_char_champion"] > 0 and measured["nll_increase_vs_champion_pct"] == 0
    assert measured["rouge_l"] == measured["rouge_l_champion"] and measured["rouge_l_drop_vs_champion_pct"] == 0
    # Paired over the same texts: the same engine on both sides leaves no spread at all.
    assert result.intervals == {"nll_increase_vs_champion_pct": (0.0, 0.0), "rouge_l_drop_vs_champion_pct": (0.0, 0.0)}
    assert measured["p50_ms"] > 0 and measured["p50_ms_champion"] > 0
    assert result.thresholds["max_nll_increase_vs_champion_pct"] == 1.0


def test_an_engine_worse_than_the_champion_fails_naming_the_measure(engine, engine_dir, data_version, lenient_latency):
    tokenizer = EngineTokenizer(engine_dir.path)
    worse = Contender(EosAfter(engine, after=0, token=engine.manifest.vocab_size - 1), tokenizer)
    result = champion_gate(worse, Contender(engine, tokenizer), "3", data_version.texts("eval"), lenient_latency)
    assert not result.passed and result.verdict == "failed" and result.measured["nll_increase_vs_champion_pct"] > 100
    assert result.intervals["nll_increase_vs_champion_pct"][0] > 100  # the whole interval past the 1 % limit
    assert GateReport((result,)).failures()[0].startswith("champion: nll_increase_vs_champion_pct")


def test_challenger_goes_to_the_fastest_engine_not_worse_than_the_champion():
    from components.gates import GateResult
    from flows.pipeline import EngineOutcome, choose_challenger
    from registry import Registration

    def outcome(precision: str, p50_ms: float, beats_champion: bool | None, recorded_passed: bool = True) -> EngineOutcome:
        report = GateReport((GateResult("latency", True, {"p50_ms": p50_ms}, {}),))
        compared = None if beats_champion is None else GateResult("champion", beats_champion, {"champion_version": 1.0}, {})
        return EngineOutcome(precision, None, report, Registration("m", precision, None, recorded_passed, (), recorded_passed), compared)

    fast_but_worse, slow_and_fine = outcome("int8", 5.0, False), outcome("fp32", 9.0, True)
    assert choose_challenger((fast_but_worse, slow_and_fine)) is slow_and_fine
    assert choose_challenger((fast_but_worse,)) is None
    assert choose_challenger((outcome("int8", 5.0, None), slow_and_fine)).precision == "int8"  # no champion: no comparison
    # Passed now, but its engine was registered before with failing gates: that record stands.
    registered_failing = outcome("int8", 5.0, None, recorded_passed=False)
    assert registered_failing.record_disagrees and choose_challenger((registered_failing, slow_and_fine)) is slow_and_fine


def test_the_flow_measures_the_new_engine_against_the_registered_champion_not_itself(project, params, tiny_model, exported, data_version, calibration, engine, engine_dir, registry_target, lenient_latency, tmp_path):
    """The champion is pulled from the registry: its numbers are its own engine's (here the
    int8 engine's), not a second reading of the new engine's."""
    from components.runtime import open_engine
    from flows.pipeline import compare_with_champion
    from registry import CHAMPION, promote, register_engine, resolve_alias

    from .conftest import build_engine
    from .test_registry import record

    int8_dir = build_engine(project, params, tiny_model, exported, data_version, "int8", calibration)
    promote(registry_target, CHAMPION, version=register_engine(registry_target, int8_dir.path, int8_dir.sha256, record()).version)
    champion = resolve_alias(registry_target, CHAMPION)

    result = compare_with_champion(engine_dir, champion, data_version, lenient_latency, registry_target, tmp_path / "cache")
    with open_engine(int8_dir) as int8_engine:
        int8 = Contender(int8_engine, EngineTokenizer(int8_dir.path))
        alone = champion_gate(int8, int8, champion.version, data_version.texts("eval"), lenient_latency)
    assert result.measured["champion_version"] == int(champion.version)
    assert result.measured["nll_per_char_champion"] == pytest.approx(alone.measured["nll_per_char"], rel=1e-6)
    assert result.measured["nll_per_char"] != result.measured["nll_per_char_champion"]
