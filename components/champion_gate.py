"""The champion gate: a new engine against the engine being served (`champion`), on this
run's data, in this run: how well each predicts the eval split, how close each one's text
comes to held-out text, and how long each takes to generate, timed turn by turn.
`gates.champion` in params.yaml says how much worse than the champion an engine may be.

The two engines may come from different models with different tokenizers (the pipeline
trains its tokenizer on the data), so quality is compared per character, not per token:
each engine reads the same texts through its own tokenizer, and the texts pair the two
engines' numbers for the intervals that decide.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from components.config import ChampionGateParams, GateParams
from components.evidence import Measure, sequential_evidence
from components.gates import GateResult, drop_pct, evidence_result, target_nll, text_windows, token_windows
from components.progress import stage_progress
from components.runtime.engine import Engine
from components.runtime.sampling import Sampling
from components.runtime.tokenizer import EngineTokenizer


@dataclass(frozen=True)
class Contender:
    """An engine and the tokenizer it reads text with."""

    engine: Engine
    tokenizer: EngineTokenizer


def champion_gate(candidate: Contender, champion: Contender, champion_version: str, eval_texts: list[str], params: GateParams) -> GateResult:
    """NLL per character and ROUGE-L of both engines on the same texts, each drop decided by
    its paired interval over the texts (components.evidence); the median latency, timed
    turn by turn, against its limit as measured."""
    limits = params.champion
    nll_measure = Measure("nll_increase_vs_champion_pct", lambda s: 100.0 * ((s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3]) - 1.0), limits.max_nll_increase_pct, "<=")
    rouge_measure = Measure("rouge_l_drop_vs_champion_pct", lambda s: drop_pct(s[..., 0], s[..., 1]), limits.max_rouge_l_drop_pct, "<=")
    texts = _window_texts(candidate.tokenizer, eval_texts, params)
    prompts, held_out = _prompt_texts(candidate.tokenizer, eval_texts, params)
    budget = (min(len(texts), params.quality.max_sequences), min(len(prompts), params.text.max_sequences))
    with stage_progress("champion gate: quality", total=budget[0] + budget[1]) as advance:
        nll_rows = lambda start, stop: _nll_rows((candidate, champion), texts[start:stop], advance)  # noqa: E731
        nll = sequential_evidence(nll_rows, params.quality.sequences, budget[0], [nll_measure], params.confidence, params.quality.max_minutes)
        rouge_rows = lambda start, stop: _rouge_rows((candidate, champion), prompts[start:stop], held_out[start:stop], params, advance)  # noqa: E731
        rouge = sequential_evidence(rouge_rows, params.text.sequences, budget[1], [rouge_measure], params.confidence, params.text.max_minutes)
    latency_prompt = candidate.tokenizer.decode(token_windows(candidate.tokenizer, eval_texts, 1, params.latency.prompt_tokens)[0].tolist())
    p50 = _interleaved_p50(candidate, champion, latency_prompt, params)
    extra = {
        "nll_per_char": nll.totals[0] / nll.totals[1],
        "nll_per_char_champion": nll.totals[2] / nll.totals[3],
        "rouge_l": rouge.totals[0] / rouge.sequences,
        "rouge_l_champion": rouge.totals[1] / rouge.sequences,
        "p50_ms": p50["candidate"],
        "p50_ms_champion": p50["champion"],
        "p50_increase_vs_champion_pct": 100.0 * (p50["candidate"] / p50["champion"] - 1.0),
        "champion_version": float(champion_version),
    }
    fast_enough = extra["p50_increase_vs_champion_pct"] <= limits.max_p50_increase_pct
    return evidence_result("champion", [(nll, [nll_measure]), (rouge, [rouge_measure])], _thresholds(limits), extra, fast_enough)


def _thresholds(limits: ChampionGateParams) -> dict[str, float]:
    return {
        "max_nll_increase_vs_champion_pct": limits.max_nll_increase_pct,
        "max_rouge_l_drop_vs_champion_pct": limits.max_rouge_l_drop_pct,
        "max_p50_increase_vs_champion_pct": limits.max_p50_increase_pct,
    }


def _window_texts(tokenizer: EngineTokenizer, texts: list[str], params: GateParams) -> list[str]:
    """The quality gate's eval windows as text: each engine reads the same characters."""
    windows = token_windows(tokenizer, texts, params.quality.max_sequences, params.quality.sequence_length)
    return [tokenizer.decode(w.tolist()) for w in windows]


def _nll_rows(contenders: tuple[Contender, Contender], texts: list[str], advance) -> np.ndarray:
    """Per text: each contender's summed NLL of its next tokens and the characters they spell."""
    rows = []
    for text in texts:
        row = []
        for contender in contenders:
            ids = np.array([contender.tokenizer.encode(text)], np.int64)
            row += [float(target_nll(contender.engine.score(ids, np.ones_like(ids)), ids).sum()), float(len(contender.tokenizer.decode(ids[0, 1:].tolist())))]
        rows.append(row)
        advance(1, "")
    return np.array(rows, np.float64).reshape(-1, 4)


def _prompt_texts(tokenizer: EngineTokenizer, texts: list[str], params: GateParams) -> tuple[list[str], list[str]]:
    """The text gate's held-out prompts and what followed them, as text (either tokenizer reads it)."""
    windows = text_windows(tokenizer, texts, params.text)
    cut = params.text.prompt_tokens
    return [tokenizer.decode(w[:cut].tolist()) for w in windows], [tokenizer.decode(w[cut:].tolist()) for w in windows]


def _rouge_rows(contenders: tuple[Contender, Contender], prompts: list[str], held_out: list[str], params: GateParams, advance) -> np.ndarray:
    """Per prompt: each contender's ROUGE-L of its greedy continuation against the held-out text."""
    from components.metrics import load_metric

    sampling = Sampling(max_new_tokens=params.text.new_tokens, stop_at_eos=False)
    rouge = load_metric("rouge_l")
    scores = []
    for contender in contenders:
        written = [contender.tokenizer.decode(contender.engine.generate([contender.tokenizer.encode(p)], sampling)[0]) for p in prompts]
        scores.append(rouge.compute(predictions=written, references=held_out)["rouge_l_scores"])
    advance(len(prompts), "")
    return np.array(scores, np.float64).T.reshape(-1, 2)


def _interleaved_p50(candidate: Contender, champion: Contender, prompt: str, params: GateParams) -> dict[str, float]:
    """Median of each engine's generation of the latency gate's length, timed turn by turn
    so that whatever else the machine does weighs on both alike (the median: a comparison
    that one stall of a shared machine does not decide)."""
    latency = params.latency
    sampling = Sampling(max_new_tokens=latency.new_tokens, stop_at_eos=False)
    contenders = {"candidate": candidate, "champion": champion}
    prompts = {name: c.tokenizer.encode(prompt) for name, c in contenders.items()}
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    with stage_progress("champion gate", total=latency.warmup + latency.runs) as advance:
        for run in range(latency.warmup + latency.runs):
            for name, contender in contenders.items():
                start = time.perf_counter()
                contender.engine.generate([prompts[name]], sampling)
                if run >= latency.warmup:
                    samples[name].append((time.perf_counter() - start) * 1000.0)
            advance(1, "")
    return {name: float(np.median(values)) for name, values in samples.items()}
