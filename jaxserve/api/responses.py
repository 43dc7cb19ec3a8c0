"""POST /v1/responses, GET and DELETE /v1/responses/{response_id}, POST /v1/responses/{response_id}/cancel,
GET /v1/responses/{response_id}/input_items: OpenAI's Responses API, text subset, over the chat path (the
chat template, tools, structured outputs and reasoning parsers are chat's).

A request's `input` (a string, or message, function_call and function_call_output items) becomes chat
messages, after the stored conversation of `previous_response_id` and under its own `instructions`
(which, as OpenAI's, are not carried to the next response). The answer becomes output items: the
reasoning, the message, then the function calls. Streamed, it is OpenAI's event sequence, each event
numbered (`sequence_number`). Responses are kept in a bounded in-memory store, least recently used first
out, unless `store` is false. A `background` response is answered by a task of its own: the request is
checked and started, the answer is `queued`, and the client polls GET until it ends or cancels it
(`response_store.py`); /load counts it. Everything here runs on the event loop.
"""

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.api.chat import ChatRun, start_chat, tool_call_arguments
from jaxserve.api.errors import APIError, error_body, validate
from jaxserve.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatResponseMessage,
    ChatTool,
    FunctionCallItem,
    FunctionDefinition,
    IncompleteDetails,
    InputItemsQuery,
    InputTokensDetails,
    JsonSchemaFormat,
    MessageItem,
    NamedFunction,
    NamedToolChoice,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseDeleted,
    ResponseFormat,
    ResponseItemList,
    ResponseObject,
    ResponseQuery,
    ResponsesRequest,
    ResponseUsage,
    UsageInfo,
)
from jaxserve.api.response_store import EventLog, ResponseStore, StoredResponse
from jaxserve.api.serving import get_serving
from jaxserve.api.streaming import ENGINE_ERRORS, ChoiceStream, collect, engine_error, finals
from jaxserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# The sampling fields as the Responses API names them, for its 400s (its chat request's names otherwise)
_FIELD_NAMES = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs", "structured_outputs": "text.format"}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _texts(content: Any, param: str) -> list[str]:
    """A message's content as its texts: a string, or its text parts."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of parts", param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"content part of type {kind!r} is not supported; only text", f"{param}.{j}")
        if not isinstance(part.get("text"), str):
            raise APIError(400, "a text part's text must be a string", f"{param}.{j}.text")
        texts.append(part["text"])
    return texts


def read_input(given: str | list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A request's `input`, checked, as chat messages and as OpenAI's input items.

    Messages: function calls join the assistant turn they follow, their outputs become tool messages,
    reasoning items are dropped (templates re-render reasoning themselves). Items (what GET .../input_items
    lists): each with an id, the client's where it gave one (ids must differ: a cursor names one), else a
    new one."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    given_ids: set[str] = set()
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        item_id = item.get("id")
        if item_id is not None:
            if not isinstance(item_id, str) or item_id in given_ids:
                raise APIError(400, f"input[{i}].id must be a string no other input item has", f"input.{i}.id")
            given_ids.add(item_id)
        if kind == "message":
            role = item.get("role")
            if role not in _INPUT_ROLES:
                raise APIError(400, f"input[{i}].role must be one of {', '.join(_INPUT_ROLES)}", f"input.{i}.role")
            texts = _texts(item.get("content"), f"input.{i}.content")
            messages.append({"role": role, "content": "\n".join(texts)})
            part = "output_text" if role == "assistant" else "input_text"
            parts = [{"type": part, "text": text, **({"annotations": []} if role == "assistant" else {})}
                     for text in texts]
            items.append({"id": item_id or _item_id("msg"), "type": "message", "role": role, "content": parts,
                          "status": "completed"})
        elif kind == "function_call":
            fields = {name: item.get(name) for name in ("call_id", "name", "arguments")}
            if not all(isinstance(value, str) for value in fields.values()):
                raise APIError(400, "a function_call item needs call_id, name and arguments strings", f"input.{i}")
            tool_call_arguments(fields["arguments"], f"input.{i}.arguments")  # named here, not as chat's field
            call = {"id": fields["call_id"], "type": "function",
                    "function": {"name": fields["name"], "arguments": fields["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            items.append({"id": item_id or _item_id("fc"), "type": "function_call", **fields, "status": "completed"})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or output is None:
                raise APIError(400, "a function_call_output item needs a call_id and an output", f"input.{i}")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
            items.append({"id": item_id or _item_id("fco"), "type": "function_call_output", "call_id": call_id,
                          "output": text, "status": "completed"})
        elif kind == "reasoning":
            summary = item.get("summary") if isinstance(item.get("summary"), list) else []
            items.append({"id": item_id or _item_id("rs"), "type": "reasoning", "summary": summary})
        else:
            raise APIError(400, f"input items of type {kind!r} are not supported", f"input.{i}.type")
    if not messages:
        raise APIError(400, "input must hold at least one message", "input")
    return messages, items


def _chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that answers a Responses request."""
    tools = None
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") != "function":
                raise APIError(400, f"tools of type {tool.get('type')!r} are not supported; only function",
                               f"tools.{i}.type")
            try:
                tools.append(ChatTool(function=FunctionDefinition.model_validate(tool)))
            except pydantic.ValidationError as e:
                raise APIError(400, f"tools[{i}] is not a function definition: {e.errors()[0]['msg']}",
                               f"tools.{i}") from None
    choice = req.tool_choice
    if isinstance(choice, pydantic.BaseModel):
        choice = NamedToolChoice(function=NamedFunction(name=choice.name))
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None and fmt.type != "text":
        schema = JsonSchemaFormat(name=fmt.name, schema=fmt.json_schema, strict=fmt.strict) if fmt.json_schema \
            else None
        response_format = ResponseFormat(type=fmt.type, json_schema=schema)
    return ChatCompletionRequest(
        model=req.model, messages=[ChatMessage(**m) for m in messages], max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed, priority=req.priority,
        tools=tools, tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format, user=req.user,
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None)


