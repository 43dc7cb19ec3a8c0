"""/classify, and /score and /rerank with a cross-encoder, in-process on engines of tiny random classifiers
(transformers' `*ForSequenceClassification`): probabilities and labels against transformers' logits in float64,
a one-class classifier's pair scores against transformers' on the tokenizer's pair encoding, /invocations
answering as /classify, and what a classifier and an embedding model each refuse."""

import httpx
import numpy as np
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from jaxserve.api.app import create_app
from jaxserve.api.scores import RERANK_PATHS, SCORE_PATHS
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from tests.api.helpers import start_server, stop_server
from tests.classifiers import LABELS
from tests.engine.helpers import make_engine
from tests.helpers import approx_floats

pytestmark = pytest.mark.slow  # transformers reference

QUERY = "Where do cats sleep?"
DOCUMENTS = ["Cats sleep on warm windowsills.", "Quarterly revenue rose by four percent.", "The cat naps on the rug.",
             "Stock prices fell."]
LONG = " ".join(f"w{i}" for i in range(300))


@pytest.fixture(scope="module")
def classifier(classifier_dir):
    """(client, transformers model, tokenizer) of a three-class Qwen3 classifier."""
    directory, model = classifier_dir("qwen3")
    engine = make_engine(directory, warmup=False)  # no --runner: a classifier chooses pooling
    with TestClient(create_app(ServerConfig(), AsyncEngine(engine))) as client:
        yield client, model.double(), AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def cross_encoder(classifier_dir):
    """(client, transformers model, tokenizer) of a one-class Qwen2 classifier: a cross-encoder reranker."""
    directory, model = classifier_dir("qwen2", num_labels=1)
    engine = make_engine(directory, warmup=False)
    with TestClient(create_app(ServerConfig(), AsyncEngine(engine))) as client:
        yield client, model.double(), AutoTokenizer.from_pretrained(str(directory))


