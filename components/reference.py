"""The PyTorch model an engine is gated against, as the gates read it: each window's top-1
tokens and summed negative log-likelihood, and greedy continuations of prompts.

Computed beside the engine where the machine holds both (`LiveReference`); else computed
first, over every window the gates may read within their budgets, and the model freed
before the engine loads (`RecordedReference`): an 8B model's bf16 weights (15 GiB) and
its int4 engine (5 GiB) do not fit a 24 GB machine together, and either fits alone. Both
compute in the same batches, so the gates' numbers are the same either way.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from components.config import QualityGateParams, TextGateParams
from components.evidence import measure_ahead
from components.progress import stage_progress
from components.resources import release_freed_memory

QUALITY_BATCH = 4  # windows scored at once by the quality gate, engine and model alike


@dataclass(frozen=True)
class WindowScores:
    """Per window: the model's argmax at every position but the last, and its summed NLL."""

    top1: np.ndarray  # [windows, length - 1]
    nll: np.ndarray  # [windows], float64


class Reference(Protocol):
    description: str  # what computed it, for the gate's conditions: "PyTorch, bfloat16"

    def scores(self, windows: np.ndarray) -> WindowScores: ...

    def continuations(self, prompts: np.ndarray, new_tokens: int) -> np.ndarray: ...

    def covering(self, windows: np.ndarray, prompts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The leading windows and prompts it can answer for."""
        ...


class LiveReference:
    """The model in memory, computing as the gates ask."""

    def __init__(self, model) -> None:
        self.model = model
        weight = next(model.parameters())
        self.description = f"PyTorch, {str(weight.dtype).removeprefix('torch.')}" + ("" if weight.device.type == "cpu" else f" on {weight.device.type}")

    def scores(self, windows: np.ndarray) -> WindowScores:
        logits = model_logits(self.model, windows)
        return WindowScores(logits[:, :-1].argmax(-1), target_nll(logits, windows).reshape(len(windows), -1).sum(-1))

    def continuations(self, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
        return np.array(greedy_continuations(self.model, prompts, new_tokens), np.int64).reshape(len(prompts), new_tokens)

    def covering(self, windows: np.ndarray, prompts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return windows, prompts


@dataclass(frozen=True)
class RecordedReference:
    """What a LiveReference answered for the leading windows and prompts, kept after the
    model was freed. Asked for anything else, it says so rather than guess."""

    description: str
    windows: np.ndarray
    top1: np.ndarray
    nll: np.ndarray
    prompts: np.ndarray
    written: np.ndarray  # [prompts, new_tokens]

    def scores(self, windows: np.ndarray) -> WindowScores:
        rows = self._rows(self.windows, windows, "window")
        return WindowScores(self.top1[rows], self.nll[rows])

    def continuations(self, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
        if new_tokens != self.written.shape[1]:
            raise ValueError(f"recorded {self.written.shape[1]} new tokens a prompt, asked for {new_tokens}")
        return self.written[self._rows(self.prompts, prompts, "prompt")]

    def covering(self, windows: np.ndarray, prompts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return windows[: len(self.windows)], prompts[: len(self.prompts)]

    @staticmethod
    def _rows(recorded: np.ndarray, asked: np.ndarray, what: str) -> list[int]:
        index = {row.tobytes(): i for i, row in enumerate(recorded)}
        missing = sum(row.tobytes() not in index for row in asked)
        if missing:
            raise ValueError(f"{missing} of {len(asked)} {what}s were not recorded from the reference model")
        return [index[row.tobytes()] for row in asked]


def record(
    model_path: Path, dtype: str, windows: np.ndarray, quality: QualityGateParams, prompts: np.ndarray, text: TextGateParams, chunk: int, device: str = "cpu"
) -> RecordedReference:
    """What the gates will ask of the model at `model_path` (computed in `dtype`), asked
    first: the quality windows in the quality gate's batches, the text prompts in chunks of
    the engine's `chunk` sequences, each as far as its gate's budget and time budget reach
    (components.evidence.measure_ahead). The model is loaded here, on `device`, and freed
    before returning."""
    from components.model_dir import load_model

    live = LiveReference(load_model(model_path, dtype, device=device))
    windows, prompts = windows[: quality.max_sequences], prompts[: text.max_sequences]
    with stage_progress("reference model: quality windows", total=len(windows)) as advance:
        scored = measure_ahead(lambda a, b: _scored_rows(live, windows[a:b], advance), quality.sequences, len(windows), quality.max_minutes)
    with stage_progress("reference model: text continuations", total=len(prompts)) as advance:
        written = measure_ahead(lambda a, b: _written_rows(live, prompts[a:b], text.new_tokens, chunk, advance), text.sequences, len(prompts), text.max_minutes)
    description = f"{live.description}, computed before the engine was loaded"
    del live
    gc.collect()
    release_freed_memory()
    if device != "cpu":
        import torch

        torch.cuda.empty_cache()  # the card's memory back for the engine, which sizes its cache to what is free
    top1 = scored[:, :-1].astype(np.int64)
    return RecordedReference(description, windows[: len(scored)], top1, scored[:, -1], prompts[: len(written)], written.astype(np.int64))


def _scored_rows(live: LiveReference, windows: np.ndarray, advance) -> np.ndarray:
    rows = []
    for start in range(0, len(windows), QUALITY_BATCH):
        scores = live.scores(windows[start : start + QUALITY_BATCH])
        rows.append(np.concatenate([scores.top1.astype(np.float64), scores.nll[:, None]], axis=1))
        advance(len(scores.nll), "")
    return np.concatenate(rows)


def _written_rows(live: LiveReference, prompts: np.ndarray, new_tokens: int, chunk: int, advance) -> np.ndarray:
    rows = []
    for start in range(0, len(prompts), chunk):
        rows.append(live.continuations(prompts[start : start + chunk], new_tokens))
        advance(len(rows[-1]), "")
    return np.concatenate(rows)


def model_logits(model, batch: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        ids = torch.from_numpy(batch).to(next(model.parameters()).device)
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().cpu().numpy()


def target_nll(logits: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """-log p(next token) at every position but the last, computed stably in float64."""
    scores = logits[:, :-1].astype(np.float64)
    log_norm = np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1)) + scores.max(-1)
    target = np.take_along_axis(scores, batch[:, 1:, None], axis=-1)[..., 0]
    return (log_norm - target).ravel()


def greedy_continuations(model, prompts: np.ndarray, new_tokens: int) -> list[list[int]]:
    """Greedy continuations by the PyTorch model (the prompts share one length: no padding),
    as the engine makes them: the argmax at every step, an end-of-text token like any
    other. `generate` with `min_new_tokens` forbade end-of-text instead, so a row whose
    argmax was one diverged from the engine's (a Llama's fp32 engine lost 6 % BLEU so)."""
    import torch

    picked = []
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(prompts).to(next(model.parameters()).device), use_cache=True)
        for _ in range(new_tokens):
            picked.append(out.logits[:, -1:].argmax(-1))
            out = model(input_ids=picked[-1], cache=out.past_key_values, use_cache=True)
    return torch.cat(picked, dim=1).tolist()


def as_reference(reference) -> Reference:
    """A Reference, or a PyTorch model to compute one live."""
    return reference if hasattr(reference, "scores") else LiveReference(reference)
