"""Runs the app under Hypercorn with a graceful drain.

SIGTERM or SIGINT: /health turns 503 and new API requests get a 503, Hypercorn closes the listening
sockets and waits up to --shutdown-timeout for in-flight requests (streams included) to finish, then
the lifespan shuts the engine down and the process exits 0. A model that fails to load exits 1.
"""

import asyncio
import logging
import signal

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

from jaxserve.api.app import create_app
from jaxserve.config import EngineConfig, ServerConfig
from jaxserve.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


def hypercorn_config(config: ServerConfig) -> HypercornConfig:
    hc = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    hc.graceful_timeout = config.shutdown_timeout
    hc.root_path = config.root_path
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    if config.ssl_certfile:
        hc.certfile, hc.keyfile = config.ssl_certfile, config.ssl_keyfile
    return hc


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serves until a signal; returns the process exit code."""
    return asyncio.run(_serve(engine_config, server_config))


async def _serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    from jaxserve.engine.llm_engine import LLMEngine  # imports jax; keep `jaxserve --help` fast

    stop = asyncio.Event()
    exit_code = 0

    def load() -> AsyncEngine:
        return AsyncEngine(LLMEngine(engine_config))

    def on_load_error(error: BaseException) -> None:
        nonlocal exit_code
        exit_code = 1
        stop.set()

    app = create_app(server_config, load, on_load_error)

    def on_signal(signum: int) -> None:
        logger.info("%s: draining in-flight requests (up to %.0fs)", signal.Signals(signum).name,
                    server_config.shutdown_timeout)
        app.state.server.draining = True
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await hypercorn_serve(app, hypercorn_config(server_config), shutdown_trigger=stop.wait)
    logger.info("server stopped")
    return exit_code