def _logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _post(client: TestClient, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_classify_gives_transformers_probabilities_and_the_likeliest_label(classifier):
    client, model, tokenizer = classifier
    inputs = DOCUMENTS[:3]
    answer = _post(client, "/classify", {"input": inputs})
    assert answer["object"] == "list" and answer["id"].startswith("classify-")
    token_ids = [[5, 900, 31000, 7], [17, 4]]
    by_ids = _post(client, "/classify", {"input": token_ids})
    prompts = [tokenizer.encode(text) for text in inputs]
    for answered, asked in ((answer, prompts), (by_ids, token_ids)):
        for i, (data, ids) in enumerate(zip(answered["data"], asked, strict=True)):
            probs = _softmax(_logits(model, ids))
            assert data["index"] == i and data["num_classes"] == 3
            np.testing.assert_allclose(data["probs"], probs, rtol=2e-4, atol=2e-5)
            assert data["label"] == LABELS[int(np.argmax(probs))]
    usage = answer["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == sum(map(len, prompts)) and usage["completion_tokens"] == 0
    one = _post(client, "/classify", {"input": DOCUMENTS[0], "truncate_prompt_tokens": 3})
    assert one["usage"]["prompt_tokens"] == 3
    np.testing.assert_allclose(one["data"][0]["probs"], _softmax(_logits(model, prompts[0][-3:])), rtol=2e-4,
                               atol=2e-5)
    invoked = _post(client, "/invocations", {"input": inputs})
    for answered in (answer, invoked):
        answered.pop("id"), answered.pop("created")
    assert invoked == approx_floats(answer)


def _softmax(logits: np.ndarray) -> np.ndarray:
    exps = np.exp(logits - logits.max())
    return exps / exps.sum()


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/classify", {"input": []}, 400, "input"),
    ("/classify", {"input": ""}, 400, "input"),
    ("/classify", {"input": [[]]}, 400, "input"),
    ("/classify", {"input": [LONG, "fits"]}, 400, "input"),  # over the 256-token context
    ("/classify", {"input": [[10**9]]}, 400, "input"),  # outside the vocabulary
    ("/classify", {"input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("/classify", {"input": "x", "priority": 1}, 400, "priority"),
    ("/classify", {"input": 5}, 400, "input"),
    ("/classify", {"input": "x", "model": "other"}, 404, "model"),
    ("/classify", {}, 400, "input"),
    ("/classify", {"input": "x", "use_activation": "maybe"}, 400, "use_activation"),
    ("/classify", {"input": "x", "softmax": [1]}, 400, "softmax"),
    ("/classify", {"messages": "not a list"}, 400, "messages"),
    ("/v1/embeddings", {"input": "x"}, 400, "model"),  # class logits are no embeddings
    ("/v1/score", {"text_1": "x", "text_2": "y"}, 400, "model"),  # three classes: no one score for a pair
    ("/v1/rerank", {"query": "q", "documents": ["d"]}, 400, "model"),
])
def test_what_a_classifier_refuses_is_a_4xx_naming_the_field(classifier, path, body, status, param):
    response = classifier[0].post(path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_a_cross_encoder_scores_and_reranks_pairs_as_transformers_does(cross_encoder):
    client, model, tokenizer = cross_encoder

    def expected(first: str, second: str) -> float:
        return float(1 / (1 + np.exp(-_logits(model, tokenizer(first, text_pair=second)["input_ids"])[0])))

    assert tokenizer(QUERY, text_pair=DOCUMENTS[0])["input_ids"] != (
        tokenizer.encode(QUERY) + tokenizer.encode(DOCUMENTS[0])), "a pair is read with its separator"
    scores = [expected(QUERY, document) for document in DOCUMENTS]
    for path in SCORE_PATHS:
        answer = _post(client, path, {"text_1": QUERY, "text_2": DOCUMENTS})
        np.testing.assert_allclose([d["score"] for d in answer["data"]], scores, rtol=1e-4, atol=1e-6)
    paired = _post(client, "/v1/score", {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:]})
    np.testing.assert_allclose([d["score"] for d in paired["data"]],
                               [expected(DOCUMENTS[0], DOCUMENTS[2]), expected(DOCUMENTS[1], DOCUMENTS[3])],
                               rtol=1e-4, atol=1e-6)
    pair_tokens = sum(len(tokenizer(QUERY, text_pair=d)["input_ids"]) for d in DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    for path in RERANK_PATHS:
        ranked = _post(client, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 3})
        assert [r["index"] for r in ranked["results"]] == order[:3], path
        np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]],
                                   sorted(scores, reverse=True)[:3], rtol=1e-4, atol=1e-6)
        assert ranked["usage"]["total_tokens"] == pair_tokens
    one_class = _post(client, "/classify", {"input": QUERY})["data"][0]
    assert one_class["label"] == "relevance" and one_class["num_classes"] == 1
    np.testing.assert_allclose(one_class["probs"], [1 / (1 + np.exp(-_logits(model, tokenizer.encode(QUERY))[0]))],
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/score", {"text_1": "x", "text_2": ["y", ""]}, "text_2.1"),
    ("/v1/score", {"text_1": ["", "a"], "text_2": ["y", "z"]}, "text_1.0"),
    ("/v1/score", {"text_1": LONG, "text_2": ["y", "z"]}, "text_1"),  # a pair over the context: its longer text
    ("/v1/score", {"text_1": "x", "text_2": ["y", "z" * 10**6]}, "text_2.1"),  # too long to tokenize
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/rerank", {"query": "q", "documents": ["d", LONG]}, "documents.1"),
    ("/v1/rerank", {"query": "", "documents": ["d"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "use_activation": {"a": 1}}, "use_activation"),
    ("/v1/score", {"text_1": "x", "text_2": "y", "activation": "yes please"}, "activation"),
])
def test_what_a_cross_encoder_refuses_is_a_400_naming_the_field(cross_encoder, path, body, param):
    response = cross_encoder[0].post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_use_activation_false_gives_the_logits(classifier, cross_encoder):
    """vLLM's `use_activation` (and its former names): false gives the logits themselves, on /classify and on
    a cross-encoder's /score and /rerank."""
    client, model, tokenizer = classifier
    logits = _logits(model, tokenizer.encode(QUERY))
    for switch in ("use_activation", "activation", "softmax"):
        answer = _post(client, "/classify", {"input": QUERY, switch: False})["data"][0]
        np.testing.assert_allclose(answer["probs"], logits, rtol=2e-4, atol=2e-4)
        assert answer["label"] == LABELS[int(np.argmax(logits))]
    client, model, tokenizer = cross_encoder
    raw = [_logits(model, tokenizer(QUERY, text_pair=d)["input_ids"])[0] for d in DOCUMENTS[:2]]
    scored = _post(client, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[:2], "use_activation": False})
    np.testing.assert_allclose([d["score"] for d in scored["data"]], raw, rtol=2e-4, atol=2e-4)
    ranked = _post(client, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS[:2], "use_activation": False})
    np.testing.assert_allclose(sorted(r["relevance_score"] for r in ranked["results"]), sorted(raw), rtol=2e-4,
                               atol=2e-4)


