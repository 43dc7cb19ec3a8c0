"""vLLM's fields that shape a request before it runs, in-process on a tiny random Llama whose tokenizer
adds a BOS (as Llama's do): add_special_tokens (completions, chat, /tokenize), a chat template's
documents, request_id and X-Request-Id in the response's id."""

import json
import shutil
import threading

import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from jaxserve.api.app import create_app
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from tests.engine.helpers import make_engine

BOS = "<|im_start|>"  # id 1 in the SmolLM2 vocabulary the tiny models share
HELLO = [{"role": "user", "content": "Say hello."}]
DOCUMENTS_TEMPLATE = (
    "{% for d in documents %}[{{ d.title }}: {{ d.text }}]\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)


@pytest.fixture(scope="module")
def bos_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with a tokenizer whose post-processor puts a BOS before every text it encodes."""
    directory = tmp_path_factory.mktemp("tiny-llama-bos")
    shutil.copytree(tiny_model_dir("llama"), directory, dirs_exist_ok=True)
    path = directory / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    bos, sequence = {"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": [bos, sequence],
        "pair": [bos, sequence, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [1], "tokens": [BOS]}},
    }
    path.write_text(json.dumps(tokenizer))
    return directory


@pytest.fixture(scope="module")
def tokenizer(bos_model_dir):
    return AutoTokenizer.from_pretrained(str(bos_model_dir))


@pytest.fixture(scope="module")
def client(bos_model_dir):
    engine = make_engine(bos_model_dir, warmup=False)
    config = ServerConfig(trust_request_chat_template=True)
    with TestClient(create_app(config, AsyncEngine(engine))) as client:
        yield client


def _post(client: TestClient, path: str, body: dict, **kwargs) -> dict:
    response = client.post(path, json=body, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


def _completion_prompt_ids(client: TestClient, **fields) -> list[int]:
    body = {"prompt": "Hello there", "max_tokens": 1, "return_token_ids": True, **fields}
    return _post(client, "/v1/completions", body)["choices"][0]["prompt_token_ids"]


def _chat_prompt_ids(client: TestClient, **fields) -> list[int]:
    body = {"messages": HELLO, "max_tokens": 1, "return_token_ids": True, **fields}
    return _post(client, "/v1/chat/completions", body)["prompt_token_ids"]


def test_completions_add_the_tokenizers_bos_unless_told_not_to(client, tokenizer):
    text_ids = tokenizer.encode("Hello there", add_special_tokens=False)
    assert _completion_prompt_ids(client) == [1, *text_ids], "vLLM's default for completions: true"
    assert _completion_prompt_ids(client, add_special_tokens=False) == text_ids
    assert _completion_prompt_ids(client, add_special_tokens=True, echo=True) == [1, *text_ids]
    ids_prompt = _post(client, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1, "return_token_ids": True,
                                                   "add_special_tokens": True})
    assert ids_prompt["choices"][0]["prompt_token_ids"] == [5, 6, 7], "token ids are taken as they are"
    tokenized = _post(client, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False})
    assert tokenized["tokens"] == text_ids and tokenized["token_strs"] is None


def test_tokenize_returns_the_token_strings_when_asked(client, tokenizer):
    text = _post(client, "/tokenize", {"prompt": "Hello there", "return_token_strs": True})
    assert text["token_strs"] == [BOS, "Hello", "Ġthere"] == tokenizer.convert_ids_to_tokens(text["tokens"])
    chat = _post(client, "/tokenize", {"messages": HELLO, "return_token_strs": True})
    assert chat["token_strs"] == tokenizer.convert_ids_to_tokens(chat["tokens"]) and chat["token_strs"][0] == BOS


def test_chat_adds_the_tokenizers_special_tokens_only_when_asked(client, tokenizer):
    rendered = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    template_ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert _chat_prompt_ids(client) == template_ids, "vLLM's default for chat: false (the template has them)"
    assert _chat_prompt_ids(client, add_special_tokens=True) == [1, *template_ids]
    streamed = client.post("/v1/chat/completions", json={
        "messages": HELLO, "max_tokens": 1, "stream": True, "return_token_ids": True, "add_special_tokens": True})
    first = json.loads(streamed.text.split("\n\n")[0].removeprefix("data: "))
    assert first["prompt_token_ids"] == [1, *template_ids]
    for add, expected in ((False, template_ids), (True, [1, *template_ids])):
        tokenized = _post(client, "/tokenize", {"messages": HELLO, "add_special_tokens": add})
        assert tokenized["tokens"] == expected and tokenized["count"] == len(expected)


def test_documents_reach_the_chat_template(client, tokenizer):
    documents = [{"title": "Paris", "text": "The capital of France."}, {"title": "Rome", "text": "Italy's."}]
    expected = ("[Paris: The capital of France.]\n[Rome: Italy's.]\nuser: Say hello.\nassistant:")
    ids = _chat_prompt_ids(client, documents=documents, chat_template=DOCUMENTS_TEMPLATE)
    assert ids == tokenizer.encode(expected, add_special_tokens=False)
    assert _chat_prompt_ids(client, documents=[], chat_template=DOCUMENTS_TEMPLATE) == \
        tokenizer.encode("user: Say hello.\nassistant:", add_special_tokens=False)
    tokenized = _post(client, "/tokenize", {"messages": HELLO, "documents": documents})
    assert tokenized["tokens"] == _chat_prompt_ids(client), "the model's own template renders no documents"
    for bad in ([{"title": 3}], {"title": "x"}, ["text"], [{"title": ["a"]}]):
        response = client.post("/v1/chat/completions", json={"messages": HELLO, "documents": bad,
                                                              "chat_template": DOCUMENTS_TEMPLATE})
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["param"].startswith("documents"), response.json()


def test_a_client_request_id_names_the_response(client):
    chat = _post(client, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "request_id": "trace-42"})
    assert chat["id"] == "chatcmpl-trace-42"
    completion = _post(client, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2, "request_id": "job:7/a"})
    assert completion["id"] == "cmpl-job:7/a" and len(completion["choices"]) == 2
    stream = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 3, "stream": True,
                                                       "request_id": "s1"})
    chunks = [json.loads(line.removeprefix("data: ")) for line in stream.text.split("\n\n")
              if line.startswith("data: {")]
    assert chunks and {chunk["id"] for chunk in chunks} == {"chatcmpl-s1"}
    # vLLM's order: the X-Request-Id header, then the body's field, then a random id
    headed = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "request_id": "body"},
                         headers={"X-Request-Id": "from-header"})
    assert headed.json()["id"] == "cmpl-from-header" and headed.headers["x-request-id"] == "from-header"
    unnamed = _post(client, "/v1/completions", {"prompt": "a", "max_tokens": 1})
    assert unnamed["id"].startswith("cmpl-") and len(unnamed["id"]) == len("cmpl-") + 32
    spaced = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"X-Request-Id": "a b"})
    assert spaced.status_code == 200 and spaced.json()["id"] != "cmpl-a b", "a header unfit for an id is only echoed"


def test_requests_that_share_an_id_run_side_by_side(client):
    """A client's id need not be unique (a retry resends it): the engine's ids stay distinct."""
    results: list[dict] = []
    body = {"prompt": "Count: one two", "max_tokens": 8, "ignore_eos": True, "temperature": 0, "request_id": "same"}

    def send() -> None:
        results.append(client.post("/v1/completions", json=body).json())

    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 4 and all(r.get("id") == "cmpl-same" for r in results), results
    assert len({r["choices"][0]["text"] for r in results}) == 1 and all(
        r["usage"]["completion_tokens"] == 8 for r in results)


@pytest.mark.parametrize("bad", ["", "x" * 257, "a b", "line\nbreak", "é", 42, ["a"], {"a": 1}])
def test_a_request_id_unfit_for_an_id_is_a_400_naming_it(client, bad):
    for path, body in (("/v1/completions", {"prompt": "a", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 1})):
        response = client.post(path, json={**body, "request_id": bad})
        assert response.status_code == 400, (path, bad, response.text)
        assert response.json()["error"]["param"] == "request_id"
    assert _post(client, "/v1/completions", {"prompt": "a", "max_tokens": 1, "request_id": "x" * 256})["id"] == \
        "cmpl-" + "x" * 256



@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"add_special_tokens": [1]}, "add_special_tokens"),
    ("/v1/chat/completions", {"add_special_tokens": {"a": 1}}, "add_special_tokens"),
    ("/v1/chat/completions", {"documents": [{"title": "x" * 10}] * 3 + [None]}, "documents"),
    ("/v1/chat/completions", {"documents": "not a list"}, "documents"),
    ("/v1/completions", {"use_beam_search": "sometimes"}, "use_beam_search"),
    ("/v1/completions", {"length_penalty": [2]}, "length_penalty"),
    ("/tokenize", {"return_token_strs": 3.5}, "return_token_strs"),
])
def test_new_fields_of_the_wrong_type_are_400s_naming_them(client, path, fields, param):
    body = {"messages": HELLO} if "chat" in path or path == "/tokenize" else {"prompt": "a"}
    if path != "/tokenize":
        body["max_tokens"] = 1
    response = client.post(path, json={**body, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param), response.json()


def test_override_generation_config_sets_the_defaults_a_request_leaves_out(bos_model_dir, tmp_path):
    """`--override-generation-config '{"max_new_tokens": 3, "temperature": 0.0}'` over a model whose
    generation_config.json says 7 tokens at temperature 0.9: a chat request without those fields gets 3
    greedy tokens (those it gets asking for them), and a request's own fields win. (Completions default to
    16 tokens, OpenAI's, so there only the temperature is left to the default.)"""
    model_dir = tmp_path / "model"
    shutil.copytree(bos_model_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.9, "max_new_tokens": 7,
                                                                  "top_p": 0.5}))
    config = ServerConfig(override_generation_config={"max_new_tokens": 3, "temperature": 0.0})
    with TestClient(create_app(config, AsyncEngine(make_engine(model_dir, warmup=False)))) as client:
        body = {"messages": HELLO, "return_token_ids": True}
        defaulted = _post(client, "/v1/chat/completions", body)["choices"][0]
        asked = _post(client, "/v1/chat/completions", {**body, "max_tokens": 3, "temperature": 0.0})["choices"][0]
        own = _post(client, "/v1/chat/completions", {**body, "max_tokens": 5, "temperature": 0.0})["choices"][0]
        prompt = {"prompt": "Hello there", "max_tokens": 4, "return_token_ids": True}
        completions = [_post(client, "/v1/completions", {**prompt, **extra})["choices"][0]["token_ids"]
                       for extra in ({}, {"temperature": 0.0}, {"temperature": 1.0, "seed": 1})]
    assert defaulted["finish_reason"] == "length" and len(defaulted["token_ids"]) == 3
    assert defaulted["token_ids"] == asked["token_ids"] == own["token_ids"][:3] and len(own["token_ids"]) == 5
    assert completions[0] == completions[1] != completions[2]


def test_force_include_usage_ends_every_stream_with_its_usage(bos_model_dir):
    """`--enable-force-include-usage` (vLLM's): a stream that did not ask for usage ends with a usage chunk
    all the same, chat and completions; without the flag it does not."""
    def last_chunk(client: TestClient, path: str, body: dict) -> dict:
        events = client.post(path, json={**body, "stream": True}).text.strip().split("\n\n")
        assert events[-1] == "data: [DONE]"
        return json.loads(events[-2].removeprefix("data: "))

    bodies = {"/v1/chat/completions": {"messages": HELLO, "max_tokens": 3},
              "/v1/completions": {"prompt": "Hello there", "max_tokens": 3}}
    for force in (True, False):
        engine = AsyncEngine(make_engine(bos_model_dir, warmup=False))
        with TestClient(create_app(ServerConfig(enable_force_include_usage=force), engine)) as client:
            for path, body in bodies.items():
                last = last_chunk(client, path, body)
                if force:
                    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3, (path, last)
                else:
                    assert last["choices"] and last.get("usage") is None, (path, last)