def _output_items(message: ChatResponseMessage) -> list[OutputItem]:
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(ReasoningItem(id=_item_id("rs"), content=[ReasoningText(text=message.reasoning_content)]))
    if message.content:
        items.append(MessageItem(id=_item_id("msg"), content=[OutputText(text=message.content)]))
    items += [FunctionCallItem(id=_item_id("fc"), call_id=call.id, name=call.function.name,
                               arguments=call.function.arguments) for call in message.tool_calls]
    return items


def _conversation_after(messages: list[dict[str, Any]], items: list[OutputItem]) -> list[dict[str, Any]]:
    """The conversation a response ends: its messages and its answer, as chat messages."""
    text = "".join(part.text for item in items if isinstance(item, MessageItem) for part in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in items if isinstance(item, FunctionCallItem)]
    answer: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        answer["tool_calls"] = calls
    return [*messages, answer]


def _usage(usage: UsageInfo) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ResponseUsage(input_tokens=usage.prompt_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens=usage.completion_tokens, output_tokens_details=OutputTokensDetails(),
                         total_tokens=usage.total_tokens)


def _finished(response: ResponseObject, items: list[OutputItem], finish_reason: str | None,
              usage: UsageInfo) -> ResponseObject:
    cut = finish_reason == "length"
    return response.model_copy(update={
        "status": "incomplete" if cut else "completed", "output": items, "usage": _usage(usage),
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None})


