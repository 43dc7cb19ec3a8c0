"""Prompt logprobs, cached-token usage, cache_salt and the prefix-cache metrics through the real server
(the bundled SmolLM2) and the openai SDK, against transformers on the same GGUF weights."""

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.api.helpers import API_KEY, MODEL, metric, wait_idle

pytestmark = pytest.mark.slow  # a real model and the transformers reference

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Longer than a step's chunk (the cpu preset computes at most 128 tokens per step).
PROMPT = np.random.default_rng(11).integers(100, 40000, size=300).tolist()


@pytest.fixture(scope="module")
def hf_logprobs(smollm2_gguf) -> np.ndarray:  # f32[len(PROMPT) - 1, V]: log p(PROMPT[i + 1] | PROMPT[:i + 1])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)[:-1].numpy()


def expected_prompt_logprobs(hf_logprobs: np.ndarray) -> np.ndarray:
    return hf_logprobs[np.arange(len(PROMPT) - 1), PROMPT[1:]]


def test_echo_with_logprobs_reports_the_prompt(client, hf_logprobs):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                         logprobs=2, extra_body={"cache_salt": "echo-test"})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(PROMPT) + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(logprobs.token_logprobs[1 : len(PROMPT)], expected_prompt_logprobs(hf_logprobs),
                               atol=1e-4)
    for i in (1, 150, len(PROMPT) - 1):  # the prompt token and the top 2, by their strings
        top = sorted(logprobs.top_logprobs[i].values(), reverse=True)[:2]
        np.testing.assert_allclose(top, np.sort(hf_logprobs[i - 1])[::-1][:2], atol=1e-4)
    assert logprobs.text_offset[1] == len(logprobs.tokens[0])
    assert response.choices[0].text.endswith("".join(logprobs.tokens[len(PROMPT):]))

    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                       logprobs=2, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == response.choices[0].text
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-5)


def test_echo_with_no_tokens_scores_the_prompt(client, server, hf_logprobs):
    """`echo` with `max_tokens` 0, how the legacy completions API (and vLLM) score a text: every choice is the
    prompt alone with its logprobs, streamed or not, and the usage counts no completion token."""
    prompt_text = httpx.post(f"{server.base_url}/detokenize", headers=AUTH, json={"tokens": PROMPT}).json()["prompt"]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, n=2,
                                         temperature=1.0)
    assert [choice.text for choice in response.choices] == [prompt_text] * 2
    for choice in response.choices:
        assert choice.finish_reason == "length" and len(choice.logprobs.tokens) == len(PROMPT)
        assert choice.logprobs.token_logprobs[0] is None
        np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], expected_prompt_logprobs(hf_logprobs),
                                   atol=1e-4)
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(PROMPT), 0, len(PROMPT))

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}))
    streamed = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert "".join(choice.text for choice in streamed) == prompt_text
    assert [choice.finish_reason for choice in streamed][-1] == "length"
    token_logprobs = [lp for choice in streamed if choice.logprobs for lp in choice.logprobs.token_logprobs]
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx(response.choices[0].logprobs.token_logprobs[1:], abs=1e-5)
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(PROMPT), 0)

    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, echo=True)
    assert plain.choices[0].text == "Hello there" and plain.choices[0].logprobs is None
    assert plain.usage.completion_tokens == 0

    for extra, param in (({}, "max_tokens"), ({"echo": True, "extra_body": {"min_tokens": 2}}, "min_tokens")):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, **extra)
        assert error.value.body["param"] == param, error.value.body


def test_prompt_logprobs_field_in_both_apis(client, server, hf_logprobs):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, n=2,
                                         extra_body={"prompt_logprobs": 3})
    for choice in response.choices:
        entries = choice.model_extra["prompt_logprobs"]
        assert len(entries) == len(PROMPT) and entries[0] is None
        got = [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], PROMPT[1:], strict=True)]
        np.testing.assert_allclose(got, expected_prompt_logprobs(hf_logprobs), atol=1e-4)
        assert all(len(entry) in (3, 4) for entry in entries[1:])
        assert {entry[str(t)]["rank"] for entry, t in zip(entries[1:], PROMPT[1:], strict=True)} - {None}
        assert entries[1][str(PROMPT[1])]["decoded_token"] == httpx.post(
            f"{server.base_url}/detokenize", headers=AUTH, json={"tokens": [PROMPT[1]]}).json()["prompt"]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 and next(iter(entry.values()))["logprob"] <= 0 for entry in entries[1:])


def test_a_repeated_prompt_is_served_from_the_cache(client, server):
    messages = [{"role": "system", "content": "You are a terse assistant. " * 30},
                {"role": "user", "content": "Name a colour."}]
    hits_before = metric(server, "jaxserve:prefix_cache_hits_total", model_name=MODEL)
    queries_before = metric(server, "jaxserve:prefix_cache_queries_total", model_name=MODEL)
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                           extra_body={"cache_salt": "tenant-a"})
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                           extra_body={"cache_salt": "tenant-a"})
    other = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                           extra_body={"cache_salt": "tenant-b"})
    prompt_tokens = first.usage.prompt_tokens
    wait_idle(server)  # the engine publishes its counters after the step that answered
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert prompt_tokens - 16 <= again.usage.prompt_tokens_details.cached_tokens < prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens == 0, "another salt shares nothing"
    assert again.choices[0].message.content == first.choices[0].message.content
    hits = metric(server, "jaxserve:prefix_cache_hits_total", model_name=MODEL) - hits_before
    queries = metric(server, "jaxserve:prefix_cache_queries_total", model_name=MODEL) - queries_before
    assert hits == again.usage.prompt_tokens_details.cached_tokens and queries == 3 * prompt_tokens

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"cache_salt": "tenant-a"})
    usage = list(stream)[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("body,param", [
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": 5}, "cache_salt"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_bad_prefix_and_prompt_logprob_fields_are_400s(server, body, param):
    for path, base in (("completions", {"prompt": "Hello"}), ("chat/completions",
                                                              {"messages": [{"role": "user", "content": "Hi"}]})):
        response = httpx.post(f"{server.v1}/{path}", headers=AUTH, json={"model": MODEL, **base, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert param in (error["param"] or "") + error["message"]


def test_sixteen_users_with_one_system_prompt_share_it(server):
    """Sixteen users with one long system prompt at once: all answered, most of the prompt cached."""
    import asyncio

    system = "You answer questions about the solar system in one sentence. " * 20

    async def main():
        # A client of this event loop (the session's async client belongs to another test's loop).
        async with openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(client.chat.completions.create(
                model=MODEL, max_tokens=4, temperature=0,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Fact {i}?"}])
                for i in range(16)))

    responses = asyncio.run(main())
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in responses]
    assert sum(c > 0 for c in cached) >= 14, cached
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in responses)


def test_openai_sdk_error_type_for_a_bad_salt(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, extra_body={"cache_salt": ""})
