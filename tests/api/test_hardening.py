"""A hostile client against a real server: every defect of the hardening issue, through real HTTP.

Each case checks the status and OpenAI's error envelope, and that the server still answers a normal
request correctly afterwards with nothing left running, waiting or holding KV pages.
"""

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.api.helpers import API_KEY, MODEL, metric, start_server, stop_server, wait_idle

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def still_serving(server, headers: dict[str, str] = AUTH) -> None:
    """A normal request answers exactly, then the engine is idle and /health is 200."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    first = httpx.post(f"{server.v1}/completions", headers=headers, json=body, timeout=60)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["completion_tokens"] == 4
    again = httpx.post(f"{server.v1}/completions", headers=headers, json=body, timeout=60)
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    wait_idle(server)
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def post_raw(server, path: str, body: bytes | str, timeout: float = 60) -> httpx.Response:
    content = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    return httpx.post(f"{server.base_url}{path}", headers={**AUTH, "Content-Type": "application/json"},
                      content=content, timeout=timeout)


def assert_error(response: httpx.Response, status: int, param: str | None = None, pattern: str = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] == "invalid_request_error"
    assert pattern.lower() in error["message"].lower(), error
    if param is not None:
        assert error["param"] == param, error


# 1. Sampling fields: one rule, every float finite, every int fits the device arrays.
@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", '{"prompt": "hi", "top_k": 2147483648}', "top_k"),  # killed the engine before
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "top_k": 99999999999}',
         "top_k"),
        ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
        ("/v1/completions", '{"prompt": "hi", "temperature": Infinity}', "temperature"),
        ("/v1/completions", '{"prompt": "hi", "temperature": 1e308}', "temperature"),
        ("/v1/completions", '{"prompt": "hi", "temperature": 1e999}', "temperature"),
        ("/v1/completions", '{"prompt": "hi", "top_p": -Infinity}', "top_p"),
        ("/v1/completions", '{"prompt": "hi", "repetition_penalty": 1e-300}', "repetition_penalty"),
        ("/v1/completions", '{"prompt": "hi", "presence_penalty": 2.5}', "presence_penalty"),
        ("/v1/completions", '{"prompt": "hi", "frequency_penalty": NaN}', "frequency_penalty"),
        ("/v1/completions", '{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": 1099511627776}', "max_tokens"),
        ("/v1/completions", '{"prompt": "hi", "min_tokens": 5, "max_tokens": 2}', "min_tokens"),
        ("/v1/completions", '{"prompt": "hi", "logprobs": 21}', "logprobs"),
        ("/v1/completions", '{"prompt": "hi", "logit_bias": {"abc": 1}}', "logit_bias"),
        ("/v1/completions", '{"prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias"),
        ("/v1/completions", '{"prompt": "hi", "logit_bias": {"99999999": 1}}', "logit_bias"),
        ("/v1/completions", '{"prompt": "hi", "stop_token_ids": [-1]}', "stop_token_ids"),
        ("/v1/completions", '{"prompt": "hi", "n": 129}', "n"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "n": 4000}', "n"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, '
                                 '"top_logprobs": 21}', "top_logprobs"),
        # each field named as its API spells it, in the param and the message
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}',
         "max_completion_tokens"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "min_tokens": 5, '
                                 '"max_completion_tokens": 2}', "min_tokens"),
        ("/v1/responses", '{"input": "hi", "max_output_tokens": 0}', "max_output_tokens"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", '
                                 '"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": '
                                 '"object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]}', "tools"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
                                 '"json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}}',
         "response_format"),
        ("/v1/completions", '{"prompt": ["a", "b", "c", "d", "e", "f", "g", "h", "i"], "n": 128}', "prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": '
                                 '"x"}]}', "messages.1.role"),
        ("/v1/completions", '{"prompt": "hi", "priority": 1}', "priority"),
        ("/v1/completions", '{"prompt": "hi", "priority": -9223372036854775809}', "priority"),
        ("/v1/responses", '{"input": "hi", "temperature": NaN}', "temperature"),
        ("/v1/responses", '{"input": "hi", "priority": 9223372036854775808}', "priority"),
    ],
)
def test_out_of_range_sampling_fields_are_400s(server, path, body, param):
    response = post_raw(server, path, body)
    assert_error(response, 400, param)
    if param in ("max_completion_tokens", "max_output_tokens") or "max_completion_tokens" in body:
        assert param in response.json()["error"]["message"] and "max_tokens" not in response.json()["error"]["message"]


def test_the_engine_survives_them_all(server):
    still_serving(server)
    assert "Traceback" not in server.log()


# 2. Malformed input: 400s, never 500s.
def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


def _call_with(arguments: str) -> dict:
    """An assistant turn that called tool f with `arguments` (a JSON text)."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


