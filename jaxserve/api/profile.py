"""POST /start_profile and /stop_profile: vLLM's profiling routes, served only when the server has a
profiler folder (`ServerConfig.profiler_dir`). Between them the engine records a `jax.profiler` trace (the
steps' host work and device ops, for XProf / TensorBoard and Perfetto); stopping waits for the device to
run what was launched, then writes the trace. The engine starts and stops it between steps."""

from collections.abc import Awaitable

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.api.errors import APIError
from jaxserve.api.serving import get_serving
from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.engine.core_process import CoreProcessDied
from jaxserve.engine.llm_engine import ProfilerState


async def start_profile(request: Request) -> Response:
    serving = get_serving(request)
    await _profiler_call(serving.engine.start_profile(serving.config.profiler_dir))
    return Response(status_code=200)


async def stop_profile(request: Request) -> Response:
    serving = get_serving(request)
    await _profiler_call(serving.engine.stop_profile())
    return Response(status_code=200)


async def _profiler_call(call: Awaitable[object]) -> None:
    """The engine's answer as the client's: a start or stop out of turn is a 400, an engine that is not
    running a 503, and a profiler that fails (a folder it cannot write, jax's own refusal, a core that does
    not answer) a 500 saying why."""
    try:
        await call
    except ProfilerState as error:
        raise APIError(400, str(error)) from None
    except (EngineDeadError, CoreProcessDied) as error:
        raise APIError(503, f"the engine is not running: {error}") from None
    except OSError as error:
        where = f"the profiler folder {error.filename}" if error.filename else "the profiler"
        raise APIError(500, f"{where}: {error.strerror or error}") from None
    except Exception as error:
        raise APIError(500, f"the profiler failed: {error}") from None
