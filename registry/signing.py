"""Signed engines: the builder signs every file of an engine directory with its private key
(OpenSSF model-signing: a Sigstore bundle, verified offline), and every consumer verifies
that signature against the project's trusted public keys before it trusts anything else.

The registry is not trusted: whoever can write to it can rewrite an engine and its tags
together, but cannot sign. The private key never leaves the file it is read from: it is
not a tag, an artifact, a log line or a Prefect result (a test greps for it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from components.errors import KilnError, RegistryError
from registry.records import Signing

SIGNATURE_FILE = "model.sig"  # model-signing's own default name: its CLI verifies kiln's engines too
DEFAULT_KEY = Path("~/.config/kiln/signing-key.pem")  # per user and machine, as ssh keeps its keys
KEY_ENV = "KILN_SIGNING_KEY"


class SignatureRefused(RegistryError):
    """A directory's signature is missing, unreadable, by a key not trusted, or does not cover its files."""


# ---------------------------------------------------------------- keys


def fingerprint(public_pem: bytes) -> str:
    """sha256 of the public key's PEM, as model-signing writes it into a bundle's key hint."""
    return hashlib.sha256(public_pem).hexdigest()


def public_pem_of(private_key: Path) -> bytes:
    return _public_pem(_load_private(private_key))


def _public_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def create_key(private_key: Path) -> Path:
    """A new P-256 key pair: the private key at `private_key` (mode 0600, its folder 0700),
    its public half beside it as `.pub`; returns the public key's path. Never overwrites."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if private_key.exists():
        raise KilnError(f"{private_key} already exists: kiln never overwrites a signing key")
    private_key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    descriptor = os.open(private_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, not even briefly
    with os.fdopen(descriptor, "wb") as out:
        out.write(pem)
    public = private_key.with_suffix(".pub")
    public.write_bytes(_public_pem(key))
    return public


def _load_private(private_key: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not private_key.is_file():
        raise KilnError(f"no signing key at {private_key}: `kiln keys init` makes one (or set {KEY_ENV} / registry.signing_key)")
    if private_key.stat().st_mode & 0o077:
        raise KilnError(f"the signing key {private_key} is readable by others (mode {private_key.stat().st_mode & 0o777:o}): chmod 600 it")
    try:
        key = serialization.load_pem_private_key(private_key.read_bytes(), password=None)
    except (ValueError, TypeError) as err:
        raise KilnError(f"{private_key} is not an unencrypted PEM private key ({err})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise KilnError(f"{private_key} is not an elliptic-curve key (kiln signs with P-256)")
    return key


def check_signer(signing: Signing) -> bool:
    """Whether registrations will be signed: the key is usable, or (only where signatures are
    not required) absent. A key that is required and missing or unusable is a RegistryError."""
    if not signing.required and (signing.key is None or not signing.key.exists()):
        return False
    if signing.key is None:
        raise RegistryError("registering needs a signing key: `kiln keys init` makes one")
    try:
        _load_private(signing.key)
    except KilnError as err:
        raise RegistryError(str(err)) from None
    return True


def trusted_fingerprints(signing: Signing) -> dict[str, Path]:
    """Each trusted public key by its fingerprint; a key file that cannot be read is an error
    naming it, not a key silently left out."""
    found = {}
    for path in signing.trusted:
        try:
            found[fingerprint(path.read_bytes())] = path
        except OSError as err:
            raise KilnError(f"the trusted key {path} cannot be read ({err.strerror})") from None
    return found


# ---------------------------------------------------------------- sign and verify


def sign(directory: Path, private_key: Path, signature: Path) -> str:
    """Sign every file under `directory` into `signature` (outside it); returns the key's fingerprint."""
    import model_signing

    key = _load_private(private_key)  # the clear errors: missing, readable by others, not EC
    hashing = model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE], ignore_git_paths=False)
    model_signing.signing.Config().set_hashing_config(hashing).use_elliptic_key_signer(private_key=private_key).sign(directory, signature)
    return fingerprint(_public_pem(key))


def sign_into(directory: Path, private_key: Path) -> str:
    """Sign `directory` and put the signature inside it as SIGNATURE_FILE (which the signature
    does not cover); returns the key's fingerprint."""
    with tempfile.TemporaryDirectory(prefix="kiln-sign-") as scratch:
        made = Path(scratch) / SIGNATURE_FILE
        signer = sign(directory, private_key, made)
        made.replace(directory / SIGNATURE_FILE)
    return signer


def verify(directory: Path, signing: Signing) -> str | None:
    """The fingerprint of the trusted key whose signature covers exactly the files of
    `directory`; None for an unsigned directory where signatures are not required.
    Raises SignatureRefused naming the check that failed."""
    import model_signing

    signature = directory / SIGNATURE_FILE
    if not signature.is_file():
        if signing.required:
            raise SignatureRefused(f"it is not signed (no {SIGNATURE_FILE} among its artifacts): a version built before signing is signed by `kiln keys sign-existing`")
        return None
    hint = _key_hint(signature)
    trusted = trusted_fingerprints(signing)
    if hint not in trusted:
        raise SignatureRefused(f"its signature is by key {hint[:16]}…, which is not a trusted key (registry.trusted_keys)")
    try:
        model_signing.verifying.Config().use_elliptic_key_verifier(public_key=trusted[hint]).verify(directory, signature)
    except ValueError as err:
        if str(err).startswith("Signature mismatch"):
            raise SignatureRefused(f"its files are not the ones signed: {_mismatch(str(err))}") from None
        raise SignatureRefused(f"its signature does not verify with the trusted key {hint[:16]}… ({err})") from None
    except Exception as err:  # cryptography's InvalidSignature carries no message
        raise SignatureRefused(f"its signature does not verify with the trusted key {hint[:16]}… ({type(err).__name__})") from None
    return hint


def _key_hint(signature: Path) -> str:
    """The signing key's fingerprint a bundle names (not itself signed: the key it names must
    then verify the signature)."""
    try:
        bundle = json.loads(signature.read_bytes())
        hint = bundle["verificationMaterial"]["publicKey"]["hint"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SignatureRefused(f"its signature {SIGNATURE_FILE} cannot be read ({type(err).__name__}: {err})") from None
    if not isinstance(hint, str) or not hint:
        raise SignatureRefused(f"its signature {SIGNATURE_FILE} names no key")
    return hint


def _mismatch(message: str) -> str:
    """model-signing's diff (the repr of a list, quotes escaped, raw digests) as the files
    that differ."""
    name = r"\\?'([^'\\]+)\\?'"
    listed = r"in model \\?'[^'\\]*\\?': ([^\"'\\\]]+)"
    found = {
        "changed": re.findall(r"Hash mismatch for " + name, message),
        "extra": [f for group in re.findall(r"Extra files found " + listed, message) for f in group.split(", ")],
        "missing": [f for group in re.findall(r"Missing files " + listed, message) for f in group.split(", ")],
    }
    return "; ".join(f"{kind} {', '.join(files)}" for kind, files in found.items() if files) or message[:300]