async def create_response(request: Request) -> Response:
    serving = get_serving(request)
    req = await serving.parse(request, ResponsesRequest)
    serving.check_model(req.model)
    if req.background and not req.store:
        raise APIError(400, "a background response must be stored: store must be true", "background")
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = serving.responses.get(req.previous_response_id)
        if stored is None:
            raise _response_not_found(req.previous_response_id, "previous_response_id")
        if stored.conversation is None:
            raise APIError(400, f"Response '{req.previous_response_id}' is {stored.response.status}: it has no "
                                "answer to continue from", "previous_response_id")
        history = stored.conversation
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []

    def converted() -> tuple[list[dict[str, Any]], list[dict[str, Any]], ChatCompletionRequest]:
        asked, items = read_input(req.input)
        messages = [*history, *asked]
        return items, messages, _chat_request(req, instructions + messages)

    items, messages, chat = await serving.by_size(request, converted)  # seconds of Python for 300k items
    request_bytes = serving.body_bytes(request)
    response_id = _item_id("resp")
    run = await start_chat(serving, chat, response_id, _FIELD_NAMES)
    response = ResponseObject(
        id=response_id, status="in_progress", model=req.model or serving.model_names[0],
        instructions=req.instructions, max_output_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, tools=req.tools or [], parallel_tool_calls=req.parallel_tool_calls,
        tool_choice=req.tool_choice.model_dump() if isinstance(req.tool_choice, pydantic.BaseModel)
        else req.tool_choice or "auto",
        text={"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
        if req.text is not None and req.text.format is not None else {"format": {"type": "text"}},
        previous_response_id=req.previous_response_id, store=req.store, metadata=req.metadata, user=req.user,
        background=req.background, reasoning=req.reasoning.model_dump() if req.reasoning is not None else None)

    def keep(final: ResponseObject) -> None:
        if req.store:
            serving.responses.put(final, _conversation_after(messages, list(final.output)), items,
                                  request_bytes=request_bytes)

    def keep_failed(failed: ResponseObject) -> None:
        if req.store:
            serving.responses.put(failed, None, items, request_bytes=request_bytes)

    if req.background:
        # Checked here, after the awaits of the checks above: nothing runs until the task iterates the stream.
        if serving.responses.is_full:
            raise APIError(429, f"{serving.responses.num_running} background responses are being answered, the "
                                "most this server runs at once: poll or cancel some first", "background")
        queued = response.model_copy(update={"status": "queued"})
        log = EventLog() if req.stream else None
        serving.responses.start(queued, items, _answer_in_background(serving.responses, run, response, messages, log),
                                log, request_bytes=request_bytes)
        if log is not None:  # this client reads the events as they come; if it leaves, the response goes on
            return StreamingResponse(log.follow(0), media_type="text/event-stream")
        return JSONResponse(queued.model_dump())
    if req.stream:
        choices = ChoiceStream(run.streams, 1, [len(run.prompt_ids)])
        return StreamingResponse(_events(run, choices, response, keep, keep_failed), media_type="text/event-stream")
    (output,) = await collect(request, run.streams)
    final = _answered(run, response, output)
    keep(final)
    return JSONResponse(final.model_dump())


def _answered(run: ChatRun, response: ResponseObject, output: RequestOutput) -> ResponseObject:
    """The response that an engine request's final output answers."""
    completion = output.outputs[0]
    message, _ = run.read(completion)
    usage = UsageInfo.of(len(run.prompt_ids), output.num_generated_tokens, output.num_cached_tokens)
    return _finished(response, _output_items(message), completion.finish_reason, usage)


async def _answer_in_background(store: ResponseStore, run: ChatRun, response: ResponseObject,
                                messages: list[dict[str, Any]], log: EventLog | None) -> None:
    """A background response's task: in progress, then what the engine answered, or failed with the error a
    client would have been sent, or cancelled (its engine request aborted as it ends). With `log`, it streams:
    each event goes to the log, for the clients that read it now or later."""

    def keep(final: ResponseObject) -> None:
        store.settle(final, _conversation_after(messages, list(final.output)))

    def keep_failed(failed: ResponseObject) -> None:
        store.settle(failed)

    try:
        store.settle(response)
        if log is None:
            (output,) = await finals(run.streams)
            keep(_answered(run, response, output))
            return
        choices = ChoiceStream(run.streams, 1, [len(run.prompt_ids)])
        # Each frame's index in the log is its sequence_number (_EventWriter numbers them from 0).
        async for frame in _events(run, choices, response, keep, keep_failed, queued=True):
            log.append(frame)
    except asyncio.CancelledError:  # POST .../cancel, DELETE, or the server's loop ending; readers of its
        store.settle(response.model_copy(update={"status": "cancelled"}))  # events see them end: GET says why
        raise
    except ENGINE_ERRORS as e:  # (a streamed one's are in its events already)
        keep_failed(_failed(response, engine_error(e)))
    except Exception as e:  # a bug must not leave the response in progress for ever
        logger.exception("background response %s failed", response.id)
        failed = _failed(response, APIError(500, f"{type(e).__name__}: {e}"))
        keep_failed(failed)
        if log is not None:  # its readers get the end a failed stream has
            out = _EventWriter(first=len(log.frames))
            log.append(out.event("error", code=failed.error.code, message=failed.error.message, param=None))
            log.append(out.event("response.failed", response=failed.model_dump()))


def _failed(response: ResponseObject, error: APIError) -> ResponseObject:
    """Failed, with the error a client would have been sent; its code a string, as OpenAI's ("server_error")."""
    info = error_body(error.status, error.message, error.param).error
    return response.model_copy(update={"status": "failed", "error": info.model_copy(update={"code": info.type})})


def _stored(request: Request) -> tuple[ResponseStore, StoredResponse]:
    store = get_serving(request).responses
    response_id = request.path_params["response_id"]
    stored = store.get(response_id)
    if stored is None:
        raise _response_not_found(response_id)
    return store, stored


def _response_not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param)


