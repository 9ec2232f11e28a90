"""The champion gate: a new engine against the engine being served (`champion`), on this
run's data, in this run: how well each predicts the eval split, how close each one's text
comes to held-out text, and how long each takes to generate, timed turn by turn.
`gates.champion` in params.yaml says how much worse than the champion an engine may be.

The two engines may come from different models with different tokenizers (the pipeline
trains its tokenizer on the data), so quality is compared per character, not per token:
each engine reads the same texts through its own tokenizer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from components.config import ChampionGateParams, GateParams
from components.gates import GateResult, drop_pct, target_nll, text_windows, token_windows
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
    limits = params.champion
    nll = {name: _nll_per_char(c, eval_texts, params) for name, c in (("candidate", candidate), ("champion", champion))}
    prompts, held_out = _prompt_texts(candidate.tokenizer, eval_texts, params)
    rouge = {name: _rouge_l(c, prompts, held_out, params) for name, c in (("candidate", candidate), ("champion", champion))}
    latency_prompt = candidate.tokenizer.decode(token_windows(candidate.tokenizer, eval_texts, 1, params.latency.prompt_tokens)[0].tolist())
    p50 = _interleaved_p50(candidate, champion, latency_prompt, params)
    measured = {
        "nll_per_char": nll["candidate"],
        "nll_per_char_champion": nll["champion"],
        "nll_increase_vs_champion_pct": 100.0 * (nll["candidate"] / nll["champion"] - 1.0),
        "rouge_l": rouge["candidate"],
        "rouge_l_champion": rouge["champion"],
        "rouge_l_drop_vs_champion_pct": drop_pct(rouge["candidate"], rouge["champion"]),
        "p50_ms": p50["candidate"],
        "p50_ms_champion": p50["champion"],
        "p50_increase_vs_champion_pct": 100.0 * (p50["candidate"] / p50["champion"] - 1.0),
        "champion_version": float(champion_version),
    }
    thresholds = _thresholds(limits)
    passed = (
        measured["nll_increase_vs_champion_pct"] <= limits.max_nll_increase_pct
        and measured["rouge_l_drop_vs_champion_pct"] <= limits.max_rouge_l_drop_pct
        and measured["p50_increase_vs_champion_pct"] <= limits.max_p50_increase_pct
    )
    return GateResult("champion", passed, measured, thresholds)


def _thresholds(limits: ChampionGateParams) -> dict[str, float]:
    return {
        "max_nll_increase_vs_champion_pct": limits.max_nll_increase_pct,
        "max_rouge_l_drop_vs_champion_pct": limits.max_rouge_l_drop_pct,
        "max_p50_increase_vs_champion_pct": limits.max_p50_increase_pct,
    }


def _nll_per_char(contender: Contender, texts: list[str], params: GateParams) -> float:
    """Negative log-likelihood of the eval windows' next tokens per character they spell."""
    quality = params.quality
    windows = token_windows(contender.tokenizer, texts, quality.sequences, quality.sequence_length)
    total_nll, total_chars = 0.0, 0
    for start in range(0, len(windows), 4):
        batch = windows[start : start + 4]
        logits = contender.engine.score(batch, np.ones_like(batch))
        total_nll += float(target_nll(logits, batch).sum())
        total_chars += sum(len(contender.tokenizer.decode(row[1:].tolist())) for row in batch)
    return total_nll / max(total_chars, 1)


def _prompt_texts(tokenizer: EngineTokenizer, texts: list[str], params: GateParams) -> tuple[list[str], list[str]]:
    """The text gate's held-out prompts and what followed them, as text (either tokenizer reads it)."""
    windows = text_windows(tokenizer, texts, params.text)
    cut = params.text.prompt_tokens
    return [tokenizer.decode(w[:cut].tolist()) for w in windows], [tokenizer.decode(w[cut:].tolist()) for w in windows]


def _rouge_l(contender: Contender, prompts: list[str], held_out: list[str], params: GateParams) -> float:
    from components.metrics import load_metric

    sampling = Sampling(max_new_tokens=params.text.new_tokens, stop_at_eos=False)
    written = [contender.tokenizer.decode(contender.engine.generate([contender.tokenizer.encode(p)], sampling)[0]) for p in prompts]
    return load_metric("rouge_l").compute(predictions=written, references=held_out)["rouge_l"]


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
