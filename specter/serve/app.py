"""The HTTP routes (/health, /v1/models, /v1/completions, /v1/chat/completions) over a model that loads in the
background."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from specter.errors import first_line
from specter.serve.engines import ServedModel
from specter.serve.events import DONE, EventStream, event
from specter.serve.protocol import ApiError, chunk_body, loading_error, parse_request, response_body, usage_chunk
from specter.serve.scheduler import Job, Scheduler

POLL_S = 0.1  # how often a waiting non-streaming request checks that its client is still there
CLIENT_CLOSED = 499  # the status logged (never seen by anyone) for a request whose client went away


class ServerState:
    """What the routes read: the served model and its scheduler once `loader` has returned (a 503 until then), or
    the error that stopped the load."""

    def __init__(self, loader: Callable[[], ServedModel], scheduler_options: dict,
                 on_load_error: Callable[[BaseException], None] | None, log: logging.Logger) -> None:
        self.loader, self.scheduler_options = loader, scheduler_options
        self.on_load_error, self.log = on_load_error, log
        self.loaded: tuple[ServedModel, Scheduler] | None = None
        self.error: BaseException | None = None
        self.created = int(time.time())
        self.closed = False

    def load(self) -> None:
        """Runs on its own thread at start-up."""
        started = time.perf_counter()
        try:
            served = self.loader()
            scheduler = Scheduler(served, log=self.log, **self.scheduler_options).start()
        except BaseException as exc:  # noqa: BLE001 - reported as one line, the process decides what follows
            self.error = exc
            self.log.error("loading the model failed: %s", first_line(exc) or type(exc).__name__)
            if self.on_load_error is not None:
                self.on_load_error(exc)
            return
        if self.closed:
            scheduler.stop()
            return
        self.loaded = (served, scheduler)
        self.log.info("%s is ready (loaded in %.1f s)", served.name, time.perf_counter() - started)

    def ready(self) -> tuple[ServedModel, Scheduler]:
        if self.loaded is not None:
            return self.loaded
        if self.error is not None:
            raise ApiError(503, f"the model failed to load: {first_line(self.error)}", code="model_load_failed",
                           kind="server_error")
        raise loading_error()

    def close(self) -> None:
        self.closed = True
        if self.loaded is not None:
            self.loaded[1].stop()


def create_app(loader: Callable[[], ServedModel], *, max_batch: int = 16,
               on_load_error: Callable[[BaseException], None] | None = None,
               log: logging.Logger | None = None) -> FastAPI:
    """The server's ASGI app. `loader` runs on a thread when the app starts (its lifespan) and returns the served
    model; until then every route answers 503. `on_load_error(exc)` is called if it fails."""
    log = log or logging.getLogger("specter.serve")
    state = ServerState(loader, {"max_batch": max_batch}, on_load_error, log)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, name="specter-load", daemon=True).start()
        try:
            yield
        finally:
            state.close()

    app = FastAPI(title="Specter", lifespan=lifespan)
    app.state.specter = state

    def failure(request: Request, error: ApiError) -> JSONResponse:
        log.warning("%s %s %d %s: %s", request.method, request.url.path, error.status, error.kind, error.message)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return failure(request, ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                         kind=kind))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return failure(request, exc)

    @app.get("/health")
    async def health(request: Request) -> Response:
        served, scheduler = state.ready()
        return JSONResponse({"status": "ok", "model": served.name, **scheduler.stats()})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        served, _ = state.ready()
        return JSONResponse({"object": "list", "data": [model_card(served, state.created)]})

    @app.get("/v1/models/{name:path}")
    async def model(request: Request, name: str) -> Response:
        served, _ = state.ready()
        if not served.knows(name):
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {served.name!r}",
                           param="model", code="model_not_found")
        return JSONResponse(model_card(served, state.created))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    async def complete(request: Request, chat: bool) -> Response:
        started = time.perf_counter()
        served, scheduler = state.ready()
        parsed = parse_request(await json_body(request), served, chat)
        events: asyncio.Queue = asyncio.Queue()
        job = Job(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], parsed,
                  threadsafe_put(asyncio.get_running_loop(), events))
        scheduler.submit(job)
        where = f"{request.method} {request.url.path}"
        if parsed.stream:
            return EventStream(stream(where, job, events, started), on_close=job.cancel)
        return await answer(request, where, job, events, started)

    async def answer(request: Request, where: str, job: Job, events: asyncio.Queue, started: float) -> Response:
        """A non-streaming request's response once its job is done; cancelled when its client goes away."""
        created, getter = int(time.time()), asyncio.ensure_future(events.get())
        try:
            while not (await asyncio.wait({getter}, timeout=POLL_S))[0]:
                if await request.is_disconnected():
                    log.info("%s %s: cancelled, the client went away", where, job.id)
                    return Response(status_code=CLIENT_CLOSED)
            kind, payload = getter.result()
        finally:
            if not getter.done():
                getter.cancel()
                job.cancel()
        if kind == "error":
            return failure(request, payload)
        log.info("%s 200: %s", where, outcome_line(payload, started))
        return JSONResponse(response_body(job.request, job.id, created, payload.text, payload.finish_reason,
                                          payload.completion_tokens))

    async def stream(where: str, job: Job, events: asyncio.Queue, started: float):
        """The SSE events of a streaming request: its pieces as they commit, the finish reason, [DONE]."""
        request, created, ended = job.request, int(time.time()), False
        try:
            if request.chat:
                yield event(chunk_body(request, job.id, created, role=True))
            while True:
                kind, payload = await events.get()
                if kind == "piece":
                    yield event(chunk_body(request, job.id, created, text=payload))
                    continue
                ended = True
                if kind == "error":
                    log.warning("%s %d %s: %s", where, payload.status, payload.kind, payload.message)
                    yield event(payload.body())
                else:
                    log.info("%s 200 (stream): %s", where, outcome_line(payload, started))
                    yield event(chunk_body(request, job.id, created, finish_reason=payload.finish_reason))
                    if request.include_usage:
                        yield event(usage_chunk(request, job.id, created, payload.completion_tokens))
                yield DONE
                return
        finally:
            if not ended:
                job.cancel()
                log.info("%s %s: cancelled, the client went away", where, job.id)

    return app


async def json_body(request: Request):
    try:
        return await request.json()
    except ValueError as err:
        raise ApiError(400, f"the request body is not valid JSON: {first_line(err)}") from None


def threadsafe_put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[str, object], None]:
    """`emit(kind, payload)` for the worker thread: puts (kind, payload) on `queue` in the event loop's thread."""

    def emit(kind: str, payload: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, payload))
        except RuntimeError:
            pass  # the event loop has closed: nobody waits for this request any more

    return emit


def model_card(served: ServedModel, created: int) -> dict:
    return {"id": served.name, "object": "model", "created": created, "owned_by": "specter",
            "max_model_len": served.max_positions}


def outcome_line(outcome, started: float) -> str:
    return (f"{outcome.completion_tokens} tokens ({outcome.finish_reason}) in "
            f"{(time.perf_counter() - started) * 1000:.0f} ms")
