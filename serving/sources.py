"""Where a served engine comes from: an alias in the registry (production: what was
promoted, verified on every pull), or a local engine directory (`kiln serve --engine`:
development and benchmarks; checked against its own engine.json, no registry, no gates)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from components.engine_dir import EngineDir, load_engine_dir
from components.errors import EngineError, RegistryError, VersionRefused
from registry import RegistryTarget, VersionInfo, get_version, resolve_alias, tags
from serving.loader import PulledVersion, prune, pull


class EngineSource(Protocol):
    model_name: str
    alias: str | None  # the alias followed; None for a fixed engine

    def describe(self) -> str: ...

    def resolve(self) -> VersionInfo:
        """The version to serve now; RegistryError when there is none."""

    def pull(self, info: VersionInfo) -> PulledVersion:
        """Its verified engine directory; VersionRefused when it must not be served."""

    def forget(self, in_use: set[str]) -> None:
        """Free local copies no longer needed."""


@dataclass(frozen=True)
class AliasSource:
    """`models:/<name>@<alias>`, pulled into `cache_root`, the last `keep_versions` kept."""

    target: RegistryTarget
    alias: str
    cache_root: Path
    keep_versions: int = 3

    @property
    def model_name(self) -> str:
        return self.target.model_name

    def describe(self) -> str:
        return f"models:/{self.target.model_name}@{self.alias}"

    def resolve(self) -> VersionInfo:
        return resolve_alias(self.target, self.alias)

    def pull(self, info: VersionInfo) -> PulledVersion:
        return pull(info, self.target, self.cache_root)

    def forget(self, in_use: set[str]) -> None:
        prune(self.cache_root, self.target.model_name, self.keep_versions, in_use)


@dataclass(frozen=True)
class VersionSource:
    """One registered version, whatever the aliases say (a canary's), pulled and verified as
    an alias's version is."""

    target: RegistryTarget
    version: str
    cache_root: Path
    keep_versions: int = 3
    alias: None = None

    @property
    def model_name(self) -> str:
        return self.target.model_name

    def describe(self) -> str:
        return f"models:/{self.target.model_name}/{self.version}"

    def resolve(self) -> VersionInfo:
        return get_version(self.target, self.version)

    def pull(self, info: VersionInfo) -> PulledVersion:
        return pull(info, self.target, self.cache_root)

    def forget(self, in_use: set[str]) -> None:
        prune(self.cache_root, self.target.model_name, self.keep_versions, in_use)


@dataclass
class LocalSource:
    """One engine directory, served as it is; its version is `local-<sha256 prefix>`."""

    path: Path
    alias: None = None
    # What `resolve` verified (hashing the engine file), so that `pull` does not hash it again.
    _verified: EngineDir | None = field(default=None, repr=False)

    @property
    def model_name(self) -> str:
        return self.path.name

    def describe(self) -> str:
        return str(self.path)

    def resolve(self) -> VersionInfo:
        try:
            self._verified = load_engine_dir(self.path)
        except EngineError as err:
            raise RegistryError(f"{self.path} is not a servable engine directory: {err}") from err
        sha256 = self._verified.sha256
        return VersionInfo(self.model_name, _local_version(sha256), {tags.ENGINE_SHA256: sha256}, (), None)

    def pull(self, info: VersionInfo) -> PulledVersion:
        if self._verified is not None and _local_version(self._verified.sha256) == info.version:
            return PulledVersion(info, self._verified, None)  # a local directory: nothing from the registry to verify
        try:
            return PulledVersion(info, load_engine_dir(self.path), None)
        except EngineError as err:
            raise VersionRefused(f"{self.path} is refused: {err}") from err

    def forget(self, in_use: set[str]) -> None:
        """Nothing was copied."""


def _local_version(sha256: str) -> str:
    return f"local-{sha256[:12]}"
