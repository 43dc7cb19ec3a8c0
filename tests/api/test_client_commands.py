"""`jaxserve chat` and `jaxserve complete` (vLLM's `vllm chat` and `vllm complete`) against the real server:
each reply streamed to the terminal as the server sends it, the chat's conversation kept across turns, and
what goes wrong said in one line."""

import io

import httpx
import pytest

from jaxserve import client
from jaxserve.cli import main
from jaxserve.config import ClientConfig
from tests.api.helpers import API_KEY, MODEL


def _replies(server, messages: list[dict[str, str]], max_tokens: int) -> str:
    response = httpx.post(f"{server.v1}/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": MODEL, "messages": messages, "max_completion_tokens": max_tokens,
                                "temperature": 0}, timeout=60)
    return response.json()["choices"][0]["message"]["content"]


def test_the_chat_streams_each_reply_and_keeps_the_conversation(server, monkeypatch):
    """Two turns read as lines, then end of input: each request carries the conversation so far (the system
    prompt, the earlier turns), asked greedily here, so each printed reply is the one the chat API gives
    for that conversation."""
    lines = iter(["What is the capital of France?", "And of Italy?"])

    def read(prompt: str) -> str:
        assert prompt == "> "
        line = next(lines, None)
        if line is None:
            raise EOFError  # Ctrl-D
        return line

    sent: list[dict] = []
    stream_text = client.stream_text

    def greedy(http, url, body, config, text_of):
        sent.append({**body, "messages": list(body["messages"])})
        return stream_text(http, url, {**body, "temperature": 0}, config, text_of)

    monkeypatch.setattr(client, "stream_text", greedy)
    out = io.StringIO()
    config = ClientConfig(url=server.v1 + "/", api_key=API_KEY, system_prompt="Answer in one word.", max_tokens=12)
    conversation = client.chat(config, read=read, out=out)
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user", "assistant"]
    assert [len(body["messages"]) for body in sent] == [2, 4] and sent[1]["messages"] == conversation[:4]
    assert all(body["model"] == MODEL and body["max_completion_tokens"] == 12 for body in sent)
    for turn in (2, 4):
        assert conversation[turn]["content"] == _replies(server, conversation[:turn], 12)
    printed = out.getvalue().splitlines()
    assert printed[:2] == [f"Using model: {MODEL}", "Please enter a message for the chat model:"]
    assert printed[2:] == [conversation[2]["content"], conversation[4]["content"]]


def test_complete_quick_prints_one_completion_and_exits(server, capsys, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # the openai SDK's variable, as vLLM's client reads it
    main(["complete", "--url", server.v1, "--max-tokens", "6", "-q", "The capital of France is"])
    printed = capsys.readouterr().out
    assert printed.endswith("\n") and printed[:-1].strip()
    tokens = httpx.post(f"{server.base_url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": MODEL, "prompt": printed[:-1], "add_special_tokens": False}).json()["count"]
    assert 1 <= tokens <= 7  # six tokens, which may tokenize apart once decoded


@pytest.mark.parametrize(("argv", "message"), [
    (["--api-key", "wrong", "-q", "hi"], "/v1/models: HTTP 401"),
    (["--api-key", API_KEY, "--max-tokens", "100000", "-q", "hi"], "HTTP 400: This model's maximum context length"),
    (["--api-key", API_KEY, "--model-name", "no-such-model", "-q", "hi"], "HTTP 404: The model `no-such-model`"),
])
def test_what_goes_wrong_is_said_in_one_line(server, capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        main(["chat", "--url", server.v1, *argv])
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxserve: error: ") and message in err[-1], err
