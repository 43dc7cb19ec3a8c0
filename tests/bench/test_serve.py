"""`jaxserve bench serve`'s client against the real server: its sampling fields reach the server, and
requests arrive at the request rate."""

import asyncio
import json
import math
import time

import numpy as np
import pytest

from jaxserve.bench import serve
from jaxserve.bench.datasets import random_requests
from jaxserve.bench.serve import arrival_offsets, run_level
from tests.api.helpers import API_KEY


def test_bench_serve_sends_its_sampling_fields(server):
    sampled = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05}
    result = asyncio.run(run_level(server.v1, None, 2, random_requests(4, 8, 6), api_key=API_KEY, sampling=sampled))
    assert result["failed"] == 0 and result["completed"] == 4, result["errors"]
    assert result["output_tokens_per_s"] * result["duration_s"] == pytest.approx(4 * 6)
    # A value the server refuses proves each field is sent.
    for field, bad in [("top_p", 1.5), ("top_k", -5), ("min_p", 2.0), ("temperature", -1.0)]:
        sampling = {**sampled, field: bad}
        refused = asyncio.run(run_level(server.v1, None, 1, random_requests(1, 8, 2), api_key=API_KEY,
                                                   sampling=sampling))
        assert refused["failed"] == 1 and "HTTP 400" in refused["errors"][0] and field in refused["errors"][0]


def test_requests_arrive_on_vllm_s_schedule():
    """vLLM's --request-rate and --burstiness: gamma gaps of mean 1/rate before every request (exponential
    at burstiness 1), the last request sent at exactly N / rate; reproducible from the seed; burstier below
    1, steadier above; an infinite rate sends every request at once."""
    offsets = np.asarray(arrival_offsets(4000, 50.0, seed=3))
    gaps = np.diff(offsets, prepend=0.0)
    assert offsets[-1] == pytest.approx(4000 / 50) and (gaps > 0).all()
    assert offsets.tolist() == arrival_offsets(4000, 50.0, seed=3) != arrival_offsets(4000, 50.0, seed=4)
    assert np.mean(gaps) == pytest.approx(1 / 50) and np.std(gaps) == pytest.approx(1 / 50, rel=0.08)
    bursty, steady = (np.diff(arrival_offsets(4000, 50.0, burstiness=b, seed=3)) for b in (0.25, 4.0))
    assert np.std(bursty) > 1.5 * np.std(gaps) and np.std(steady) < 0.6 * np.std(gaps)
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 8.0, burstiness=math.inf) == [0.125, 0.25, 0.375, 0.5]  # the gamma's limit: even gaps


def _fake_requests(monkeypatch, seconds: float) -> tuple[list[float], list[int]]:
    """`_one_request` replaced by one that takes `seconds`: (the send times, the peak of requests in flight)."""
    sent: list[float] = []
    in_flight, peak = [0], [0]

    async def one_request(client, url, headers, body) -> serve.RequestResult:
        sent.append(time.perf_counter())
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        await asyncio.sleep(seconds)
        in_flight[0] -= 1
        return serve.RequestResult(ttft_s=seconds / 2, e2e_s=seconds, num_output_tokens=2)

    monkeypatch.setattr(serve, "_one_request", one_request)
    return sent, peak


def test_requests_are_sent_at_their_times_and_no_more_than_the_cap_in_flight(monkeypatch):
    sent, peak = _fake_requests(monkeypatch, 0.05)
    result = asyncio.run(run_level("http://127.0.0.1:9/v1", None, None, random_requests(12, 8, 2), request_rate=40.0,
                                   seed=1))
    offsets = arrival_offsets(12, 40.0, seed=1)
    assert result["completed"] == 12 and result["request_rate"] == 40.0
    # Each send time less its arrival time: the run's start plus that send's delay, never negative. The
    # least is the start (a send on a loaded machine may be late, none early).
    delays = np.asarray(sent) - np.asarray(offsets)
    assert np.median(delays - delays.min()) < 0.02, "sent at their arrival times"
    assert result["duration_s"] >= offsets[-1]
    peak[0] = 0
    capped = asyncio.run(run_level("http://127.0.0.1:9/v1", None, 2, random_requests(6, 8, 2)))  # at once, 2 in flight
    assert peak[0] == 2 and capped["completed"] == 6 and capped["duration_s"] >= 3 * 0.05
    assert capped["request_rate"] == "inf" and json.loads(json.dumps(capped, allow_nan=False)) == capped


