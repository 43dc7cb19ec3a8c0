"""The app in-process on a tiny random Llama: loading and dead-engine states, which a subprocess can't force."""

import threading

import pytest
from starlette.testclient import TestClient

from jaxserve.api.app import create_app
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from tests.api.helpers import wait_for
from tests.engine.helpers import make_engine


@pytest.fixture(scope="module")
def llm_engine(tiny_model_dir):
    return make_engine(tiny_model_dir("llama"))


def test_health_is_503_while_loading_then_200(llm_engine):
    release = threading.Event()

    def load() -> AsyncEngine:
        release.wait(30)
        return AsyncEngine(llm_engine)

    with TestClient(create_app(ServerConfig(), load)) as client:
        assert client.get("/health").status_code == 503
        loading = client.get("/v1/models")
        assert loading.status_code == 503 and "loading" in loading.json()["error"]["message"]
        release.set()
        wait_for(lambda: client.get("/health").status_code == 200)
        assert client.get("/v1/models").json()["data"][0]["id"] == llm_engine.model.name


def test_a_dead_engine_answers_503_and_fails_in_flight_requests(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), warmup=False)
    async_engine = AsyncEngine(engine)
    calls = {"n": 0}
    original = engine.runner.launch

    def failing_launch(scheduler_output):
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("device lost")
        return original(scheduler_output)

    engine.runner.launch = failing_launch
    with TestClient(create_app(ServerConfig(), async_engine)) as client:
        body = {"prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True}
        in_flight = client.post("/v1/completions", json=body)
        assert in_flight.status_code == 503
        assert "device lost" in in_flight.json()["error"]["message"]
        assert client.get("/health").status_code == 503
        after = client.post("/v1/completions", json=body)
        assert after.status_code == 503 and after.json()["error"]["type"] == "service_unavailable"
        stream = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "stream": True})
        assert stream.status_code == 503


def test_an_unhandled_error_is_logged_once_and_answered_in_the_envelope(monkeypatch, caplog):
    from jaxserve.api import misc

    async def broken(request):
        raise RuntimeError("a bug")

    def no_model() -> AsyncEngine:
        raise FileNotFoundError("no model here")

    monkeypatch.setattr(misc, "version", broken)
    with TestClient(create_app(ServerConfig(), no_model), raise_server_exceptions=False) as client:
        caplog.clear()
        response = client.get("/version")
    assert response.status_code == 500
    assert response.json()["error"] == {"message": "internal server error", "type": "server_error", "param": None,
                                        "code": 500}
    tracebacks = [r for r in caplog.records if r.exc_info and "a bug" in str(r.exc_info[1])]
    assert len(tracebacks) == 1, [r.getMessage() for r in caplog.records]


def test_a_large_request_refused_or_served_frees_its_lists_off_the_event_loop(llm_engine, monkeypatch):
    """A chat of 3,000 messages too long for the context, then /detokenize of 150,000 ids (served): each body's
    long list and each request's are emptied a slice at a time on worker threads (the request's once its
    response is done, `LongListsMiddleware`), not freed on the event loop in one call each."""
    import asyncio

    from jaxserve import collector

    calls = []

    def recorded(*lists: list) -> None:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        calls.append((on_loop, [len(items) for items in lists]))
        collector.empty_in_pieces(*lists)

    monkeypatch.setattr("jaxserve.api.serving.empty_in_pieces", recorded)
    monkeypatch.setattr("jaxserve.api.middleware.empty_in_pieces", recorded)
    messages = [{"role": "user", "content": f"message {i}: " + "x" * 100} for i in range(3000)]
    with TestClient(create_app(ServerConfig(), AsyncEngine(llm_engine))) as client:
        response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert response.status_code == 400 and "context length" in response.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json={"messages": messages[:1], "max_tokens": 2}).status_code == 200
        assert calls == [(False, [3000]), (False, [3000])]
        response = client.post("/detokenize", json={"tokens": [7] * 150_000})
        assert response.status_code == 200 and response.json()["prompt"]
    assert calls[2:] == [(False, [150_000]), (False, [150_000])]
