"""Experiment (serving issue): kiln serve's scheduler in a process of its own, HTTP in another.

In kiln serve the engine thread shares the GIL with the HTTP side. This prototype keeps
kiln's `Scheduler`, `Sequence` and `TextStream` as they are but runs them in a child process
(as vLLM v1 runs its EngineCore); the parent is a minimal FastAPI app whose streaming
`/v1/completions` speaks the same SSE as kiln serve (token-id prompts only, greedy,
`ignore_eos`), fed through a pipe that carries one message per scheduler turn. It answers
one question — does the continuous-batching ratio move when the two halves stop sharing a
GIL — and is not a server to ship (no auth, swaps, metrics or input checks).

    .venv/bin/python benchmarks/serving_split.py ENGINE_DIR [--max-batch 1] [--port 8124]

then drive it with `flows.bench_serving`'s clients (see `serving_split_ab` below).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import threading
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def engine_process(conn, engine_dir: str, threads: int, max_batch: int | None) -> None:
    """The child: kiln's scheduler over the engine; events leave in one message per turn."""
    from components.runtime import load_engine
    from components.runtime.sampling import Sampling
    from components.runtime.tokenizer import EngineTokenizer
    from serving.scheduler import Delta, Finished, Scheduler, Sequence
    from serving.text import TextStream

    tokenizer = EngineTokenizer(Path(engine_dir))
    outbox: list[tuple] = []
    lock = threading.Lock()

    def flush(running: int, waiting: int, decoded: int) -> None:  # after every turn
        with lock:
            if not outbox:
                return
            batch = outbox[:]
            outbox.clear()
        conn.send(batch)

    scheduler = Scheduler(load_engine(Path(engine_dir), threads=threads), max_waiting=256, max_batch=max_batch, observe=flush)

    def emit_for(rid: int):
        def emit(event) -> None:  # (rid, text) for a delta; (rid, None, reason, prompt, completion) at the end
            if isinstance(event, Delta):
                item = (rid, event.text)
            elif isinstance(event, Finished):
                item = (rid, None, event.reason, event.prompt_tokens, event.completion_tokens)
            else:
                item = (rid, None, "error", 0, 0)
            with lock:
                outbox.append(item)

        return emit

    conn.send("ready")
    while True:
        message = conn.recv()
        if message is None:
            break
        rid, prompt, max_tokens = message
        sampling = Sampling(max_new_tokens=max_tokens, stop_at_eos=False)
        scheduler.submit([Sequence(prompt, sampling, TextStream(tokenizer.stream_decoder()), emit_for(rid))])
    scheduler.close(timeout=10)


def create_app(engine_dir: Path, threads: int, max_batch: int | None):
    import contextlib

    ids = itertools.count()
    queues: dict[int, asyncio.Queue] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        parent, child = mp.get_context("spawn").Pipe()
        process = mp.get_context("spawn").Process(target=engine_process, args=(child, str(engine_dir), threads, max_batch), daemon=True)
        process.start()
        assert await asyncio.to_thread(parent.recv) == "ready"
        app.state.conn = parent

        def dispatch(batch: list[tuple]) -> None:
            for item in batch:
                queue = queues.get(item[0])
                if queue is not None:
                    queue.put_nowait(item)

        def read() -> None:
            while True:
                try:
                    batch = parent.recv()
                except EOFError:
                    return
                loop.call_soon_threadsafe(dispatch, batch)

        threading.Thread(target=read, daemon=True).start()
        yield
        parent.send(None)
        process.join(10)

    app = FastAPI(lifespan=lifespan)

    @app.get("/readyz")
    async def readyz() -> dict:
        return {"ready": True}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"id": engine_dir.name}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = json.loads(await request.body())
        rid = next(ids)
        queue = queues[rid] = asyncio.Queue()
        request.app.state.conn.send((rid, body["prompt"], body["max_tokens"]))
        head = {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": body["model"]}

        async def events():
            try:
                while True:
                    item = await queue.get()
                    ready = [item]
                    while not queue.empty():
                        ready.append(queue.get_nowait())
                    chunks, last = [], False
                    for event in ready:
                        if event[1] is not None:
                            if event[1]:
                                chunks.append(head | {"choices": [{"index": 0, "text": event[1], "logprobs": None, "finish_reason": None}]})
                        else:
                            usage = {"prompt_tokens": event[3], "completion_tokens": event[4], "total_tokens": event[3] + event[4]}
                            chunks.append(head | {"choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": event[2]}], "usage": usage})
                            last = True
                    text = "".join(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n" for chunk in chunks)
                    if last:
                        yield text + "data: [DONE]\n\n"
                        return
                    if text:
                        yield text
            finally:
                queues.pop(rid, None)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("engine", type=Path)
    parser.add_argument("--max-batch", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--port", type=int, default=8124)
    args = parser.parse_args()
    app = create_app(args.engine.resolve(), args.threads, args.max_batch)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
