"""Structured outputs and tool calls over real HTTP with the openai SDK (the bundled SmolLM2): outputs
parse and validate against their schemas, streamed and not, alone and mixed with free requests;
named and required tool choices always return valid calls; bad definitions are 400s."""

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.api.helpers import API_KEY, MODEL, wait_idle

pytestmark = pytest.mark.slow  # a real model behind a real server

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "format": "email"},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "ja"]}, "minItems": 1, "maxItems": 3},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["name", "age", "address", "languages"],
    "additionalProperties": False,
}
INVENTORY = {
    "type": "object",
    "properties": {"items": {"type": "array", "maxItems": 4, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                          "count": {"type": "integer", "minimum": 1, "maximum": 99},
                                          "status": {"enum": ["in_stock", "backorder"]}},
        "required": ["sku", "count", "status"], "additionalProperties": False}}},
    "required": ["items"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "inventory": INVENTORY}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a timezone",
     "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                    "required": ["timezone"], "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "Describe a fictional person, or an inventory, as JSON."}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_chat(client, name, temperature):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=schema_format(name), max_tokens=250, temperature=temperature,
        seed=3, n=2)
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        valid(choice.message.content, SCHEMAS[name])
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=schema_format(name), max_tokens=250, temperature=temperature,
        seed=3, n=2, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in response.choices]  # seeded: the same tokens streamed


def test_completions_spellings(client):
    """Completions take response_format, structured_outputs and the older guided_* fields."""
    prompt = "Write a date in ISO format:"
    regex = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
    for extra in [{"structured_outputs": {"regex": regex}}, {"guided_regex": regex}]:
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=1.0, seed=1,
                                             extra_body=extra)
        assert re.fullmatch(regex, response.choices[0].text), response.choices[0].text
    choices = ["positive", "negative", "neutral"]
    response = client.completions.create(model=MODEL, prompt=["I love it. Sentiment:", "Awful. Sentiment:"],
                                         max_tokens=10, n=2, temperature=1.0,
                                         extra_body={"guided_choice": choices})
    assert len(response.choices) == 4 and all(c.text in choices for c in response.choices)
    response = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=60, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(response.choices[0].text), dict)
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    response = client.completions.create(model=MODEL, prompt="2 + 2 =", max_tokens=20, temperature=0,
                                         extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", response.choices[0].text)


def test_constrained_and_free_requests_share_steps(server, async_client):
    async def one(i: int):
        if i % 2:
            return None, await async_client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=40, temperature=1.0, seed=i)
        name = sorted(SCHEMAS)[i // 2 % 2]
        return name, await async_client.chat.completions.create(
            model=MODEL, messages=ASK, response_format=schema_format(name), max_tokens=250, temperature=1.0, seed=i)

    async def all_of():
        return await asyncio.gather(*(one(i) for i in range(8)))

    for name, response in asyncio.run(all_of()):
        if name is not None:
            assert response.choices[0].finish_reason == "stop"
            valid(response.choices[0].message.content, SCHEMAS[name])
    wait_idle(server)


def check_call(call, name: str | None = None) -> dict:
    tool = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
    assert name is None or call.function.name == name
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["parameters"])
    return arguments


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_and_required_tool_choice(client, temperature):
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, name in [(named, "get_time"), ("required", None)]:
        response = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice=choice,
                                                  max_tokens=120, temperature=temperature, seed=5, n=2,
                                                  parallel_tool_calls=False)
        for c in response.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            assert len(c.message.tool_calls) == 1
            check_call(c.message.tool_calls[0], name)


def test_tool_calls_stream_as_deltas(client):
    """Name and id once, in the call's first delta; then argument fragments that join to the same call
    the non-streamed response returns."""
    kwargs = dict(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice="required", max_tokens=160, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.function.name and d.type == "function"
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole]


def test_multi_turn_with_a_tool_result(client):
    first = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, max_tokens=80,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    check_call(call, "get_weather")
    messages = [*WEATHER, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=30, temperature=0)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    assert second.choices[0].finish_reason in ("stop", "length")


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, None),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "not-a-type"}}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_json": "{not json"}, "structured_outputs"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" by default, and this server has no --tool-call-parser
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"}, None),
    # limits and wrong types
    ({"guided_choice": [f"c{i}" for i in range(1025)]}, "structured_outputs"),
    ({"guided_choice": ["ok", ""]}, "structured_outputs"),
    ({"guided_choice": "not-a-list"}, "guided_choice"),
    ({"structured_outputs": {"regex": "a" * (256 * 1024 + 1)}}, "structured_outputs"),
    ({"structured_outputs": {"json": 42}}, None),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": ""}}, "structured_outputs"),
    ({"guided_regex": "(a+)+" * 5000}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 257}}], "tool_choice": "required"}, None),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(1025)],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "not-an-object"}}],
      "tool_choice": "required"}, None),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    # definitions that no output matches
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}},
     "response_format"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_definitions_are_400(server, extra, param):
    body = {"model": MODEL, "messages": WEATHER, "max_tokens": 5, **extra}
    response = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" or error["type"]
    if param is not None:
        assert error["param"] == param, error


def test_sdk_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=WEATHER, max_tokens=5,
                                       extra_body={"guided_regex": "(unclosed"})
