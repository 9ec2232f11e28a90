"""The HTTP server: a FastAPI app from a factory. The engine is pulled and warmed in the
lifespan (never at import), the alias is followed by polling and by MLflow webhooks, and
every failure maps to an OpenAI-style error body: bad input is a 4xx naming the field,
never a 5xx and never a dead server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from components.errors import KilnError
from registry import version_tags_by_version
from serving import handlers
from serving.engine_process import RuntimeOptions
from serving.follow import AliasFollower, ChatDefaults, NothingToServe, ServedEngine
from serving.handlers import ApiError
from serving.metrics import ServerMetrics
from serving.schemas import ErrorBody, ErrorDetail
from serving.sse import EventStream
from serving.sources import AliasSource, EngineSource
from serving.webhooks import WebhookRejected, verified_alias_event

log = logging.getLogger("kiln.serving")
VERSION_HEADER = "X-Kiln-Model-Version"


@dataclass(frozen=True)
class ServerSettings:
    """How the server behaves; `kiln serve` fills it from params.yaml's `serving` section."""

    poll_interval_s: float = 10.0  # 0 turns polling off
    max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    api_key: str | None = None  # bearer token for /v1/*; None: open
    webhook_secret: str | None = None  # fixed (KILN_WEBHOOK_SECRET); else read from the file below
    # The secret `kiln up` keeps, read at each delivery: a `kiln serve` started before the
    # first `kiln up` would otherwise refuse every delivery until restarted.
    webhook_secret_file: Path | None = None
    webhook_max_age_s: float = 300.0
    runtime: RuntimeOptions = RuntimeOptions()
    max_n: int = 8  # choices a prompt (OpenAI's `n`)
    chat_template: Path | None = None  # for a version without a chat template of its own
    tool_format: str | None = None  # for a version whose template writes no known call format


