"""POST /v1/chat/completions: the chat template turns messages into one prompt with n completions."""

import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import jinja2
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from jaxserve.api.beam_search import ServedBeamSearch, beam_search, beam_search_params
from jaxserve.api.errors import MAX_JSON_DEPTH, APIError, check_json
from jaxserve.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    TokenLogprob,
    ToolCallInfo,
    TopLogprob,
    UsageInfo,
)
from jaxserve.api.reasoning import Phase, ReasoningParser, ReasoningSplitter, reasoning_stream, split_reasoning
from jaxserve.api.serving import (
    LONG_LIST,
    ModelServing,
    get_serving,
    logprob_token_ids,
    num_logprobs,
    request_ids,
    requested_structure,
)
from jaxserve.api.streaming import ChoiceStream, collect, sse, stream_usage
from jaxserve.api.tools import TOOL_PARSERS, ToolCallStream
from jaxserve.api.tools.plan import ToolPlan, plan_tools
from jaxserve.collector import empty_in_pieces, fewer_collections
from jaxserve.config import RESERVED_TEMPLATE_KWARGS
from jaxserve.models.template_format import ContentPartError, content_texts, resolve_content_format, template_content
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import InvalidParam, SamplingParams


def _template_tool_calls(calls: object, param: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI tool_calls as templates read them: arguments as a dict, not text."""
    if not isinstance(calls, list):
        raise APIError(400, "tool_calls must be a list", param)
    result = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, "each tool call needs a function with a name", param)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):  # a dict or list came through the body's own checks
            arguments = tool_call_arguments(arguments, param)
        result.append({**call, "function": {**function, "arguments": arguments}})
    return result


def tool_call_arguments(text: str, param: str) -> Any:
    """A tool call's arguments, a JSON text, parsed and checked as a body is; a 400 naming `param` otherwise."""
    try:
        arguments = json.loads(text)
    except ValueError:
        raise APIError(400, "tool call arguments must be a JSON text", param) from None
    except RecursionError:
        raise APIError(400, f"tool call arguments are nested deeper than {MAX_JSON_DEPTH} levels", param) from None
    try:
        check_json(arguments)
    except APIError as e:
        raise APIError(400, f"tool call arguments: {e.message}", param) from None
    return arguments


def _message_dicts(messages: list[ChatMessage], content_format: str) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: content as text (`content_format` string, parts joined by
    newlines) or as OpenAI's list of text parts (openai, a plain text its one part)."""
    result = []
    for i, message in enumerate(messages):
        data = message.model_dump(exclude_none=True)
        if "tool_calls" in data:
            data["tool_calls"] = _template_tool_calls(data["tool_calls"], f"messages.{i}.tool_calls")
        data.setdefault("content", "")  # an assistant turn of only tool calls: templates read content
        reasoning = data.get("reasoning_content") or data.get("reasoning")
        if message.role == "assistant" and isinstance(reasoning, str) and reasoning and "thinking" not in data and not (
                data["content"] and data.get("tool_calls")):  # which GPT-OSS's template refuses
            data["thinking"] = reasoning  # GPT-OSS's template renders an earlier turn's analysis from `thinking`
        try:
            texts = content_texts(message.content)
        except ContentPartError as e:
            raise APIError(400, str(e), f"messages.{i}.content.{e.where}") from None
        if texts is not None:
            data["content"] = template_content(texts, content_format)
        result.append(data)
    return result


OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def check_roles(messages: list[ChatMessage], template: str | dict[str, str] | None) -> None:
    """A 400 naming the message whose role is not OpenAI's, unless the chat template names that role
    (Llama 3's `ipython`, for one): a template would otherwise drop or garble the turn silently."""
    if isinstance(template, dict):  # a tokenizer's named templates
        template = "\n".join(template.values())
    for i, message in enumerate(messages):
        role = message.role
        if role not in OPENAI_ROLES and not (template and (f"'{role}'" in template or f'"{role}"' in template)):
            raise APIError(400, f"messages[{i}].role {role!r} is not one of {', '.join(sorted(OPENAI_ROLES))}, "
                                "and the chat template does not use it", f"messages.{i}.role")


async def render_chat(
    serving: ModelServing,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    truncate: int | None = None,
    *,
    documents: list[dict[str, str]] | None = None,
    add_special_tokens: bool = False,
    reasoning_effort: str | None = None,
) -> list[int]:
    """The conversation rendered by the chat template and tokenized, on the tokenizer thread: rendering and
    tokenizing grow with the input. The template writes the special tokens; `add_special_tokens` adds the
    tokenizer's own on top (vLLM's field; a second BOS for most templates). `documents` reach the template
    as `documents`, and `reasoning_effort` as `reasoning_effort` (over chat_template_kwargs', as vLLM merges
    them). `truncate`: its last tokens kept (truncate_prompt_tokens, checked already)."""
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    if continue_final_message and add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true")
    if chat_template is not None and not serving.config.trust_request_chat_template:
        raise APIError(400, "a chat_template in the request is refused: the server runs only its own template "
                            "unless started with --trust-request-chat-template", "chat_template")
    if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs or {})):
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    # the server's defaults under the request's own (vLLM's --default-chat-template-kwargs)
    template_kwargs = {**(serving.config.default_chat_template_kwargs or {}), **(chat_template_kwargs or {}),
                       **({"reasoning_effort": reasoning_effort} if reasoning_effort is not None else {})}
    template = chat_template or serving.chat_template
    rendering = template or getattr(serving.tokenizer, "chat_template", None)
    check_roles(messages, rendering)

    def render() -> list[int]:
        # a template's content format read from its syntax tree: parsing a new template takes a while
        content_format = resolve_content_format(serving.config.chat_template_content_format, rendering, tools)
        with fewer_collections() if len(messages) > LONG_LIST else contextlib.nullcontext():  # collector.py
            conversation = _message_dicts(messages, content_format)
            try:
                text = serving.tokenizer.apply_chat_template(
                    conversation, chat_template=template, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, tokenize=False, tools=tools,
                    documents=documents, **template_kwargs,
                )
            except (jinja2.TemplateError, ValueError, TypeError, LookupError, AttributeError, RecursionError) as e:
                raise APIError(400, f"the chat template could not render these messages: {e}", "messages") from None
            finally:
                empty_in_pieces(conversation)
        if truncate is None:
            serving.check_text_length(text, "messages")
        return serving.truncate(serving.tokenizer.encode(text, add_special_tokens=add_special_tokens), truncate)

    return await serving.off_loop(render)


