"""LoRA adapters over HTTP: /v1/models lists each adapter with its parent, a request names one as its
`model` and gets the outputs of the adapter merged into the base model, and a name not served is a 404."""

import pytest
from starlette.testclient import TestClient

from jaxserve.api.app import create_app
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from tests.engine.helpers import make_engine
from tests.lora_helpers import write_adapter, write_merged

TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def dirs(tiny_model_dir, tmp_path_factory):
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("lora-api")
    adapter = write_adapter(root / "sql", base, TARGETS, rank=8, alpha=16.0, seed=5)
    return base, adapter, write_merged(root / "merged", base, adapter)


@pytest.fixture(scope="module")
def client(dirs):
    base, adapter, _ = dirs
    module = f'{{"name": "sql-lora", "path": "{adapter}", "base_model_name": "tiny"}}'
    engine = make_engine(base, warmup=False, enable_lora=True, lora_modules=(module,), max_loras=1)
    config = ServerConfig(served_model_name=("tiny",), allow_runtime_lora_updating=True)
    with TestClient(create_app(config, AsyncEngine(engine))) as client:
        yield client


def _completion(client: TestClient, model: str, **extra) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **extra}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_models_lists_the_adapter_with_its_parent(client, dirs):
    cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert set(cards) == {"tiny", "sql-lora"}
    assert cards["sql-lora"]["parent"] == "tiny"
    assert cards["sql-lora"]["root"] == str(dirs[1])
    for name, card in cards.items():  # retrieved one by one: the same cards
        assert client.get(f"/v1/models/{name}").json() == card


def test_an_adapter_request_gets_the_merged_models_outputs(client, dirs):
    """Completions and chat under the adapter's name equal the merged model's; the base model's name (and
    no name) still gets the base model, so requests of both share the server."""
    merged_engine = make_engine(dirs[2], warmup=False)
    with TestClient(create_app(ServerConfig(served_model_name=("merged",)), AsyncEngine(merged_engine))) as merged:
        expected = _completion(merged, "merged")["choices"][0]["text"]
        chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
        expected_chat = merged.post("/v1/chat/completions", json={**chat_body, "model": "merged"}).json()
    got = _completion(client, "sql-lora")
    assert got["model"] == "sql-lora"
    assert got["choices"][0]["text"] == expected
    base_text = _completion(client, "tiny")["choices"][0]["text"]
    assert base_text != expected
    assert _completion(client, None)["choices"][0]["text"] == base_text
    chat = client.post("/v1/chat/completions", json={**chat_body, "model": "sql-lora"}).json()
    assert chat["choices"][0]["message"]["content"] == expected_chat["choices"][0]["message"]["content"]


def test_streamed_adapter_request(client):
    body = {"model": "sql-lora", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        text = "".join(line for line in response.iter_lines() if line.startswith("data: {"))
    assert '"model":"sql-lora"' in text.replace(" ", "")


@pytest.mark.parametrize("model", ["sql", "SQL-LORA", "sql-lora ", "tiny/sql-lora"])
def test_a_model_not_served_is_a_404(client, model):
    response = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"


def test_adapters_load_and_unload_while_serving(client, dirs, tmp_path):
    """vLLM's runtime updates: an adapter loaded from the server's disk serves at once under its name (the
    same adapter as sql-lora, so the same text); unloaded, its name is a 404 again."""
    _, adapter, _ = dirs
    expected = _completion(client, "sql-lora")["choices"][0]["text"]
    loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "sql-2", "lora_path": str(adapter)})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'sql-2' added successfully."
    assert "sql-2" in {card["id"] for card in client.get("/v1/models").json()["data"]}
    assert _completion(client, "sql-2")["choices"][0]["text"] == expected
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "sql-2", "lora_path": str(adapter)})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    inplace = client.post("/v1/load_lora_adapter", json={"lora_name": "sql-2", "lora_path": str(adapter),
                                                          "load_inplace": True})
    assert inplace.status_code == 200
    unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql-2"})
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    response = client.post("/v1/completions", json={"model": "sql-2", "prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 404
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql-2"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
    assert _completion(client, "sql-lora")["choices"][0]["text"] == expected  # the others serve on


@pytest.mark.parametrize(("body", "param"), [
    ({"lora_name": "x", "lora_path": "/no/such/dir"}, "lora_path"),
    ({"lora_name": "x", "lora_path": "x" * 100_000}, "lora_path"),  # past the OS's name limit
    ({"lora_name": "x", "lora_path": "/" + "a/" * 5_000}, "lora_path"),  # past its path limit
    ({"lora_name": "x", "lora_path": "/tmp\x00/etc"}, "lora_path"),  # a NUL byte
    ({"lora_name": "x", "lora_path": 5}, "lora_path"),
    ({"lora_name": "x", "lora_path": ["/tmp"]}, "lora_path"),
    ({"lora_name": "x", "lora_path": "ADAPTER", "load_inplace": "maybe"}, "load_inplace"),
    ({"lora_name": "x", "lora_path": "org/hub-adapter"}, "lora_path"),  # never a download
    ({"lora_name": "x", "lora_path": "BASE"}, "lora_path"),  # a model, not an adapter
    ({"lora_name": "tiny", "lora_path": "ADAPTER"}, "lora_name"),  # the base model's name
    ({"lora_name": "", "lora_path": "ADAPTER"}, "lora_name"),
    ({"lora_name": "x"}, "lora_path"),
    ({"lora_name": "x", "lora_path": "ADAPTER", "rank": 4}, "rank"),
    ({"lora_name": 5, "lora_path": "ADAPTER"}, "lora_name"),
    ([], None),
])
def test_bad_loads_are_400s_and_serve_nothing(client, dirs, body, param):
    base, adapter, _ = dirs
    if isinstance(body, dict):
        body = {k: str(base) if v == "BASE" else str(adapter) if v == "ADAPTER" else v for k, v in body.items()}
    response = client.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param
    assert {card["id"] for card in client.get("/v1/models").json()["data"]} == {"tiny", "sql-lora"}


def test_runtime_updates_are_off_unless_allowed_and_need_enable_lora(tiny_model_dir, dirs):
    engine = make_engine(tiny_model_dir("llama"), warmup=False)
    body = {"lora_name": "x", "lora_path": str(dirs[1])}
    with TestClient(create_app(ServerConfig(), AsyncEngine(engine))) as plain:
        assert plain.post("/v1/load_lora_adapter", json=body).status_code == 404
    engine = make_engine(tiny_model_dir("llama"), warmup=False)
    with TestClient(create_app(ServerConfig(allow_runtime_lora_updating=True), AsyncEngine(engine))) as allowed:
        response = allowed.post("/v1/load_lora_adapter", json=body)
        assert response.status_code == 400 and "--enable-lora" in response.json()["error"]["message"]


def test_metrics_carry_vllm_s_lora_info_series(client):
    _completion(client, "sql-lora")
    lines = [line for line in client.get("/metrics").text.splitlines()
             if line.startswith("jaxserve:lora_requests_info{")]
    assert len(lines) == 1 and 'max_lora="1"' in lines[0] and 'running_lora_adapters=""' in lines[0]
