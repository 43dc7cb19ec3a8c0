"""Tool calls whose arguments the request's schemas type (Qwen3-Coder's and GLM-4.5's formats) through the chat
endpoint, in-process on a tiny random Llama served with `--tool-call-parser qwen3_coder` and with `glm45`: the
model's text is forced into each format by a regex (as such a model would write it), and the answer must carry the
typed calls, streamed and not, and finish as `tool_calls`."""

import json
import re

import pytest
from starlette.testclient import TestClient

from jaxserve.api.app import create_app
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from tests.engine.helpers import make_engine

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "when": {"type": "array"}}}}}]
# parser -> what its model writes for the call
WRITTEN = {
    "qwen3_coder": "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=when>\n"
                   "[\"am\", 6]\n</parameter>\n</function>\n</tool_call>",
    "glm45": "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>San Jose</arg_value>\n"
             "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true"
             "</arg_value>\n<arg_key>when</arg_key>\n<arg_value>[\"am\", 6]</arg_value>\n</tool_call>",
}
ARGUMENTS = {"city": "San Jose", "days": 3, "metric": True, "when": ["am", 6]}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return AsyncEngine(make_engine(tiny_model_dir("llama"), warmup=False, max_model_len=512, num_kv_pages=512))


@pytest.fixture(scope="module", params=sorted(WRITTEN))
def served(request, engine):
    """(parser, a client of a server with it)."""
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser=request.param)
    with TestClient(create_app(config, engine)) as client:
        yield request.param, client


def _body(parser: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": "Weather in San Jose for 3 days?"}], "tools": TOOLS,
            "max_tokens": 200, "temperature": 0, "structured_outputs": {"regex": re.escape(WRITTEN[parser])},
            **fields}


def test_a_call_comes_back_typed(served):
    parser, client = served
    response = client.post("/v1/chat/completions", json=_body(parser))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking.\n"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGUMENTS


def test_a_streamed_call_joins_to_the_same_arguments(served):
    parser, client = served
    response = client.post("/v1/chat/completions", json=_body(parser, stream=True))
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
