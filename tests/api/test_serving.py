"""Serving helpers in isolation: generation-config defaults, chat templates, stream merging, errors."""

import asyncio
import json

import pytest
from pydantic import BaseModel

from jaxserve.api.errors import APIError, validate
from jaxserve.api.serving import check_server_files, load_chat_template, merge_streams
from jaxserve.config import ServerConfig
from jaxserve.models.source import load_generation_defaults


def test_generation_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 77, "do_sample": True, "top_k": None}
    ))
    assert load_generation_defaults("auto", tmp_path) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 77}
    assert load_generation_defaults("vllm", tmp_path) == {}
    assert load_generation_defaults(str(tmp_path), None)["temperature"] == 0.6
    assert load_generation_defaults("auto", tmp_path / "missing") == {}
    with pytest.raises(FileNotFoundError):
        load_generation_defaults(str(tmp_path / "missing"), None)


def test_chat_template_from_file_or_inline(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template
    assert load_chat_template(template) == template
    assert load_chat_template(None) is None


def test_a_chat_template_that_looks_like_a_path_must_open_and_an_inline_one_has_its_escapes_decoded(tmp_path):
    """vLLM's rule: no `{`, `}` nor newline makes the value a path; a shell's `\\n` in an inline template is
    a newline. Characters beyond latin-1 survive the decoding (vLLM's own decode garbles them)."""
    for mistyped in (str(tmp_path / "tempalte.jinja"), "templates/chat.jinja", str(tmp_path)):
        with pytest.raises(FileNotFoundError, match="looks like a file path but cannot be read"):
            load_chat_template(mistyped)
    assert load_chat_template("{{ messages[0]['content'] }}\\n") == "{{ messages[0]['content'] }}\n"
    assert load_chat_template("{{ '日本 é' }}\\t") == "{{ '日本 é' }}\t"
    assert load_chat_template("{{ 'x' }}" * 5000) == "{{ 'x' }}" * 5000  # too long a name for a path


def test_the_server_s_files_are_read_before_the_model_loads(tmp_path):
    check_server_files(ServerConfig(chat_template="{{ 1 }}", generation_config="vllm"))
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        check_server_files(ServerConfig(chat_template=str(tmp_path / "missing.jinja")))
    with pytest.raises(FileNotFoundError, match=r"--generation-config: no generation_config\.json in"):
        check_server_files(ServerConfig(generation_config=str(tmp_path)))
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6}')
    check_server_files(ServerConfig(generation_config=str(tmp_path)))


def test_merge_streams_interleaves_and_cancels_producers_when_closed():
    closed: list[int] = []

    async def producer(index: int, delays: list[float]):
        try:
            for step, delay in enumerate(delays):
                await asyncio.sleep(delay)
                yield f"{index}:{step}"
        finally:
            closed.append(index)

    async def run():
        # producer 0 yields at 0 and 0.5 s, producer 1 at 0.1 and 0.2 s: margins a loaded machine keeps
        merged = merge_streams([producer(0, [0.0, 0.5]), producer(1, [0.1, 0.1])])
        order = [item async for _, item in merged]
        assert order == ["0:0", "1:0", "1:1", "0:1"]
        assert sorted(closed) == [0, 1]
        closed.clear()
        merged = merge_streams([producer(0, [0.0] + [1.0] * 10), producer(1, [0.0] + [1.0] * 10)])
        await anext(merged)
        await merged.aclose()  # the client left: both producers must be cancelled
        assert sorted(closed) == [0, 1]

    asyncio.run(run())


def test_validation_errors_name_the_field_without_union_member_names():
    class Body(BaseModel):
        prompt: str | list[int]
        ids: list[int] = []
        n: int = 1

    with pytest.raises(APIError) as info:
        validate(Body, {"prompt": 5})
    assert info.value.status == 400 and info.value.param == "prompt"
    with pytest.raises(APIError) as info:
        validate(Body, {"prompt": "hi", "ids": [1, "x"]})
    assert info.value.param == "ids.1"
    with pytest.raises(APIError) as info:
        validate(Body, {"prompt": "hi", "n": "many"})
    assert info.value.param == "n"


def test_generation_overrides_go_over_the_model_s_defaults(tmp_path):
    """--override-generation-config, vLLM's: its values over the model's generation_config.json (or alone,
    with --generation-config vllm), by the file's names."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    overrides = {"temperature": 0.2, "max_new_tokens": 5, "top_k": None}
    assert load_generation_defaults("auto", tmp_path, overrides) == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 5}
    assert load_generation_defaults("vllm", tmp_path, overrides) == {"temperature": 0.2, "max_tokens": 5}
    assert load_generation_defaults("auto", None, {"min_p": 0.1}) == {"min_p": 0.1}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"temperature": -1}, "temperature: temperature must be a finite number"),
    ({"max_new_tokens": 0}, "max_new_tokens: max_tokens must be an integer in [1, "),
    ({"top_p": "high"}, "top_p: top_p must be a finite number"),
])
def test_generation_overrides_are_checked_at_start(overrides, message):
    from jaxserve.config import ServerConfig

    with pytest.raises(ValueError) as raised:
        ServerConfig(override_generation_config=overrides)
    assert message in str(raised.value)


def test_generation_overrides_jaxserve_does_not_take_are_ignored_with_a_warning(tmp_path, caplog):
    """As vLLM does: a model card's generation settings copied whole (do_sample, say) start the server."""
    from jaxserve.config import ServerConfig

    overrides = {"do_sample": True, "temperature": 0.6}
    ServerConfig(override_generation_config=overrides)
    assert "'do_sample' is not a default jaxserve takes (temperature, top_p, top_k" in caplog.text
    assert load_generation_defaults("vllm", None, overrides) == {"temperature": 0.6}


