"""The response that carries a completion's server-sent events.

Starlette's StreamingResponse watches for the client leaving through an anyio task group
per response whenever the server speaks ASGI below 2.4, which uvicorn does (2.3): a task,
a cancel scope and its cancellation retries for every request. Under 16 streaming
clients on two cores that machinery was a visible share of the HTTP side's CPU, which is
what bounds the batch the engine gets (docs: the serving issue's notes). Here one plain
asyncio task waits for `http.disconnect` and cancels the stream, whose generator's
`finally` then takes the sequences out of the batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


# OpenAI's streams end with this event. Each ASGI send is a socket write (~90 us on loopback
# here, the HTTP side's largest cost): the piece that ends with it also ends the body,
# instead of an empty write of its own after it.
LAST_EVENT = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], headers: Mapping[str, str] | None = None) -> None:
        super().__init__(events, headers=headers)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None  # an ASGI app always runs in a task
        state = {"done": False, "left": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not state["done"]:  # gone before the last chunk: stop streaming to nobody
                state["left"] = True
                streaming.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await self.stream_response(send)
            state["done"] = True
        except asyncio.CancelledError:
            if not state["left"]:  # the server is shutting down, not the client leaving
                raise
            streaming.uncancel()
        finally:
            watcher.cancel()
            # Cancelled while awaiting `send`, the body's generator is left suspended and its
            # `finally` (which takes the sequences out of the batch) would wait for the GC.
            await self._events.aclose()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for piece in self.body_iterator:
            ended = piece.endswith(LAST_EVENT)
            await send({"type": "http.response.body", "body": piece.encode(self.charset), "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
