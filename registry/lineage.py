"""One version's lineage as the registry holds it: from the data version it was trained on
to the aliases that name it now (`kiln lineage VERSION`)."""

from __future__ import annotations

from dataclasses import dataclass

from components.errors import RegistryError
from registry.promotion import AliasMove, alias_history
from registry.records import RegistryTarget, VersionInfo
from registry.store import _client, aliases_of, get_version


@dataclass(frozen=True)
class VersionLineage:
    info: VersionInfo
    run_metrics: dict[str, float]  # the registering run's metrics (training perplexity, gates)
    moves: tuple[AliasMove, ...]  # recorded alias moves to or from this version, oldest first

    def tag(self, name: str) -> str:
        return self.info.tags.get(name, "—")


def version_lineage(target: RegistryTarget, version: str) -> VersionLineage:
    from mlflow.exceptions import MlflowException

    info = get_version(target, version)
    metrics: dict[str, float] = {}
    if info.run_id:
        try:
            metrics = dict(_client(target).get_run(info.run_id).data.metrics)
        except MlflowException as err:
            raise RegistryError(f"cannot read run {info.run_id} of version {version}: {err.message}") from err
    aliases = set(aliases_of(target)) | {"champion"}
    moves = [m for alias in sorted(aliases) for m in alias_history(target, alias) if version in (m.version, m.previous)]
    return VersionLineage(info, metrics, tuple(sorted(moves, key=lambda m: m.at)))