def test_lengths_vary_within_the_range_ratio_and_the_prompt_tokens_count_them(monkeypatch):
    """vLLM's --random-range-ratio: input and output lengths uniform within the ratio either side of theirs;
    the report's prompt tokens are those sent (the shared prefix's included)."""
    bodies: list[dict] = []
    _fake_requests(monkeypatch, 0.0)
    one_request = serve._one_request

    async def recording(client, url, headers, body) -> serve.RequestResult:
        bodies.append(body)
        return await one_request(client, url, headers, body)

    monkeypatch.setattr(serve, "_one_request", recording)
    requests = random_requests(200, 100, 40, prefix_len=5, range_ratio=0.5)
    result = asyncio.run(run_level("http://127.0.0.1:9/v1", None, 8, requests))
    inputs = [len(body["prompt"]) - 5 for body in bodies]
    outputs = [body["max_tokens"] for body in bodies]
    assert 50 <= min(inputs) < 60 and 140 < max(inputs) <= 150 and min(outputs) >= 20 and max(outputs) <= 60
    assert len(set(outputs)) > 20 and result["prompt_tokens"] == sum(len(body["prompt"]) for body in bodies)
    bodies.clear()
    asyncio.run(run_level("http://127.0.0.1:9/v1", None, 8, random_requests(10, 100, 40)))
    assert {len(body["prompt"]) for body in bodies} == {100} and {body["max_tokens"] for body in bodies} == {40}
    bodies.clear()  # the shared prefix alone, as before the ratio existed; outputs at least 1 token
    asyncio.run(run_level("http://127.0.0.1:9/v1", None, 8, random_requests(30, 0, 1, prefix_len=5, range_ratio=0.9)))
    assert {len(body["prompt"]) for body in bodies} == {5} and {body["max_tokens"] for body in bodies} <= {1, 2}


def test_bench_serve_sends_at_the_request_rate_to_the_server(server):
    result = asyncio.run(run_level(server.v1, None, None, random_requests(4, 8, 2), api_key=API_KEY, request_rate=50.0))
    assert result["failed"] == 0 and result["completed"] == 4, result["errors"]
    with pytest.raises(ValueError, match="request_rate and burstiness must be > 0"):
        asyncio.run(run_level(server.v1, None, 1, random_requests(1, 8, 2), api_key=API_KEY, request_rate=0.0))


