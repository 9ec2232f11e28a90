"""`kiln serve`: params.yaml's `serving` section and the environment's secrets → the server."""

from __future__ import annotations

import os
from pathlib import Path

from components.config import Params
from components.workspace import Workspace
from registry import preflight, registry_target

API_KEY_ENV = "KILN_API_KEY"
WEBHOOK_SECRET_ENV = "KILN_WEBHOOK_SECRET"


def webhook_secret_file(root: Path) -> Path:
    """Where `kiln up` keeps the secret it registered the webhook with (when the
    environment gives none), so that `kiln serve` in the same project checks with it."""
    return Workspace(root).state / "webhook.secret"


def webhook_secret(root: Path) -> str | None:
    if os.environ.get(WEBHOOK_SECRET_ENV):
        return os.environ[WEBHOOK_SECRET_ENV]
    path = webhook_secret_file(root)
    return path.read_text().strip() if path.is_file() else None


def serve_alias(root: Path, params: Params, alias: str | None, host: str | None, port: int | None, engine: Path | None = None, max_batch: int | None = None) -> None:
    """Serve the alias (default serving.alias), or with `engine` that local directory."""
    from serving.app import ServerSettings, serve
    from serving.follow import RuntimeOptions
    from serving.sources import AliasSource, LocalSource

    config = params.serving
    if engine is not None:
        source = LocalSource(engine.resolve())
    else:
        target = registry_target(params.registry, root)
        preflight(target)
        source = AliasSource(target, alias or config.alias, Workspace(root).serving_cache, keep_versions=config.keep_versions)
    settings = ServerSettings(
        poll_interval_s=config.poll_interval_s if engine is None else 0, max_tokens=config.max_tokens, max_body_bytes=config.max_body_bytes,
        api_key=os.environ.get(API_KEY_ENV) or None, webhook_secret=webhook_secret(root), webhook_max_age_s=config.webhook_max_age_s,
        runtime=RuntimeOptions(threads=config.threads, max_batch=max_batch, max_waiting=config.max_waiting),
    )  # fmt: skip
    serve(source, settings, host or config.host, port or config.port)


def promoted_engine(root: Path, params: Params) -> tuple[str, Path]:
    """The champion's verified engine directory (else the challenger's), pulled into the
    serving cache as `kiln serve` would: what the serving benchmark measures."""
    from components.errors import KilnError, RegistryError
    from registry import CHALLENGER, CHAMPION, resolve_alias
    from serving.loader import pull

    target = registry_target(params.registry, root)
    preflight(target)
    for alias in (CHAMPION, CHALLENGER):
        try:
            info = resolve_alias(target, alias)
        except RegistryError:
            continue
        pulled = pull(info, target, Workspace(root).serving_cache)
        return f"{info.name} v{info.version} ({pulled.engine_dir.manifest.precision}, @{alias})", pulled.engine_dir.path
    raise KilnError(f"{target.model_name} has no champion or challenger to benchmark: run `kiln run` first, or pass --engine DIR")
