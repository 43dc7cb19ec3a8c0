"""/v1/responses through the openai SDK on the shared server: the same answers as chat, streamed as
OpenAI's events, continued with previous_response_id, with function tools and JSON schemas."""

import asyncio
import json
import time

import httpx
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
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),  # as the Responses API names it
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input.0"),
    ({"input": "hi", "background": True, "store": False}, "background"),  # nothing to poll
    # OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata." + "k" * 65),
    ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata.k"),
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
    assert store.get("b") is None and store.get("a").conversation == [{"role": "user", "content": "a"}]
    assert store.get("c") is not None


def test_the_store_keeps_its_responses_within_its_byte_budget():
    """An input may be as large as the body limit (a reasoning item's summary never reaches the prompt, so no
    context bounds it): past the budget the least recently used go, though never the one just stored."""
    from jaxserve.api.protocol import ResponseObject
    from jaxserve.api.response_store import ResponseStore

    store = ResponseStore(capacity=100, max_bytes=12_000)  # each about 3,000 + its JSON (about 500)
    for name in ("a", "b", "c"):
        store.put(ResponseObject(id=name, status="completed", model="m"), [], request_bytes=3_000)
    assert all(store.get(name) is not None for name in "abc")
    store.get("a")  # "b" is now the least recently used
    store.put(ResponseObject(id="d", status="completed", model="m"), [], request_bytes=3_000)
    assert store.get("b") is None and all(store.get(name) is not None for name in "acd")
    store.put(ResponseObject(id="huge", status="completed", model="m"), [], request_bytes=50_000)
    assert store.get("huge") is not None and all(store.get(name) is None for name in "acd")
    store.put(ResponseObject(id="huge", status="completed", model="m"), [], request_bytes=1_000)  # rewritten
    store.put(ResponseObject(id="e", status="completed", model="m"), [], request_bytes=1_000)
    assert store.get("huge") is not None and store.get("e") is not None, "a rewrite counts once"


STORY = dict(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=1500, temperature=0)


def _poll(client, response_id: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {response.status} after {timeout}s"
        time.sleep(0.05)
    return response


def _metric(client, name: str, label: str = "") -> float:
    """A metric's value summed over its series (those whose labels hold `label`), from /metrics."""
    text = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line)


def _aborted(client) -> float:
    return _metric(client, "jaxserve:request_success_total", 'finished_reason="abort"')


def _engine_idle(client, timeout: float = 60.0) -> bool:
    """No sequence runs in the engine (its requests finished or aborted), per /metrics."""
    deadline = time.monotonic() + timeout
    assert "jaxserve:num_requests_running" in httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    while _metric(client, "jaxserve:num_requests_running") != 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_background_response_is_polled_to_the_answer_of_a_foreground_one(client):
    kwargs = dict(model=MODEL, input=ASK, max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    queued = client.responses.create(**kwargs, background=True)
    assert queued.background and queued.status == "queued" and queued.output == [] and queued.usage is None
    done = _poll(client, queued.id)
    assert done.background and done.status == whole.status and done.output_text == whole.output_text
    assert done.usage.output_tokens == whole.usage.output_tokens
    # It continues a conversation as a foreground response does.
    follow = dict(model=MODEL, input="Now three animals.", max_output_tokens=12, temperature=0)
    assert (client.responses.create(**follow, previous_response_id=done.id).output_text
            == client.responses.create(**follow, previous_response_id=whole.id).output_text)
    # Cancelling a response that ended answers it as it ended (OpenAI's cancel is idempotent).
    again = client.responses.cancel(done.id)
    assert again.status == done.status and again.output_text == done.output_text


def test_cancel_ends_a_running_background_response_and_its_engine_request(client):
    aborted = _aborted(client)
    running = client.responses.create(**STORY, background=True)
    base = str(client.base_url).removesuffix("/v1/")
    assert httpx.get(f"{base}/load").json()["server_load"] >= 1
    assert client.responses.retrieve(running.id).status in ("queued", "in_progress")  # a long story: it runs
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.id == running.id
    assert _aborted(client) >= aborted + 1  # its stream closed before it finished: the engine request aborts
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert _engine_idle(client), "the cancelled response's engine request still runs"
    with pytest.raises(openai.BadRequestError) as e:  # it has no answer to continue from
        client.responses.create(model=MODEL, input="Go on.", max_output_tokens=4, previous_response_id=running.id)
    assert e.value.body["param"] == "previous_response_id" and "cancelled" in e.value.body["message"]
    foreground = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background=true"):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_missing")