def create_app(source: EngineSource, settings: ServerSettings = ServerSettings()) -> FastAPI:
    metrics = ServerMetrics()
    follower = AliasFollower(
        source, settings.runtime, on_event=lambda result, served, seconds: _record_swap(metrics, result, served, seconds),
        chat=ChatDefaults(settings.chat_template, settings.tool_format),
    )
    follower.observe_batches(metrics.observe_batch)
    metrics.watch_engine_process(lambda: follower.current.scheduler.pid if follower.current else None)
    if isinstance(source, AliasSource):
        metrics.watch_registry(lambda: version_tags_by_version(source.target))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.startup_error = None
        app.state.mailbox = handlers.Mailbox(asyncio.get_running_loop())
        try:
            await asyncio.to_thread(follower.follow)
        except NothingToServe as err:
            app.state.startup_error = err  # `kiln serve` prints it and exits 2
            raise
        poller = asyncio.create_task(_poll(follower, settings.poll_interval_s)) if settings.poll_interval_s > 0 else None
        try:
            yield
        finally:
            if poller:
                poller.cancel()
            metrics.ready.set(0)
            await asyncio.to_thread(follower.close)

    app = FastAPI(title="kiln serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)  # served below, behind the API key
    app.state.follower, app.state.metrics, app.state.settings = follower, metrics, settings
    _routes(app, follower, metrics, settings)
    _documentation(app, settings)
    _error_handlers(app, follower)
    return app


async def _poll(follower: AliasFollower, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.to_thread(follower.follow)
        except Exception:  # the poller must outlive any one failure; the follower logged it
            log.exception("polling the registry failed")


def _record_swap(metrics: ServerMetrics, result: str, served: ServedEngine | None, seconds: float) -> None:
    metrics.swaps.labels(result).inc()
    if result == "swapped" and served is not None:
        metrics.engine_load.observe(seconds)
        metrics.served.info(served.facts)
        metrics.ready.set(1)


def _routes(app: FastAPI, follower: AliasFollower, metrics: ServerMetrics, settings: ServerSettings) -> None:
    def served() -> ServedEngine:
        if follower.current is None:
            raise ApiError(503, "no engine is loaded yet", type="server_busy", code="not_ready")
        return follower.current

    def _submit(request, started: float, prepare) -> tuple[ServedEngine, handlers.Submitted]:
        """Queue the request on the served engine; `prepare(engine)` gives its prompts and
        sampling (they depend on the version: its tokenizer, template and context)."""
        for attempt in (1, 2):
            engine = served()
            handlers.check_model(request, engine)
            prepared = prepare(engine)
            try:
                job = handlers.submit(prepared, request, engine, started, app.state.mailbox)
                if prepared.constraint is not None:
                    metrics.constrained_requests.labels(prepared.constraint.kind).inc()
                return engine, job
            except ApiError as err:  # swapped between `served()` and `submit`: the new one takes it
                if err.code != "engine_swapping" or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    @app.get("/healthz")
    async def healthz() -> dict:
        """Liveness: 200 while the process answers."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        """200 with the served version's facts while a warm engine serves; 503 before, and while its engine process loads again."""
        current = follower.current
        if current is None or not current.scheduler.alive:  # not loaded yet, or its engine process died and is loading again
            return JSONResponse({"ready": False}, status_code=503)
        return JSONResponse({"ready": True, **current.facts}, headers={VERSION_HEADER: current.version})

    @app.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus metrics (text format): docs/reference/metrics.md lists them."""
        # Off the event loop: a scrape reads the registry (an MLflow query) and NVML.
        return PlainTextResponse(await asyncio.to_thread(generate_latest, metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The one model served: its registered version, alias, precision, backend, engine sha256 and signing key."""
        _authorize(request, settings)
        engine = served()
        body = handlers.model_list(engine, follower.source.alias)
        return JSONResponse(body.model_dump(), headers={VERSION_HEADER: engine.version})

    async def _serve(request: Request, parse, prepare, stream, complete) -> Response:
        """A completions-style route: parse the body, queue its sequences on the served engine
        (`prepare(parsed, engine, max_tokens)`: their prompts and sampling), then stream or answer."""
        started = time.monotonic()
        try:
            _authorize(request, settings)
            parsed = parse(await _body(request, settings.max_body_bytes), settings.max_tokens, settings.max_n)
            engine, job = _submit(parsed, started, lambda engine: prepare(parsed, engine, settings.max_tokens))
        except ApiError as err:
            metrics.requests.labels(_outcome(err)).inc()
            raise
        if parsed.stream:
            return EventStream(_streamed(stream(engine, job, parsed), job, metrics), headers={VERSION_HEADER: engine.version})
        return await _answered(complete(engine, job, parsed), engine, job)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI's completions: a prompt (text, token ids, or a list of either), sampling, `n`, `logprobs`, `echo`, stop strings; `stream` answers server-sent events."""
        return await _serve(request, handlers.parse_completion, handlers.completion_prepared, handlers.stream, handlers.complete)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI's chat completions: the messages rendered with the version's chat template (400 where it has none), then as completions."""
        return await _serve(request, handlers.parse_chat, handlers.chat_prepared, handlers.stream_chat, handlers.complete_chat)

    async def _answered(answer, engine: ServedEngine, job: handlers.Submitted) -> Response:
        try:
            body = await answer
        except ApiError as err:
            handlers.observe(job, metrics, _outcome(err))
            raise
        finally:
            job.cancel()  # a client gone mid-request frees its slots (no-op once finished)
        handlers.observe(job, metrics, "ok")
        return JSONResponse(body.model_dump(exclude_none=True), headers={VERSION_HEADER: engine.version})

    @app.post("/hooks/mlflow")
    async def mlflow_webhook(request: Request) -> Response:
        """MLflow's alias webhooks (HMAC-signed with the webhook secret): the server re-reads the alias and swaps engines."""
        try:
            secret = _webhook_secret(settings)
            event = verified_alias_event(secret, request.headers, await _body(request, settings.max_body_bytes), time.time(), settings.webhook_max_age_s)
        except WebhookRejected as err:
            metrics.webhooks.labels("rejected").inc()
            log.warning("webhook delivery refused: %s", err)  # the sender only logs a 401: say why here
            raise ApiError(401, str(err), type="authentication_error") from None
        ours = event is not None and (event.model, event.alias) == (follower.source.model_name, follower.source.alias)
        metrics.webhooks.labels("followed" if ours else "ignored").inc()
        if ours:  # re-read the alias from the registry: the payload is a hint, the registry the truth
            asyncio.get_running_loop().run_in_executor(None, lambda: follower.follow(retry_refused=True))
        return JSONResponse({"accepted": True, "followed": ours})


def _documentation(app: FastAPI, settings: ServerSettings) -> None:
    """`GET /openapi.json` and a Swagger UI at `GET /docs`, behind the API key where one is set."""
    from serving.openapi import docs_page, documented_schema, kiln_version

    schema = documented_schema(app, kiln_version())
    app.openapi = lambda: schema

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        _authorize(request, settings)
        return JSONResponse(schema)

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> Response:
        _authorize(request, settings)
        return HTMLResponse(docs_page(schema))


async def _streamed(chunks: AsyncIterator[str], job: handlers.Submitted, metrics: ServerMetrics) -> AsyncIterator[str]:
    outcome = "cancelled"
    try:
        async for chunk in chunks:
            yield chunk
        outcome = "ok"
    finally:  # also when the client disconnects: its sequences leave the batch at the next step
        job.cancel()
        handlers.observe(job, metrics, outcome)


def _webhook_secret(settings: ServerSettings) -> str:
    if settings.webhook_secret:
        return settings.webhook_secret
    path = settings.webhook_secret_file
    secret = path.read_text().strip() if path is not None and path.is_file() else ""
    if not secret:
        where = f"KILN_WEBHOOK_SECRET is unset and {path} does not exist yet (`kiln up` writes it)" if path else "it was started without one"
        raise WebhookRejected(f"this server has no webhook secret to check deliveries with: {where}")
    return secret


def _outcome(err: ApiError) -> str:
    return {401: "unauthorized", 404: "bad_request", 413: "bad_request", 503: "rejected_busy"}.get(err.status, "bad_request" if err.status < 500 else "error")


def _authorize(request: Request, settings: ServerSettings) -> None:
    if settings.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), settings.api_key.encode()):
        raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer <KILN_API_KEY>)", type="authentication_error", code="invalid_api_key")