_TOOL_REPLY = {"role": "tool", "tool_call_id": "c1", "content": "x"}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", '{"prompt": ' + nested(1000) + "}", None),
        ("/v1/completions", '{"prompt": "hi", "user": ' + nested(100_000) + "}", None),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": '
                                 '{"x": ' + nested(1000) + "}}", None),
        ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages.0.content"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
         "messages.0.content.0.text"),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
        # content parts: each error names the part, and the text where a text part has none
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
         "messages.0.content.0.text"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
         "messages.0.content.0.text"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
                                 '{"type": "image_url"}]}]}', "messages.0.content.1"),
        ("/v1/responses", '{"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}',
         "input.0.content.0.text"),
        ("/v1/completions", '{"prompt": "hi", "model": "\\ud800"}', "model"),
        ("/v1/completions", '{"prompt": "hi", "\\ud800": 1}', None),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', None),
        # an integer of more digits than Python converts (4,300), in any field, known or not
        ("/v1/completions", '{"prompt": "hi", "x": ' + "1" * 4301 + "}", None),
        ("/v1/completions", '{"prompt": [' + "7" * 5000 + "]}", None),
        ("/tokenize", '{"prompt": "hi", "add_special_tokens": ' + "1" * 5000 + "}", None),
        # tool-call arguments, a JSON text inside a string, nested past Python's recursion limit or the body's
        ("/v1/chat/completions", json.dumps({"messages": [*FRANCE, _call_with(nested(100_000)), _TOOL_REPLY]}),
         "messages.1.tool_calls"),
        ("/v1/chat/completions", json.dumps({"messages": [*FRANCE, _call_with(nested(500)), _TOOL_REPLY]}),
         "messages.1.tool_calls"),
        ("/tokenize", json.dumps({"messages": [*FRANCE, _call_with(nested(100_000)), _TOOL_REPLY]}),
         "messages.1.tool_calls"),
        ("/v1/responses", json.dumps({"input": [{"type": "function_call", "call_id": "c1", "name": "f",
                                                 "arguments": nested(100_000)},
                                                {"type": "function_call_output", "call_id": "c1", "output": "r"}]}),
         "input.0.arguments"),
        ("/v1/responses", json.dumps({"input": [{"role": "user", "content": "hi"},
                                                {"type": "function_call", "call_id": "c1", "name": "f",
                                                 "arguments": "not json"}]}), "input.1.arguments"),
    ],
)
def test_malformed_bodies_are_400s(server, path, body, param):
    assert_error(post_raw(server, path, body), 400, param)


def test_the_server_survives_malformed_bodies(server):
    still_serving(server)
    assert "Traceback" not in server.log()


