"""POST /start_profile and /stop_profile (vLLM's), served with a profiler folder: a trace of the requests
between them; a second start or a stop without one is a 400 and the server serves on; behind --api-key; not
served without a folder; and the folder's rule (flag, then JAXSERVE_PROFILER_DIR, then vLLM's variable)."""

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from jaxserve.api.app import create_app
from jaxserve.api.serving import check_server_files
from jaxserve.config import ServerConfig, profiler_dir
from jaxserve.engine.async_engine import AsyncEngine
from tests.engine.helpers import make_engine, traced_jit_calls


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Iterator[AsyncEngine]:
    """One AsyncEngine for the module's apps (one LLMEngine is driven by one at a time)."""
    async_engine = AsyncEngine(make_engine(tiny_model_dir("llama"), warmup=False))
    yield async_engine
    async_engine.shutdown()


def test_a_profile_holds_the_requests_between_start_and_stop(engine, tmp_path):
    log_dir = tmp_path / "trace"
    config = ServerConfig(profiler_dir=str(log_dir), api_key="k")
    with TestClient(create_app(config, engine)) as client:
        assert client.post("/start_profile").status_code == 401, "behind the API key"
        key = {"Authorization": "Bearer k"}
        assert client.post("/start_profile", headers=key).status_code == 200
        again = client.post("/start_profile", headers=key)
        assert again.status_code == 400 and "being recorded already" in again.json()["error"]["message"]
        answer = client.post("/v1/completions", headers=key, json={"prompt": [5, 6, 7], "max_tokens": 3})
        assert answer.status_code == 200, answer.text
        assert client.post("/stop_profile", headers=key).status_code == 200
        late = client.post("/stop_profile", headers=key)
        assert late.status_code == 400 and "no profile is being recorded" in late.json()["error"]["message"]
        assert client.post("/v1/completions", headers=key, json={"prompt": [5], "max_tokens": 1}).status_code == 200
        paths = client.get("/openapi.json").json()["paths"]
        assert {"/start_profile", "/stop_profile"} <= set(paths)
    assert traced_jit_calls(str(log_dir))["step"] >= 2


def test_the_routes_answer_503_for_an_engine_that_is_not_running(tiny_model_dir, tmp_path):
    stopped = AsyncEngine(make_engine(tiny_model_dir("llama"), warmup=False))
    stopped.shutdown()
    with TestClient(create_app(ServerConfig(profiler_dir=str(tmp_path)), stopped)) as client:
        for path in ("/start_profile", "/stop_profile"):
            response = client.post(path)
            assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
            assert "not running" in response.json()["error"]["message"]
    assert not list(tmp_path.iterdir())  # no trace was started


def test_a_profiler_that_refuses_is_a_500_saying_why_and_the_server_serves_on(engine, tmp_path):
    """jax runs one trace per process: with another one running (a caller's own), a start fails with jax's
    reason, and once that trace ends the profiler starts and stops."""
    import jax

    with TestClient(create_app(ServerConfig(profiler_dir=str(tmp_path / "served")), engine)) as client:
        jax.profiler.start_trace(str(tmp_path / "other"))
        try:
            refused = client.post("/start_profile")
        finally:
            jax.profiler.stop_trace()
        assert refused.status_code == 500, refused.text
        assert refused.json()["error"]["message"].startswith("the profiler failed: ")
        assert client.post("/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 200
        assert client.post("/start_profile").status_code == 200
        assert client.post("/stop_profile").status_code == 200


def test_the_routes_are_not_served_without_a_folder(engine):
    with TestClient(create_app(ServerConfig(), engine)) as client:
        assert client.post("/start_profile").status_code == 404
        assert "/start_profile" not in client.get("/openapi.json").json()["paths"]


def test_the_folder_comes_from_the_flag_then_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXSERVE_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    assert profiler_dir() is None
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", "/from/vllm")
    assert profiler_dir() == "/from/vllm"
    monkeypatch.setenv("JAXSERVE_PROFILER_DIR", "/from/jaxserve")
    assert profiler_dir() == "/from/jaxserve" and profiler_dir("/flag") == "/flag"
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(ValueError, match=r"--profiler-dir .*a-file/trace: Not a directory"):
        check_server_files(ServerConfig(profiler_dir=str(blocked / "trace")))
    check_server_files(ServerConfig(profiler_dir=str(tmp_path / "made" / "here")))
    assert (tmp_path / "made" / "here").is_dir()
    from jaxserve.cli import _server_config, build_parser

    assert _server_config(build_parser().parse_args(["serve", "--profiler-dir", "/flag"])).profiler_dir == "/flag"
    assert _server_config(build_parser().parse_args(["serve"])).profiler_dir == "/from/jaxserve"