def _logprobs(serving: ModelServing, completion: CompletionOutput, by_id: bool) -> ChatLogprobs:
    """Logprobs of the completion's tokens: all of them (a stream's delta holds only the new ones)."""
    content = []
    top = completion.top_logprobs or []
    for i in range(len(completion.token_ids)):
        token = serving.token_label(completion.token_ids[i], by_id)
        alternatives = [
            TopLogprob(token=(s := serving.token_label(t, by_id)), logprob=lp, bytes=list(s.encode()))
            for t, lp in (top[i].items() if top else ())
        ]
        content.append(TokenLogprob(token=token, logprob=completion.token_logprobs[i], bytes=list(token.encode()),
                                    top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def _tool_plan(serving: ModelServing, req: ChatCompletionRequest) -> ToolPlan | None:
    parser = TOOL_PARSERS[serving.config.tool_call_parser] if serving.config.enable_auto_tool_choice else None
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    try:
        plan = plan_tools([t.function.model_dump() for t in req.tools or []], choice, req.parallel_tool_calls, parser)
        if plan is not None and plan.forced and requested_structure(req) is not None:
            raise InvalidParam("a required or named tool_choice constrains the output; it cannot be combined "
                               "with response_format or structured_outputs", "tool_choice")
    except InvalidParam as e:
        raise APIError(400, str(e), e.param) from None
    return plan


@dataclass(frozen=True)
class _Reasoning:
    """How a request's outputs split into reasoning and content (--reasoning-parser)."""

    parser: ReasoningParser
    phase: Phase  # where its outputs start
    included: bool  # the request's include_reasoning

    def stream(self) -> ReasoningSplitter:
        return reasoning_stream(self.parser, self.phase)


def _reasoning(serving: ModelServing, req: ChatCompletionRequest, prompt_ids: list[int],
               constrained: bool) -> _Reasoning | None:
    """`constrained`: a structured output applies. Without the reasoning (include_reasoning false) it
    applies from the first token, as in vLLM, and the whole output is the answer."""
    if serving.reasoning is None:
        return None
    phase = serving.reasoning.first_phase(prompt_ids)
    if constrained and not req.include_reasoning:
        phase = Phase.CONTENT
    return _Reasoning(serving.reasoning.parser, phase, req.include_reasoning)


def _after_reasoning(serving: ModelServing, params: SamplingParams, reasoning: _Reasoning | None) -> SamplingParams:
    """The params with their structured output (a response format, a forced tool call) made to wait for
    the end of reasoning, as vLLM applies it, unless the output starts with the answer (the prompt ended
    the reasoning, or the request leaves it out)."""
    if reasoning is None or params.structured_outputs is None:
        return params
    waits = serving.reasoning.grammar_waits(reasoning.phase)
    if not waits:
        return params
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(params.structured_outputs,
                                                                              after_token_ids=waits))


def _message(
    completion: CompletionOutput, plan: ToolPlan | None, reasoning: _Reasoning | None, role: str = "assistant",
) -> tuple[ChatResponseMessage, str | None]:
    """The reply message of a finished choice (its reasoning, then the calls its answer holds), and its
    finish_reason."""
    thought, text = split_reasoning(reasoning.parser, reasoning.phase, completion.text) if reasoning else (
        None, completion.text)
    thought = thought if reasoning is not None and reasoning.included else None
    if plan is None:
        message = ChatResponseMessage(role=role, content=text, reasoning_content=thought, reasoning=thought)
        return message, completion.finish_reason
    content, calls = plan.make_parser().parse(text or "", truncated=completion.finish_reason == "length")
    calls = calls[: plan.max_calls]
    message = ChatResponseMessage(
        role=role,
        content=None if plan.forced and calls else content,
        reasoning_content=thought,
        reasoning=thought,
        tool_calls=[ToolCallInfo(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls],
    )
    return message, _finish_reason(completion.finish_reason, bool(calls))


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason


@dataclass(frozen=True)
class ChatRun:
    """A chat request started in the engine: what its answer is read with (chat completions and the
    Responses API share it)."""

    prompt_ids: list[int]
    plan: ToolPlan | None  # how tool calls are read from the text
    reasoning: _Reasoning | None  # how reasoning is split from the text
    streams: list[AsyncIterator[RequestOutput]]  # the one engine request's outputs (its n sequences)
    beam: ServedBeamSearch | None = None  # use_beam_search: no stream; the search runs when awaited
    lora_name: str | None = None  # the LoRA adapter the request's model names

    def read(self, completion: CompletionOutput) -> tuple[ChatResponseMessage, str | None]:
        """A finished choice's assistant message and finish_reason."""
        return _message(completion, self.plan, self.reasoning)

    def reasoning_stream(self) -> ReasoningSplitter | None:
        return self.reasoning.stream() if self.reasoning is not None else None

    def tool_stream(self) -> ToolCallStream | None:
        return ToolCallStream(self.plan.make_parser(), self.plan.max_calls) if self.plan is not None else None


async def start_chat(serving: ModelServing, req: ChatCompletionRequest, request_id: str,
                     field_names: dict[str, str] | None = None) -> ChatRun:
    """Checks, renders and starts a chat request; every 400 comes before anything starts, naming the field
    as the client sent it: chat's own names, or `field_names` (the sampling field's name to the one the
    client's API gives it: the Responses API's max_output_tokens) where the request came through another."""
    lora_name = serving.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
    plan = _tool_plan(serving, req)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    serving.check_truncation(req.truncate_prompt_tokens)
    prompt_ids = await render_chat(serving, req.messages, req.add_generation_prompt, req.continue_final_message,
                                   req.chat_template, req.chat_template_kwargs, tools, req.truncate_prompt_tokens,
                                   documents=req.documents, add_special_tokens=req.add_special_tokens,
                                   reasoning_effort=req.reasoning_effort)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    names = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
             "logprobs": "top_logprobs", **({"structured_outputs": "response_format"} if req.response_format else {}),
             **(field_names or {}), **({"structured_outputs": "tools"} if plan is not None and plan.forced else {})}
    params = serving.sampling_params(req, prompt_ids, max_tokens, logprobs,
                                     structure=plan.structure if plan is not None else None, field_names=names)
    if serving.reasoning is not None and serving.reasoning.parser.special_markers:  # harmony's markers must
        params = dataclasses.replace(params, skip_special_tokens=False)  # reach the parser (beams' too)
    if req.use_beam_search:
        if plan is not None:
            raise APIError(400, "tool calls are not available with use_beam_search", "tools")
        return ChatRun(prompt_ids, None, _reasoning(serving, req, prompt_ids, False), [],
                       beam_search_params(serving, req, params, len(prompt_ids)), lora_name)
    if plan is not None and plan.keeps_special_tokens:  # the calls' markers must reach the parser
        params = dataclasses.replace(params, skip_special_tokens=False)
    reasoning = _reasoning(serving, req, prompt_ids, params.structured_outputs is not None)
    params = _after_reasoning(serving, params, reasoning)
    grammar = await serving.compile_grammar(params, names)
    streams = [serving.generate(prompt_ids, params, request_id, req.cache_salt, grammar, req.priority, lora_name)]
    return ChatRun(prompt_ids, plan, reasoning, streams, lora_name=lora_name)


async def create_chat_completion(request: Request) -> Response:
    serving = get_serving(request)
    req = await serving.parse(request, ChatCompletionRequest)
    request_id, engine_id = request_ids("chatcmpl", request, req.request_id)
    run = await start_chat(serving, req, engine_id)
    prompt_ids, plan, reasoning, streams = run.prompt_ids, run.plan, run.reasoning, run.streams
    model_name = req.model or serving.model_names[0]
    choices = ChoiceStream(streams, req.n, [len(prompt_ids)])
    if req.stream:
        created = int(time.time())

        include_usage, usage_every_chunk = stream_usage(req.stream_options, serving.config.enable_force_include_usage)

        def chunk(items: list[ChatChunkChoice], usage: UsageInfo | None = None,
                  prompt_token_ids: list[int] | None = None) -> ChatCompletionChunk:
            if usage is None and usage_every_chunk and items:
                usage = choices.choice_usage(items[0].index)
            return ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=items, usage=usage,
                                       prompt_token_ids=prompt_token_ids)

        body = sse(_chunks(serving, req, plan, reasoning, choices, chunk, prompt_ids),
                   (lambda: chunk([], choices.usage)) if include_usage else None)
        return StreamingResponse(body, media_type="text/event-stream")
    if run.beam is not None:
        final = await beam_search(serving, request, prompt_ids, run.beam, engine_id, req.cache_salt, req.priority,
                                  run.lora_name)
    else:
        (final,) = await collect(request, streams)
    role, by_id = _reply_role(serving, req), serving.tokens_by_id(req)
    echoed = _echoed(req, role)
    if req.logprobs:
        await serving.label_tokens(logprob_token_ids(final.outputs), by_id)
    prompt_logprobs = await serving.prompt_logprobs(final)

    def build() -> ChatCompletionResponse:
        items = []
        for c in final.outputs:
            message, finish_reason = _message(c, plan, reasoning, role)
            if echoed:
                message.content = echoed + (message.content or "")
            items.append(ChatChoice(index=c.index, message=message,
                                    logprobs=_logprobs(serving, c, by_id) if req.logprobs else None,
                                    finish_reason=finish_reason, stop_reason=c.stop_reason,
                                    token_ids=list(c.token_ids) if req.return_token_ids else None))
        usage = UsageInfo.of(len(prompt_ids), final.num_generated_tokens, final.num_cached_tokens)
        return ChatCompletionResponse(id=request_id, model=model_name, choices=items, usage=usage,
                                      prompt_logprobs=prompt_logprobs,
                                      prompt_token_ids=prompt_ids if req.return_token_ids else None)

    return await serving.answer(build, num_logprobs(final, req.top_logprobs if req.logprobs else None,
                                                    req.prompt_logprobs))


