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
    with TestClient(create_app(ServerConfig(served_model_name=("tiny",)), AsyncEngine(engine))) as client:
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
