"""Which registry a project uses: the tracking URI in params.yaml, or the embedded store.

The embedded store is MLflow's SQLite database and a local artifact folder under
`mlruns/` in the project; this module is the one place that knows that layout.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from registry.records import RegistryTarget, Signing
from registry.signing import DEFAULT_KEY, KEY_ENV, public_pem_of

EMBEDDED_STORE = "mlruns"


class RegistrySettings(Protocol):
    """The `registry` section of params.yaml (components.config.RegistryParams), as the
    registry reads it: the registry depends on no config module."""

    @property
    def tracking_uri(self) -> str | None: ...

    @property
    def model_name(self) -> str: ...

    @property
    def experiment(self) -> str: ...

    @property
    def signing_key(self) -> str | None: ...

    @property
    def trusted_keys(self) -> list[str]: ...

    @property
    def trust_own_key(self) -> bool: ...

    @property
    def require_signature(self) -> bool: ...


def registry_target(settings: RegistrySettings, project_root: Path) -> RegistryTarget:
    """The configured tracking URI, or the embedded SQLite store under the project's mlruns/.
    A SQLite store, embedded or named, keeps its artifacts in `artifacts/` beside it."""
    uri = settings.tracking_uri or f"sqlite:///{project_root / EMBEDDED_STORE / 'mlflow.db'}"
    signing = project_signing(settings, project_root)
    if not uri.startswith("sqlite:///"):
        return RegistryTarget(uri, settings.model_name, settings.experiment, signing=signing)  # the server decides
    artifacts = Path(uri.removeprefix("sqlite:///")).parent / "artifacts"
    return RegistryTarget(uri, settings.model_name, settings.experiment, artifacts, signing)


def signing_key_path(settings: RegistrySettings) -> Path:
    """$KILN_SIGNING_KEY, else registry.signing_key, else ~/.config/kiln/signing-key.pem."""
    return Path(os.environ.get(KEY_ENV) or settings.signing_key or DEFAULT_KEY).expanduser()


def project_signing(settings: RegistrySettings, project_root: Path) -> Signing:
    """The key this machine signs with (a machine without it can verify, not sign) and the
    public keys the project trusts."""
    key = signing_key_path(settings)
    trusted = [project_root / path for path in settings.trusted_keys]
    if settings.trust_own_key and key.is_file():
        own = key.with_suffix(".pub")
        if not own.is_file():  # a key made elsewhere: its public half, written once beside it
            own.write_bytes(public_pem_of(key))
        trusted.append(own)
    return Signing(key, tuple(dict.fromkeys(trusted)), settings.require_signature)


def is_embedded(target: RegistryTarget) -> bool:
    return target.tracking_uri.startswith("sqlite:///")