async def _body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it passes `limit` bytes (declared or sent)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes; the limit is {limit}", code="body_too_large")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise ApiError(413, f"the request body passed the limit of {limit} bytes", code="body_too_large")
    return bytes(body)


def _error_handlers(app: FastAPI, follower: AliasFollower) -> None:
    def respond(status: int, detail: ErrorDetail, headers: dict[str, str] | None = None) -> JSONResponse:
        headers = dict(headers or {})
        if follower.current is not None:
            headers.setdefault(VERSION_HEADER, follower.current.version)
        return JSONResponse(ErrorBody(error=detail).model_dump(), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, err: ApiError) -> JSONResponse:
        return respond(err.status, ErrorDetail(message=err.message, type=err.type, param=err.param, code=err.code), err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {err.detail}"
        return respond(err.status_code, ErrorDetail(message=message, type="invalid_request_error", code=str(err.status_code)))

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, err: Exception) -> JSONResponse:  # a bug, never bad input
        log.exception("unexpected error")
        return respond(500, ErrorDetail(message=f"internal error: {type(err).__name__}", type="server_error"))


def serve(source: EngineSource, settings: ServerSettings, host: str, port: int) -> None:
    """Run the server until Ctrl-C or SIGTERM; NothingToServe when the alias names nothing
    servable at start (the lifespan found it; uvicorn would only log a traceback of it and
    exit 3, so its log is quietened and the error raised for the CLI to print in one line)."""
    import uvicorn

    check_port_free(host, port)  # before the engine loads: uvicorn binds only after the lifespan
    app = create_app(source, settings)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", log_config=_log_config(), lifespan="on", timeout_graceful_shutdown=10, access_log=False
    )  # fmt: skip
    startup_failed = lambda: getattr(app.state, "startup_error", None) is not None
    logging.getLogger("uvicorn.error").addFilter(lambda record: not startup_failed())
    try:
        uvicorn.Server(config).run()
    except SystemExit:
        if not startup_failed():
            raise
    if startup_failed():
        raise app.state.startup_error


class PortTaken(KilnError):
    """The address `kiln serve` was asked to bind is in use or not ours to bind."""


def check_port_free(host: str, port: int) -> None:
    """Bind and release the address as uvicorn will (SO_REUSEADDR, so a socket of a server
    just stopped in TIME_WAIT does not count as taken); PortTaken naming it otherwise."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise PortTaken(f"cannot serve on {host}:{port}: {err.strerror or err} (another server there? choose one with --port)") from None


def _log_config() -> dict:
    """uvicorn's logging, with kiln's serving log on the same handler: which version is
    served, each swap and each refusal reach the terminal (unconfigured, INFO is dropped)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["kiln"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config
