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


def serve_alias(root: Path, params: Params, alias: str | None, host: str | None, port: int | None) -> None:
    from serving.app import ServerSettings, serve
    from serving.follow import EngineSource

    config = params.serving
    target = registry_target(params.registry, root)
    preflight(target)
    source = EngineSource(
        target, alias or config.alias, Workspace(root).serving_cache,
        keep_versions=config.keep_versions, threads=config.threads, max_waiting=config.max_waiting,
    )  # fmt: skip
    settings = ServerSettings(
        poll_interval_s=config.poll_interval_s, max_tokens=config.max_tokens, max_body_bytes=config.max_body_bytes,
        api_key=os.environ.get(API_KEY_ENV) or None, webhook_secret=webhook_secret(root), webhook_max_age_s=config.webhook_max_age_s,
    )  # fmt: skip
    serve(source, settings, host or config.host, port or config.port)
