"""POST /start_profile and /stop_profile: vLLM's profiling routes, served only when the server has a
profiler folder (`ServerConfig.profiler_dir`). Between them the engine records a `jax.profiler` trace (the
steps' host work and device ops, for XProf / TensorBoard and Perfetto); stopping waits for the device to
run what was launched, then writes the trace. The engine starts and stops it between steps."""

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.api.errors import APIError
from jaxserve.api.serving import get_serving
from jaxserve.engine.llm_engine import ProfilerState


async def start_profile(request: Request) -> Response:
    serving = get_serving(request)
    try:
        await serving.engine.start_profile(serving.config.profiler_dir)
    except ProfilerState as error:
        raise APIError(400, str(error)) from None
    return Response(status_code=200)


async def stop_profile(request: Request) -> Response:
    serving = get_serving(request)
    try:
        await serving.engine.stop_profile()
    except ProfilerState as error:
        raise APIError(400, str(error)) from None
    return Response(status_code=200)
