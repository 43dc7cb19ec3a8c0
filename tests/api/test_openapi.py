"""/openapi.json and /docs, in process on a tiny random Llama: the document is valid OpenAPI 3.1, it and the
app's routes agree both ways, and what the app answers matches the schemas the document gives."""

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import pytest
from schemathesis.specs.openapi.definitions import OPENAPI_31  # the official 3.1 meta-schema, vendored
from starlette.routing import Route
from starlette.testclient import TestClient

from jaxserve.api.app import create_app
from jaxserve.api.openapi import openapi_routes
from jaxserve.api.scores import RERANK_PATHS, SCORE_PATHS
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from tests.engine.helpers import make_engine

HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
DOC_ROUTES = {route.path for route in openapi_routes(ServerConfig())}  # serve the document, not in it

# One small valid request per documented operation, to compare what the app answers with the document.
SAMPLE_BODIES: dict[tuple[str, str], Any] = {
    ("/v1/completions", "post"): {"prompt": "Hi", "max_tokens": 2},
    ("/v1/chat/completions", "post"): {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    ("/tokenize", "post"): {"prompt": "Hello"},
    ("/detokenize", "post"): {"tokens": [5, 6]},
    ("/v1/responses", "post"): {"input": "Hi", "max_output_tokens": 2},
    ("/invocations", "post"): {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
}
# A --runner pooling server's (tests/api/test_embeddings.py, tests/api/test_scores.py, tests/api/test_classify.py)
OTHER_RUNNER = {(path, "post") for path in ("/v1/embeddings", "/classify", *SCORE_PATHS, *RERANK_PATHS)}


@pytest.fixture(scope="module")
def llm_engine(tiny_model_dir):
    return make_engine(tiny_model_dir("llama"), warmup=False)


@pytest.fixture(scope="module")
def apart_engine(tiny_model_dir) -> Iterator[AsyncEngine]:
    """An engine for the tests that build their own app while `client`'s is alive (one LLMEngine is driven by
    one AsyncEngine at a time); an app given an AsyncEngine leaves its shutdown to the caller."""
    async_engine = AsyncEngine(make_engine(tiny_model_dir("llama"), warmup=False))
    yield async_engine
    async_engine.shutdown()


@pytest.fixture(scope="module")
def client(llm_engine) -> Iterator[TestClient]:
    with TestClient(create_app(ServerConfig(), AsyncEngine(llm_engine))) as client:
        yield client


@pytest.fixture(scope="module")
def document(client) -> dict[str, Any]:
    response = client.get("/openapi.json")
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    return response.json()


def operations(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {(path, method) for path, item in document["paths"].items() for method in item if method in HTTP_METHODS}


def app_operations(app) -> set[tuple[str, str]]:
    """(path, method) of every route the app serves; Starlette adds HEAD to each GET by itself."""
    served = set()
    for route in app.routes:
        assert isinstance(route, Route), f"{route!r}: only plain routes are expected"
        if route.path not in DOC_ROUTES:  # `{name:path}` is `{name}` in OpenAPI's templates
            path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
            served |= {(path, method.lower()) for method in route.methods or () if method != "HEAD"}
    return served


def response_validator(document: dict[str, Any], schema: dict[str, Any]) -> jsonschema_rs.Validator:
    """A validator for `schema` whose `#/components/...` refs resolve inside the document."""
    return jsonschema_rs.validator_for({**schema, "components": document["components"]})


def test_the_document_is_valid_openapi_3_1(document):
    assert document["openapi"].startswith("3.1")
    errors = [f"{'/'.join(map(str, e.instance_path))}: {e.message}"
              for e in jsonschema_rs.validator_for(OPENAPI_31).iter_errors(document)]
    assert not errors, "\n".join(errors)
    for name, schema in document["components"]["schemas"].items():
        assert jsonschema_rs.meta.is_valid(schema), name  # each one a valid JSON Schema 2020-12
    schemes = document["components"]["securitySchemes"]
    assert schemes["bearer"] == {**schemes["bearer"], "type": "http", "scheme": "bearer"}
    assert document["servers"] == [{"url": "/"}]

    refs = set(_refs(document))
    schemas = document["components"]["schemas"]
    missing = {ref for ref in refs if ref.removeprefix("#/components/schemas/") not in schemas}
    assert not missing and refs, missing
    ids = [op["operationId"] for item in document["paths"].values() for m, op in item.items() if m in HTTP_METHODS]
    assert len(ids) == len(set(ids))


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_the_document_and_the_app_routes_agree(client, document):
    documented, served = operations(document), app_operations(client.app)
    assert not served - documented, f"served but not documented: {sorted(served - documented)}"
    assert not documented - served, f"documented but not served: {sorted(documented - served)}"
    assert not DOC_ROUTES & set(document["paths"])  # FastAPI's convention: the docs don't describe themselves


def test_the_optional_routes_are_documented_where_they_are_served(apart_engine, tmp_path):
    """Runtime LoRA updates and the profiler's routes: in the document exactly when the app serves them."""
    config = ServerConfig(allow_runtime_lora_updating=True, profiler_dir=str(tmp_path))
    with TestClient(create_app(config, apart_engine)) as client:
        documented, served = operations(client.get("/openapi.json").json()), app_operations(client.app)
    assert documented == served
    assert {("/v1/load_lora_adapter", "post"), ("/start_profile", "post"), ("/stop_profile", "post")} <= served


def test_request_bodies_come_from_the_pydantic_models(document):
    schemas = document["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "DetokenizeRequest", "TokenizeCompletionRequest",
                 "TokenizeChatRequest", "CompletionResponse", "ChatCompletionResponse", "ChatCompletionChunk",
                 "ModelList", "TokenizeResponse", "DetokenizeResponse", "ErrorResponse"):
        assert name in schemas, name
    completions = document["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    assert {"prompt", "max_tokens", "top_k", "stream_options"} <= set(schemas["CompletionRequest"]["properties"])
    assert set(completions["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    tokenize = document["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {ref["$ref"].rsplit("/", 1)[1] for ref in tokenize["anyOf"]} == {
        "TokenizeCompletionRequest", "TokenizeChatRequest"}
    for path, method in operations(document):
        for status, response in document["paths"][path][method]["responses"].items():
            if status.startswith(("4", "5")) and "content" in response:
                assert response["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorResponse"}, (path, method, status)


def test_what_the_app_answers_matches_the_document(client, document):
    response_id = None  # "/v1/responses" sorts before "/v1/responses/{response_id}", which reads it back
    model_id = client.get("/v1/models").json()["data"][0]["id"]
    # DELETE last: it forgets the response that the others read.
    for path, method in sorted(operations(document) - OTHER_RUNNER, key=lambda op: (op[1] == "delete", op)):
        url = path.replace("{response_id}", str(response_id)).replace("{model_id}", model_id)
        if path.endswith("/cancel"):  # only a background response can be cancelled
            body = {**SAMPLE_BODIES[("/v1/responses", "post")], "background": True}
            url = path.replace("{response_id}", client.post("/v1/responses", json=body).json()["id"])
        response = client.request(method.upper(), url, json=SAMPLE_BODIES.get((path, method)))
        if path == "/v1/responses":
            response_id = response.json()["id"]
        assert response.status_code == 200, (path, method, response.text)
        content = document["paths"][path][method]["responses"]["200"].get("content", {})
        if "application/json" in content:
            validator = response_validator(document, content["application/json"]["schema"])
            errors = [e.message for e in validator.iter_errors(response.json())]
            assert not errors, (path, method, errors)
        elif content:
            assert response.headers["content-type"].split(";")[0] in content, (path, method)


@pytest.mark.parametrize(("path", "chunk"), [("/v1/completions", "CompletionResponse"),
                                             ("/v1/chat/completions", "ChatCompletionChunk")])
def test_streamed_events_match_the_documented_chunk(client, document, path, chunk):
    body = {**SAMPLE_BODIES[(path, "post")], "stream": True}
    response = client.post(path, json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 1
    validator = response_validator(document, {"$ref": f"#/components/schemas/{chunk}"})
    for event in events[:-1]:
        assert validator.is_valid(json.loads(event)), event


def test_errors_match_the_error_response_schema(client, document):
    validator = response_validator(document, {"$ref": "#/components/schemas/ErrorResponse"})
    for method, path, body in [("POST", "/v1/completions", {}), ("POST", "/tokenize", {"prompt": 5}),
                               ("POST", "/v1/chat/completions", {"messages": [], "model": "nope"})]:
        response = client.request(method, path, json=body)
        assert 400 <= response.status_code < 500, (path, response.status_code)
        documented = document["paths"][path][method.lower()]["responses"]
        assert str(response.status_code) in documented, (path, response.status_code)
        assert validator.is_valid(response.json()), response.text


def test_security_is_applied_where_the_api_key_is_checked(apart_engine):
    with TestClient(create_app(ServerConfig(api_key="k"), apart_engine)) as client:
        document = client.get("/openapi.json").json()  # open without a key, like /health
        assert client.get("/docs").status_code == 200
        for path, method in sorted(operations(document)):
            op = document["paths"][path][method]
            status = client.request(method.upper(), path, json=SAMPLE_BODIES.get((path, method))).status_code
            assert (status == 401) == ("security" in op), (path, method, status)
            assert ("401" in op["responses"]) == ("security" in op), (path, method)
            if "security" in op:
                assert op["security"] == [{"bearer": []}]
                headers = {"Authorization": "Bearer k"}
                # past the key: 200, or the answer of a generating server to an embedding, or of an unknown id
                expected = 400 if (path, method) in OTHER_RUNNER else 404 if "{" in path else 200
                assert client.request(method.upper(), path, json=SAMPLE_BODIES.get((path, method)),
                                      headers=headers).status_code == expected, (path, method)


def test_root_path_is_honoured(apart_engine):
    app = create_app(ServerConfig(root_path="/llm"), apart_engine)
    with TestClient(app, root_path="/llm") as client:
        assert client.get("/llm/openapi.json").json()["servers"] == [{"url": "/llm"}]
        page = client.get("/llm/docs")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '"/llm/openapi.json"' in page.text and "swagger-ui-bundle.js" in page.text