def test_delete_forgets_a_response_and_cancels_a_running_one(client):
    ended = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2)
    aborted = _aborted(client)
    running = client.responses.create(**STORY, background=True)
    assert client.responses.retrieve(running.id).status in ("queued", "in_progress")
    for response in (ended, running):
        assert client.delete(f"/responses/{response.id}", cast_to=object) == {
            "id": response.id, "object": "response", "deleted": True}
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(response.id)
    assert _aborted(client) >= aborted + 1
    assert _engine_idle(client), "the deleted response's engine request still runs"


def test_the_store_drops_what_a_deleted_background_response_still_writes():
    from jaxserve.api.protocol import ResponseObject
    from jaxserve.api.response_store import ResponseStore

    async def scenario() -> None:
        store = ResponseStore()
        response = ResponseObject(id="r", status="queued", model="m", background=True)
        gate = asyncio.Event()

        async def work() -> None:
            try:
                await gate.wait()
            finally:  # as a cancelled background task does: writes its last state
                store.settle(response.model_copy(update={"status": "cancelled"}))

        store.start(response, [], work())
        await asyncio.sleep(0)
        assert store.is_running("r") and store.get("r").response.status == "queued"
        assert await store.delete("r") and store.get("r") is None and not store.is_running("r")
        # Cancelled before it ever ran: cancelled all the same, and no longer held.
        store.start(response.model_copy(update={"id": "s"}), [], work())
        await store.cancel("s")
        assert store.num_running == 0 and store.get("s").response.status == "cancelled"
        # A cancel and a delete at once: the response is gone, and the cancel does not fail.
        store.start(response.model_copy(update={"id": "t"}), [], work())
        await asyncio.sleep(0)
        await asyncio.gather(store.cancel("t"), store.delete("t"))
        assert store.get("t") is None and store.num_running == 0

    asyncio.run(scenario())


def test_the_store_never_evicts_a_response_that_runs():
    from jaxserve.api.protocol import ResponseObject
    from jaxserve.api.response_store import ResponseStore

    async def scenario() -> None:
        store, gate = ResponseStore(capacity=2), asyncio.Event()
        store.start(ResponseObject(id="bg", status="queued", model="m", background=True), [], gate.wait())
        for name in ("a", "b", "c"):
            store.put(ResponseObject(id=name, status="completed", model="m"), [])
        assert store.get("bg") is not None and store.get("c") is not None
        assert store.get("a") is None and store.get("b") is None
        assert store.is_full  # half the store may run: create_response refuses another with a 429
        gate.set()
        async with asyncio.timeout(10):
            while store.num_running:  # its task ends, then its done-callback lets it go
                await asyncio.sleep(0)
        assert not store.is_full
        store.put(ResponseObject(id="d", status="completed", model="m"), [])  # now it may go
        assert store.get("bg") is None
        assert ResponseStore(capacity=1024).max_running == 512

    asyncio.run(scenario())


