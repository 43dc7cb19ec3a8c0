"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime LoRA updates, served only when the
server allows them (`ServerConfig.allow_runtime_lora_updating`), with vLLM's bodies and answers. An adapter
is read on a worker thread (the engine keeps stepping) and served from the next request that names it;
one unloaded takes no new request, and those already started finish with it."""

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from jaxserve.api.errors import APIError
from jaxserve.api.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from jaxserve.api.serving import get_serving
from jaxserve.config import LoraModule
from jaxserve.engine.llm_engine import AdapterExists
from jaxserve.models.peft import is_local_directory


async def load_lora_adapter(request: Request) -> Response:
    serving = get_serving(request)
    req = await serving.parse(request, LoadLoraAdapterRequest)
    if serving.info.lora_layout is None:
        raise APIError(400, "LoRA adapters are not enabled: start the server with --enable-lora", "lora_name")
    if not req.lora_name or req.lora_name in serving.model_names:
        raise APIError(400, f"lora_name {req.lora_name!r} must be a new, non-empty model name", "lora_name")
    if not is_local_directory(req.lora_path):  # a runtime load reads the server's disk, never the network
        raise APIError(400, f"lora_path {req.lora_path!r} is not a directory on the server", "lora_path")
    if serving.engine.has_adapter(req.lora_name) and not req.load_inplace:
        raise APIError(400, f"The lora adapter '{req.lora_name}' has already been loaded.", "lora_name")
    try:  # read first: a bad adapter leaves the one served under the name in place
        await serving.engine.load_lora(LoraModule(req.lora_name, req.lora_path), replace=req.load_inplace)
    except AdapterExists as error:  # loaded meanwhile by another request
        raise APIError(400, str(error), "lora_name") from None
    except ValueError as error:
        raise APIError(400, str(error), "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    serving = get_serving(request)
    req = await serving.parse(request, UnloadLoraAdapterRequest)
    try:
        await serving.engine.remove_lora(req.lora_name)
    except KeyError:
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