def test_a_stream_that_fails_after_its_200_ends_with_an_error_event_and_done():
    """A fault of the server's own while a stream runs (past the 200, so no status can change) is an error
    event then [DONE], as an engine error is; before, the connection was cut mid-body with neither."""
    from jaxserve.api.protocol import UsageInfo
    from jaxserve.api.streaming import sse, sse_data

    async def chunks():
        yield UsageInfo.of(1, 1, 0)
        raise RuntimeError("a bug in a chunk builder")

    async def frames() -> list[str]:
        return [frame async for frame in sse(chunks(), None)]

    sent = asyncio.run(frames())
    assert sent[0] == sse_data(UsageInfo.of(1, 1, 0)) and sent[-1] == "data: [DONE]\n\n"
    error = json.loads(sent[1].removeprefix("data: "))["error"]
    assert error["code"] == 500 and error["type"] == "server_error" and "RuntimeError" not in error["message"]


def test_a_large_body_s_input_is_converted_on_a_worker_thread():
    """`ModelServing.by_size`: the Python work on a large body's input (a Responses request's 300k items took
    seconds) runs on a worker thread, so the event loop answers others meanwhile; a small one's runs here."""
    import threading
    from types import SimpleNamespace

    from jaxserve.api.serving import ModelServing

    async def thread_of(nbytes: int) -> threading.Thread:
        request = SimpleNamespace(state=SimpleNamespace(json_body_bytes=nbytes))
        return await ModelServing.by_size(request, threading.current_thread)

    async def main():
        return threading.current_thread(), await thread_of(1_000), await thread_of(10 * 2**20)

    loop_thread, small, large = asyncio.run(main())
    assert small is loop_thread and large is not loop_thread


def test_a_large_body_s_long_lists_are_validated_an_item_at_a_time_to_the_same_request():
    """`errors.validate_in_pieces` (a large body's validation, on a worker thread): the same request as one
    validation, and an invalid item named as one validation names it."""
    from jaxserve.api.errors import APIError, validate, validate_in_pieces
    from jaxserve.api.protocol import ChatCompletionRequest

    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(3000)]
    body = {"model": "m", "max_tokens": 3, "messages": messages}
    assert validate_in_pieces(ChatCompletionRequest, body) == validate(ChatCompletionRequest, body)
    bad = {**body, "messages": [*messages[:2500], {"role": "user", "content": 5}, *messages[2500:]]}
    errors = []
    for check in (validate, validate_in_pieces):
        with pytest.raises(APIError) as info:
            check(ChatCompletionRequest, bad)
        errors.append((info.value.param, info.value.message))
    assert errors[0] == errors[1] and errors[0][0].startswith("messages.2500.content"), errors


def test_a_large_body_s_lists_are_freed_off_the_event_loop(monkeypatch):
    """A large body's long lists are emptied a slice at a time off the event loop: the parsed body's once it is
    validated (the request holds its own copies), the request's once its response is done
    (`LongListsMiddleware`), so that freeing either on the loop does not stop it (200,000 messages held it for
    about 75 ms)."""
    import asyncio
    import threading

    from starlette.datastructures import State

    from jaxserve import collector
    from jaxserve.api.middleware import LongListsMiddleware
    from jaxserve.api.protocol import ChatCompletionRequest
    from jaxserve.api.serving import ModelServing

    freed_on = []

    def recorded(*lists: list) -> None:
        freed_on.append((threading.current_thread(), [len(items) for items in lists]))
        collector.empty_in_pieces(*lists)

    monkeypatch.setattr("jaxserve.api.serving.empty_in_pieces", recorded)
    monkeypatch.setattr("jaxserve.api.middleware.empty_in_pieces", recorded)
    messages = [{"role": "user", "content": f"m{i}"} for i in range(3000)]
    stop = ["a", "b"]
    body = json.dumps({"model": "m", "messages": messages, "stop": stop}).encode() + b" " * (10 * 2**20)
    scope = {"type": "http", "state": {}}

    class Request:  # what `parse` reads of starlette's: its state is the scope's, as starlette's is
        state = State(scope["state"])

        async def body(self) -> bytes:
            return body

    async def main():
        serving = object.__new__(ModelServing)
        serving.config = type("Config", (), {"max_request_body_bytes": 64 * 2**20, "body_read_timeout": 60})()
        request = Request()
        monkeypatch.setattr("jaxserve.api.serving.read_body", lambda request, limit, timeout: request.body())
        req = None

        async def handler(scope, receive, send) -> None:
            nonlocal req
            req = await serving.parse(request, ChatCompletionRequest)
            parsed = request.state.json_body
            assert parsed["messages"] == [] and len(req.messages) == 3000  # the body's emptied, the request's kept

        await LongListsMiddleware(handler)(scope, None, None)
        return threading.current_thread(), req

    loop_thread, req = asyncio.run(main())
    assert req.messages == [] and req.stop == ["a", "b"]
    assert [lengths for _, lengths in freed_on] == [[3000], [3000]]
    assert all(thread is not loop_thread for thread, _ in freed_on)


