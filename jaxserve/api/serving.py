"""What every endpoint shares: the loaded model's serving state, sampling-parameter conversion with
OpenAI's length checks, stream merging, and cancelling work when the client goes away.

Everything here runs on the event loop; the engine runs on its own thread (see AsyncEngine).
"""

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from starlette.requests import Request

from jaxserve.api.errors import APIError, error_body
from jaxserve.api.metrics import ServerMetrics
from jaxserve.api.protocol import SamplingFields
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

T = TypeVar("T")

# Fields of a model's generation_config.json that become default sampling parameters (vLLM's rule).
_GENERATION_DEFAULTS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}


def load_generation_defaults(setting: str, model_dir: Path | None) -> dict[str, Any]:
    """Default sampling parameters: "vllm" none, "auto" the model's generation_config.json, or a folder's."""
    if setting == "vllm":
        return {}
    directory = model_dir if setting == "auto" else Path(setting)
    if directory is None or not (directory / "generation_config.json").is_file():
        if setting != "auto":
            raise FileNotFoundError(f"--generation-config: no generation_config.json in {directory}")
        return {}
    raw = json.loads((directory / "generation_config.json").read_text())
    return {ours: raw[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if raw.get(theirs) is not None}


def load_chat_template(setting: str | None) -> str | None:
    """--chat-template is a file path or the template itself."""
    if setting is None:
        return None
    path = Path(setting)
    return path.read_text() if len(setting) < 4096 and path.is_file() else setting


@dataclass
class ModelServing:
    """Everything the handlers need once the model is loaded."""

    engine: AsyncEngine
    config: ServerConfig
    model_names: tuple[str, ...]
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    model_root: str
    chat_template: str | None
    generation_defaults: dict[str, Any]
    metrics: ServerMetrics
    _token_strings: dict[int, str] = field(default_factory=dict)

    @classmethod
    def create(cls, engine: AsyncEngine, config: ServerConfig) -> "ModelServing":
        llm = engine.engine
        names = config.served_model_name or (llm.model.name,)
        source = llm.model.source
        return cls(
            engine=engine,
            config=config,
            model_names=names,
            # The engine thread decodes with its tokenizer; a fast tokenizer must not be shared across threads.
            tokenizer=copy.deepcopy(llm.tokenizer),
            max_model_len=llm.max_model_len,
            vocab_size=llm.vocab_size,
            max_logprobs=llm.config.model.max_logprobs,
            model_root=str(source.directory / source.gguf_file if source.gguf_file else source.directory),
            chat_template=load_chat_template(config.chat_template),
            generation_defaults=load_generation_defaults(
                config.generation_config, None if source.gguf_file else source.directory
            ),
            metrics=ServerMetrics(names[0], lambda: engine.stats),
        )

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def token_string(self, token_id: int) -> str:
        if token_id not in self._token_strings:
            self._token_strings[token_id] = self.tokenizer.decode([token_id])
        return self._token_strings[token_id]

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise APIError(400, "the prompt is empty", "prompt")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt")

    def sampling_params(
        self, req: SamplingFields, prompt_len: int, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        """The request's SamplingParams, with OpenAI's context-length check naming the numbers."""
        remaining = self.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = self.generation_defaults.get("max_tokens")
            max_tokens = remaining if max_tokens is None else min(max_tokens, remaining)
        if remaining < 1 or max_tokens > remaining:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                f"completion). Please reduce the prompt or max_tokens.",
                "max_tokens",
            )
        if logprobs is not None and logprobs > self.max_logprobs:
            raise APIError(400, f"logprobs must be at most {self.max_logprobs}, got {logprobs}", "logprobs")
        try:
            logit_bias = {int(token): bias for token, bias in (req.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", "logit_bias") from None
        bad = next((t for t in [*logit_bias, *(req.stop_token_ids or [])] if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} in logit_bias/stop_token_ids is outside the vocabulary")

        def pick(name: str, fallback: float) -> float:
            """The request's value, else the model's generation-config default, else OpenAI's."""
            for value in (getattr(req, name), self.generation_defaults.get(name)):
                if value is not None:
                    return value
            return fallback

        try:
            return SamplingParams(
                n=req.n,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0),
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                logit_bias=logit_bias,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                logprobs=logprobs,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        try:
            self.engine.engine.validate_request(prompt_token_ids, params)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Starts a request (call `validate` first, so bad input is a 400 even when streaming)."""
        return self.metrics.track(self.engine.generate(prompt_token_ids, params, request_id))


def engine_error(e: ValueError | EngineDeadError) -> APIError:
    """Maps what the engine raises to the status a client should see."""
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not running: {e}")
    return APIError(400, str(e))


def sse_error(e: ValueError | EngineDeadError) -> str:
    """An error inside a stream that has already sent its 200: an error event (vLLM does the same)."""
    error = engine_error(e)
    return f"data: {error_body(error.status, error.message).model_dump_json()}\n\n"


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleaves several async iterators as items arrive, tagging each with its iterator's index.
    Closing the merged stream cancels the producers (which aborts their engine requests)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def drain(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as e:
            await queue.put((index, e))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
                continue
            index, item = entry
            if isinstance(item, BaseException):
                raise item
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClientDisconnected(Exception):
    pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it if the client disconnects first (which aborts its engine requests)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected
    return task.result()


class ServerState:
    """The app's one piece of state (on `app.state.server`): the model once loaded, a load failure,
    and whether the server is draining for shutdown."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.serving: ModelServing | None = None
        self.load_error: BaseException | None = None
        self.draining = False

    @property
    def is_healthy(self) -> bool:
        return self.serving is not None and self.serving.engine.is_running

    def ready(self) -> ModelServing:
        """The serving state, or a 503 that says why there is none."""
        if self.serving is None:
            reason = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise APIError(503, reason)
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if not self.serving.engine.is_running:
            raise APIError(503, "the engine is not running")
        return self.serving


def get_serving(request: Request) -> ModelServing:
    return request.app.state.server.ready()
