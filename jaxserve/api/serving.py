"""What every endpoint shares: the loaded model's serving state, tokenization off the event loop,
sampling-parameter conversion, stream merging, and cancelling work when the client goes away.

Threads: handlers run on the event loop and never call into the LLMEngine (the engine thread owns it).
They read `AsyncEngine.info`, a frozen record, and use their own tokenizer copies: one for a single
worker thread that tokenizes prompts and renders chat templates (work that grows with the input and
must not stall the loop), one for the loop itself, which only decodes single tokens for logprobs.
"""

import asyncio
import contextlib
import functools
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.api.errors import (
    APIError,
    ClientDisconnected,
    is_large,
    parse_json,
    read_body,
    validate,
    validate_in_pieces,
)
from jaxserve.api.json_pieces import dumps_in_pieces
from jaxserve.api.metrics import ServerMetrics
from jaxserve.api.middleware import LONG_LISTS
from jaxserve.api.protocol import PromptLogprob, PromptLogprobList, SamplingFields, random_id
from jaxserve.api.reasoning import REASONING_PARSERS, ReasoningMarkers
from jaxserve.api.response_store import ResponseStore
from jaxserve.collector import empty_in_pieces, fewer_collections
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine, EngineInfo
from jaxserve.engine.structured_output import CompiledGrammar
from jaxserve.models.source import load_generation_defaults
from jaxserve.models.tokenizer import encode_text
from jaxserve.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from jaxserve.sampling_params import (
    InvalidParam,
    SamplingParams,
    StructuredOutputsParams,
    check_cache_salt,
    check_priority,
)

T = TypeVar("T")

LONG_LIST = 1024  # a large request's list of more items (a chat's messages) is emptied off the loop (middleware.py)
LARGE_ANSWER_LOGPROBS = 2048  # an answer listing more logprob entries is built off the event loop (`answer`)
GRAMMAR_COMPILE_TIMEOUT_S = 10.0  # a schema that takes longer is a 400 (llguidance compiles most in ms)
logger = logging.getLogger("jaxserve.api.requests")

_CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")  # visible ASCII: safe in ids, logs and headers


def request_ids(prefix: str, request: Request, body_id: str | None) -> tuple[str, str]:
    """(the response's id, the engine's) as vLLM makes them: "{prefix}-{base}", the base being the client's
    X-Request-Id header, else the body's `request_id`, else random. A client's id need not be unique (a
    retry sends it again), so the engine's id adds a random part to it. A body id that is not 1 to 256
    visible ASCII characters is a 400; such a header is only echoed, as before."""
    header = request.headers.get("x-request-id")
    base = header if header is not None and _CLIENT_REQUEST_ID.fullmatch(header) else body_id
    if base is None:
        response_id = random_id(prefix)
        return response_id, response_id
    if not _CLIENT_REQUEST_ID.fullmatch(base):
        raise APIError(400, "request_id must be 1 to 256 visible ASCII characters", "request_id")
    response_id = f"{prefix}-{base}"
    return response_id, f"{response_id}-{uuid.uuid4().hex[:12]}"


def client_error(error: InvalidParam, field_names: dict[str, str] | None = None) -> APIError:
    """A 400 for a sampling field's error, every field named as the request's API spells it (`field_names`:
    the sampling field's name to the request's), in the param and the message ("min_tokens must be <=
    max_completion_tokens")."""
    names = {old: new for old, new in (field_names or {}).items() if old != new}
    message = str(error)
    if names:
        message = re.sub(rf"\b({'|'.join(map(re.escape, names))})\b", lambda m: names[m.group(1)], message)
    return APIError(400, message, names.get(error.param or "", error.param))


def load_chat_template(setting: str | None) -> str | None:
    """--chat-template is a file path or the template itself, by vLLM's rule: a value without any of
    `{`, `}` or a newline is a path, which must open; a template given inline has its backslash escapes
    (`\\n`) decoded, as a shell passes them."""
    if setting is None:
        return None
    try:
        return Path(setting).read_text()
    except (OSError, ValueError) as e:
        if not any(c in setting for c in "{}\n"):
            raise FileNotFoundError(f"--chat-template {setting!r} looks like a file path but cannot be read: "
                                    f"{e.strerror if isinstance(e, OSError) else e}") from None
    # unicode_escape reads bytes as latin-1: other characters travel as their own escapes, so they survive.
    return setting.encode("latin-1", "backslashreplace").decode("unicode_escape")


