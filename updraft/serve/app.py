"""The FastAPI application: routes, API-key check, body-size limit, lifespan.

The routes never touch a file named by a client: the model, its tokenizer and its chat
template are read once at start-up from the directory the operator gave.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from updraft.chat_template import ChatTemplate
from updraft.serve.chat.protocol import ChatCompletionRequest
from updraft.serve.chat.serving import ChatServing
from updraft.serve.completions.protocol import CompletionRequest
from updraft.serve.completions.serving import CompletionServing
from updraft.serve.engine_client import CoreLink, EngineClient
from updraft.serve.engine_core import EngineInfo
from updraft.serve.errors import error_body, install_error_handlers
from updraft.serve.metrics import CONTENT_TYPE, ServerMetrics
from updraft.serve.models.protocol import ModelCard, ModelList
from updraft.serve.models.serving import ModelsServing
from updraft.serve.serving import ServingBase
from updraft.serve.settings import ServeSettings
from updraft.tokenizer import Tokenizer

T = TypeVar("T")


@dataclass(frozen=True)
class ServedFiles:
    """What the app reads from the checkpoint directory, once: an API process reads it
    while the engine process is still loading the model."""

    tokenizer: Tokenizer | None
    chat_template: ChatTemplate

    @classmethod
    def read(cls, model: str) -> ServedFiles:
        return cls(Tokenizer.from_dir(model), ChatTemplate.from_dir(model))


def build_app(
    link: CoreLink, info: EngineInfo, settings: ServeSettings, files: ServedFiles | None = None
) -> FastAPI:
    """The app in front of the engine core ``link`` reaches, over ``files`` (read from
    ``info.model`` when not given). Routes are module-level functions that find the
    client through ``request.app.state``, and the lifespan drops it there at shutdown:
    FastAPI keeps route callables in module-wide caches, and a closure over the client
    would outlive the server."""
    files = files or ServedFiles.read(info.model)
    metrics = ServerMetrics(settings.model_name)
    engine = EngineClient(link, files.tokenizer, metrics, info.eos_token_ids)
    app = FastAPI(title="updraft", version="0.1.0", lifespan=_lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.engine = engine
    # One handler per endpoint, over the pieces they share (intake, threads, compiler).
    base = ServingBase(engine, info, settings, files.chat_template)
    app.state.serving = base
    app.state.completions = CompletionServing(base)
    app.state.chat = ChatServing(base)
    app.state.models = ModelsServing(settings.model_name, info.max_model_len)
    install_error_handlers(app, metrics.rejected)
    # Middleware added last runs first: the key is checked before the body is read.
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_request_bytes,
        on_refusal=lambda: metrics.rejected(413),
    )
    if settings.api_key is not None:
        app.add_middleware(
            RequireAPIKey, api_key=settings.api_key, on_refusal=lambda: metrics.rejected(401)
        )
    app.include_router(v1)
    app.include_router(probes)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = app.state
    state.engine.start()
    try:
        yield
    finally:
        # uvicorn has already waited for open responses; this bounds what is left.
        await state.engine.shutdown(state.settings.drain_timeout)
        state.serving.close()
        del state.serving, state.completions, state.chat, state.engine


v1 = APIRouter(prefix="/v1")
probes = APIRouter()


@v1.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _until_disconnect(request, request.app.state.completions.create(body))


@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _until_disconnect(request, request.app.state.chat.create(body))


@v1.get("/models")
async def models(request: Request) -> ModelList:
    return request.app.state.models.list()


@v1.get("/models/{model_id:path}")
async def model(model_id: str, request: Request) -> ModelCard:
    return request.app.state.models.get(model_id)


@probes.get("/health")
async def health(request: Request) -> Response:
    engine = getattr(request.app.state, "engine", None)
    if engine is None or not engine.is_alive:
        return JSONResponse(error_body(503, "the engine loop has stopped"), status_code=503)
    if not engine.accepting:
        return JSONResponse(error_body(503, "the server is shutting down"), status_code=503)
    return Response(status_code=200)


@probes.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE)


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
    """Run a handler, cancelling it if the client goes away first, so that a request
    whose client has left is aborted (and its KV blocks freed) even before its first
    output or, without streaming, before its last."""
    work_task = asyncio.ensure_future(work)
    disconnect_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        raise
    finally:
        disconnect_task.cancel()
    if work_task.done():
        return work_task.result()
    work_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work_task
    return Response(status_code=499)  # nobody reads it: the client is gone


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# Probes stay open with an API key: liveness, and Prometheus counters that name nothing
# but the served model.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class RequireAPIKey:
    """401 for every path but ``OPEN_PATHS`` (the API, its docs and its OpenAPI schema
    included) without ``Authorization: Bearer <key>``, before the body is read."""

    def __init__(self, app: ASGIApp, api_key: str, on_refusal: Callable[[], None]) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        authorization = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key):
            await self.app(scope, receive, send)
            return
        self.on_refusal()
        message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
        response = JSONResponse(
            error_body(401, message, code="invalid_api_key"),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


class BodySizeLimit:
    """413 for a body over ``max_bytes``. The body is read here in full (it is small by
    construction) and replayed to the app, so the limit holds for chunked bodies too."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refusal: Callable[[], None]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        body = bytearray()
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            body += message.get("body", b"")
            more_body = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for a disconnect
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.on_refusal()
        message = f"request body is larger than this server's limit of {self.max_bytes} bytes"
        response = JSONResponse(error_body(413, message), status_code=413)
        await response(scope, receive, send)
