"""POST /invocations (SageMaker's route, as vLLM serves it) on the shared server: a chat body is answered as
/v1/chat/completions and a completion body as /v1/completions, the same greedy answers, streamed alike; the
key guards it; a body no endpoint takes is a 400 naming what the route takes. The pooling server's side is in
tests/api/test_scores.py."""

import json

import httpx
import pytest

from tests.api.helpers import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12,
        "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


def _post(server, path: str, body, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=120)


@pytest.mark.parametrize(("body", "path"), [(CHAT, "/v1/chat/completions"), (COMPLETION, "/v1/completions")])
def test_the_body_picks_the_endpoint_that_answers_it(server, body, path):
    direct, invoked = _post(server, path, body), _post(server, "/invocations", body)
    assert direct.status_code == invoked.status_code == 200, invoked.text
    want, got = direct.json(), invoked.json()
    assert got["object"] == want["object"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # the second hits the prefix cache
    assert [got["usage"][k] for k in counts] == [want["usage"][k] for k in counts]
    assert got["choices"][0] == want["choices"][0]


def test_a_streamed_chat_through_invocations_is_chat_s_stream(server):
    with httpx.stream("POST", f"{server.base_url}/invocations", json={**CHAT, "stream": True}, headers=AUTH,
                      timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
    assert text == _post(server, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"model": MODEL, "input": "hi"}, None, "messages (/v1/chat/completions); prompt (/v1/completions)"),
    ([CHAT], None, "must be a JSON object, not an array"),
    ("hi", None, "must be a JSON object, not a string"),
    ({"model": MODEL, "messages": "not a list"}, "messages", ""),  # chat's own validation, naming the field
    ({"model": MODEL, "messages": None, "prompt": 5}, "prompt", ""),  # a null field picks nothing: a completion
])
def test_what_invocations_refuses_is_a_400(server, body, param, message):
    response = _post(server, "/invocations", body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and message in error["message"], response.text


def test_a_null_field_picks_no_endpoint(server):
    body = {**COMPLETION, "messages": None}
    assert _post(server, "/invocations", body).json()["choices"][0] == _post(
        server, "/v1/completions", COMPLETION).json()["choices"][0]


def test_the_key_guards_invocations(server):
    assert _post(server, "/invocations", CHAT, headers={}).status_code == 401
