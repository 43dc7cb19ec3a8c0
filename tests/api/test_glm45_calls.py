"""GLM-4.5's tool calls through the chat endpoint, in-process on a tiny random Llama served with
`--tool-call-parser glm45`: the model's text is forced into GLM-4.5's format by a regex (as a GLM-4.5 model
would write it), and the answer must carry the typed calls, streamed and not, and finish as `tool_calls`."""

import json
import re

import pytest
from starlette.testclient import TestClient

from jaxserve.api.app import create_app
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from tests.engine.helpers import make_engine

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "when": {"type": "array"}}}}}]
WRITTEN = ("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>San Jose</arg_value>\n"
           "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>when</arg_key>\n<arg_value>[\"am\", 6]"
           "</arg_value>\n</tool_call>")
ARGUMENTS = {"city": "San Jose", "days": 3, "when": ["am", 6]}


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), warmup=False, max_model_len=512, num_kv_pages=512)
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="glm45")
    with TestClient(create_app(config, AsyncEngine(engine))) as client:
        yield client


def _body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Weather in San Jose for 3 days?"}], "tools": TOOLS,
            "max_tokens": 200, "temperature": 0, "structured_outputs": {"regex": re.escape(WRITTEN)}, **fields}


def test_a_call_comes_back_typed(client):
    response = client.post("/v1/chat/completions", json=_body())
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking.\n"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGUMENTS


def test_a_streamed_call_joins_to_the_same_arguments(client):
    response = client.post("/v1/chat/completions", json=_body(stream=True))
    chunks = [json.loads(line.removeprefix("data: ")) for line in response.text.split("\n\n")
              if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert content == "Checking.\n", "no part of the markup is sent as content"
    assert calls[0]["function"]["name"] == "get_weather" and all(c["function"].get("name") is None for c in calls[1:])
    assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == ARGUMENTS
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_server_takes_glm45_s_reasoning_parser_too():
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="glm47", reasoning_parser="glm45")
    assert (config.tool_call_parser, config.reasoning_parser) == ("glm47", "glm45")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServerConfig(reasoning_parser="glm4")