@pytest.mark.parametrize(("problem_type", "num_labels"), [("regression", 1), ("multi_label_classification", 3)])
def test_the_activation_follows_the_config_s_problem_type(classifier_dir, problem_type, num_labels):
    """As vLLM chooses it: a regression (a reward model) gives its logit as it is, a multi-label classifier a
    sigmoid per class."""
    directory, model = classifier_dir("llama", num_labels, problem_type)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    engine = make_engine(directory, warmup=False)
    with TestClient(create_app(ServerConfig(), AsyncEngine(engine))) as client:
        answer = _post(client, "/classify", {"input": [QUERY, DOCUMENTS[0]]})
    for data, text in zip(answer["data"], (QUERY, DOCUMENTS[0]), strict=True):
        logits = _logits(model.double(), tokenizer.encode(text))
        expected = logits if problem_type == "regression" else 1 / (1 + np.exp(-logits))
        np.testing.assert_allclose(data["probs"], expected, rtol=2e-4, atol=2e-5)


def test_a_chat_is_classified_as_its_rendered_template(classifier):
    """vLLM's chat form of /classify: `messages` rendered by the chat template (no generation prompt, as the
    chat embeddings request renders them), classified as one input; /invocations answers it the same."""
    client, model, tokenizer = classifier
    messages = [{"role": "user", "content": QUERY}, {"role": "assistant", "content": DOCUMENTS[0]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    answer = _post(client, "/classify", {"messages": messages})
    np.testing.assert_allclose(answer["data"][0]["probs"], _softmax(_logits(model, ids)), rtol=2e-4, atol=2e-5)
    assert answer["usage"]["prompt_tokens"] == len(ids)
    invoked = _post(client, "/invocations", {"messages": messages})
    assert invoked["data"] == approx_floats(answer["data"])
    both = client.post("/classify", json={"messages": messages, "input": "x"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "messages"


def test_an_embedding_model_refuses_to_classify(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), warmup=False, runner="pooling")
    with TestClient(create_app(ServerConfig(), AsyncEngine(engine))) as client:
        response = client.post("/classify", json={"input": "x"})
        assert response.status_code == 400 and "no classifier head" in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "model"


def test_jaxserve_serve_serves_a_cross_encoder_over_http(tmp_path, compile_cache, classifier_dir):
    """`jaxserve serve <classifier>` with no --runner: the server chooses pooling, and answers /v1/rerank and
    /classify over real HTTP as the in-process app does."""
    directory, model = classifier_dir("qwen2", num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    server = start_server(tmp_path, compile_cache, str(directory))
    try:
        ranked = httpx.post(f"{server.base_url}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS},
                            timeout=60).json()
        scores = [float(1 / (1 + np.exp(-_logits(model.double(), tokenizer(QUERY, text_pair=d)["input_ids"])[0])))
                  for d in DOCUMENTS]
        assert [r["index"] for r in ranked["results"]] == sorted(range(4), key=lambda i: -scores[i])
        np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], sorted(scores, reverse=True),
                                   rtol=1e-4, atol=1e-6)
        classified = httpx.post(f"{server.base_url}/classify", json={"input": [QUERY]}, timeout=60).json()
        assert classified["data"][0]["label"] == "relevance"
        refused = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi"}, timeout=60)
        assert refused.status_code == 400
    finally:
        stop_server(server)
    assert server.process.returncode == 0
    assert "the model is a classifier: serving it with --runner pooling" in server.log()
    assert "Traceback" not in server.log()