def check_server_files(config: ServerConfig) -> None:
    """Reads --chat-template's and --generation-config's files and makes --profiler-dir's folder before the
    model loads, so a wrong path ends the start in one line (ModelServing.create reads the files again once
    the model is there)."""
    load_chat_template(config.chat_template)
    if config.profiler_dir is not None:
        try:
            os.makedirs(config.profiler_dir, exist_ok=True)
        except OSError as error:
            raise ValueError(f"--profiler-dir {config.profiler_dir}: {error.strerror or error}") from None
    if config.generation_config not in ("auto", "vllm"):
        load_generation_defaults(config.generation_config, None, config.override_generation_config)


def requested_structure(req: SamplingFields) -> StructuredOutputsParams | None:
    """The one structured output a request asks for, through whichever spelling: OpenAI's
    response_format, vLLM's structured_outputs, or its older guided_* fields. Two at once is a 400."""
    asked: dict[str, StructuredOutputsParams] = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked["response_format"] = StructuredOutputsParams(json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidParam("response_format json_schema needs json_schema.schema", "response_format")
        asked["response_format"] = StructuredOutputsParams(json=fmt.json_schema.json_schema)
    if (so := req.structured_outputs) is not None:
        asked["structured_outputs"] = StructuredOutputsParams(
            json=so.json_, json_object=bool(so.json_object), regex=so.regex, choice=so.choice, grammar=so.grammar,
            whitespace_pattern=so.whitespace_pattern)
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice,
              "grammar": req.guided_grammar}
    if any(v is not None for v in guided.values()):
        asked["guided_*"] = StructuredOutputsParams(**guided, whitespace_pattern=req.guided_whitespace_pattern)
    if len(asked) > 1:
        raise InvalidParam(f"{' and '.join(asked)} both constrain the output; give one", next(iter(asked)))
    return next(iter(asked.values()), None)


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for (vocabulary strings are at least as long as the text
    they decode to), so a text longer than max_model_len times this cannot fit and need not be tokenized."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "model")


def _long_lists(values: Iterable[Any]) -> list[list]:
    """The lists of more than LONG_LIST items among `values`: those a large request frees a slice at a time."""
    return [value for value in values if isinstance(value, list) and len(value) > LONG_LIST]


def _validate_large(model: type[T], data: Any) -> T:
    """`validate_in_pieces` with fewer collections (collector.py); then the body's long lists emptied a slice at
    a time, rather than freed in one call with the body."""
    validated = None
    try:
        with fewer_collections():
            validated = validate_in_pieces(model, data)
        return validated
    finally:  # valid or not
        if isinstance(data, dict):
            kept = {id(value) for value in vars(validated).values()} if validated is not None else set()
            empty_in_pieces(*(value for value in _long_lists(data.values())
                              if id(value) not in kept))  # not a list a field kept as it was (`Any`)


