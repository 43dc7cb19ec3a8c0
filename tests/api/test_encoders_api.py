"""Encoders over the API: `jaxserve serve` of a sentence-transformers BERT answers /v1/embeddings through the
openai SDK with transformers' mean-pooled, normalized vectors; a BERT cross-encoder's /v1/rerank and /v1/score
are transformers' pair scores with token types; what an encoder refuses is a 400 naming the field."""

import shutil

import numpy as np
import openai
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from jaxserve.api.app import create_app
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from tests.api.helpers import API_KEY, MODEL, start_server, stop_server
from tests.encoders import save_sentence_transformers_pooling
from tests.engine.helpers import make_engine

pytestmark = pytest.mark.slow  # transformers reference, a server of its own

TEXTS = ["the cat sat on the mat", "a dog is on the mat", "money in the bank", "where is paris?"]
QUERY = "where is the cat?"


def _mean_hidden(model, tokenizer, text: str) -> np.ndarray:
    with torch.no_grad():
        hidden = model.double()(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].numpy()
    return hidden.mean(axis=0)


@pytest.fixture(scope="module")
def st_server(tmp_path_factory, compile_cache, encoder_dir):
    """A server of a sentence-transformers BERT (mean pooling, max_seq_length 48), and its transformers model."""
    source, model = encoder_dir("bert")
    directory = tmp_path_factory.mktemp("st-bert") / "model"
    shutil.copytree(source, directory)
    save_sentence_transformers_pooling(directory, "mean_tokens", max_seq_length=48)
    server = start_server(tmp_path_factory.mktemp("encoder"), compile_cache, str(directory), "--api-key", API_KEY,
                          "--max-model-len", "auto")
    yield server, model, AutoTokenizer.from_pretrained(str(directory))
    stop_server(server)
    assert server.process.returncode == 0
    assert "the model is an encoder: serving it with --runner pooling" in server.log()
    assert "pooling: mean (its sentence-transformers pooling)" in server.log()
    assert "Traceback" not in server.log()


def test_the_openai_sdk_gets_transformers_mean_pooled_unit_vectors(st_server):
    server, model, tokenizer = st_server
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    answer = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    for text, data in zip(TEXTS, answer.data, strict=True):
        expected = _mean_hidden(model, tokenizer, text)
        np.testing.assert_allclose(data.embedding, expected / np.linalg.norm(expected), rtol=1e-4, atol=1e-5)
    assert answer.usage.prompt_tokens == sum(len(tokenizer(text)["input_ids"]) for text in TEXTS)
    decoded = client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding  # base64, the SDK's default
    np.testing.assert_allclose(decoded, answer.data[0].embedding, atol=1e-6)
    scored = client.post("/score", cast_to=object, body={"model": MODEL, "text_1": QUERY, "text_2": TEXTS[:2]})
    query = _mean_hidden(model, tokenizer, QUERY)
    cosines = [float(query @ v / np.linalg.norm(query) / np.linalg.norm(v))
               for v in (_mean_hidden(model, tokenizer, t) for t in TEXTS[:2])]
    np.testing.assert_allclose([d["score"] for d in scored["data"]], cosines, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "the cat " * 40}, "input"),  # 82 tokens: over the model's max_seq_length of 48
    ({"input": [[5, 99999]]}, "input"),  # a token past the vocabulary
    ({"input": []}, "input"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 8}, "dimensions"),  # not a matryoshka model
])
def test_what_an_encoder_refuses_is_a_400_naming_the_field(st_server, body, param):
    server, _, _ = st_server
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/embeddings", cast_to=object, body={"model": MODEL, **body})
    assert refused.value.body["param"] == param, refused.value.body
    with pytest.raises(openai.BadRequestError, match=r"--runner pooling|embedding"):
        client.completions.create(model=MODEL, prompt="the cat", max_tokens=2)
    assert client.embeddings.create(model=MODEL, input="the cat").data  # the engine serves on


def test_a_bert_cross_encoder_reranks_as_transformers_does(encoder_dir):
    directory, model = encoder_dir("bert", 1)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    engine = make_engine(directory, warmup=False, max_model_len=None)  # no --runner: an encoder pools
    with torch.no_grad():
        logits = [model.double()(**tokenizer(QUERY, text_pair=t, return_tensors="pt")).logits[0, 0].item()
                  for t in TEXTS]
    scores = 1 / (1 + np.exp(-np.array(logits)))
    with TestClient(create_app(ServerConfig(), AsyncEngine(engine))) as client:
        ranked = client.post("/v1/rerank", json={"query": QUERY, "documents": TEXTS, "top_n": 2}).json()
        assert [r["index"] for r in ranked["results"]] == list(np.argsort(-scores)[:2])
        np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], np.sort(scores)[::-1][:2],
                                   rtol=1e-4, atol=1e-6)
        paired = client.post("/v1/score", json={"text_1": QUERY, "text_2": TEXTS}).json()
        np.testing.assert_allclose([d["score"] for d in paired["data"]], scores, rtol=1e-4, atol=1e-6)
        tokenizer.truncation_side = "left"  # vLLM's: the texts' ends kept, inside [CLS] and the [SEP]s
        with torch.no_grad():
            cut = [model.double()(**tokenizer(QUERY, text_pair=t, truncation=True, max_length=7,
                                              return_tensors="pt")).logits[0, 0].item() for t in TEXTS]
        truncated = client.post("/v1/score", json={"text_1": QUERY, "text_2": TEXTS, "truncate_prompt_tokens": 7})
        np.testing.assert_allclose([d["score"] for d in truncated.json()["data"]], 1 / (1 + np.exp(-np.array(cut))),
                                   rtol=1e-4, atol=1e-6)
        too_long = client.post("/v1/rerank", json={"query": QUERY, "documents": [TEXTS[0], "the cat " * 80]})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "documents.1", too_long.text
