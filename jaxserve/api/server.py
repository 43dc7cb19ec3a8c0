"""Runs the app under Hypercorn, drains gracefully, and exits with a code a supervisor can act on.

Shutdown (SIGTERM or SIGINT), the behaviour load balancers handle best: the listening socket stays open
while the server drains, /health and /ping turn 503 at once (health checks take the replica out of
rotation) and new API requests get a 503 with `Connection: close` (a retryable answer, where a refused
connection would look like a crash). In-flight requests, streams included, finish for up to
--shutdown-timeout seconds; those still running then end cleanly (a stream with an error event and
`[DONE]`, a plain request with a 503). Then the socket closes and the process exits 0.

If the engine dies (a fault of the device or runtime, not of one request's data), the server drains the
same way and exits 1, so a supervisor restarts it rather than leaving a replica that answers 503 forever.
A model that fails to load exits 1 too.
"""

import asyncio
import errno
import logging
import os
import signal
import ssl

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

from jaxserve.api.app import create_app
from jaxserve.api.serving import ServerState
from jaxserve.config import EngineConfig, ServerConfig
from jaxserve.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

_CUT_GRACE_S = 5.0  # after the deadline, time for handlers to send their error endings
_ENGINE_POLL_S = 0.5


def bind(config: ServerConfig) -> tuple[HypercornConfig, int]:
    """Hypercorn's configuration, its sockets already bound and its TLS files already read, and the port
    they are bound to (the one the system chose for --port 0).

    Called before the model is looked for: a port in use, a host that is not this machine's or a
    certificate that cannot be read fails the start at once, in one line, not after minutes of loading
    (as `vllm serve` binds its socket before its engine starts). Connections are refused until the
    server listens, once the app has started.
    """
    hc = _hypercorn_config(config)
    for flag, path in (("--ssl-certfile", config.ssl_certfile), ("--ssl-keyfile", config.ssl_keyfile)):
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"{flag} {path!r} is not a file")
    try:
        if hc.ssl_enabled:
            hc.create_ssl_context()
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"--ssl-certfile/--ssl-keyfile cannot be used: {e}") from e
    try:
        sockets = hc.create_sockets()
    except OSError as e:
        reason = "it is in use (another server?)" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise RuntimeError(f"cannot listen on {hc.bind[0]}: {reason}") from e
    # Hypercorn takes the bound sockets by their descriptors; detach() hands each over, so nothing here
    # closes a descriptor that Hypercorn's own socket owns.
    bound = sockets.secure_sockets or sockets.insecure_sockets
    port = bound[0].getsockname()[1]
    hc.bind = [f"fd://{sock.detach()}" for sock in bound]
    return hc, port


def _hypercorn_config(config: ServerConfig) -> HypercornConfig:
    hc = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    hc.graceful_timeout = _CUT_GRACE_S  # our own drain has already waited for in-flight requests
    hc.root_path = config.root_path
    level = logging.getLevelName(config.server_log_level.upper()) if config.server_log_level != "trace" else 5
    for name in ("hypercorn.error", "hypercorn.access"):
        logging.getLogger(name).setLevel(level)
    hc.errorlog = logging.getLogger("hypercorn.error")
    # One line per request, as uvicorn's access log that vLLM users read: client, request line, status.
    hc.accesslog = logging.getLogger("hypercorn.access") if config.access_log else None
    hc.access_log_format = '%(h)s - "%(m)s %(Uq)s HTTP/%(H)s" %(s)s %(st)s %(L)ss'
    if config.ssl_certfile:
        hc.certfile, hc.keyfile = config.ssl_certfile, config.ssl_keyfile
    return hc


def run_server(engine_config: EngineConfig, server_config: ServerConfig, hypercorn: HypercornConfig) -> int:
    """Serves on `hypercorn` (from `bind`) until a signal or an engine failure; returns the exit code."""
    return asyncio.run(_serve(engine_config, server_config, hypercorn))


async def drain(state: ServerState, timeout: float) -> None:
    """Refuses new requests, waits up to `timeout` for in-flight ones, then ends the rest cleanly."""
    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while state.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.num_in_flight and state.serving is not None:
        logger.warning("shutdown timeout: ending %d in-flight requests", state.num_in_flight)
        state.serving.engine.fail_all("the server is shutting down")
        deadline = loop.time() + _CUT_GRACE_S
        while state.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)


async def _serve(engine_config: EngineConfig, server_config: ServerConfig, hypercorn: HypercornConfig) -> int:
    from jaxserve.engine.llm_engine import LLMEngine  # imports jax; keep `jaxserve --help` fast

    stop = asyncio.Event()
    exit_code = 0
    draining: asyncio.Task | None = None

    def load() -> AsyncEngine:
        return AsyncEngine(LLMEngine(engine_config))

    def on_load_error(error: BaseException) -> None:
        nonlocal exit_code
        exit_code = 1
        stop.set()

    app = create_app(server_config, load, on_load_error)
    state: ServerState = app.state.server

    def shut_down() -> None:
        nonlocal draining
        if draining is None:
            draining = asyncio.create_task(drain(state, server_config.shutdown_timeout))
            draining.add_done_callback(lambda _: stop.set())

    def on_signal(signum: int) -> None:
        if draining is not None:
            logger.info("%s: already draining", signal.Signals(signum).name)
            return
        logger.info("%s: draining in-flight requests (up to %.0fs); new requests get 503",
                    signal.Signals(signum).name, server_config.shutdown_timeout)
        shut_down()

    async def watch_engine() -> None:
        nonlocal exit_code
        while state.serving is None or state.serving.engine.is_running:
            await asyncio.sleep(_ENGINE_POLL_S)
        if draining is None:
            logger.error("the engine stopped after a runtime fault; draining and exiting with code 1")
            exit_code = 1
            shut_down()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    watcher = asyncio.create_task(watch_engine())
    try:
        await hypercorn_serve(app, hypercorn, shutdown_trigger=stop.wait)
    finally:
        watcher.cancel()
    logger.info("server stopped")
    return exit_code
