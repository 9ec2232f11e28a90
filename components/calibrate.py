"""The calibrate stage: the DVC-versioned calibration pool → a curated calibration set.

Samples are stratified by token-length buckets that follow the build's prompt profile
(min / opt / max), exact and near duplicates are removed (MinHash LSH), and the choice is
deterministic for a seed. Each sample is a prompt; the int8 calibration reader feeds it
both as a context-phase input (empty past) and as decode steps with a real past.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from components.config import CalibrationParams, ProfileParams, section_digest
from components.data import DataVersion
from components.files import stage_output
from components.runtime.tokenizer import EngineTokenizer

MANIFEST = "calibration.json"
SAMPLES = "samples.json"
# Part of the output folder's name and of the Prefect cache key (flows.caching): bump it when
# this stage's code changes what it makes, and only this stage and those after it rebuild.
STAGE_VERSION = "1"


@dataclass(frozen=True)
class Bucket:
    """Prompt lengths in [low, high]."""

    low: int
    high: int

    @property
    def name(self) -> str:
        return f"{self.low}-{self.high}"


@dataclass(frozen=True)
class CalibrationSet:
    path: Path
    digest: str
    prompts: tuple[tuple[int, ...], ...]
    decode_steps: int

    @property
    def content_digest(self) -> str:
        return self.digest

    @property
    def output_dir(self) -> Path:
        return self.path

    def is_intact(self) -> bool:
        """Still on disk and unchanged since it was made (a cached result may outlive its files)."""
        try:
            return (self.path / SAMPLES).is_file() and self.manifest()["digest"] == self.digest
        except (OSError, ValueError, KeyError):
            return False

    def manifest(self) -> dict:
        return json.loads((self.path / MANIFEST).read_text())


def buckets_from_profile(prompt: ProfileParams | object, count: int) -> list[Bucket]:
    """`count` buckets from the profile's min to max prompt length, one edge at opt.

    Half the buckets lie below opt and half above, so the lengths TensorRT tunes for
    (opt) and the extremes it must accept (min, max) are all calibrated.
    """
    low, opt, high = prompt.min, prompt.opt, prompt.max
    below = max(1, count // 2)
    above = max(1, count - below)
    edges = list(np.linspace(max(low, 1), opt, below + 1)) + list(np.linspace(opt, high, above + 1))[1:]
    edges = sorted({int(round(e)) for e in edges})
    return [Bucket(a if i == 0 else a + 1, b) for i, (a, b) in enumerate(zip(edges, edges[1:]))]


def calibration_set_from_pool(
    data: DataVersion, tokenizer_dir: Path, profiles: ProfileParams, params: CalibrationParams, out_root: Path
) -> CalibrationSet:
    """Curate, save (manifest, samples, length plot) and return the calibration set."""
    key = f"v{STAGE_VERSION}-{section_digest(params)[:10]}-{section_digest(profiles)[:10]}-{data.md5[:12]}-{_tokenizer_digest(tokenizer_dir)[:10]}"
    build = lambda staging: _curate_into(staging, data, tokenizer_dir, profiles, params)  # noqa: E731
    return _load(stage_output(out_root / key, MANIFEST, build), params.decode_steps)


def _tokenizer_digest(tokenizer_dir: Path) -> str:
    return hashlib.sha256((tokenizer_dir / "tokenizer.json").read_bytes()).hexdigest()


def _load(path: Path, decode_steps: int) -> CalibrationSet:
    manifest = json.loads((path / MANIFEST).read_text())
    prompts = tuple(tuple(p) for p in json.loads((path / SAMPLES).read_text())["prompts"])
    return CalibrationSet(path=path, digest=manifest["digest"], prompts=prompts, decode_steps=decode_steps)


def _curate_into(target: Path, data: DataVersion, tokenizer_dir: Path, profiles: ProfileParams, params: CalibrationParams) -> None:
    tokenizer = EngineTokenizer(tokenizer_dir)
    pool = data.texts("calibration")
    kept, near_duplicates = drop_near_duplicates(pool, params.near_duplicate_threshold, params.seed)
    encoded = [tokenizer.encode_prompt(pool[i]) for i in kept]
    buckets = buckets_from_profile(profiles.prompt, params.buckets)
    chosen = stratified_prompts(kept, encoded, buckets, params.samples, params.seed)
    chosen = _drop_exact_duplicates(chosen)
    manifest = _manifest(pool, encoded, chosen, buckets, near_duplicates, params, data)
    (target / SAMPLES).write_text(json.dumps({"prompts": [c[2] for c in chosen]}))
    (target / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    plot_lengths([len(e) for e in encoded], [len(c[2]) for c in chosen], buckets, target / "lengths.png")


def drop_near_duplicates(texts: list[str], threshold: float, seed: int) -> tuple[list[int], int]:
    """Indices of texts kept after near-duplicate removal (MinHash LSH on word 5-shingles),
    first occurrence wins; and how many were dropped."""
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=64)
    kept = []
    for index, text in enumerate(texts):
        signature = MinHash(num_perm=64, seed=seed)
        words = text.lower().split()
        for shingle in {" ".join(words[i : i + 5]) for i in range(max(1, len(words) - 4))}:
            signature.update(shingle.encode())
        if not lsh.query(signature):
            lsh.insert(str(index), signature)
            kept.append(index)
    return kept, len(texts) - len(kept)


def stratified_prompts(
    ids: list[int], encoded: list[list[int]], buckets: list[Bucket], samples: int, seed: int
) -> list[tuple[int, str, list[int]]]:
    """(pool index, bucket name, prompt ids): an equal share of samples per bucket.

    A passage can serve any bucket whose lower edge it reaches; its prompt is cut to a
    length drawn inside that bucket. Passages are visited in a seeded order, each bucket
    takes the next passage long enough for it, so short buckets don't starve long ones.
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(encoded))
    share = _shares(samples, len(buckets))
    chosen: list[tuple[int, str, list[int]]] = []
    used: set[int] = set()
    for bucket, quota in sorted(zip(buckets, share), key=lambda pair: -pair[0].low):  # scarce long ones first
        for position in order:
            if quota == 0:
                break
            if position in used or len(encoded[position]) < bucket.low:
                continue
            length = int(rng.integers(bucket.low, min(bucket.high, len(encoded[position])) + 1))
            chosen.append((ids[position], bucket.name, encoded[position][:length]))
            used.add(position)
            quota -= 1
    return sorted(chosen, key=lambda c: (c[1], c[0]))


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _drop_exact_duplicates(chosen: list[tuple[int, str, list[int]]]) -> list[tuple[int, str, list[int]]]:
    seen: set[tuple[int, ...]] = set()
    unique = []
    for item in chosen:
        if tuple(item[2]) not in seen:
            seen.add(tuple(item[2]))
            unique.append(item)
    return unique


