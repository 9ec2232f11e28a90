"""Everything MLflow: records, register, tag, alias, resolve, download. The only package
that imports mlflow; of kiln's components it knows only contracts: errors, files and the
engine directory."""

from registry.lineage import VersionLineage, version_lineage
from registry.promotion import AliasMove, alias_history, check_promotable, promote, rollback
from registry.records import DatasetRecord, Registration, RegistryTarget, RunLink, RunRecord, Signing, VersionInfo
from registry.store import (
    CHALLENGER,
    CHAMPION,
    add_signature,
    alias_version,
    aliases_of,
    download_version,
    engine_identity,
    find_version,
    get_version,
    log_training,
    log_version_report,
    preflight,
    register_alias_webhook,
    register_engine,
    resolve_alias,
    tag_version,
    version_tags_by_version,
    versions_tagged,
)
from registry.target import registry_target

__all__ = [
    "AliasMove",
    "CHALLENGER",
    "CHAMPION",
    "DatasetRecord",
    "Registration",
    "RegistryTarget",
    "RunLink",
    "RunRecord",
    "Signing",
    "VersionInfo",
    "VersionLineage",
    "add_signature",
    "check_promotable",
    "alias_history",
    "alias_version",
    "aliases_of",
    "download_version",
    "engine_identity",
    "find_version",
    "get_version",
    "log_training",
    "log_version_report",
    "preflight",
    "promote",
    "register_alias_webhook",
    "register_engine",
    "registry_target",
    "resolve_alias",
    "rollback",
    "tag_version",
    "version_lineage",
    "version_tags_by_version",
    "versions_tagged",
]