async def retrieve_response(request: Request) -> Response:
    """A stored response; with `stream=true`, a background response created with stream=true as its events,
    those after `starting_after` (a sequence number) and then each as it comes."""
    _, stored = _stored(request)
    query = validate(ResponseQuery, dict(request.query_params))
    if not query.stream:
        return JSONResponse(stored.response.model_dump())
    if stored.events is None:
        raise APIError(400, "only a background response created with stream=true can be streamed", "stream")
    if stored.events.dropped:
        raise APIError(400, "this response's events are no longer kept (the store keeps the newest); GET it "
                            "without stream", "stream")
    return StreamingResponse(stored.events.follow(query.starting_after + 1), media_type="text/event-stream")


async def list_input_items(request: Request) -> Response:
    """A page of the input items a stored response was asked with, as OpenAI lists them: `order` desc (the
    default, newest first) or asc, `limit` 1-100 (20), `after` the id of the item the page follows."""
    _, stored = _stored(request)
    query = validate(InputItemsQuery, dict(request.query_params))
    items = list(stored.input_items) if query.order == "asc" else list(reversed(stored.input_items))
    start = 0
    if query.after is not None:
        ids = [item["id"] for item in items]
        if query.after not in ids:
            raise APIError(400, f"after names no input item of this response: {query.after!r}", "after")
        start = ids.index(query.after) + 1
    limit = query.limit
    page = items[start:start + limit]
    return JSONResponse(ResponseItemList(data=page, first_id=page[0]["id"] if page else None,
                                         last_id=page[-1]["id"] if page else None,
                                         has_more=start + limit < len(items)).model_dump())


async def cancel_response(request: Request) -> Response:
    """Ends a background response that runs (its engine request aborted) and answers it as it then stands:
    cancelled, or as it ended if it ended first (OpenAI's cancel is idempotent)."""
    store, stored = _stored(request)
    response = stored.response
    if not response.background:
        raise APIError(400, "only a response created with background=true can be cancelled", "response_id")
    await store.cancel(response.id)
    if (stored := store.get(response.id)) is None:  # deleted while it was being cancelled
        raise _response_not_found(response.id)
    return JSONResponse(stored.response.model_dump())


async def delete_response(request: Request) -> Response:
    """Forgets a stored response, cancelling it first if it runs in the background."""
    store, stored = _stored(request)
    await store.delete(stored.response.id)
    return JSONResponse(ResponseDeleted(id=stored.response.id).model_dump())


