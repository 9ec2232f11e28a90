"""Everything MLflow: register, tag, alias, resolve, download. The only package importing mlflow."""

from kiln.registry.store import (
    CHALLENGER,
    CHAMPION,
    Registration,
    RegistryTarget,
    VersionInfo,
    download_version,
    find_version_by_sha256,
    preflight,
    promote,
    register_engine,
    resolve_alias,
)

__all__ = [
    "CHALLENGER",
    "CHAMPION",
    "Registration",
    "RegistryTarget",
    "VersionInfo",
    "download_version",
    "find_version_by_sha256",
    "preflight",
    "promote",
    "register_engine",
    "resolve_alias",
]