def test_bench_serve_replays_a_file_s_prompts_through_the_server(server, tmp_path, smollm2_tokenizer, smollm2_gguf):
    """vLLM's `bench serve --dataset-name sharegpt|custom --dataset-path F`: each conversation's first turn (or
    each line's prompt, in the chat template) sent as text for its reply's length (or the line's
    output_tokens). Without --tokenizer or --model, the tokens are counted with the tokenizer of the model
    the server names in /v1/models: the prompt tokens the bench counts are those the server reports."""
    from jaxserve.bench.datasets import CustomDataset, ShareGPTDataset
    from jaxserve.cli import main

    replies = ["Paris is the capital of France.", "Two plus two is four, as always.",
               "Water boils at one hundred degrees.", "The sun rises in the east, mostly."]
    conversations = [{"conversations": [{"from": "human", "value": f"Question {i}: tell me a short fact, please."},
                                        {"from": "gpt", "value": reply}]} for i, reply in enumerate(replies)]
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps(conversations))
    custom = tmp_path / "prompts.jsonl"
    custom.write_text("\n".join(json.dumps({"prompt": f"Name a colour, number {i}.", "output_tokens": 3 + i})
                                for i in range(3)))
    server_flags = ["--base-url", server.base_url, "--api-key", API_KEY, "--max-concurrency", "2", "--num-prompts"]
    for flags, expected in [
        (["6", "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt)],  # 4 conversations, 2 repeats
         ShareGPTDataset(str(sharegpt)).sample(smollm2_tokenizer, 6)),
        (["3", "--dataset-name", "custom", "--dataset-path", str(custom), "--custom-output-len", "-1",
          "--tokenizer", str(smollm2_gguf)],
         CustomDataset(str(custom)).sample(smollm2_tokenizer, 3, output_len=-1)),
    ]:
        main(["bench", "serve", *server_flags, *flags, "--json", str(tmp_path / "result.json")])
        [result] = json.loads((tmp_path / "result.json").read_text())
        assert result["completed"] == len(expected) and result["failed"] == 0, result["errors"]
        assert round(result["output_tokens_per_s"] * result["duration_s"]) == sum(r.output_len for r in expected)
        assert result["prompt_tokens"] == sum(r.prompt_len for r in expected)


def test_a_chat_stream_s_first_token_is_its_first_text_not_its_role():
    """TTFT and ITL count chunks that carry output: a completions chunk's choice (as vLLM's bench counts it),
    a chat chunk's text, reasoning or tool call; not the chat stream's opening role chunk, which jaxserve
    sends before the prompt is computed, nor the usage chunk."""
    carries = serve._carries_output
    assert not carries({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert carries({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    assert carries({"choices": [{"index": 0, "delta": {"reasoning_content": "so"}}]})
    assert carries({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})
    assert carries({"choices": [{"index": 0, "text": ""}]})
    assert not carries({"choices": [], "usage": {"completion_tokens": 3}})


def test_bench_serve_streams_the_chat_api_as_vllm_s_openai_chat_backend(server, tmp_path, smollm2_tokenizer,
                                                                         monkeypatch):
    """vLLM's `bench serve --backend openai-chat`: each prompt one user message to /v1/chat/completions
    (random token ids decoded with the tokenizer of the model the server names), for exactly its output
    length; the prompt tokens counted are the server's, the chat template's included. A custom file's
    prompts go as written: the server puts them in the template, once."""
    from jaxserve.bench.datasets import CustomDataset, as_text
    from jaxserve.cli import main

    bodies: list[dict] = []
    one_request = serve._one_request

    async def recording(client, url, headers, body) -> serve.RequestResult:
        bodies.append(body)
        assert url.endswith("/v1/chat/completions")
        result = await one_request(client, url, headers, body)
        # a gap per output chunk after the first: one a token, but a token whose text is held back (part of a
        # UTF-8 character, a sampled token's) makes no chunk of its own
        assert 0 < result.ttft_s < result.e2e_s and 0 < len(result.itl_s) <= body["max_completion_tokens"] - 1
        return result

    monkeypatch.setattr(serve, "_one_request", recording)
    flags = ["bench", "serve", "--base-url", server.base_url, "--api-key", API_KEY, "--backend", "openai-chat",
             "--max-concurrency", "2", "--num-prompts", "4", "--json", str(tmp_path / "result.json")]
    main([*flags, "--input-len", "12", "--output-len", "5"])
    [result] = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0, result["errors"]
    assert round(result["output_tokens_per_s"] * result["duration_s"]) == 4 * 5
    texts = [smollm2_tokenizer.decode(r.prompt) for r in random_requests(4, 12, 5)]
    assert [body["messages"] for body in bodies] == [[{"role": "user", "content": text}] for text in texts]
    assert all("prompt" not in body and body["ignore_eos"] for body in bodies)
    templated = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                       add_generation_prompt=True, tokenize=False) for text in texts]
    assert result["prompt_tokens"] == sum(len(smollm2_tokenizer(text).input_ids) for text in templated)
    assert result["prompt_tokens"] > sum(r.prompt_len for r in as_text(random_requests(4, 12, 5), smollm2_tokenizer))

    custom = tmp_path / "prompts.jsonl"
    custom.write_text("\n".join(json.dumps({"prompt": f"Name a colour, number {i}."}) for i in range(2)))
    bodies.clear()
    main([*flags, "--dataset-name", "custom", "--dataset-path", str(custom), "--custom-output-len", "3",
          "--disable-shuffle"])
    [result] = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0, result["errors"]
    assert {body["messages"][0]["content"] for body in bodies} == {"Name a colour, number 0.",
                                                                   "Name a colour, number 1."}
    templated = CustomDataset(str(custom), shuffle=False).sample(smollm2_tokenizer, 4, output_len=3)
    assert result["prompt_tokens"] == sum(r.prompt_len for r in templated)


def test_latencies_are_summed_up_at_the_percentiles_asked_and_goodput_counts_requests_within_every_slo(monkeypatch):
    """vLLM's --metric-percentiles and --goodput: each latency's mean, deviation, median and the percentiles
    asked for; the goodput is the rate of requests whose TTFT, TPOT and E2E all met their SLOs (a request of
    one token has a TPOT of 0)."""
    latencies = {}  # max_tokens -> (ttft_s, e2e_s, tokens)
    for i in range(1, 11):
        latencies[i] = (0.01 * i, 0.01 * i + 0.002 * (i - 1) * 10, i)  # TPOT 20 ms from the second token

    async def one_request(client, url, headers, body) -> serve.RequestResult:
        ttft, e2e, tokens = latencies[body["max_tokens"]]
        return serve.RequestResult(ttft_s=ttft, e2e_s=e2e, num_output_tokens=tokens, itl_s=[0.02] * (tokens - 1))

    monkeypatch.setattr(serve, "_one_request", one_request)
    requests = [serve.BenchRequest([1000], 1, i) for i in range(1, 11)]
    result = asyncio.run(run_level("http://127.0.0.1:9/v1", None, 4, requests, percentiles=(90.0, 99.9),
                                   goodput={"ttft": 50.0, "tpot": 25.0}))
    ttfts = np.asarray([0.01 * i for i in range(1, 11)]) * 1000
    assert result["ttft_ms"]["p90"] == pytest.approx(np.percentile(ttfts, 90))
    assert result["ttft_ms"]["p99.9"] == pytest.approx(np.percentile(ttfts, 99.9))
    assert result["ttft_ms"]["p50"] == pytest.approx(np.median(ttfts)) and "p99" not in result["ttft_ms"]
    assert result["ttft_ms"]["std"] == pytest.approx(ttfts.std())
    assert result["tpot_ms"]["mean"] == pytest.approx(20.0)
    # TTFT <= 50 ms: the first five requests; TPOT 20 ms (0 for the one-token request) meets 25 ms
    assert result["request_goodput"] * result["duration_s"] == pytest.approx(5)
    assert result["goodput_slos_ms"] == {"ttft": 50.0, "tpot": 25.0}
    strict = asyncio.run(run_level("http://127.0.0.1:9/v1", None, 4, requests, goodput={"tpot": 10.0, "e2el": 1e6}))
    assert strict["request_goodput"] * strict["duration_s"] == pytest.approx(1), "only the one-token request"
    assert "request_goodput" not in asyncio.run(run_level("http://127.0.0.1:9/v1", None, 4, requests))


def test_the_ready_check_waits_for_an_answer_and_stops_at_a_refusal(server):
    """vLLM's --ready-check-timeout-sec: a request sent until the server answers it; nothing listening is
    retried until the time is up; a request the server refuses (a 400) ends the wait at once."""
    from jaxserve.bench.datasets import BenchRequest

    headers = {"Authorization": f"Bearer {API_KEY}"}
    probe = serve._body(BenchRequest("Hello", 1, 1), None, {"temperature": 0.0}, chat=False)
    assert asyncio.run(serve.wait_until_ready(server.v1, probe, False, 60.0, headers)) < 60.0
    chat_probe = serve._body(BenchRequest("Hello", 1, 1), None, {"temperature": 0.0}, chat=True)
    assert asyncio.run(serve.wait_until_ready(server.v1, chat_probe, True, 60.0, headers)) < 60.0
    with pytest.raises(ValueError, match=r"refused the ready check's request \(HTTP 400.*temperature"):
        asyncio.run(serve.wait_until_ready(server.v1, {**probe, "temperature": -1.0}, False, 60.0, headers))
    with pytest.raises(ValueError, match=r"refused the ready check's request \(HTTP 401"):
        asyncio.run(serve.wait_until_ready(server.v1, probe, False, 60.0, {}))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"was not ready within 1\.5 s \(the last try: ConnectError"):
        asyncio.run(serve.wait_until_ready("http://127.0.0.1:9/v1", probe, False, 1.5, headers, retry_s=0.2))
    assert 1.0 < time.perf_counter() - start < 10.0


def test_bench_serve_takes_vllm_s_run_flags_to_the_server(server, tmp_path, monkeypatch):
    """--num-warmups, --header, --request-id-prefix, --extra-body, --logprobs, --served-model-name and the
    penalties reach the server on every request (warm-up requests first, not measured); --save-result writes a
    record a level, with the run's settings and --metadata, to vLLM's file name in --result-dir."""
    from jaxserve.cli import main

    sent: list[tuple[dict, dict]] = []
    one_request = serve._one_request

    async def recording(client, url, headers, body) -> serve.RequestResult:
        sent.append((headers, body))
        result = await one_request(client, url, headers, body)
        assert result.error is None, result.error
        return result

    monkeypatch.setattr(serve, "_one_request", recording)
    served = json.loads(__import__("httpx").get(f"{server.v1}/models", headers={"Authorization": f"Bearer {API_KEY}"},
                                                timeout=30).text)["data"][0]["id"]
    main(["bench", "serve", "--base-url", server.base_url, "--api-key", API_KEY, "--max-concurrency", "1", "2",
          "--num-prompts", "3", "--input-len", "8", "--output-len", "3", "--num-warmups", "2",
          "--ready-check-timeout-sec", "30", "--header", "X-Team=bench", "--request-id-prefix", "run7-",
          "--extra-body", '{"top_k": 1, "seed": 5}', "--logprobs", "2", "--served-model-name", served,
          "--model", "a-tokenizer-name", "--frequency-penalty", "0.5", "--repetition-penalty", "1.1",
          "--save-result", "--result-dir", str(tmp_path / "results"), "--label", "smoke", "--metadata", "tp=1",
          "gpu=none", "--metric-percentiles", "90", "--goodput", "e2el:60000"])
    probe, warmups, measured = sent[0], sent[1:3], sent[3:]
    assert probe[1] == measured[0][1] and len(measured) == 6, "vLLM's probe: the first request"
    assert all(headers["X-Team"] == "bench" and "X-Request-Id" not in headers for headers, _ in [probe, *warmups])
    assert [headers["X-Request-Id"] for headers, _ in measured] == [f"run7-{level}-{i}" for level in (0, 1)
                                                                     for i in range(3)]
    for _, body in sent:
        assert body["model"] == served and body["top_k"] == 1 and body["seed"] == 5 and body["logprobs"] == 2
        assert body["frequency_penalty"] == 0.5 and body["repetition_penalty"] == 1.1
    [path] = (tmp_path / "results").iterdir()
    assert path.name.startswith("smoke-infqps-concurrency1-2-a-tokenizer-name-") and path.suffix == ".json"
    records = json.loads(path.read_text())
    assert [r["concurrency"] for r in records] == [1, 2] and all(r["completed"] == 3 for r in records)
    assert all(r["tp"] == "1" and r["gpu"] == "none" and r["label"] == "smoke" and r["backend"] == "openai"
               and r["model_id"] == "a-tokenizer-name" and "p90" in r["ttft_ms"] for r in records)
    assert all(r["request_goodput"] == pytest.approx(r["request_throughput"]) for r in records)
    for record in records:  # vLLM's flat names too
        assert record["median_ttft_ms"] == record["ttft_ms"]["p50"] and record["p90_e2el_ms"] == record["e2e_ms"]["p90"]
        assert record["total_output_tokens"] == 9 and record["output_throughput"] == record["output_tokens_per_s"]
        assert record["max_concurrency"] == record["concurrency"] and record["requests_without_usage"] == 0


@pytest.mark.parametrize(("body", "error"), [
    (b'data: {"choices": [{"index": 0, "text": "a"}]}\n\ndata: {"error": {"message": "engine died", "code": 500}}\n\n',
     "error in the stream: {\"message\": \"engine died\""),
    (b"data: [1, 2]\n\n", "malformed stream: ValueError(\"a streamed event that is not a JSON object"),
    (b"data: {not json\n\n", "malformed stream: JSONDecodeError"),
    (b'data: {"usage": {"prompt_tokens": 3}}\n\n', "malformed stream: KeyError('completion_tokens')"),
    # a 200 whose stream carries no output (the role chunk, an empty finish): no first token, as vLLM fails it
    (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
     b'data: {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "length"}]}\n\n'
     b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 16}}\n\ndata: [DONE]\n\n',
     "the stream carried no output"),
])
def test_a_stream_that_breaks_off_or_is_not_the_api_s_fails_its_request_alone(body, error):
    """A server's error event mid-stream, or a body that is not the API's, fails that request with the reason
    (the level goes on and counts it failed) rather than ending the whole run with a traceback."""
    import httpx

    async def one() -> serve.RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await serve._one_request(client, "http://bench.test/v1/completions", {}, {})

    result = asyncio.run(one())
    assert result.error is not None and result.error.startswith(error), result.error


