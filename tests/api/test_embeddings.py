"""/v1/embeddings through the openai SDK on a `--runner pooling` server of the bundled SmolLM2 (the pooled
vectors themselves match transformers in tests/engine/test_pooling.py)."""

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.api.helpers import API_KEY, MODEL, start_server, stop_server

pytestmark = pytest.mark.slow  # a server of its own


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory, compile_cache):
    server = start_server(tmp_path_factory.mktemp("pooling"), compile_cache, "--api-key", API_KEY,
                          "--runner", "pooling", "--pooling-type", "mean")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def embed(pooling_server):
    return openai.OpenAI(base_url=pooling_server.v1, api_key=API_KEY, max_retries=0, timeout=120)


TEXTS = ["The cat sat on the mat.", "A kitten rested on the rug.", "Quarterly revenue rose by 4%."]


def test_embeddings_are_unit_vectors_the_same_alone_as_in_a_batch(embed):
    batch = embed.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2] and batch.model == MODEL
    vectors = np.array([d.embedding for d in batch.data])
    assert vectors.shape == (3, 576)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    alone = embed.embeddings.create(model=MODEL, input=TEXTS[2], encoding_format="float").data[0].embedding
    np.testing.assert_allclose(alone, vectors[2], atol=1e-4)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > 10


def test_base64_the_sdk_default_is_the_same_little_endian_float32(embed, pooling_server):
    floats = embed.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float").data[0].embedding
    decoded = embed.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding  # the SDK asks for base64
    np.testing.assert_allclose(decoded, floats, atol=1e-6)
    raw = httpx.post(f"{pooling_server.v1}/embeddings", headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    values = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(values, floats, atol=1e-6)


def test_token_ids_truncation_and_unnormalized_vectors(embed, pooling_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    ids = httpx.post(f"{pooling_server.base_url}/tokenize", headers=headers, json={"prompt": TEXTS[1]}).json()["tokens"]
    by_text = embed.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float").data[0].embedding
    by_ids = embed.embeddings.create(model=MODEL, input=[ids], encoding_format="float").data[0].embedding
    np.testing.assert_allclose(by_ids, by_text, atol=1e-5)
    tail = embed.embeddings.create(model=MODEL, input=[ids[-3:]], encoding_format="float")
    cut = embed.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float",
                                  extra_body={"truncate_prompt_tokens": 3})
    np.testing.assert_allclose(cut.data[0].embedding, tail.data[0].embedding, atol=1e-5)
    assert cut.usage.prompt_tokens == 3
    raw = embed.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float",
                                  extra_body={"normalize": False}).data[0].embedding
    np.testing.assert_allclose(np.asarray(raw) / np.linalg.norm(raw), by_text, atol=1e-5)
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-3


CHAT = [{"role": "system", "content": "You sort support tickets."},
        {"role": "user", "content": "My invoice shows the wrong amount."}]


def test_a_conversation_is_embedded_as_its_chat_template_renders_it(embed, pooling_server):
    """vLLM's chat embeddings: `messages` instead of `input`, rendered by the model's chat template (no
    generation prompt unless asked, no special tokens beyond the template's) and embedded as one input:
    the same vector as the rendered ids sent as tokens, and their count as the usage."""
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def rendered(**options) -> list[int]:
        body = {"messages": CHAT, "add_generation_prompt": False, **options}
        return httpx.post(f"{pooling_server.base_url}/tokenize", headers=headers, json=body).json()["tokens"]

    def embedded(**options) -> dict:
        response = httpx.post(f"{pooling_server.v1}/embeddings", headers=headers,
                              json={"model": MODEL, "messages": CHAT, "encoding_format": "float", **options})
        assert response.status_code == 200, response.text
        return response.json()

    ids = rendered()
    chat = embedded()
    assert chat["usage"]["prompt_tokens"] == len(ids) and len(chat["data"]) == 1
    by_ids = embed.embeddings.create(model=MODEL, input=[ids], encoding_format="float").data[0].embedding
    np.testing.assert_allclose(chat["data"][0]["embedding"], by_ids, atol=1e-5)
    prompted = embedded(add_generation_prompt=True)  # the assistant's header after the conversation
    assert prompted["usage"]["prompt_tokens"] == len(rendered(add_generation_prompt=True)) > len(ids)
    assert not np.allclose(prompted["data"][0]["embedding"], by_ids, atol=1e-3)
    cut = embedded(truncate_prompt_tokens=5)  # the rendered conversation's last 5 tokens
    tail = embed.embeddings.create(model=MODEL, input=[ids[-5:]], encoding_format="float").data[0].embedding
    np.testing.assert_allclose(cut["data"][0]["embedding"], tail, atol=1e-5)


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": CHAT, "input": "hi"}, "messages"),  # one or the other
    ({"messages": []}, "messages"),
    ({"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True}, None),
    ({"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),  # the server's template only
    ({"messages": [{"role": "user", "content": "x " * 5000}]}, "messages"),  # over the context
    ({"messages": "hi"}, "messages"),
])
def test_bad_conversations_are_400s_naming_the_field(pooling_server, body, param):
    response = httpx.post(f"{pooling_server.v1}/embeddings", headers={"Authorization": f"Bearer {API_KEY}"},
                          json=body)
    assert response.status_code == 400, response.text
    assert param is None or response.json()["error"]["param"] == param


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": "hi", "dimensions": 64}, "dimensions"),  # SmolLM2's embeddings are not matryoshka
    ({"input": [[10**9]]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, None),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": ["x"] * 2049}, "input"),
])
def test_bad_inputs_are_400s_naming_the_field(pooling_server, body, param):
    response = httpx.post(f"{pooling_server.v1}/embeddings", headers={"Authorization": f"Bearer {API_KEY}"},
                          json=body)
    assert response.status_code == 400, response.text
    assert param is None or response.json()["error"]["param"] == param


def test_each_server_refuses_the_other_kind_of_request(embed, client):
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        embed.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        embed.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.embeddings.create(model=MODEL, input="Hi")  # the shared server generates


def test_an_input_as_long_as_the_context_is_embedded(embed, pooling_server):
    """vLLM embeds up to max_model_len tokens (the server's 2,048): nothing is generated, so no token of the
    context is kept for one; a longer input is a 400 with the numbers, and truncation to the context fits."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    context = [int(t) for t in np.random.default_rng(5).integers(100, 20_000, 2048)]
    full = embed.embeddings.create(model=MODEL, input=[context], encoding_format="float").data[0].embedding
    over = httpx.post(f"{pooling_server.v1}/embeddings", headers=headers, json={"input": [[7, *context]]},
                      timeout=120)
    assert over.status_code == 400 and "2048 tokens. However, you requested 2049 tokens" in over.text, over.text
    assert over.json()["error"]["param"] == "input"
    cut = httpx.post(f"{pooling_server.v1}/embeddings", headers=headers,
                     json={"input": [[7, *context]], "truncate_prompt_tokens": -1, "encoding_format": "float"},
                     timeout=120)
    assert cut.status_code == 200, cut.text
    np.testing.assert_allclose(cut.json()["data"][0]["embedding"], full, atol=1e-5)