@dataclass
class ModelServing:
    """Everything the handlers need once the model is loaded."""

    engine: AsyncEngine
    config: ServerConfig
    info: EngineInfo
    model_names: tuple[str, ...]
    tokenizer: Any  # used only on `_worker`
    loop_tokenizer: Any  # used only on the event loop (single-token decodes)
    chat_template: str | None
    generation_defaults: dict[str, Any]
    metrics: ServerMetrics
    max_prompt_chars: int
    reasoning: ReasoningMarkers | None  # --reasoning-parser with its markers' token ids
    matryoshka: bool  # the model's embeddings may be cut short (`dimensions`)
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses kept for follow-ups
    created: int = field(default_factory=lambda: int(time.time()))  # the models' `created`: when they loaded
    _worker: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "jaxserve-tokenizer"))
    _token_strings: dict[int, str] = field(default_factory=dict)

    @classmethod
    def create(cls, engine: AsyncEngine, config: ServerConfig) -> "ModelServing":
        info = engine.info
        names = config.served_model_name or (info.model_name,)
        return cls(
            engine=engine,
            config=config,
            info=info,
            model_names=names,
            tokenizer=engine.tokenizer,
            loop_tokenizer=engine.engine.tokenizer_copy(),
            chat_template=load_chat_template(config.chat_template),
            generation_defaults=load_generation_defaults(
                config.generation_config, Path(info.model_dir) if info.model_dir else None,
                config.override_generation_config,
            ),
            metrics=ServerMetrics(names[0], lambda: engine.stats, max_model_len=info.limits.max_model_len, cache_info={
                "block_size": str(info.page_size), "num_gpu_blocks": str(info.num_kv_pages),
                "max_num_seqs": str(info.max_num_seqs),
                "max_num_batched_tokens": str(info.max_num_batched_tokens),
                "enable_prefix_caching": str(info.enable_prefix_caching),
            }, prefix=config.metrics_prefix),
            max_prompt_chars=info.limits.max_model_len * longest_token_chars(engine.tokenizer),
            reasoning=ReasoningMarkers.of(REASONING_PARSERS[config.reasoning_parser], engine.tokenizer)
            if config.reasoning_parser else None,
            matryoshka=info.matryoshka,
        )

    @property
    def max_model_len(self) -> int:
        return self.info.limits.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.limits.vocab_size

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def parse(self, request: Request, model: type[T]) -> T:
        """The request's body as `model` (once a request: a large body's lists are emptied by it)."""
        data = await self.read_json(request)
        if is_large(self.body_bytes(request)):  # its validation is long too, and holds the interpreter lock
            validated = await asyncio.to_thread(_validate_large, model, data)
            setattr(request.state, LONG_LISTS, _long_lists(vars(validated).values()))  # freed off the loop
            return validated
        return validate(model, data)

    async def read_json(self, request: Request) -> Any:
        """The body's JSON, read once a request: a route that picks its handler by the body (/invocations)
        reads it first, and the handler gets the same."""
        if not hasattr(request.state, "json_body"):
            body = await read_body(request, self.config.max_request_body_bytes, self.config.body_read_timeout)
            request.state.json_body_bytes = len(body)
            request.state.json_body = await self.by_size(request, functools.partial(parse_json, body))
        return request.state.json_body

    @staticmethod
    def body_bytes(request: Request) -> int:
        """The size of the request's body, once `read_json` has read it."""
        return request.state.json_body_bytes

    @staticmethod
    async def by_size(request: Request, work: Callable[[], T]) -> T:
        """`work()` on a worker thread where the request's body was large (its Python work on a large
        input would hold the event loop), else here."""
        if not is_large(ModelServing.body_bytes(request)):
            return work()

        def fewer() -> T:  # collector.py
            with fewer_collections():
                return work()

        return await asyncio.to_thread(fewer)

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """Runs tokenizer work on the tokenizer thread (one at a time: the tokenizer is not shareable)."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, work, *args)

    def check_text_length(self, text: str, param: str = "prompt") -> None:
        """A 400 for text too long to fit the context whatever it tokenizes to, before tokenizing it."""
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; a text of "
                                f"{len(text)} characters cannot fit in it. Please reduce the length of the "
                                "prompt.", param)

    async def encode(self, text: str, add_special_tokens: bool = True, truncate: int | None = None) -> list[int]:
        """`truncate`: vLLM's truncate_prompt_tokens (checked by `check_truncation`): the last tokens kept."""
        if truncate is None:  # else the text may be longer than the context: it is cut after tokenizing
            self.check_text_length(text)
        keep = self.info.limits.kept_tokens(truncate)
        return await self.off_loop(lambda: encode_text(self.tokenizer, text, None, add_special_tokens, keep))

    async def encode_pair(self, first: str, second: str, truncate: int | None = None) -> list[int]:
        """A cross-encoder's prompt: two texts as the tokenizer encodes a pair (`text_pair`: its template's
        special tokens around and between them), as vLLM's cross-encoder scoring reads them. The texts' lengths
        were checked (`check_text_length`) where `truncate` is None."""
        keep = self.info.limits.kept_tokens(truncate)
        return await self.off_loop(lambda: encode_text(self.tokenizer, first, second, True, keep))

    def check_truncation(self, truncate: int | None) -> None:
        try:
            self.info.limits.check_truncation(truncate)
        except InvalidParam as e:
            raise APIError(400, str(e), e.param) from None

    def truncate(self, token_ids: list[int], truncate: int | None) -> list[int]:
        return self.info.limits.truncate(token_ids, truncate)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self.off_loop(lambda: self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (--lora-modules), None for the base model; a 404 for
        a model not served."""
        if model is None or model in self.model_names:
            return None
        if self.engine.has_adapter(model):
            return model
        raise model_not_found(model)

    def tokens_by_id(self, req: Any) -> bool:
        """Whether a request's logprobs name tokens by id: its `return_tokens_as_token_ids` where given, else
        the server's default (vLLM's --return-tokens-as-token-ids)."""
        asked = req.return_tokens_as_token_ids
        return self.config.return_tokens_as_token_ids if asked is None else asked

    def token_label(self, token_id: int, by_id: bool) -> str:
        """How logprobs name a token: its text, or with vLLM's `return_tokens_as_token_ids` "token_id:{id}"
        (a token whose bytes are not whole UTF-8, alone, has no text of its own)."""
        return f"token_id:{token_id}" if by_id else self.token_string(token_id)

    def token_string(self, token_id: int) -> str:
        if token_id not in self._token_strings:
            self._token_strings[token_id] = self.loop_tokenizer.decode([token_id])
        return self._token_strings[token_id]

    def sampling_params(
        self,
        req: SamplingFields,
        prompt_token_ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structure: StructuredOutputsParams | None = None,
        field_names: dict[str, str] | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams, checked against the engine's limits (the one rule, in
        jaxserve.sampling_params); any violation is a 400 naming the field, as `field_names` spells the
        sampling fields in this request's API (chat's max_completion_tokens for max_tokens). `prompt_logprobs`
        defaults to the request's own field; its cache_salt and priority are checked here too. `structure` (a
        tool choice's grammar) replaces what the request's own fields ask for."""
        if self.info.runner == "pooling":
            raise APIError(400, "this server embeds prompts (--runner pooling): it serves /v1/embeddings, not "
                                "completions", "model")
        if req.prompt_logprobs is not None and req.stream:  # vLLM's rule: they come with the whole answer
            raise APIError(400, "prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if req.stream_options is not None and not req.stream:  # OpenAI's and vLLM's rule
            raise APIError(400, "stream_options can only be given when stream is true", "stream_options")
        default_max = self.generation_defaults.get("max_tokens")
        if max_tokens is None and default_max is not None and len(prompt_token_ids) + default_max <= self.max_model_len:
            max_tokens = default_max  # else: None, up to the context length

        def pick(name: str, fallback: float) -> float:
            """The request's value, else the model's generation-config default, else OpenAI's."""
            for value in (getattr(req, name), self.generation_defaults.get(name)):
                if value is not None:
                    return value
            return fallback

        try:
            try:
                logit_bias = {int(token): bias for token, bias in (req.logit_bias or {}).items()}
            except ValueError:
                raise InvalidParam("logit_bias keys must be token ids", "logit_bias") from None
            params = SamplingParams(
                n=req.n,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0),
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                logit_bias=logit_bias,
                bad_words=req.bad_words,
                allowed_token_ids=req.allowed_token_ids,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                logprobs=logprobs,
                prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                structured_outputs=structure or requested_structure(req),
                output_kind=RequestOutputKind.DELTA,  # the API's one kind: its streams and `collect` add them up
            )
            self.info.limits.check(prompt_token_ids, params)
            check_cache_salt(req.cache_salt)
            check_priority(req.priority, self.info.scheduling_policy)
        except InvalidParam as e:
            raise client_error(e, field_names) from None
        return params

    async def compile_grammar(self, params: SamplingParams,
                              field_names: dict[str, str] | None = None) -> CompiledGrammar | None:
        """The request's structured output compiled on the grammar threads; a 400 if it fails or is slow
        (`field_names` as for `sampling_params`)."""
        if params.structured_outputs is None:
            return None
        try:
            return await self.engine.compile_grammar(params.structured_outputs, GRAMMAR_COMPILE_TIMEOUT_S)
        except InvalidParam as e:
            raise client_error(e, field_names) from None

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, cache_salt: str | None = None,
        grammar: CompiledGrammar | None = None, priority: int = 0, lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Starts a request whose params came from `sampling_params` (so bad input was a 400 already) and
        whose structured output, if any, from `compile_grammar`; `lora_name` from `check_model`."""
        if self.config.log_requests:
            logger.info("request %s: %d prompt tokens, params %s", request_id, len(prompt_token_ids), params)
        return self.metrics.track(self.engine.generate(prompt_token_ids, params, request_id, cache_salt, grammar,
                                                       checked=True, priority=priority, lora_name=lora_name))

    def _decode_each(self, token_ids: set[int]) -> dict[int, str]:
        """Each token decoded alone, in one batch (tokenizer thread only)."""
        ordered = sorted(token_ids)
        return dict(zip(ordered, self.tokenizer.batch_decode([[t] for t in ordered]), strict=True)) if ordered else {}

    async def label_tokens(self, token_ids: set[int], by_id: bool) -> None:
        """Makes `token_label` of these ids a lookup, decoding the ones not yet known on the tokenizer thread:
        an answer built on a worker thread then never touches the event loop's tokenizer."""
        if not by_id and (unknown := token_ids - self._token_strings.keys()):
            self._token_strings.update(await self.token_strings(unknown))

    @staticmethod
    async def answer(build: Callable[[], BaseModel], num_logprobs: int) -> Response:
        """The non-streamed answer `build()` makes, as JSON. One listing many logprobs (`num_logprobs`
        entries, tokens and their alternatives, past `LARGE_ANSWER_LOGPROBS`) is built, dumped and encoded
        on a worker thread, in pieces, so the event loop answers others meanwhile (built here, 128 choices
        of 40 tokens with 20 alternatives each held it for 1.6-2.4 s); its tokens must be labelled already
        (`label_tokens`)."""
        if num_logprobs <= LARGE_ANSWER_LOGPROBS:
            return JSONResponse(build().model_dump())
        return Response(await asyncio.to_thread(lambda: dumps_in_pieces(build())), media_type="application/json")

    async def token_strings(self, token_ids: set[int]) -> dict[int, str]:
        """Token id -> its text, decoded on the tokenizer thread (a long prompt has many to decode)."""
        return await self.off_loop(self._decode_each, token_ids)

    async def prompt_logprobs(self, output: RequestOutput) -> PromptLogprobList | None:
        """vLLM's `prompt_logprobs` of an output, built on the tokenizer thread: a long prompt makes
        many entries, and the event loop must not stall on them."""
        entries = output.prompt_logprobs
        if entries is None:
            return None

        def convert() -> PromptLogprobList:
            strings = self._decode_each({t for entry in entries if entry for t in entry})
            return [None if entry is None else
                    {t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=strings[t])
                     for t, lp in entry.items()}
                    for entry in entries]

        return await self.off_loop(convert)


