"""create_app: the Starlette application around an AsyncEngine, with no module-level state.

Given a loader instead of an engine, the app starts answering at once (/health says 503) and loads
the model on a worker thread, so orchestrators can tell "loading" from "down".
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jaxserve.api import chat, classify, completions, embeddings, invocations, lora, misc, profile, responses, scores
from jaxserve.api.errors import APIError, error_response
from jaxserve.api.middleware import (
    APIKeyMiddleware,
    ErrorMiddleware,
    InFlightMiddleware,
    LongListsMiddleware,
    RequestIdMiddleware,
)
from jaxserve.api.openapi import openapi_routes
from jaxserve.api.scores import RERANK_PATHS, SCORE_PATHS
from jaxserve.api.serving import ModelServing, ServerState
from jaxserve.collector import freeze_start_up_heap
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, exc.param, exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, exc.detail, headers=exc.headers)


def _internal_error() -> Response:
    return error_response(500, "internal server error")


def create_app(
    config: ServerConfig,
    engine: AsyncEngine | Callable[[], AsyncEngine],
    on_load_error: Callable[[BaseException], None] | None = None,
) -> Starlette:
    """An app serving `engine`, or the engine that calling `engine()` loads (which the app then owns
    and shuts down on exit)."""
    state = ServerState(config)

    async def load(loader: Callable[[], AsyncEngine]) -> None:
        try:
            async_engine = await asyncio.to_thread(loader)
            state.serving = await asyncio.to_thread(ModelServing.create, async_engine, config)
        except Exception as e:
            if isinstance(e, ValueError | FileNotFoundError):  # what the model or a flag cannot be: one line
                logger.error("loading the model failed: %s", e)
            else:
                logger.exception("loading the model failed")
            state.load_error = e
            if on_load_error is not None:
                on_load_error(e)
            return
        await asyncio.to_thread(freeze_start_up_heap)
        host = "0.0.0.0" if config.host in ("", "::") else config.host
        logger.info("ready: serving %s at http://%s:%d%s/v1", state.serving.model_names[0], host,
                    config.port, config.root_path)

    async def log_stats() -> None:
        while state.serving is None:
            await asyncio.sleep(1.0)
        await state.serving.metrics.log_periodically(logger)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loading = None
        if isinstance(engine, AsyncEngine):
            state.serving = ModelServing.create(engine, config)
        else:
            logger.info("loading the model; /health answers 503 until it is ready")
            loading = asyncio.create_task(load(engine))
        stats_logger = None if config.disable_log_stats else asyncio.create_task(log_stats())
        yield
        state.draining = True
        if stats_logger is not None:
            stats_logger.cancel()
        if state.serving is not None:  # their engine requests abort while the engine and this loop run
            await state.serving.responses.cancel_all()
        if loading is not None:
            await loading  # a load cannot be interrupted; let it finish so its engine is shut down
            if state.serving is not None:
                await asyncio.to_thread(state.serving.engine.shutdown)
        if state.serving is not None:
            state.serving.close()

    routes = [
        *openapi_routes(config),
        Route("/v1/completions", completions.create_completion, methods=["POST"]),
        Route("/v1/chat/completions", chat.create_chat_completion, methods=["POST"]),
        Route("/v1/embeddings", embeddings.create_embedding, methods=["POST"]),
        Route("/classify", classify.create_classification, methods=["POST"]),
        # vLLM's scoring endpoints, each also at its unversioned path (and rerank at Cohere's v2 one)
        *(Route(path, scores.create_score, methods=["POST"]) for path in SCORE_PATHS),
        *(Route(path, scores.create_rerank, methods=["POST"]) for path in RERANK_PATHS),
        Route("/v1/responses", responses.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel_response, methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", responses.list_input_items, methods=["GET"]),
        Route("/invocations", invocations.invoke, methods=["POST"]),
        Route("/v1/models", misc.list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", misc.retrieve_model, methods=["GET"]),
        Route("/health", misc.health, methods=["GET"]),
        Route("/ping", misc.health, methods=["GET", "POST"]),
        Route("/load", misc.load, methods=["GET"]),
        Route("/version", misc.version, methods=["GET"]),
        Route("/metrics", misc.metrics, methods=["GET"]),
        Route("/tokenize", misc.tokenize, methods=["POST"]),
        Route("/detokenize", misc.detokenize, methods=["POST"]),
        *([Route("/v1/load_lora_adapter", lora.load_lora_adapter, methods=["POST"]),
           Route("/v1/unload_lora_adapter", lora.unload_lora_adapter, methods=["POST"])]
          if config.allow_runtime_lora_updating else []),
        *([Route("/start_profile", profile.start_profile, methods=["POST"]),
           Route("/stop_profile", profile.stop_profile, methods=["POST"])] if config.profiler_dir is not None else []),
    ]
    middleware = [
        Middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                   allow_credentials=config.allow_credentials, allow_methods=list(config.allowed_methods),
                   allow_headers=list(config.allowed_headers)),
        Middleware(RequestIdMiddleware, generate=config.enable_request_id_headers),
        Middleware(InFlightMiddleware, counter=state),
        Middleware(LongListsMiddleware),
        Middleware(ErrorMiddleware, response=_internal_error),
    ]
    if config.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=config.api_key))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
        },
        lifespan=lifespan,
    )
    app.state.server = state
    return app
