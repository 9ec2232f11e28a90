"""Is a downloaded version what kiln's builder signed, and what the registry says it is?

First the signature (registry.signing): every file of the engine directory, signed by a
trusted key, so an engine rewritten in the store together with its tags is refused. Then
the version's own `engine_sha256` tag, not only the `engine.json` that travels with it.
Every consumer of a registered version (promote, the sample step, verify-promotion, the
serving loader) goes through here; nothing forces it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from components.engine_dir import EngineDir, load_engine_dir
from components.errors import EngineError, RegistryError, VersionRefused
from registry import tags
from registry.records import Signing, VersionInfo
from registry.signing import SignatureRefused, verify


def check_gates(info: VersionInfo) -> None:
    """Refuse a version whose gates did not pass, unless a person forced its promotion with a
    recorded reason: kiln never aliases or serves one silently."""
    if info.tags.get(tags.GATES_PASSED) != tags.TRUE and not info.tags.get(tags.FORCED_REASON):
        verdict = f", {tags.GATES_VERDICT} {info.tags[tags.GATES_VERDICT]!r}" if tags.GATES_VERDICT in info.tags else ""  # inconclusive, or failed
        raise VersionRefused(f"{_name(info)} is refused: it did not pass its gates ({tags.GATES_PASSED} tag {info.tags.get(tags.GATES_PASSED)!r}{verdict})")


def verified_engine_dir(info: VersionInfo, local: Path, signing: Signing) -> tuple[EngineDir, str | None]:
    """The downloaded engine directory and the fingerprint of the trusted key that signed it:
    its signature verified first (which hashes every file, once), then the directory checked
    against itself (engine.json readable, files present; the engine files' sha256 as
    engine.json says, hashed here only where no signature covered them) and the version's tags."""
    signer = verified_signer(info, local, signing)
    expected = info.tags.get(tags.ENGINE_SHA256)
    if not expected:
        raise VersionRefused(f"{_name(info)} is refused: it has no {tags.ENGINE_SHA256} tag")
    try:
        engine_dir = load_engine_dir(local, files_verified=signer is not None)  # the signature hashed every file
    except EngineError as err:
        raise VersionRefused(f"{_name(info)} is refused: {err}") from err
    if engine_dir.sha256 != expected:
        raise VersionRefused(
            f"{_name(info)} is refused: its engine file has sha256 {engine_dir.sha256[:12]}…, "
            f"the version's {tags.ENGINE_SHA256} tag says {expected[:12]}…"
        )
    template = engine_dir.manifest.chat_template_sha256 or "none"
    recorded = info.tags.get(tags.CHAT_TEMPLATE_SHA256)
    if recorded is not None and recorded != template:  # versions registered before templates were recorded have no tag
        raise VersionRefused(f"{_name(info)} is refused: its chat template has sha256 {template[:12]}…, the version's {tags.CHAT_TEMPLATE_SHA256} tag says {recorded[:12]}…")
    return engine_dir, signer


def verified_signer(info: VersionInfo, local: Path, signing: Signing) -> str | None:
    """The fingerprint of the trusted key that signed the downloaded directory (None: an
    unsigned version where signatures are not required); the version's `signing_key` tag,
    where it has one, must name that key."""
    try:
        signer = verify(local, signing)
    except SignatureRefused as err:
        raise VersionRefused(f"{_name(info)} is refused: {err}") from err
    recorded = info.tags.get(tags.SIGNING_KEY)
    if signer is not None and recorded is not None and recorded != signer:
        raise VersionRefused(f"{_name(info)} is refused: its {tags.SIGNING_KEY} tag says {recorded[:16]}…, its signature is by {signer[:16]}…")
    return signer


def verify_download(info: VersionInfo, download: Callable[[Path], Path], signing: Signing) -> None:
    """Download the version into a scratch folder with `download(destination) -> engine dir`
    and verify it there; a version whose artifacts are gone is refused, naming that."""
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as scratch:
        try:
            local = download(Path(scratch) / "download")
        except RegistryError as err:
            raise VersionRefused(f"{_name(info)} is refused: its artifacts cannot be downloaded ({err})") from err
        verified_engine_dir(info, local, signing)


def _name(info: VersionInfo) -> str:
    return f"{info.name} version {info.version}"
