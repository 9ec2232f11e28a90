"""`kiln serve`: params.yaml's `serving` section and the environment's secrets → the server."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from components.config import Params
from components.errors import ConfigError
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


def ensure_webhook_secret(root: Path) -> str:
    """The project's webhook secret, made (random, readable by its owner only) if none exists."""
    existing = webhook_secret(root)
    if existing:
        return existing
    return _private_file(webhook_secret_file(root), secrets.token_urlsafe(32))


def mlflow_encryption_key(root: Path) -> str:
    """The Fernet key MLflow encrypts webhook secrets with; kept so that a restarted
    `kiln up` can still read the secrets it stored (unset, MLflow picks one per process)."""
    path = Workspace(root).state / "mlflow-webhook.key"
    if path.is_file():
        return path.read_text().strip()
    from cryptography.fernet import Fernet

    return _private_file(path, Fernet.generate_key().decode())


def _private_file(path: Path, content: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(content)
    return content


def serve_alias(
    root: Path, params: Params, alias: str | None, host: str | None, port: int | None, engine: Path | None = None, max_batch: int | None = None, prefix_cache_mib: int | None = None
) -> None:
    """Serve the alias (default serving.alias), or with `engine` that local directory."""
    from serving.app import serve

    source, settings = engine_source(root, params, alias, engine), server_settings(root, params, engine is None, max_batch, prefix_cache_mib)
    host = host or params.serving.host
    if settings.api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        from flows import render

        render.note(f"serving on {host} with no {API_KEY_ENV}: anyone who reaches this port can use the model")
    serve(source, settings, host, port or params.serving.port)


def engine_source(root: Path, params: Params, alias: str | None, engine: Path | None):
    """What a server serves: the alias (default serving.alias) from the registry, checked
    reachable first, or the local engine directory `engine`."""
    from serving.sources import AliasSource, LocalSource

    if engine is not None:
        return LocalSource(engine.resolve())
    target = registry_target(params.registry, root)
    preflight(target)
    return AliasSource(target, alias or params.serving.alias, Workspace(root).serving_cache, keep_versions=params.serving.keep_versions)


def server_settings(root: Path, params: Params, follows_alias: bool, max_batch: int | None = None, prefix_cache_mib: int | None = None):
    """params.yaml's `serving` section and the environment's secrets as the server's
    settings (polling the registry only where it `follows_alias`)."""
    from serving.app import ServerSettings
    from serving.engine_process import RuntimeOptions

    config = params.serving
    prefix_cache_bytes = (config.prefix_cache_mib if prefix_cache_mib is None else prefix_cache_mib) << 20
    return ServerSettings(
        poll_interval_s=config.poll_interval_s if follows_alias else 0, max_tokens=config.max_tokens, max_body_bytes=config.max_body_bytes,
        api_key=os.environ.get(API_KEY_ENV) or None, webhook_secret=os.environ.get(WEBHOOK_SECRET_ENV) or None,
        webhook_secret_file=webhook_secret_file(root), webhook_max_age_s=config.webhook_max_age_s,
        runtime=RuntimeOptions(threads=config.threads, max_batch=max_batch, max_waiting=config.max_waiting, prefix_cache_bytes=prefix_cache_bytes),
        max_n=config.max_n, chat_template=_chat_template(root, config.chat_template), tool_format=config.tool_format,
    )  # fmt: skip


def _chat_template(root: Path, path: str | None) -> Path | None:
    """serving.chat_template as a file that compiles, checked before the server starts."""
    from serving.chat import ChatTemplate, ChatTemplateError

    if path is None:
        return None
    template = (root / path).resolve()
    if not template.is_file():
        raise ConfigError(f"serving.chat_template names {template}, which is not a file")
    try:
        ChatTemplate(template.read_text(), {}, str(template))
    except ChatTemplateError as err:
        raise ConfigError(f"serving.chat_template: {err}") from None
    return template