@pytest.mark.parametrize("streamed", [False, True])
def test_a_background_response_the_engine_fails_is_failed_with_the_error(streamed):
    from jaxserve.api.protocol import ResponseObject
    from jaxserve.api.response_store import EventLog, ResponseStore
    from jaxserve.api.responses import _answer_in_background
    from jaxserve.engine.async_engine import EngineDeadError

    class Run:  # a ChatRun whose one engine stream fails at its start
        prompt_ids = (1, 2)

        async def _failing(self):
            raise EngineDeadError("the engine core exited")
            yield

        @property
        def streams(self):
            return [self._failing()]

        def reasoning_stream(self):
            return None

        def tool_stream(self):
            return None

    async def scenario():
        store, log = ResponseStore(), EventLog() if streamed else None
        response = ResponseObject(id="r", status="queued", model="m", background=True)
        store.start(response, [], _answer_in_background(store, Run(), response, [], log), log)
        async with asyncio.timeout(10):
            while store.is_running("r"):
                await asyncio.sleep(0)
        return store.get("r"), log

    stored, log = asyncio.run(scenario())
    failed, conversation = stored.response, stored.conversation
    assert failed.status == "failed" and conversation is None
    assert failed.error.code == "service_unavailable" and "the engine core exited" in failed.error.message
    if streamed:  # its readers saw the error, then the failed response, and the log closed
        assert log.done and [json.loads(f.split("data: ", 1)[1])["type"] for f in log.frames][-2:] == [
            "error", "response.failed"]


def test_background_responses_past_the_store_s_capacity_are_429s(tiny_model_dir):
    """A client that enqueues background work without end is refused once the store holds as many running
    responses as it can keep, and served again once one ends (in-process: a store of one)."""
    from starlette.testclient import TestClient

    from jaxserve.api.app import create_app
    from jaxserve.api.response_store import ResponseStore
    from jaxserve.config import ServerConfig
    from jaxserve.engine.async_engine import AsyncEngine
    from tests.engine.helpers import make_engine

    engine = make_engine(tiny_model_dir("llama"), warmup=False)
    with TestClient(create_app(ServerConfig(), AsyncEngine(engine))) as http:
        http.app.state.server.serving.responses = ResponseStore(capacity=2)  # one may run
        body = {"input": "Once upon a time", "max_output_tokens": 200, "temperature": 0, "background": True}
        first = http.post("/v1/responses", json=body).json()
        refused = http.post("/v1/responses", json=body)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["param"] == "background" and "poll or cancel" in refused.text
        assert http.post(f"/v1/responses/{first['id']}/cancel").json()["status"] in ("cancelled", "completed")
        # Past the store's budget for events, an ended response's go (GET without stream still answers).
        http.app.state.server.serving.responses = ResponseStore(capacity=2, max_event_bytes=1)
        streamed = http.post("/v1/responses", json={**body, "max_output_tokens": 2, "stream": True})
        created = json.loads(streamed.text.split("data: ", 1)[1].split("\n", 1)[0])
        gone = http.get(f"/v1/responses/{created['response']['id']}", params={"stream": "true"})
        assert gone.status_code == 400 and "no longer kept" in gone.text, gone.text
        assert http.get(f"/v1/responses/{created['response']['id']}").json()["status"] in ("completed", "incomplete")
        again = http.post("/v1/responses", json=body)
        assert again.status_code == 200, again.text
        # Ended before the client closes: the engine outlives this app, and must not answer a closed loop.
        http.post(f"/v1/responses/{again.json()['id']}/cancel")
        assert http.post("/v1/responses", json={**body, "background": False, "max_output_tokens": 1}).status_code == 200


def test_input_items_list_what_a_response_was_asked_with_a_page_at_a_time(client):
    asked = [{"role": "system", "content": "Answer briefly."},
             {"role": "user", "content": "Name three colours."},
             {"role": "assistant", "content": "Red, green, blue."},
             {"role": "user", "content": [{"type": "input_text", "text": "Now three animals."}]}]
    response = client.responses.create(model=MODEL, input=asked, max_output_tokens=2)
    items = client.responses.input_items.list(response.id, order="asc").data
    assert [(item.type, item.role) for item in items] == [("message", m["role"]) for m in asked]
    assert [item.content[0].text for item in items] == [
        "Answer briefly.", "Name three colours.", "Red, green, blue.", "Now three animals."]
    assert [item.content[0].type for item in items] == ["input_text", "input_text", "output_text", "input_text"]
    ids = [item.id for item in items]
    assert len(set(ids)) == 4 and all(i.startswith("msg_") for i in ids)
    assert [item.id for item in client.responses.input_items.list(response.id).data] == ids[::-1]  # desc: default
    first = client.responses.input_items.list(response.id, order="asc", limit=3)
    assert first.has_more and [item.id for item in first.data] == ids[:3] and first.last_id == ids[2]
    rest = client.responses.input_items.list(response.id, order="asc", limit=3, after=ids[2])
    assert not rest.has_more and [item.id for item in rest.data] == ids[3:]
    assert [item.id for item in client.responses.input_items.list(response.id, order="asc", limit=1)] == ids  # pages
    # A follow-up lists its own input, not the conversation it continues.
    follow = client.responses.create(model=MODEL, input="And three birds.", max_output_tokens=2,
                                     previous_response_id=response.id)
    (only,) = client.responses.input_items.list(follow.id).data
    assert only.content[0].text == "And three birds." and only.role == "user"