class _EventWriter:
    """Numbers and frames a streamed response's events, and tracks its output items as they open and close."""

    def __init__(self, first: int = 0) -> None:
        self.sequence_number = first
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def open_item(self, item: OutputItem) -> list[str]:
        """Closes the open item and opens `item` (a message's one text part with it)."""
        events = self.close_item()
        self.items.append(item)
        self.open = item
        added = item.model_copy(update={"status": "in_progress"})
        if isinstance(item, MessageItem | ReasoningItem):
            added = added.model_copy(update={"content": []})
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item=added.model_dump()))
        if isinstance(item, MessageItem):
            events.append(self.event("response.content_part.added", item_id=item.id,
                                     output_index=len(self.items) - 1, content_index=0,
                                     part=OutputText(text="").model_dump()))
        return events

    def close_item(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items) - 1
        events = []
        if isinstance(item, MessageItem):
            part = item.content[0]
            events.append(self.event("response.output_text.done", item_id=item.id, output_index=index,
                                     content_index=0, text=part.text, logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item.id, output_index=index,
                                     content_index=0, part=part.model_dump()))
        elif isinstance(item, ReasoningItem):
            events.append(self.event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                     content_index=0, text=item.content[0].text))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                     name=item.name, arguments=item.arguments))
        events.append(self.event("response.output_item.done", output_index=index, item=item.model_dump()))
        return events


async def _events(run: ChatRun, choices: ChoiceStream, response: ResponseObject,
                  keep: Callable[[ResponseObject], None], keep_failed: Callable[[ResponseObject], None],
                  queued: bool = False) -> AsyncIterator[str]:
    """A streamed response: created (`queued`: created queued, then response.queued, as OpenAI's background
    streams begin), in progress, each output item's events as its text arrives, then completed (or
    incomplete), kept with `keep`; an engine failure after the start ends it with an error event and
    failed, kept with `keep_failed`."""
    out = _EventWriter()
    if queued:
        waiting = response.model_copy(update={"status": "queued"}).model_dump()
        yield out.event("response.created", response=waiting)
        yield out.event("response.queued", response=waiting)
    else:
        yield out.event("response.created", response=response.model_dump())
    yield out.event("response.in_progress", response=response.model_dump())
    thoughts, tools = run.reasoning_stream(), run.tool_stream()
    finish_reason = None
    try:
        async for delta in choices:
            final = delta.finish_reason is not None
            finish_reason = delta.finish_reason or finish_reason
            text, thought = delta.completion.text_delta, ""
            if thoughts is not None:
                thought, text = thoughts.feed(text, final)
            calls = []
            if tools is not None:
                text, calls = tools.feed(text, final, truncated=delta.finish_reason == "length")
            if thought:
                if not isinstance(out.open, ReasoningItem):
                    for event in out.open_item(ReasoningItem(id=_item_id("rs"), content=[ReasoningText(text="")])):
                        yield event
                item = out.open
                item.content[0].text += thought
                yield out.event("response.reasoning_text.delta", item_id=item.id, output_index=len(out.items) - 1,
                                content_index=0, delta=thought)
            if text:
                if not isinstance(out.open, MessageItem):
                    for event in out.open_item(MessageItem(id=_item_id("msg"), content=[OutputText(text="")])):
                        yield event
                item = out.open
                item.content[0].text += text
                yield out.event("response.output_text.delta", item_id=item.id, output_index=len(out.items) - 1,
                                content_index=0, delta=text, logprobs=[])
            for call in calls:
                if call.id is not None:  # a new call: its id and name come first
                    for event in out.open_item(FunctionCallItem(id=_item_id("fc"), call_id=call.id,
                                                                name=call.name or "", arguments="")):
                        yield event
                item = out.open
                if call.arguments and isinstance(item, FunctionCallItem):
                    item.arguments += call.arguments
                    yield out.event("response.function_call_arguments.delta", item_id=item.id,
                                    output_index=len(out.items) - 1, delta=call.arguments)
        for event in out.close_item():
            yield event
    except Exception as e:  # the engine's errors, or a fault of the server's own: a 500 in the stream
        if not isinstance(e, ENGINE_ERRORS):
            logger.exception("response %s failed after its stream began", response.id)
        error = engine_error(e) if isinstance(e, ENGINE_ERRORS) else APIError(500, "internal server error")
        failed = _failed(response, error).model_copy(update={"output": out.items})
        keep_failed(failed)
        yield out.event("error", code=failed.error.code, message=failed.error.message, param=failed.error.param)
        yield out.event("response.failed", response=failed.model_dump())
        return
    final = _finished(response, out.items, finish_reason, choices.usage)
    keep(final)
    yield out.event("response.incomplete" if final.status == "incomplete" else "response.completed",
                    response=final.model_dump())
