"""/v1/responses through the openai SDK on the shared server: the same answers as chat, streamed as
OpenAI's events, continued with previous_response_id, with function tools and JSON schemas."""

import json

import jsonschema
import openai
import pytest

from tests.api.helpers import MODEL
from tests.api.test_structured_api import SCHEMAS, TOOLS, WEATHER

FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's tool shape
ASK = "Name three colours."


def _chat(client, messages, max_tokens=12) -> str:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                          temperature=0).choices[0].message.content


def test_a_response_is_the_chat_answer_as_output_items(client):
    response = client.responses.create(model=MODEL, input=ASK, max_output_tokens=12, temperature=0,
                                       instructions="Answer briefly.")
    expected = _chat(client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}])
    assert response.output_text == expected and response.id.startswith("resp_")
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert response.usage.input_tokens > 5 and response.usage.output_tokens <= 12
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.status in ("completed", "incomplete") and response.instructions == "Answer briefly."
    cut = client.responses.create(model=MODEL, input=ASK, max_output_tokens=1, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert client.responses.retrieve(response.id).output_text == expected


def test_streamed_events_come_in_order_and_add_up_to_the_response(client):
    kwargs = dict(model=MODEL, input=ASK, max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert types[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", f"response.{whole.status}"]
    assert "".join(deltas) == whole.output_text == events[-1].response.output_text
    assert events[-4].text == whole.output_text and events[0].response.status == "in_progress"


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input=ASK, max_output_tokens=12, temperature=0)
    second = client.responses.create(model=MODEL, input="Now three animals.", max_output_tokens=12, temperature=0,
                                     previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.output_text == _chat(client, [{"role": "user", "content": ASK},
                                                {"role": "assistant", "content": first.output_text},
                                                {"role": "user", "content": "Now three animals."}])
    unstored = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, store=False)
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=MODEL, input="More.", previous_response_id=missing)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(missing)


def test_function_calls_and_their_outputs(client):
    response = client.responses.create(model=MODEL, input=WEATHER[0]["content"], tools=FLAT_TOOLS,
                                       tool_choice="required", max_output_tokens=160, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.call_id and c.id.startswith("fc_") for c in calls)
    tool = next(t for t in FLAT_TOOLS if t["name"] == calls[0].name)
    jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
    streamed = list(client.responses.create(model=MODEL, input=WEATHER[0]["content"], tools=FLAT_TOOLS,
                                            tool_choice="required", max_output_tokens=160, temperature=0, stream=True))
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done[0].arguments == calls[0].arguments and arguments.startswith(calls[0].arguments)
    follow = client.responses.create(
        model=MODEL, previous_response_id=response.id, max_output_tokens=10, temperature=0,
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"sky": "clear"})}
               for c in calls])
    assert follow.output_text and follow.output[0].type == "message"
    forced = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=FLAT_TOOLS, max_output_tokens=80,
                                     tool_choice={"type": "function", "name": "get_time"}, temperature=0)
    assert [item.name for item in forced.output] == ["get_time"]


def test_text_format_json_schema(client):
    schema = SCHEMAS["person"]
    response = client.responses.create(model=MODEL, input="Describe a person as JSON.", max_output_tokens=200,
                                       temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                                                       "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input.0.role"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "tools": [{"type": "function", "name": ""}]}, "tools.0"),
    ({"input": "hi", "max_output_tokens": 0}, "max_tokens"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input.0"),
])
def test_bad_requests_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", cast_to=object, body={"model": MODEL, **body})
    assert e.value.body["param"] == param, e.value.body


def test_the_store_keeps_the_most_recently_used_responses():
    from jaxserve.api.protocol import ResponseObject
    from jaxserve.api.response_store import ResponseStore

    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(ResponseObject(id=name, status="completed", model="m"), [{"role": "user", "content": name}])
    assert store.get("a") is not None  # "a" is now the most recent
    store.put(ResponseObject(id="c", status="completed", model="m"), [])
    assert store.get("b") is None and store.get("a")[1] == [{"role": "user", "content": "a"}]
    assert store.get("c") is not None