def logprob_token_ids(completions: Iterable[CompletionOutput]) -> set[int]:
    """The tokens the completions' logprobs name: theirs and their alternatives."""
    return {*(t for c in completions for t in c.token_ids),
            *(t for c in completions for top in c.top_logprobs or () for t in top)}


def num_logprobs(output: RequestOutput, top: int | None, prompt: int | None) -> int:
    """The logprob entries an answer lists: each generated token and its `top` alternatives (None: no
    logprobs asked for), and each prompt token and its `prompt` ones."""
    generated = 0 if top is None else sum(len(c.token_ids) for c in output.outputs) * (1 + top)
    return generated + (0 if prompt is None else output.num_prompt_tokens * (1 + prompt))


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


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it if the client disconnects first (which aborts its engine requests)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the caller gave up on it: the work ends (its requests aborted) first
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # its own error must not replace the cancel
            await task
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
    whether the server is draining for shutdown, and how many HTTP requests are in flight."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.serving: ModelServing | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.num_in_flight = 0  # API requests being answered (the /load figure; the drain waits for 0)

    @property
    def is_healthy(self) -> bool:
        return self.serving is not None and self.serving.engine.is_running and not self.draining

    def ready(self) -> ModelServing:
        """The serving state, or a 503 that says why there is none."""
        if self.draining:  # a load balancer retries elsewhere; the connection closes after this answer
            raise APIError(503, "the server is shutting down", headers={"Connection": "close"})
        if self.serving is None:
            reason = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise APIError(503, reason)
        if not self.serving.engine.is_running:
            raise APIError(503, "the engine is not running")
        return self.serving


def get_serving(request: Request) -> ModelServing:
    return request.app.state.server.ready()