def _manifest(pool, encoded, chosen, buckets, near_duplicates: int, params: CalibrationParams, data: DataVersion) -> dict:
    lengths = np.array([len(c[2]) for c in chosen]) if chosen else np.zeros(1)
    counts = {b.name: sum(1 for c in chosen if c[1] == b.name) for b in buckets}
    body = {
        "data_md5": data.md5,
        "pool_size": len(pool),
        "near_duplicates_removed": near_duplicates,
        "samples": len(chosen),
        "decode_steps": params.decode_steps,
        "seed": params.seed,
        "buckets": counts,
        "tokens": {"min": int(lengths.min()), "mean": float(lengths.mean()), "max": int(lengths.max()), "total": int(lengths.sum())},
        "sample_ids": [f"calibration:{c[0]}" for c in chosen],
    }
    prompts = json.dumps([c[2] for c in chosen]).encode()
    body["digest"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode() + prompts).hexdigest()
    return body


def plot_lengths(pool: list[int], curated: list[int], buckets: list[Bucket], path: Path) -> None:
    """Token-length distribution of the pool vs the curated set, with the bucket edges."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.5))
    top = int(buckets[-1].high * 1.5)  # the profile's range and a margin; the long tail is counted, not drawn
    bins = np.linspace(0, top, 40)
    shown = [n for n in pool if n <= top]
    label = f"pool ({len(pool)}; {len(pool) - len(shown)} longer than {top})"
    for values, name, colour in ((shown, label, "#4c72b0"), (curated, f"curated ({len(curated)})", "#dd8452")):
        if values:  # a density of nothing divides by zero
            axes.hist(values, bins=bins, alpha=0.55, label=name, density=True, color=colour)
    for bucket in buckets:
        axes.axvline(bucket.high, color="k", linewidth=0.6, linestyle=":")
    axes.set_title("calibration prompt lengths; dotted: bucket edges from the prompt profile", fontsize=9)
    axes.set_xlabel("tokens per sample (prompt length for the curated set)")
    axes.set_ylabel("density")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
