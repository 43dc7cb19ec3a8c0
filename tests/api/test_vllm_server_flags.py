"""vLLM's server flags for chat and the docs, through HTTP on one tiny random Llama: --response-role,
--default-chat-template-kwargs, --chat-template-content-format, --return-tokens-as-token-ids and
--disable-fastapi-docs, each against the server without it."""

import json

import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from jaxserve.api.app import create_app
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.models.template_format import template_content_format
from tests.engine.helpers import make_engine
from tests.helpers import approx_floats

HELLO = [{"role": "user", "content": "Say hello."}]
# A template that reads a keyword of chat_template_kwargs, and one that loops over each message's content
# parts, as templates for OpenAI's list of parts do.
GREETING_TEMPLATE = "{{ greeting }}{% for m in messages %} {{ m.role }}: {{ m.content }}{% endfor %}"
PARTS_TEMPLATE = "{% for m in messages %}{% for part in m['content'] %}[{{ part.text }}]{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    async_engine = AsyncEngine(make_engine(tiny_model_dir("llama"), warmup=False))
    yield async_engine
    async_engine.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))


def _client(engine: AsyncEngine, **config) -> TestClient:
    return TestClient(create_app(ServerConfig(trust_request_chat_template=True, **config), engine))


def _post(client: TestClient, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _prompt_ids(client: TestClient, **fields) -> list[int]:
    body = {"messages": HELLO, "max_tokens": 1, "return_token_ids": True, **fields}
    return _post(client, "/v1/chat/completions", body)["prompt_token_ids"]


def _first_chunk(client: TestClient, body: dict) -> dict:
    events = client.post("/v1/chat/completions", json={**body, "stream": True}).text.strip().split("\n\n")
    return json.loads(events[0].removeprefix("data: "))


def test_the_response_role_names_a_new_turn_and_a_continued_one_keeps_its_own(engine):
    """--response-role: the reply's role where the prompt opens a new turn, streamed or not; a reply that
    continues the last message (add_generation_prompt false) has that message's role, as in vLLM."""
    continued = [*HELLO, {"role": "assistant", "content": "Hello"}]
    for role in ("assistant", "model"):
        with _client(engine, **({} if role == "assistant" else {"response_role": role})) as client:
            body = {"messages": HELLO, "max_tokens": 2}
            assert _post(client, "/v1/chat/completions", body)["choices"][0]["message"]["role"] == role
            assert _first_chunk(client, body)["choices"][0]["delta"]["role"] == role
            body = {"messages": continued, "max_tokens": 2, "add_generation_prompt": False,
                    "continue_final_message": True}
            assert _post(client, "/v1/chat/completions", body)["choices"][0]["message"]["role"] == "assistant"
            assert _first_chunk(client, body)["choices"][0]["delta"]["role"] == "assistant"
            body = {"messages": HELLO, "max_tokens": 2, "add_generation_prompt": False}
            assert _post(client, "/v1/chat/completions", body)["choices"][0]["message"]["role"] == "user"
            # echo repeats the last message where it has the reply's role (vLLM's rule)
            body = {"messages": continued, "max_tokens": 2, "temperature": 0}
            plain = _post(client, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
            echoed = _post(client, "/v1/chat/completions", {**body, "echo": True})["choices"][0]["message"]["content"]
            assert echoed == ("Hello" + plain if role == "assistant" else plain)


def test_default_chat_template_kwargs_sit_under_the_request_s_own(engine, tokenizer):
    """--default-chat-template-kwargs reach the template of every request that leaves them out; a request's
    own chat_template_kwargs win, key by key, and still may not set apply_chat_template's own arguments."""
    def encoded(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    with _client(engine) as plain, _client(engine, default_chat_template_kwargs={"greeting": "Hi"}) as client:
        assert _prompt_ids(plain, chat_template=GREETING_TEMPLATE) == encoded(" user: Say hello.")
        assert _prompt_ids(client, chat_template=GREETING_TEMPLATE) == encoded("Hi user: Say hello.")
        assert _prompt_ids(client, chat_template=GREETING_TEMPLATE, chat_template_kwargs={"greeting": "Yo"}) == \
            encoded("Yo user: Say hello.")
        response = client.post("/v1/chat/completions", json={
            "messages": HELLO, "chat_template_kwargs": {"add_generation_prompt": False}})
        assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs"
        tokenized = _post(client, "/tokenize", {"messages": HELLO, "chat_template": GREETING_TEMPLATE})
        assert tokenized["tokens"] == encoded("Hi user: Say hello."), "/tokenize renders as chat does"


def test_the_content_format_gives_a_template_text_or_openai_s_parts(engine, tokenizer):
    """--chat-template-content-format: auto hands a template that loops over a message's content OpenAI's
    list of parts (a plain text becomes one part) and any other template the text; string and openai force
    one form, which a template written for the other renders wrongly."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]}]

    def rendered(client: TestClient, template: str, messages: list[dict]) -> str:
        return tokenizer.decode(_prompt_ids(client, chat_template=template, messages=messages))

    with _client(engine) as auto, _client(engine, chat_template_content_format="string") as string, \
            _client(engine, chat_template_content_format="openai") as openai:
        assert rendered(auto, PARTS_TEMPLATE, parts) == rendered(openai, PARTS_TEMPLATE, parts) == "[Say][hello.]"
        assert rendered(auto, PARTS_TEMPLATE, HELLO) == "[Say hello.]"
        assert rendered(auto, GREETING_TEMPLATE, parts) == rendered(string, GREETING_TEMPLATE, parts) == \
            " user: Say\nhello."
        assert rendered(string, PARTS_TEMPLATE, HELLO) == "[]" * len("Say hello."), "a loop over the characters"
        assert "'type': 'text'" in rendered(openai, GREETING_TEMPLATE, HELLO)


def test_the_auto_content_format_reads_real_templates(tokenizer):
    assert template_content_format(tokenizer.chat_template) == "string"  # SmolLM2's
    gemma3_like = ("{%- for message in messages -%}{%- if message['content'] is string -%}{{ message['content'] }}"
                   "{%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}"
                   "{{ item['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}")
    assert template_content_format(gemma3_like) == "openai"
    llama4_like = ("{%- for message in messages[1:] %}{%- if message['content'] is string %}{{ message['content'] }}"
                   "{%- else %}{%- for content in message['content'] | sort(attribute='type') %}"
                   "{{ content['text'] }}{%- endfor %}{%- endif %}{%- endfor %}")
    assert template_content_format(llama4_like) == "openai", "through a slice and a filter"
    by_sets = ("{% set turns = messages %}{% for turn in turns %}{% set parts = turn.content %}"
               "{% for p in parts %}{{ p.text }}{% generation %}{% endgeneration %}{% endfor %}{% endfor %}")
    assert template_content_format(by_sets) == "openai", "through {% set %}, with transformers' extension"
    assert template_content_format("{% for c in message.content %}{{ c.text }}{% endfor %}") == "string", (
        "a loop over the content of a variable that no loop over the messages set")
    assert template_content_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "string"
    assert template_content_format("{% for m in messages %") == "string", "rendering reports a broken template"


def test_return_tokens_as_token_ids_is_every_request_s_default(engine):
    """--return-tokens-as-token-ids: logprobs name tokens `token_id:{id}` for requests that do not ask,
    chat and completions, streamed or not; without it they name them by their text."""
    chat = {"messages": HELLO, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "temperature": 0}
    completion = {"prompt": "Hello there", "max_tokens": 3, "logprobs": 2, "temperature": 0, "return_token_ids": True}
    with _client(engine, return_tokens_as_token_ids=True) as by_id, _client(engine) as by_text:
        choice = _post(by_id, "/v1/chat/completions", {**chat, "return_token_ids": True})["choices"][0]
        ids = choice["token_ids"]
        assert [entry["token"] for entry in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in ids]
        assert all(top["token"].startswith("token_id:") for entry in choice["logprobs"]["content"]
                   for top in entry["top_logprobs"])
        streamed = _first_chunk(by_id, chat)  # the role chunk, then the tokens'
        assert streamed["choices"][0]["delta"]["role"] == "assistant"
        events = by_id.post("/v1/chat/completions", json={**chat, "stream": True}).text.strip().split("\n\n")
        tokens = [entry["token"] for event in events[1:-1]
                  for entry in (json.loads(event.removeprefix("data: "))["choices"][0].get("logprobs") or {}
                                ).get("content", [])]
        assert tokens == [f"token_id:{i}" for i in ids]
        text_choice = _post(by_text, "/v1/chat/completions", chat)["choices"][0]
        assert not any(entry["token"].startswith("token_id:") for entry in text_choice["logprobs"]["content"])
        refused = _post(by_id, "/v1/chat/completions", {**chat, "return_tokens_as_token_ids": False})["choices"][0]
        # two servers' answers: the same tokens, their logprobs to float32's precision
        assert refused["logprobs"] == approx_floats(text_choice["logprobs"]), "a request's own false wins"
        completed = _post(by_id, "/v1/completions", completion)["choices"][0]
        assert completed["logprobs"]["tokens"] == [f"token_id:{i}" for i in completed["token_ids"]]


def test_disable_fastapi_docs_removes_the_docs_and_nothing_else(engine):
    with _client(engine, disable_fastapi_docs=True) as client, _client(engine) as plain:
        for path in ("/docs", "/openapi.json"):
            assert client.get(path).status_code == 404
            assert plain.get(path).status_code == 200
        assert client.get("/v1/models").status_code == 200


def test_tokenize_renders_a_request_s_template_and_tools_as_chat_does(engine, tokenizer):
    """/tokenize with messages takes chat's chat_template (behind --trust-request-chat-template) and tools
    (vLLM's fields), rather than ignoring them."""
    template = ("{% for t in tools %}{{ t.function.name }};{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"messages": HELLO, "chat_template": template, "tools": tools}
    with _client(engine) as client:
        tokenized = _post(client, "/tokenize", body)
        assert tokenized["tokens"] == tokenizer.encode("get_weather;Say hello.", add_special_tokens=False)
        assert tokenized["tokens"] == _prompt_ids(client, chat_template=template, tools=tools, tool_choice="none")
    with TestClient(create_app(ServerConfig(), engine)) as untrusting:
        response = untrusting.post("/tokenize", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"


# The effort's marker: a number of words that tells the efforts apart by the prompt's length alone.
EFFORT_TEMPLATE = ("{% set words = {'none': 1, 'low': 2, 'high': 4, 'max': 5}.get(reasoning_effort, 0) %}"
                   "{% for i in range(words) %}think {% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}")


def test_reasoning_effort_reaches_the_chat_template(engine, tokenizer):
    """OpenAI's `reasoning_effort` is the template's `reasoning_effort` (GPT-OSS's template writes it into
    its system message), over chat_template_kwargs' as vLLM merges them; the Responses API's
    `reasoning.effort` is the same; a value outside low, medium and high is a 400 naming the field."""
    def encoded(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def thinking(words: int) -> list[int]:
        return encoded("think " * words + "Say hello.")

    with _client(engine, chat_template=EFFORT_TEMPLATE) as client:
        assert _prompt_ids(client) == thinking(0)
        assert _prompt_ids(client, reasoning_effort="low") == thinking(2)
        assert _prompt_ids(client, reasoning_effort="none") == thinking(1), "vLLM's values beyond OpenAI's three"
        assert _prompt_ids(client, reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}) == \
            thinking(4)
        assert _post(client, "/tokenize", {"messages": HELLO, "reasoning_effort": "max"})["tokens"] == thinking(5)
        response = client.post("/v1/chat/completions", json={"messages": HELLO, "reasoning_effort": "extreme"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning_effort"
        for effort, words in ((None, 0), ("low", 2), ("high", 4)):
            reply = _post(client, "/v1/responses", {"input": "Say hello.", "max_output_tokens": 1,
                                                    **({"reasoning": {"effort": effort}} if effort else {})})
            assert reply["usage"]["input_tokens"] == len(thinking(words))
            assert reply["reasoning"] == ({"effort": effort} if effort else None), "echoed as OpenAI does"
        response = client.post("/v1/responses", json={"input": "Hi", "reasoning": {"effort": "extreme"}})
        assert response.status_code == 400 and response.json()["error"]["param"].startswith("reasoning")