def test_a_stream_without_usage_counts_its_output_chunks():
    """A server that sends no usage chunk: each chunk that carried output is a token (a lower bound where a
    server merges tokens), said in the level's requests_without_usage, instead of 0 tokens and perfect TPOTs."""
    import httpx

    body = b"".join(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n' for _ in range(5)) + b"data: [DONE]\n\n"

    async def one() -> serve.RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await serve._one_request(client, "http://bench.test/v1/completions", {}, {})

    result = asyncio.run(one())
    assert result.error is None and result.num_output_tokens == 5 and not result.usage_reported
    assert len(result.itl_s) == 4


def test_a_run_in_which_no_request_succeeds_writes_its_results_and_exits_1(server, tmp_path, capsys):
    """Every request refused (a top_p out of range): the rows and the saved record say so, and the command
    exits 1 naming the level and the server's reason, so that a script's benchmark does not pass on nothing."""
    from jaxserve.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["bench", "serve", "--base-url", server.base_url, "--api-key", API_KEY, "--max-concurrency", "2",
              "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--extra-body", '{"top_p": 5}',
              "--burstiness", "inf", "--request-rate", "50", "--result-filename", str(tmp_path / "run.json"),
              "--save-result"])
    assert exited.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("jaxserve: error: no request succeeded at concurrency 2: HTTP 400") and "top_p" in last
    [record] = json.loads((tmp_path / "run.json").read_text())
    assert (record["completed"], record["failed"], record["burstiness"]) == (0, 2, "inf")
