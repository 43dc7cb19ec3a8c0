"""The OpenAI-compatible server end to end: a real Hypercorn subprocess driven by the openai SDK."""

import asyncio
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from jaxserve.allocator import find_tcmalloc
from tests.api.helpers import API_KEY, MODEL, metric, start_server, stop_server, wait_idle

# A real model: `make test-fast` skips it, `make test-gpu` runs it, on one worker (one server; Makefile).
pytestmark = [pytest.mark.slow, pytest.mark.gpu, pytest.mark.xdist_group("server")]

AUTH = {"Authorization": f"Bearer {API_KEY}"}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_health_models_version_and_loading(server, client):
    assert server.saw_loading, "/health should answer 503 while the model loads"
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == 2048
    assert client.models.retrieve(MODEL) == models[0]
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4o` does not exist"):
        client.models.retrieve("gpt-4o")
    auth = {"Authorization": f"Bearer {API_KEY}"}
    listed = httpx.get(f"{server.v1}/models", headers=auth).json()
    assert httpx.get(f"{server.v1}/models/", headers=auth).json() == listed  # no id: the list


def test_the_default_serves_a_gguf_file_in_its_blocks(tmp_path, compile_cache):
    """`serve` without --quantization (auto) keeps the bundled GGUF's blocks on a CPU and answers through the
    native kernel; elsewhere it dequantizes. (The other tests' server passes --quantization none.)"""
    import jax

    server = start_server(tmp_path, compile_cache, "--quantization", "auto")
    try:
        reply = openai.OpenAI(base_url=server.v1, api_key="unused").chat.completions.create(
            model=MODEL, messages=FRANCE, temperature=0, max_tokens=12)
        assert reply.choices[0].message.content.strip() and reply.usage.completion_tokens > 0
        if jax.default_backend() == "cpu":
            assert "quantization auto: gguf" in server.log()
            assert "210 Q4_1 layer weights and 1 Q8_0 embedding tables kept in their blocks" in server.log()
        else:
            assert "quantization auto: none" in server.log()
    finally:
        stop_server(server)


def test_the_engine_core_runs_in_its_own_process(server):
    tasks = Path(f"/proc/{server.process.pid}/task").iterdir()  # the model loads on a thread: its child
    children = [pid for task in tasks for pid in (task / "children").read_text().split()]
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") for pid in children]
    assert any(b"spawn_main" in command for command in commands), commands
    assert "[core]" in server.log()  # the core process's own log lines


@pytest.mark.cpu_only("jaxserve notes its allocator where CPU steps depend on it")
@pytest.mark.skipif(find_tcmalloc() is None, reason="no tcmalloc here (`make setup` fetches one with apt)")
def test_the_server_and_its_engine_core_run_on_tcmalloc(server):
    """`jaxserve serve` re-executed itself with tcmalloc preloaded, and the core process inherited it."""
    tasks = Path(f"/proc/{server.process.pid}/task").iterdir()
    children = [pid for task in tasks for pid in (task / "children").read_text().split()]
    assert children, "the engine core process"
    for pid in [server.process.pid, *children]:  # the core lives as long as the server
        assert "libtcmalloc" in Path(f"/proc/{pid}/maps").read_text(), pid
    assert "memory allocator: tcmalloc" in server.log()


def test_chat_answers_paris(client):
    response = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30)
    choice = response.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert response.usage.completion_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streaming_concatenates_to_the_non_streamed_text(client):
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    # The same counts; cached_tokens may differ (the second request finds more of the prompt cached).
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert chunks[-1].choices == [] and [getattr(chunks[-1].usage, k) for k in counts] == [
        getattr(full.usage, k) for k in counts]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason

    prompt = "The three primary colours are"
    full = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=30)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=30, stream=True))
    assert streamed == full.choices[0].text


def test_n_seed_and_stop(client):
    kwargs = dict(model=MODEL, messages=FRANCE, temperature=1.0, max_tokens=16, n=2, seed=7)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert first.usage.completion_tokens == second.usage.completion_tokens
    other = client.chat.completions.create(**{**kwargs, "seed": 8})
    assert [c.message.content for c in other.choices] != [c.message.content for c in first.choices]

    stopped = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", temperature=0, max_tokens=30,
                                        stop=[" 6"])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and " 6" not in choice.text and " 5" in choice.text


def test_completions_prompt_shapes_and_echo(client, server):
    ids = httpx.post(f"{server.base_url}/tokenize", headers=AUTH, json={"prompt": "Hello there"}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt="Hello there", temperature=0, max_tokens=5)
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=5)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model=MODEL, prompt=["Hello there", "Good morning"], temperature=0,
                                      max_tokens=5, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == by_text.choices[0].text
    many_ids = client.completions.create(model=MODEL, prompt=[ids, ids], temperature=0, max_tokens=5)
    assert [c.text for c in many_ids.choices] == [by_text.choices[0].text] * 2
    echoed = client.completions.create(model=MODEL, prompt="Hello there", temperature=0, max_tokens=5, echo=True)
    assert echoed.choices[0].text == "Hello there" + by_text.choices[0].text


def test_logprobs(client):
    completion = client.completions.create(model=MODEL, prompt="The sky is", temperature=0, max_tokens=4,
                                           logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert "".join(logprobs.tokens) == completion.choices[0].text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 3 and max(top.values()) == pytest.approx(logprob)  # greedy: the top token
        assert top[token] == pytest.approx(logprob) and next(iter(top)) == token, "the sampled token first"
    # OpenAI's legacy rule (vLLM's): the sampled token is always there, so logprobs=0 gives it alone and a
    # sampled token outside the top k makes k + 1 entries
    sampled = client.completions.create(model=MODEL, prompt="The sky is", temperature=2.0, seed=7, max_tokens=16,
                                        logprobs=0).choices[0].logprobs
    assert sampled.top_logprobs == [{t: lp} for t, lp in zip(sampled.tokens, sampled.token_logprobs, strict=True)]
    wide = client.completions.create(model=MODEL, prompt="The sky is", temperature=2.0, seed=7, max_tokens=16,
                                     logprobs=1).choices[0].logprobs
    assert all(len(top) == 1 + (lp < max(top.values())) and top[t] == lp
               for t, lp, top in zip(wide.tokens, wide.token_logprobs, wide.top_logprobs, strict=True))
    assert any(len(top) == 2 for top in wide.top_logprobs), "at temperature 2 some token is not the top one"

    chat = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=5,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    assert all(t.logprob <= 0 for t in content)


def test_vllm_sampling_extras(server, client):
    body = {"prompt": "<|im_end|>", "add_special_tokens": False}
    eos_id = httpx.post(f"{server.base_url}/tokenize", headers=AUTH, json=body).json()["tokens"][0]
    response = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=12,
        logit_bias={str(eos_id): 100}, extra_body={"min_tokens": 4},
    )
    assert response.usage.completion_tokens == 5 and response.choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=20,
                                           extra_body={"ignore_eos": True})
    penalised = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=20,
        frequency_penalty=1.5, presence_penalty=1.0, extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
    )
    assert plain.usage.completion_tokens == penalised.usage.completion_tokens == 20
    assert plain.choices[0].message.content != penalised.choices[0].message.content


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        (lambda c: c.chat.completions.create(model="nope", messages=FRANCE), openai.NotFoundError, "does not exist"),
        (lambda c: c.completions.create(model=MODEL, prompt="hi", max_tokens=5000), openai.BadRequestError,
         r"maximum context length is 2048 tokens.*5001 tokens"),
        (lambda c: c.completions.create(model=MODEL, prompt="hi", temperature=-1), openai.BadRequestError,
         "temperature"),
        (lambda c: c.completions.create(model=MODEL, prompt="hi", suffix="x"), openai.BadRequestError, "suffix"),
        (lambda c: c.completions.create(model=MODEL, prompt=[]), openai.BadRequestError, "empty"),
        (lambda c: c.completions.create(model=MODEL, prompt=[10**7]), openai.BadRequestError, "vocabulary"),
        (lambda c: c.completions.create(model=MODEL, prompt="hi", logprobs=21), openai.BadRequestError, "at most 20"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=FRANCE, response_format={
            "type": "json_schema", "json_schema": {"name": "no-schema"}}), openai.BadRequestError, "json_schema"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=FRANCE, top_logprobs=2), openai.BadRequestError,
         "top_logprobs"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=[]), openai.BadRequestError, "messages"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=FRANCE, n=0), openai.BadRequestError, "n must"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=FRANCE, stream=True, max_tokens=9999),
         openai.BadRequestError, "maximum context length"),
    ],
)
def test_errors_are_openai_errors(client, call, error, pattern):
    with pytest.raises(error) as info:
        call(client)
    body = info.value.body
    assert re.search(pattern, body["message"]), body
    assert body["type"] and body["code"] == info.value.status_code


def test_raw_http_errors(server):
    url = f"{server.v1}/completions"
    bad_json = httpx.post(url, headers=AUTH, content=b"{not json")
    assert bad_json.status_code == 400 and "invalid JSON" in bad_json.json()["error"]["message"]
    missing = httpx.post(url, headers=AUTH, json={"model": MODEL})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
    too_big = httpx.post(url, headers=AUTH, content=b"x" * (16 * 2**20 + 1))
    assert too_big.status_code == 413 and "limit" in too_big.json()["error"]["message"]
    assert httpx.get(f"{server.v1}/nothing-here", headers=AUTH).status_code == 404
    assert httpx.get(url, headers=AUTH).status_code == 405
    echoed = httpx.post(url, headers={**AUTH, "X-Request-Id": "abc-123"}, json={"prompt": "hi", "max_tokens": 1})
    assert echoed.status_code == 200 and echoed.headers["x-request-id"] == "abc-123"


def test_api_key_guards_the_api_but_not_health_or_metrics(server):
    wrong = openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.post(f"{server.base_url}/tokenize", json={"prompt": "hi"}).status_code == 401
    assert httpx.post(f"{server.base_url}/detokenize", json={"tokens": [1]}).status_code == 401
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


def test_tokenize_detokenize_round_trip(server, client):
    text = "Paged attention keeps the KV cache in pages."
    tokenized = httpx.post(f"{server.base_url}/tokenize", headers=AUTH, json={"model": MODEL, "prompt": text}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 2048
    back = httpx.post(f"{server.base_url}/detokenize", headers=AUTH, json={"tokens": tokenized["tokens"]}).json()
    assert back["prompt"] == text
    chat = httpx.post(f"{server.base_url}/tokenize", headers=AUTH, json={"messages": FRANCE}).json()
    response = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=1)
    assert chat["count"] == response.usage.prompt_tokens


def test_32_concurrent_streams_finish_with_correct_usage(server, async_client):
    prompts = [f"Tell me a fact about the number {i}." for i in range(32)]
    tokens_before = metric(server, 'jaxserve:generation_tokens_total')

    async def one(prompt: str, max_tokens: int):
        stream = await async_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.8, seed=1, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return text, usage

    async def run_all():
        return await asyncio.gather(*(one(p, 8 + i % 5) for i, p in enumerate(prompts)))

    results = asyncio.run(run_all())
    for i, (prompt, (text, usage)) in enumerate(zip(prompts, results, strict=True)):
        num_prompt = httpx.post(f"{server.base_url}/tokenize", headers=AUTH, json={"prompt": prompt}).json()["count"]
        assert (usage.prompt_tokens, usage.completion_tokens) == (num_prompt, 8 + i % 5)
        assert text
    expected = sum(8 + i % 5 for i in range(32))
    assert metric(server, 'jaxserve:generation_tokens_total') - tokens_before == expected
    wait_idle(server)  # the engine's snapshot, published just after the last output went out: no page held


def test_disconnected_clients_free_their_pages(server):
    async def abandon():
        async with httpx.AsyncClient(timeout=60) as http:
            for _ in range(4):
                body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1500, "stream": True,
                        "ignore_eos": True}
                async with http.stream("POST", f"{server.v1}/completions", headers=AUTH, json=body) as response:
                    lines = 0
                    async for line in response.aiter_lines():
                        lines += line.startswith("data:")
                        if lines == 3:
                            break  # leave mid-stream

    asyncio.run(abandon())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and metric(server, "jaxserve:num_requests_running") > 0:
        time.sleep(0.2)
    assert metric(server, "jaxserve:kv_cache_usage_perc") == 0.0
    assert metric(server, "jaxserve:num_requests_running") == 0
    assert metric(server, "jaxserve:request_success_total", finished_reason="abort") >= 4


def test_metrics_record_latencies(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    assert metric(server, "jaxserve:time_to_first_token_seconds_count") >= 1
    assert metric(server, "jaxserve:inter_token_latency_seconds_count") >= 1
    assert metric(server, "jaxserve:e2e_request_latency_seconds_count") >= 1
    assert metric(server, "jaxserve:prompt_tokens_total") > 0
    assert metric(server, "jaxserve:num_requests_waiting") == 0
