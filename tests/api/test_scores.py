"""/v1/score and /v1/rerank in-process on a `--runner pooling` engine of a tiny random Llama (mean pooling):
cosine similarities against transformers' final hidden states in float64, the pairing rules, the ranking
and top_n, every path vLLM serves them at, and what they refuse."""

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from jaxserve.api.app import create_app
from jaxserve.api.scores import RERANK_PATHS, SCORE_PATHS
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from tests.engine.helpers import make_engine
from tests.helpers import approx_floats

QUERY = "Where do cats sleep?"
LONG = " ".join(f"w{i}" for i in range(300))
DOCUMENTS = ["Cats sleep on warm windowsills.", "Quarterly revenue rose by four percent.", "The cat naps on the rug.",
             "Stock prices fell."]


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), warmup=False, runner="pooling", pooling_type="mean")
    with TestClient(create_app(ServerConfig(), AsyncEngine(engine))) as client:
        yield client


@pytest.fixture(scope="module")
def cosine(tiny_model_dir, tiny_hf_model):
    """text, text -> their cosine similarity from transformers' mean-pooled final hidden states, in float64."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    model = tiny_hf_model("llama").double()

    def embed(text: str) -> np.ndarray:
        with torch.no_grad():
            hidden = model.model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0]
        return hidden.mean(0).numpy()

    def similarity(a: str, b: str) -> float:
        x, y = embed(a), embed(b)
        return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))

    return similarity


def _post(client: TestClient, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_scores_are_the_cosine_similarities_of_the_embeddings(client, cosine):
    one_to_n = _post(client, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert [d["index"] for d in one_to_n["data"]] == [0, 1, 2, 3] and one_to_n["object"] == "list"
    expected = [cosine(QUERY, document) for document in DOCUMENTS]
    np.testing.assert_allclose([d["score"] for d in one_to_n["data"]], expected, atol=2e-4)
    n_to_n = _post(client, "/v1/score", {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:]})
    np.testing.assert_allclose([d["score"] for d in n_to_n["data"]],
                               [cosine(DOCUMENTS[0], DOCUMENTS[2]), cosine(DOCUMENTS[1], DOCUMENTS[3])], atol=2e-4)
    single = _post(client, "/score", {"text_1": [QUERY], "text_2": QUERY})
    assert single["data"][0]["score"] == pytest.approx(1.0, abs=1e-5), "a text is its own nearest"
    usage = one_to_n["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 5 and usage["completion_tokens"] == 0


def test_rerank_orders_the_documents_by_score_and_keeps_the_best_top_n(client, cosine):
    scores = [cosine(QUERY, document) for document in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    for path in RERANK_PATHS:
        ranked = _post(client, path, {"query": QUERY, "documents": DOCUMENTS})
        assert [r["index"] for r in ranked["results"]] == order, path
        assert [r["document"]["text"] for r in ranked["results"]] == [DOCUMENTS[i] for i in order]
        np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], sorted(scores, reverse=True),
                                   atol=2e-4)
        assert ranked["id"].startswith("rerank-") and ranked["usage"]["total_tokens"] > 5
    top = _post(client, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert [r["index"] for r in top["results"]] == order[:2]
    assert len(_post(client, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 99})["results"]) == 4


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),  # 2:3 pairs nothing
    ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
    ("/v1/score", {"text_1": "x", "text_2": []}, "text_2"),
    ("/v1/score", {"text_1": "x", "text_2": ["y", ""]}, "text_2.1"),
    ("/v1/score", {"text_1": "x", "text_2": "y", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/score", {"text_1": "x", "text_2": ["y"] * 2048}, "text_2"),
    ("/v1/score", {"text_1": "x", "text_2": "y", "priority": 1}, "priority"),
    ("/v1/score", {"text_1": 5, "text_2": "y"}, "text_1"),
    ("/v1/score", {"text_1": LONG, "text_2": ["y", "z"]}, "text_1"),  # over the 256-token context
    ("/v1/score", {"text_1": "x", "text_2": ["y", "z" * 10**6]}, "text_2.1"),  # too long to tokenize
    ("/v1/rerank", {"query": LONG, "documents": ["d"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["d", LONG]}, "documents.1"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "", "documents": ["d"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": "d"}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "model": "other"}, "model"),
])
def test_what_scoring_refuses_is_a_4xx_naming_the_field(client, path, body, param):
    response = client.post(path, json=body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"].startswith(param), response.json()


def test_a_generating_server_refuses_scores(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), warmup=False)
    with TestClient(create_app(ServerConfig(), AsyncEngine(engine))) as client:
        for path in (*SCORE_PATHS, *RERANK_PATHS):
            response = client.post(path, json={"text_1": "a", "text_2": "b", "query": "q", "documents": ["d"]})
            assert response.status_code == 400 and "--runner pooling" in response.json()["error"]["message"]


def test_an_embedding_input_over_the_context_is_a_400_naming_the_input(client):
    response = client.post("/v1/embeddings", json={"input": ["fits", LONG]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input", response.text


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}),
    ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
    ("/v1/embeddings", {"input": DOCUMENTS[:2]}),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": QUERY}]}),
])
def test_invocations_answers_as_the_endpoint_the_body_picks(client, path, body):
    """SageMaker's /invocations on a pooling server (the generating server's side: tests/api/test_invocations.py)."""
    want, got = _post(client, path, body), _post(client, "/invocations", body)
    for answer in (want, got):
        answer.pop("id", None), answer.pop("created", None)
    # The two calls may be batched differently (texts split across steps as they arrive), so a float may
    # differ in its last bits; everything else is the same answer.
    assert got == approx_floats(want)
    refused = client.post("/invocations", json={"prompt": "hi"})
    assert refused.status_code == 400 and "query and documents (/v1/rerank)" in refused.json()["error"]["message"]
