"""A small HTTP receiver for MLflow's registry webhooks, for processes that serve no model
(`kiln deploy`): it checks each delivery (serving.webhooks) and hands genuine alias events
to a callback; the caller decides what they start.

Answers: 200 `{"accepted": true, "handled": bool}`, 401 naming what was wrong with an
unsigned, badly signed or stale delivery, 413 for an oversized body.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from serving.webhooks import AliasEvent, WebhookRejected, verified_alias_event

MAX_BODY_BYTES = 64 * 1024  # an alias event is a few hundred bytes


def alias_hook_app(secret: str, max_age_s: float, on_event: Callable[[AliasEvent], bool]) -> FastAPI:
    """`on_event` returns whether the event was acted on; it runs on a worker thread and
    should only hand the event on."""
    app = FastAPI(title="kiln registry webhooks", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/hooks/mlflow")
    async def mlflow_webhook(request: Request) -> JSONResponse:
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return _error(413, f"the body has {len(body)} bytes, more than {MAX_BODY_BYTES}")
        try:
            event = verified_alias_event(secret, request.headers, body, time.time(), max_age_s)
        except WebhookRejected as err:
            return _error(401, str(err))
        handled = event is not None and await asyncio.to_thread(on_event, event)
        return JSONResponse({"accepted": True, "handled": handled})

    return app


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "authentication_error" if status == 401 else "invalid_request_error"}}, status_code=status)


class ReceiverThread:
    """The receiver on its own thread (uvicorn), for a process whose main thread is busy."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self.url = f"http://{host}:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, name="kiln-hook-receiver", daemon=True)

    def start(self, timeout_s: float = 30) -> ReceiverThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the webhook receiver could not listen on {self.url} (is the port taken? triggers.webhook_port)")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
