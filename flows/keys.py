"""`kiln keys sign-existing`: sign the versions registered before engines were signed.

The registry cannot vouch for itself (its tags can be rewritten with its files), so a
version is signed only where this machine still holds the engine it built: every file of
the downloaded version byte-identical to an engine directory in the project's build stage
outputs (.kiln/stages/engines). Anything else is left unsigned for a person to rebuild.
"""

from __future__ import annotations

import filecmp
import tempfile
from dataclasses import dataclass
from pathlib import Path

from components.engine_dir import MANIFEST, load_engine_dir
from components.errors import EngineError, RegistryError
from registry import RegistryTarget, add_signature, download_version, tags, version_tags_by_version
from registry.signing import SIGNATURE_FILE, check_signer, sign


@dataclass(frozen=True)
class SignOutcome:
    version: str
    result: str  # "signed", "already signed", "left unsigned"
    detail: str


def sign_existing(target: RegistryTarget, built_engines: Path) -> list[SignOutcome]:
    """Sign each unsigned version of the model whose files are byte-identical to an engine
    built here; oldest first."""
    if not check_signer(target.signing):
        raise RegistryError("signing needs a signing key: `kiln keys init` makes one")
    built = _built_by_sha256(built_engines)
    outcomes = []
    for version, (version_tags, _) in sorted(version_tags_by_version(target).items(), key=lambda item: int(item[0])):
        with tempfile.TemporaryDirectory(prefix="kiln-sign-existing-") as scratch:
            outcomes.append(_sign_one(target, version, version_tags, built, Path(scratch)))
    return outcomes


def _sign_one(target: RegistryTarget, version: str, version_tags: dict[str, str], built: dict[str, list[Path]], scratch: Path) -> SignOutcome:
    if tags.SIGNING_KEY in version_tags:
        return SignOutcome(version, "already signed", f"by key {version_tags[tags.SIGNING_KEY][:16]}…")
    try:
        downloaded = download_version(target, version, scratch / "download")
    except RegistryError as err:
        return SignOutcome(version, "left unsigned", f"its artifacts cannot be downloaded ({err})")
    if (downloaded / SIGNATURE_FILE).exists():
        return SignOutcome(version, "left unsigned", f"it holds a {SIGNATURE_FILE} but no {tags.SIGNING_KEY} tag: someone else's doing; rebuild it")
    candidates = built.get(version_tags.get(tags.ENGINE_SHA256, ""), [])
    if not candidates:
        return SignOutcome(version, "left unsigned", "no engine built here has its sha256: rebuild it (kiln run) on the machine that signs")
    local = next((c for c in candidates if _same_files(downloaded, c)), None)
    if local is None:
        return SignOutcome(version, "left unsigned", "no engine built here has exactly its files (the store changed, or its build output is gone): rebuild it")
    signature = scratch / SIGNATURE_FILE
    signed_by = sign(local, target.signing.key, signature)
    add_signature(target, version, signature, signed_by)
    return SignOutcome(version, "signed", f"matches {local.name}, signed by key {signed_by[:16]}…")


def _built_by_sha256(built_engines: Path) -> dict[str, list[Path]]:
    """The engine directories of the build stage's outputs, by their engine file's sha256
    (one engine file may be built into several directories: other profiles)."""
    found: dict[str, list[Path]] = {}
    for directory in sorted(built_engines.iterdir()) if built_engines.is_dir() else []:
        if (directory / MANIFEST).is_file():
            try:
                found.setdefault(load_engine_dir(directory).sha256, []).append(directory)
            except EngineError:
                continue  # a damaged build output vouches for nothing
    return found


def _same_files(a: Path, b: Path) -> bool:
    """The same relative paths, each byte-identical."""
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files_a)
