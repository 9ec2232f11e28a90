"""The serving loader: a registered version → a verified local engine directory → an Engine.

An alias is resolved to a version first and that pinned version is downloaded, so the
alias cannot move mid-download. MLflow stores no checksum, so the version's
`engine_sha256` tag is what the engine file is checked against, not only the
`engine.json` that travels with it: an artifact edited together with its manifest is
still refused. A refused version is never loaded.
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from components.engine_dir import MANIFEST, EngineDir, load_engine_dir
from components.errors import EngineError, VersionRefused
from components.runtime import load_engine
from components.runtime.engine import Engine
from registry import RegistryTarget, VersionInfo, download_version, get_version, resolve_alias


@dataclass(frozen=True)
class PulledVersion:
    """A registered version and its verified local engine directory."""

    info: VersionInfo
    engine_dir: EngineDir

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
        with _locked(local.parent):
            if not (local / MANIFEST).is_file():
                _download_into(target, info.version, local)
    return PulledVersion(info, verified_engine_dir(info, local))


def check_gates(info: VersionInfo) -> None:
    if info.tags.get("gates.passed") != "true":
        raise VersionRefused(f"{info.name} version {info.version} is refused: its gates.passed tag is {info.tags.get('gates.passed')!r}, not 'true'")


def verified_engine_dir(info: VersionInfo, local: Path) -> EngineDir:
    """The local engine directory, checked against itself (engine.json, files, sha256) and
    against the version's `engine_sha256` tag."""
    expected = info.tags.get("engine_sha256")
    if not expected:
        raise VersionRefused(f"{info.name} version {info.version} is refused: it has no engine_sha256 tag")
    try:
        engine_dir = load_engine_dir(local)
    except EngineError as err:
        raise VersionRefused(f"{info.name} version {info.version} is refused: {err}") from err
    if engine_dir.sha256 != expected:
        raise VersionRefused(
            f"{info.name} version {info.version} is refused: its engine file has sha256 {engine_dir.sha256[:12]}…, "
            f"the version's engine_sha256 tag says {expected[:12]}…"
        )
    return engine_dir


def load(pulled: PulledVersion, threads: int | None = None) -> Engine:
    """Open the pulled engine with the runtime of its backend (the one the gates used)."""
    try:
        return load_engine(pulled.engine_dir.path, threads=threads)
    except EngineError as err:
        raise VersionRefused(f"{pulled.label} is refused: {err}") from err


def _download_into(target: RegistryTarget, version: str, local: Path) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=local.parent, prefix=f".{version}.partial-") as scratch:
        downloaded = download_version(target, version, Path(scratch) / "download")
        shutil.rmtree(local, ignore_errors=True)
        downloaded.rename(local)


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """One process at a time fills a model's cache folder (an advisory file lock)."""
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
