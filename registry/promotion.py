"""Moving aliases: promotion, its history, and rollback.

The pipeline sets `challenger`; a person sets `champion` (`kiln promote`, `kiln rollback`
or the MLflow UI). A person's move is recorded on the registered model as one tag per move
(`<alias>.moves.0001`, … with the version, the one it replaced, who, when and why), so the
model page in the MLflow UI shows the story and `rollback` knows where to go back to.
MLflow keeps no alias history of its own.

A version whose gates failed is never aliased, unless a person forces it with a reason;
the reason, who and when then become tags of the version, and the serving loader accepts
it on that record. Integrity is never forced: the engine file must match its sha256 tag.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from components.errors import RegistryError, VersionRefused
from registry import tags
from registry.records import RegistryTarget, VersionInfo
from registry.store import CHALLENGER, CHAMPION, _client, _version_info, alias_version, download_version, get_version, store_lock, versions_tagged
from registry.verify import check_gates, verify_download


@dataclass(frozen=True)
class AliasMove:
    """One move of an alias made by a person, as recorded on the registered model."""

    alias: str
    number: int
    version: str
    previous: str | None  # the version the alias named before, None if it named none
    by: str
    at: str  # ISO 8601, UTC
    reason: str

    @property
    def tag(self) -> str:
        return tags.alias_move(self.alias, self.number)


def promote(
    target: RegistryTarget,
    to_alias: str = CHAMPION,
    from_alias: str = CHALLENGER,
    version: str | None = None,
    by: str | None = None,
    reason: str = "",
    force: bool = False,
) -> VersionInfo:
    """Point `to_alias` at `version` (default: the version `from_alias` names). The flow
    uses it to set `challenger`; a person (`by` given) to set `champion`, and their move is
    recorded (`alias_history`).

    Refuses, naming the check, a version whose artifacts are missing or do not match its
    engine_sha256 tag, and one whose gates did not pass unless `force` with a `reason`
    (recorded on the version): kiln never aliases such a version silently.
    """
    if force and not (by and reason.strip()):
        raise RegistryError("forcing a promotion needs a reason (--reason TEXT): it is recorded on the version with who and when")
    info = _version_to_move(target, from_alias) if version is None else get_version(target, version)
    forced = _checked(target, info, force)
    client = _client(target)
    with store_lock(target):
        previous = _version_of(alias_version(target, to_alias))
        _call(lambda: client.set_registered_model_alias(target.model_name, to_alias, info.version), f"set {target.model_name}@{to_alias}")
        try:
            if forced:
                for key, value in {tags.FORCED_REASON: reason.strip(), tags.FORCED_BY: by, tags.FORCED_AT: _now()}.items():
                    _call(lambda k=key, v=value: client.set_model_version_tag(target.model_name, info.version, k, v), f"tag version {info.version}")
            if by is not None:
                _record_move(client, target, to_alias, info.version, previous, by, reason.strip())
        except RegistryError:  # an alias moved without its record would hide who moved it: put it back
            _restore_alias(client, target, to_alias, previous)
            raise
    return _version_info(client, target.model_name, info.version)


def check_promotable(target: RegistryTarget, version: str) -> VersionInfo:
    """The version, when `promote` would move an alias to it (gates passed, artifacts that
    match their tags and signature); VersionRefused or RegistryError naming the check
    otherwise. A canary checks it before the version gets any traffic."""
    info = get_version(target, version)
    _checked(target, info, force=False)
    return info


def _checked(target: RegistryTarget, info: VersionInfo, force: bool) -> bool:
    """`promote`'s checks; True when the version's gates failed and `force` overrides them."""
    forced = _check_or_force(info, force)
    verify_download(info, lambda destination: download_version(target, info.version, destination), target.signing)
    return forced


def _version_to_move(target: RegistryTarget, from_alias: str) -> VersionInfo:
    """The version `from_alias` names; a RegistryError that says what to do when it names
    none (the usual first contact: `kiln promote` before any `kiln run`)."""
    info = alias_version(target, from_alias)
    if info is not None:
        return info
    if not versions_tagged(target, {}):
        raise RegistryError(f"{target.model_name} has no registered version in {target.tracking_uri} yet: run `kiln run` first (it builds, gates and registers the engines, and sets {CHALLENGER} on one that passed)")
    raise RegistryError(f"{target.model_name}@{from_alias} names no version: pass --version N, or --from-alias another alias")


def rollback(target: RegistryTarget, by: str, alias: str = CHAMPION, reason: str = "") -> tuple[VersionInfo, str]:
    """Move `alias` back to the version it named before its current one, through the same
    checks as a promotion; returns that version and the one it replaced. The rollback is a
    move of its own, so rolling back twice returns to where it started."""
    history = alias_history(target, alias)
    current = _version_of(alias_version(target, alias))
    if current is None:
        raise RegistryError(f"{target.model_name}@{alias} names no version: there is nothing to roll back")
    back_to = _version_before(history, current)
    if back_to is None:
        raise RegistryError(
            f"{target.model_name}@{alias} is version {current}, and no earlier version of it is recorded "
            f"({len(history)} recorded move(s); moves made by `kiln promote` and `kiln rollback` are recorded)"
        )
    note = reason.strip() or f"rollback from version {current}"
    info = promote(target, to_alias=alias, version=back_to, by=by, reason=note, force=False)
    return info, current


def alias_history(target: RegistryTarget, alias: str) -> list[AliasMove]:
    """The recorded moves of `alias`, oldest first."""
    from mlflow.exceptions import MlflowException

    try:
        model_tags = _client(target).get_registered_model(target.model_name).tags
    except MlflowException as err:
        raise RegistryError(f"cannot read {target.model_name}: {err.message}") from err
    prefix = tags.alias_moves_prefix(alias)
    moves = []
    for key in sorted(k for k in model_tags if k.startswith(prefix)):
        try:
            record = json.loads(model_tags[key])
            moves.append(AliasMove(alias=alias, number=int(key.removeprefix(prefix)), **record))
        except (ValueError, TypeError) as err:
            raise RegistryError(f"the registered model's tag {key} is not a kiln alias move ({err}): {model_tags[key][:120]!r}") from err
    return moves


def _check_or_force(info: VersionInfo, force: bool) -> bool:
    """True when the version's gates failed and `force` overrides them."""
    try:
        check_gates(info)
        return False
    except VersionRefused:
        if force:
            return True
        raise


def _version_before(history: list[AliasMove], current: str) -> str | None:
    """The version the alias named before `current` became it; where the alias was moved
    outside kiln since (the MLflow UI), the version kiln last set."""
    if not history:
        return None
    last = history[-1]
    return last.previous if last.version == current else last.version


def _record_move(client, target: RegistryTarget, alias: str, version: str, previous: str | None, by: str, reason: str) -> None:
    number = max((m.number for m in alias_history(target, alias)), default=0) + 1
    move = AliasMove(alias, number, version, previous, by, _now(), reason)
    record = {k: v for k, v in asdict(move).items() if k not in ("alias", "number")}
    _call(lambda: client.set_registered_model_tag(target.model_name, move.tag, json.dumps(record)), f"record the move of @{alias}")


def _version_of(info: VersionInfo | None) -> str | None:
    return None if info is None else info.version


def _restore_alias(client, target: RegistryTarget, alias: str, version: str | None) -> None:
    if version is None:
        client.delete_registered_model_alias(target.model_name, alias)
    else:
        client.set_registered_model_alias(target.model_name, alias, version)


def _call(action, what: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        action()
    except MlflowException as err:
        raise RegistryError(f"cannot {what}: {err.message}") from err


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
