"""The serving loader: a registered version → a verified local engine directory → an Engine.

An alias is resolved to a version first and that pinned version is downloaded, so the
alias cannot move mid-download. The copy is checked against the version's tags
(registry.verify) on every pull, the cached one too: a refused version is never loaded.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from components.engine_dir import MANIFEST, EngineDir
from components.errors import BackendUnavailable, EngineError, RegistryError, VersionRefused
from components.files import exclusive_lock, stage_output
from components.runtime import open_engine
from components.runtime.engine import Engine
from components.runtime.sampling import Sampling
from registry import RegistryTarget, VersionInfo, download_version, get_version, resolve_alias
from registry.verify import check_gates, verified_engine_dir


@dataclass(frozen=True)
class PulledVersion:
    """A registered version and its verified local engine directory."""

    info: VersionInfo
    engine_dir: EngineDir
    signed_by: str | None  # the trusted key's fingerprint; None: unsigned, allowed by registry.require_signature false

    @property
    def label(self) -> str:
        return f"{self.info.name} version {self.info.version}"


def pull_alias(target: RegistryTarget, alias: str, cache_root: Path) -> PulledVersion:
    """`models:/<name>@<alias>`, resolved to its version, then pulled as that version."""
    return pull(resolve_alias(target, alias), target, cache_root)


def pull_version(target: RegistryTarget, version: str, cache_root: Path) -> PulledVersion:
    return pull(get_version(target, version), target, cache_root)


def pull(info: VersionInfo, target: RegistryTarget, cache_root: Path) -> PulledVersion:
    """The version's engine directory under `cache_root/<name>/<version>/`, downloaded once
    (into a scratch folder renamed into place, under a lock) and verified on every pull."""
    check_gates(info)
    local = cache_root / info.name / info.version
    if not (local / MANIFEST).is_file():
        with exclusive_lock(local.parent / ".lock"):  # one process fills the cache
            if not (local / MANIFEST).is_file():
                try:
                    _download_into(target, info.version, local)
                except RegistryError as err:
                    raise VersionRefused(f"{info.name} version {info.version} is refused: its artifacts cannot be downloaded ({err})") from err
    pulled = PulledVersion(info, *verified_engine_dir(info, local, target.signing))
    os.utime(local)  # recency for `prune`
    return pulled


def load(pulled: PulledVersion, threads: int | None = None) -> Engine:
    """Open the pulled engine with the runtime of its backend (the one the gates used); the
    directory was verified by `pull`, so its engine file is not hashed again."""
    try:
        return open_engine(pulled.engine_dir, threads=threads)
    except (EngineError, BackendUnavailable) as err:  # corrupt, or not runnable on this machine
        raise VersionRefused(f"{pulled.label} is refused: {err}") from err


def load_warm(pulled: PulledVersion, threads: int | None = None) -> Engine:
    """`load`, then one short generation: a version that cannot generate is refused here,
    before it serves anyone."""
    engine = load(pulled, threads=threads)
    try:
        engine.generate([[engine.manifest.eos_token_id]], Sampling(max_new_tokens=2, stop_at_eos=False))
        engine.prepare_to_serve()
    except Exception as err:  # ShapeOutOfProfile or the backend's own error type alike
        engine.close()
        raise VersionRefused(f"{pulled.label} is refused: its warm-up generation failed: {err}") from err
    return engine


def _download_into(target: RegistryTarget, version: str, local: Path) -> None:
    def fill(staging: Path) -> None:
        downloaded = download_version(target, version, staging / ".download")
        for item in downloaded.iterdir():
            item.rename(staging / item.name)
        shutil.rmtree(staging / ".download")

    stage_output(local, MANIFEST, fill)


def prune(cache_root: Path, name: str, keep: int, in_use: set[str]) -> list[str]:
    """Delete all but the `keep` most recently pulled versions of `name` (never one
    `in_use`); returns the versions deleted."""
    folder = cache_root / name
    if not folder.is_dir():
        return []
    with exclusive_lock(folder / ".lock"):
        pulled = sorted((p for p in folder.iterdir() if (p / MANIFEST).is_file()), key=lambda p: p.stat().st_mtime, reverse=True)
        stale = [p for p in pulled[keep:] if p.name not in in_use]
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in stale]