@pytest.mark.parametrize(("query", "param"), [({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                                              ({"limit": "ten"}, "limit"), ({"limit": "1" + "0" * 30}, "limit"),
                                              ({"order": "sideways"}, "order"),
                                              ({"after": "msg_missing"}, "after")])
def test_input_items_refuse_a_bad_query_naming_it(client, query, param):
    response = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.get(f"/responses/{response.id}/input_items", cast_to=object, options={"params": query})
    assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_missing")


def test_input_items_keep_calls_their_outputs_and_the_client_s_ids():
    from jaxserve.api.errors import APIError
    from jaxserve.api.responses import read_input

    asked = [{"type": "message", "role": "user", "content": "Weather in Paris?", "id": "msg_client"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": {"sky": "clear"}},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "It asked."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Clear."}]}]
    messages, (message, call, output, reasoning, answer) = read_input(asked)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert message == {"id": "msg_client", "type": "message", "role": "user", "status": "completed",
                       "content": [{"type": "input_text", "text": "Weather in Paris?"}]}
    assert call["id"].startswith("fc_") and (call["call_id"], call["name"], call["arguments"]) == (
        "call_1", "get_weather", '{"city": "Paris"}')
    assert output["type"] == "function_call_output" and json.loads(output["output"]) == {"sky": "clear"}
    assert reasoning["type"] == "reasoning" and reasoning["summary"][0]["text"] == "It asked."
    assert answer["content"] == [{"type": "output_text", "text": "Clear.", "annotations": []}]
    # A cursor names one item: two items of one id are refused (OpenAI's rule too).
    with pytest.raises(APIError) as e:
        read_input([asked[0], {**asked[4], "id": "msg_client"}])
    assert e.value.status == 400 and e.value.param == "input.1.id"


def test_a_streamed_background_response_is_the_foreground_stream_and_resumes_from_any_event(client):
    kwargs = dict(model=MODEL, input=ASK, max_output_tokens=12, temperature=0)
    foreground = list(client.responses.create(**kwargs, stream=True))
    events = list(client.responses.create(**kwargs, stream=True, background=True))
    # OpenAI's background streams begin queued: created (queued), queued, then as a foreground stream.
    assert [e.type for e in events] == ["response.created", "response.queued", *(e.type for e in foreground[1:])]
    assert events[0].response.status == "queued" and events[0].response.background
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == foreground[-1].response.output_text
    response_id = events[0].response.id
    assert client.responses.retrieve(response_id).output_text == events[-1].response.output_text
    # Resumed: the events after a sequence number, the same ones; after the last, none.
    resumed = list(client.responses.retrieve(response_id, stream=True, starting_after=3))
    assert [(e.sequence_number, e.type) for e in resumed] == [(e.sequence_number, e.type) for e in events[4:]]
    assert len(list(client.responses.retrieve(response_id, stream=True))) == len(events)
    assert list(client.responses.retrieve(response_id, stream=True, starting_after=len(events) - 1)) == []


def test_a_client_that_leaves_a_background_stream_leaves_the_response_running(client, server):
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 64, "temperature": 0, "stream": True,
            "background": True}
    headers = {"Authorization": f"Bearer {client.api_key}"}
    with httpx.stream("POST", f"{server.v1}/responses", json=body, headers=headers, timeout=120) as stream:
        lines = stream.iter_lines()
        first = next(json.loads(line[6:]) for line in lines if line.startswith("data: "))
    assert first["type"] == "response.created"
    done = _poll(client, first["response"]["id"])  # the client left after one event: the response went on
    assert done.status in ("completed", "incomplete") and done.output_text  # not cancelled
    whole = client.responses.create(model=MODEL, input=ASK, max_output_tokens=64, temperature=0)
    assert done.output_text == whole.output_text