# 3. The event loop never blocks on a request's size or template.
def health_latencies_while(server, work) -> tuple[list[float], object]:
    """Polls /health every 50 ms while `work()` runs on another thread; returns the latencies and its result."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", work()))
    thread.start()
    latencies = []
    while thread.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.05)
    thread.join()
    return latencies, result["value"]


def test_a_10mb_prompt_is_refused_without_stalling_health(server):
    huge = "lorem ipsum " * (10 * 2**20 // 12)
    for path, body in (("/v1/completions", {"prompt": huge, "max_tokens": 1}),
                       ("/tokenize", {"prompt": huge}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})):
        latencies, response = health_latencies_while(
            server, lambda path=path, body=body: httpx.post(f"{server.base_url}{path}", headers=AUTH, json=body,
                                                             timeout=120))
        assert_error(response, 400, pattern="maximum context length")
        assert max(latencies, default=0) < 2.0, latencies  # a generous bound, not a benchmark
    still_serving(server)


def test_request_chat_templates_are_refused_unless_trusted(server):
    body = {"messages": FRANCE, "chat_template": "{{ 'a ' * 2000000 }}"}
    assert_error(httpx.post(f"{server.v1}/chat/completions", headers=AUTH, json=body), 400, "chat_template",
                 "--trust-request-chat-template")
    reserved = {"messages": FRANCE, "chat_template_kwargs": {"tokenize": True}}
    assert_error(httpx.post(f"{server.v1}/chat/completions", headers=AUTH, json=reserved), 400,
                 "chat_template_kwargs")


# 5. Error messages carry the right numbers.
def test_context_length_error_without_max_tokens(server):
    long_text = "The quick brown fox jumps over the lazy dog. " * 240  # ~2,400 tokens > 2,048
    response = httpx.post(f"{server.v1}/chat/completions", headers=AUTH,
                          json={"messages": [{"role": "user", "content": long_text}]})
    assert_error(response, 400, "prompt", "maximum context length is 2048 tokens")
    message = response.json()["error"]["message"]
    assert "leaves no room" in message and " -" not in message, message


# 9. Endpoints and 405s.
def test_405_ping_load(server):
    response = httpx.get(f"{server.v1}/completions", headers=AUTH)
    assert_error(response, 405)
    assert "POST" in response.headers["allow"]
    assert httpx.get(f"{server.base_url}/ping").status_code == 200
    assert httpx.post(f"{server.base_url}/ping").status_code == 200
    load = httpx.get(f"{server.base_url}/load").json()
    assert load == {"server_load": 0}


# 8. An access log line per request, as vLLM users read it.
def test_access_log(server):
    httpx.get(f"{server.v1}/models", headers={**AUTH, "User-Agent": "access-log-probe"})
    deadline = time.monotonic() + 5
    while '"GET /v1/models HTTP/1.1" 200' not in server.log():
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.1)


# Servers of their own: trusting request templates, short body and shutdown timeouts.
@pytest.fixture(scope="module")
def trusting_server(tmp_path_factory, compile_cache):
    server = start_server(tmp_path_factory.mktemp("trusting"), compile_cache, "--trust-request-chat-template",
                          "--body-read-timeout", "2", "--shutdown-timeout", "4")
    yield server
    stop_server(server)


def test_trusted_templates_render_off_the_loop(trusting_server):
    server = trusting_server
    slow = ("{% for i in range(400) %}{% for j in range(400) %}{% for k in range(20) %}{% endfor %}{% endfor %}"
            "{% endfor %}{{ messages[0]['content'] }}")
    body = {"messages": FRANCE, "chat_template": slow, "max_tokens": 2, "temperature": 0}
    latencies, response = health_latencies_while(
        server, lambda: httpx.post(f"{server.v1}/chat/completions", json=body, timeout=120))
    assert response.status_code == 200, response.text
    assert max(latencies, default=0) < 2.0, latencies
    inflated = {"messages": FRANCE, "chat_template": "{{ 'a ' * 2000000 }}"}
    assert_error(httpx.post(f"{server.v1}/chat/completions", json=inflated, timeout=60), 400, "messages",
                 "maximum context length")
    still_serving(server, {})


def test_slow_and_vanishing_uploads(trusting_server):
    server = trusting_server
    host, port = server.base_url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=30) as stalled:
        stalled.sendall(head + b'{"prompt": "hi"')
        start = time.monotonic()
        reply = b""
        while chunk := stalled.recv(65536):  # the server closes the connection after its answer
            reply += chunk
        waited = time.monotonic() - start
    reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert 1.5 < waited < 10 and '"invalid_request_error"' in reply
    time.sleep(0.5)  # the 408's access line
    before = server.log().count("\n")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=30) as vanishing:
            vanishing.sendall(head + b'{"prompt": ')
        time.sleep(0.3)
    time.sleep(1.0)
    new_lines = server.log().splitlines()[before:]
    assert "Traceback" not in server.log() and not any("ERROR" in line for line in new_lines), new_lines
    # A quiet line and an access line each; the background warm-up's and the periodic stats' own lines may
    # land in the window.
    connection_lines = [line for line in new_lines if "/v1/completions" in line]
    assert len(connection_lines) <= 2 * 3, new_lines
    still_serving(server, {})


async def read_stream(server, body: dict) -> list[str]:
    events = []
    async with httpx.AsyncClient(timeout=120) as http, http.stream(
            "POST", f"{server.v1}/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    return events


# 7. Shutdown: the socket stays open while draining, new requests get a 503, cut streams end cleanly.
def signal_while_serving(server, send_signal: Callable[[], None]) -> tuple[httpx.Response, httpx.Response,
                                                                            httpx.Response, list[str]]:
    """A long stream and a short request run; `send_signal()`; then /health once it turns 503, a new request,
    the short request's answer and the stream's events."""
    long = {"prompt": "Tell me a long story.", "max_tokens": 1800, "stream": True, "ignore_eos": True}
    # Few tokens: the short request must finish inside the 4 s drain on a loaded machine too (20 did not once).
    short = {"prompt": "Hi", "max_tokens": 6, "ignore_eos": True}

    async def scenario():
        stream = asyncio.create_task(read_stream(server, long))
        async with httpx.AsyncClient(timeout=60) as http:
            finishing = asyncio.create_task(http.post(f"{server.v1}/completions", json=short))
            deadline = time.monotonic() + 60
            while metric(server, "jaxserve:num_requests_running") < 2:
                assert time.monotonic() < deadline, "the stream and the short request did not both run"
                await asyncio.sleep(0.05)
            send_signal()
            deadline = time.monotonic() + 30
            while (health := await http.get(f"{server.base_url}/health")).status_code != 503:
                assert time.monotonic() < deadline, "/health did not turn 503 after the signal"
                await asyncio.sleep(0.1)
            refused = await http.post(f"{server.v1}/completions", json=short)
            finished = await finishing
        return health, refused, finished, await stream

    return asyncio.run(scenario())


def assert_drained(server, health: httpx.Response, refused: httpx.Response, finished: httpx.Response,
                   events: list[str]) -> None:
    assert health.status_code == 503
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    assert refused.headers.get("connection") == "close"
    assert finished.status_code == 200 and finished.json()["usage"]["completion_tokens"] == 6
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    assert server.process.wait(60) == 0
    with pytest.raises(httpx.TransportError):  # the socket closed once the drain was over
        httpx.get(f"{server.base_url}/health", timeout=2)
    log = server.log()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]


def wait_for_warmup(server) -> None:
    """Until the background warm-up has compiled every bucket: steps in the largest bucket while it takes the
    cores made a short request miss the drain once on a loaded CI machine."""
    deadline = time.monotonic() + 300
    while "warm-up: all" not in server.log() and not re.search(r"warm-up: \d+ buckets compiled", server.log()):
        if time.monotonic() > deadline:
            pytest.fail(f"the background warm-up did not finish in 300 s:\n{server.log()[-3000:]}")
        time.sleep(0.2)


def test_sigterm_drains_then_ends_streams_cleanly_and_exits_0(trusting_server):
    """A background response that runs does not hold the drain (no client could read it after), and the
    shutdown cancels it cleanly: exit 0, no traceback."""
    server = trusting_server
    story = {"input": "Tell me a long story.", "max_output_tokens": 1800, "background": True}
    background = httpx.post(f"{server.v1}/responses", json=story, timeout=60)
    assert background.status_code == 200 and background.json()["status"] == "queued", background.text
    running = httpx.get(f"{server.v1}/responses/{background.json()['id']}", timeout=60).json()
    assert running["status"] in ("queued", "in_progress"), running
    wait_for_warmup(server)
    assert_drained(server, *signal_while_serving(server, lambda: server.process.send_signal(signal.SIGTERM)))


def test_ctrl_c_to_the_process_group_drains_an_engine_core_process(tmp_path: Path, compile_cache):
    """A Ctrl-C reaches every process of the group, the engine core's too: the core keeps serving while
    the server drains, and the short request in flight still finishes."""
    server = start_server(tmp_path, compile_cache, "--engine-process", "--shutdown-timeout", "4", new_session=True)
    try:
        wait_for_warmup(server)
        assert_drained(server, *signal_while_serving(server, lambda: os.killpg(server.process.pid, signal.SIGINT)))
        assert "engine core failed" not in server.log()
    finally:
        stop_server(server)


# 1. A runtime fault (not a request's) stops the engine; the server drains and exits non-zero.
INJECT_DEVICE_FAULT = '''
import sys
from jaxserve.runner import model_runner

original = model_runner.ModelRunner.launch


def launch(self, scheduler_output):
    if any(new.sampling_seed == 424242 for new in scheduler_output.new_requests):
        raise RuntimeError("injected device fault")
    return original(self, scheduler_output)


model_runner.ModelRunner.launch = launch
from jaxserve.cli import main

main(sys.argv[1:])
'''


def test_a_runtime_fault_drains_and_exits_1(tmp_path: Path, compile_cache):
    script = tmp_path / "faulty_device.py"
    script.write_text(INJECT_DEVICE_FAULT)
    server = start_server(tmp_path, compile_cache, launcher=(str(script),))
    try:
        still_serving(server, {})
        doomed = httpx.post(f"{server.v1}/completions", json={"prompt": "hi", "seed": 424242, "max_tokens": 5},
                            timeout=60)
        assert doomed.status_code == 503 and "injected device fault" in doomed.json()["error"]["message"]
        assert server.process.wait(30) == 1
        assert "exiting with code 1" in server.log()
    finally:
        stop_server(server)


# 2. Compiles still under way in a background warm-up at shutdown: XLA cannot interrupt one, so the
# server exits once its requests are done and its engine stopped, without waiting for them.
STALL_BACKGROUND_COMPILES = '''
import sys
import threading
from jaxserve.runner import model_runner

original = model_runner.ModelRunner._compile_one
ready_bucket = threading.Event()


def compile_one(self, job, slots):
    if ready_bucket.is_set():  # every bucket after the one the server is ready with: a compile that never ends
        threading.Event().wait(3600)
    ready_bucket.set()
    return original(self, job, slots)


model_runner.ModelRunner._compile_one = compile_one
from jaxserve.cli import main

main(sys.argv[1:])
'''


def test_sigterm_exits_without_waiting_for_background_compiles(tmp_path: Path, compile_cache):
    script = tmp_path / "stalled_compiles.py"
    script.write_text(STALL_BACKGROUND_COMPILES)
    server = start_server(tmp_path, compile_cache, "--warmup", "background", launcher=(str(script),))
    try:
        assert httpx.post(f"{server.v1}/completions", json={"prompt": "hi", "max_tokens": 3},
                          timeout=60).status_code == 200  # served by the one compiled bucket
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0  # before: the interpreter's exit joined the compile threads
        log = server.log()
        assert "server stopped" in log and "Traceback" not in log, log[-3000:]
    finally:
        stop_server(server)


def test_stream_options_without_stream_is_a_400(server):
    """OpenAI's and vLLM's rule: stream_options only with stream true (it was taken and ignored)."""
    for path, body in (("/v1/chat/completions", {"messages": FRANCE}), ("/v1/completions", {"prompt": "Hi"})):
        for stream in (False, None):
            response = httpx.post(f"{server.base_url}{path}", headers=AUTH, json={
                **body, "max_tokens": 2, "stream": stream, "stream_options": {"include_usage": True}})
            assert_error(response, 400, "stream_options")
            assert response.json()["error"]["param"] == "stream_options"