def _reply_role(serving: ModelServing, req: ChatCompletionRequest) -> str:
    """The reply's role, as vLLM gives it: --response-role where the prompt opens a new turn, else that of
    the last message, which the reply continues."""
    return serving.config.response_role if req.add_generation_prompt else req.messages[-1].role


def _echoed(req: ChatCompletionRequest, role: str) -> str:
    """vLLM's chat `echo`: the reply starts with the last message when that has the reply's `role` (a
    message the reply continues)."""
    last = req.messages[-1]
    if not req.echo or last.role != role or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part["text"] for part in last.content)  # text parts only: render_chat checked them


class _ChunkMaker(Protocol):
    def __call__(self, items: list[ChatChunkChoice], usage: UsageInfo | None = None,
                 prompt_token_ids: list[int] | None = None) -> ChatCompletionChunk: ...


async def _chunks(
    serving: ModelServing,
    req: ChatCompletionRequest,
    plan: ToolPlan | None,
    reasoning: _Reasoning | None,
    choices: ChoiceStream,
    chunk: _ChunkMaker,
    prompt_ids: list[int],
) -> AsyncIterator[ChatCompletionChunk]:
    tool_streams = [ToolCallStream(plan.make_parser(), plan.max_calls) for _ in range(req.n)] if plan else []
    thought_streams = [reasoning.stream() for _ in range(req.n)] if reasoning else []
    # return_token_ids: a choice's tokens since its last chunk (a delta with nothing to say yet keeps them)
    pending_ids: list[list[int]] = [[] for _ in range(req.n)]
    role = _reply_role(serving, req)
    echoed = _echoed(req, role)
    for i in range(req.n):  # each choice's first chunk carries the role (the prompt's ids; what echo repeats)
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role=role, content=""))],
                    prompt_token_ids=prompt_ids if req.return_token_ids else None)
        if echoed:
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=echoed))])
    async for delta in choices:
        completion = delta.completion
        finish_reason = delta.finish_reason
        pending_ids[delta.index].extend(completion.token_ids)
        content: str | None = completion.text_delta
        thought: str | None = None
        if reasoning is not None:
            thought, content = thought_streams[delta.index].feed(content, final=finish_reason is not None)
            thought = (thought or None) if reasoning.included else None
        calls: list[DeltaToolCall] | None = None
        if plan is not None:
            calls_stream = tool_streams[delta.index]
            content, call_deltas = calls_stream.feed(content, final=finish_reason is not None,
                                                     truncated=finish_reason == "length")
            calls = [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                                   function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
                     for d in call_deltas] or None
            finish_reason = _finish_reason(finish_reason, calls_stream.num_calls > 0)
        if (plan is not None or reasoning is not None) and not (content or calls or thought or finish_reason
                                                                 or req.logprobs):
            continue  # nothing to say yet (a call's name or a marker still arriving)
        token_ids, pending_ids[delta.index] = pending_ids[delta.index], []
        yield chunk([ChatChunkChoice(
            index=delta.index, delta=DeltaMessage(content=content if content or (calls is None and thought is None)
                                                  else None, reasoning_content=thought, reasoning=thought,
                                                  tool_calls=calls),
            logprobs=_logprobs(serving, completion, serving.tokens_by_id(req)) if req.logprobs else None,
            finish_reason=finish_reason, stop_reason=completion.stop_reason,
            token_ids=token_ids if req.return_token_ids else None,
        )])