def test_null_is_the_default_where_openai_lets_a_client_send_it():
    """n, stream, logprobs, echo, parallel_tool_calls and max_tokens sent as null take their defaults, as
    OpenAI's and vLLM's servers read them (a null was a 400; completions' max_tokens null ran to the context's
    end instead of its default 16)."""
    from jaxserve.api.protocol import ChatCompletionRequest, CompletionRequest

    completion = validate(CompletionRequest, {"prompt": "x", "max_tokens": None, "n": None, "stream": None,
                                              "echo": None, "logprobs": None})
    assert (completion.max_tokens, completion.n, completion.stream, completion.echo, completion.logprobs) == (
        16, 1, False, False, None)
    chat = validate(ChatCompletionRequest, {"messages": [], "n": None, "stream": None, "logprobs": None,
                                            "parallel_tool_calls": None, "max_tokens": None})
    assert (chat.n, chat.stream, chat.logprobs, chat.parallel_tool_calls, chat.max_tokens) == (1, False, False, True,
                                                                                                None)
    with pytest.raises(APIError, match="n"):
        validate(CompletionRequest, {"prompt": "x", "n": "two"})


def test_a_large_answer_is_built_and_encoded_on_a_worker_thread_to_the_same_bytes():
    """`ModelServing.answer`: an answer listing many logprobs is built off the event loop and encoded in pieces
    (`json_pieces.dumps_in_pieces`), to the bytes Starlette's JSONResponse of its dump gives; a small one is
    built here."""
    import threading

    from starlette.responses import JSONResponse

    from jaxserve.api.protocol import (
        ChatChoice,
        ChatCompletionResponse,
        ChatLogprobs,
        ChatResponseMessage,
        PromptLogprob,
        TokenLogprob,
        TopLogprob,
        UsageInfo,
    )
    from jaxserve.api.serving import LARGE_ANSWER_LOGPROBS, ModelServing

    def build() -> ChatCompletionResponse:
        built_on.append(threading.current_thread())
        tokens = [TokenLogprob(token=f"t\u00e9{i}\"", logprob=-i / 7, bytes=[116], top_logprobs=[
            TopLogprob(token=f"a{j}", logprob=-j / 3, bytes=[97]) for j in range(3)]) for i in range(40)]
        return ChatCompletionResponse(  # `created` given: the three builds may straddle a second
            id="x", created=1, model="m", usage=UsageInfo.of(3, 40, 0), prompt_logprobs=[None, {5: PromptLogprob(
                logprob=-1.5, rank=1, decoded_token="a")}],
            choices=[ChatChoice(index=i, message=ChatResponseMessage(role="assistant", content="h\u00e9"),
                                logprobs=ChatLogprobs(content=tokens), finish_reason="stop") for i in range(4)])

    async def main():
        return (threading.current_thread(), await ModelServing.answer(build, LARGE_ANSWER_LOGPROBS),
                await ModelServing.answer(build, LARGE_ANSWER_LOGPROBS + 1))

    built_on: list[threading.Thread] = []
    loop_thread, small, large = asyncio.run(main())
    assert built_on[0] is loop_thread and built_on[1] is not loop_thread
    expected = JSONResponse(build().model_dump()).body
    assert small.body == large.body == expected and large.media_type == "application/json"


def test_other_threads_run_while_a_large_answer_is_encoded():
    """pydantic's model_dump and json.dumps are one call each over a whole answer: in pieces, the lock passes."""
    import threading
    import time

    from jaxserve.api.json_pieces import dumps_in_pieces
    from jaxserve.api.protocol import ChatLogprobs, TokenLogprob, TopLogprob

    logprobs = ChatLogprobs(content=[TokenLogprob(token="t", logprob=-1.0, top_logprobs=[
        TopLogprob(token="a", logprob=-2.0, bytes=[97]) for _ in range(20)]) for _ in range(6000)])
    encoding, ticks = threading.Event(), []

    def tick() -> None:
        encoding.wait()
        while encoding.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    encoding.set()
    body = dumps_in_pieces(logprobs)
    encoding.clear()
    ticker.join()
    assert json.loads(body) == logprobs.model_dump() and len(ticks) >= 4, len(ticks)