def test_cancelling_a_streamed_background_response_ends_its_readers(client):
    """Both readers, the creating client's and one that resumed while it ran, end when it is cancelled: the
    log closes without a final event (GET says why)."""
    import concurrent.futures

    stream = client.responses.create(**STORY, stream=True, background=True)
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break
    response_id = seen[0].response.id
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        resumed = pool.submit(lambda: [e.type for e in client.responses.retrieve(
            response_id, stream=True, starting_after=seen[-1].sequence_number)])
        time.sleep(0.5)  # the resumed reader waits on the log
        assert not resumed.done()
        assert client.responses.cancel(response_id).status == "cancelled"
        later = resumed.result(timeout=60)
    rest = [e.type for e in stream]
    finals = {"response.completed", "response.incomplete", "response.failed"}
    assert not finals & set(later) and not finals & set(rest)
    assert [e.type for e in client.responses.retrieve(response_id, stream=True)][:len(seen)] == [e.type for e in seen]


def test_streaming_again_needs_a_streamed_background_response(client):
    plain = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2)
    for query, param in (({"stream": "true"}, "stream"), ({"stream": "maybe"}, "stream")):
        with pytest.raises(openai.BadRequestError) as e:
            client.get(f"/responses/{plain.id}", cast_to=object, options={"params": query})
        assert e.value.body["param"] == param
    streamed = list(client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, stream=True, background=True))
    for after in ("-5", "9" * 30, "first"):  # below -1, past any int64, not a number
        with pytest.raises(openai.BadRequestError) as e:
            client.get(f"/responses/{streamed[0].response.id}", cast_to=object,
                       options={"params": {"stream": "true", "starting_after": after}})
        assert e.value.body["param"] == "starting_after", after


def test_the_event_log_follows_from_any_index_and_ends_when_closed():
    from jaxserve.api.response_store import EventLog

    async def scenario() -> tuple[list[str], list[str]]:
        log = EventLog()
        log.append("a")

        async def read(start: int) -> list[str]:
            return [frame async for frame in log.follow(start)]

        early, late = asyncio.create_task(read(0)), asyncio.create_task(read(2))
        await asyncio.sleep(0)
        for frame in ("b", "c"):
            log.append(frame)
            await asyncio.sleep(0)
        log.close()
        async with asyncio.timeout(10):
            return await early, await late

    assert asyncio.run(scenario()) == (["a", "b", "c"], ["c"])


def test_a_reader_inside_a_log_the_store_drops_reads_it_to_its_end():
    """The store lets the oldest ended logs go past its byte budget; a client still reading one (a slow
    creator, a resumed stream) gets every event, not a stream that stops cleanly halfway."""
    from jaxserve.api.protocol import ResponseObject
    from jaxserve.api.response_store import EventLog, ResponseStore

    async def scenario() -> tuple[list[str], bool]:
        store, logs = ResponseStore(capacity=8, max_event_bytes=100), [EventLog(), EventLog()]

        async def work(log: EventLog, count: int) -> None:
            for k in range(count):
                log.append(f"event {k:02d} " + "x" * 10)

        response = [ResponseObject(id=f"resp_{i}", status="queued", model="m", background=True) for i in range(2)]
        store.start(response[0], [], work(logs[0], 5), logs[0])  # 95 bytes: within the budget
        await asyncio.sleep(0.01)
        reader = logs[0].follow(0)
        got = [await anext(reader) for _ in range(2)]
        store.start(response[1], [], work(logs[1], 2), logs[1])  # the budget passed: the first log goes
        await asyncio.sleep(0.01)
        got += [frame async for frame in reader]
        return got, logs[0].dropped

    got, dropped = asyncio.run(scenario())
    assert dropped and len(got) == 5 and got[-1].startswith("event 04")
