"""`jaxserve bench serve`: an HTTP load generator in the manner of `vllm bench serve`.

Each request streams /v1/completions with its prompt (`datasets.py`: random token ids, a ShareGPT
conversation's first turn, a custom file's prompt), or with the openai-chat backend /v1/chat/completions
with the prompt as one user message (random ids decoded to text first), and `ignore_eos`, so it yields
exactly its output length; the server's reported prompt and cached prompt tokens are counted. Requests are sent at
`request_rate` per second on vLLM's schedule (`arrival_offsets`; inf: all at once), and at most
`concurrency` are in flight (None: no cap): one that arrives with that many in flight waits for one to
finish, and its latencies count from when it is sent, as vLLM counts them.
TTFT is the first streamed token, ITL the gaps between tokens, TPOT (E2E - TTFT) / (tokens - 1); a chat
stream's opening chunk, which carries the role and no text, is not a token. Each latency is summed up by its
mean, deviation, median and chosen percentiles, and a goodput counts the requests within every SLO given.

Before the levels, as vLLM's bench: a ready check (the first request sent until the server answers it) and
warm-up requests, where asked for. Saved results are a record per level: jaxserve's figures and the same under
the flat names of vLLM's saved results (`median_ttft_ms`, `output_throughput`, ...). A stream that carries
no output fails, as in vLLM; one without a usage chunk counts its output chunks as its tokens. Everything
here runs on one asyncio loop per level (and one for the ready check, one for the warm-up).
"""

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from jaxserve.bench.datasets import BenchRequest, CustomDataset, ShareGPTDataset, as_text, random_requests
from jaxserve.config import BENCH_BACKENDS, ServeBenchConfig


@dataclass
class RequestResult:
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None  # the server's count (usage), where it reports one
    num_cached_tokens: int = 0
    usage_reported: bool = True  # False: the server sent no usage, so its output tokens are its output chunks
    error: str | None = None


def _carries_output(chunk: dict) -> bool:
    """Whether a streamed chunk carries generated output: any choice of a completions chunk (vLLM's bench
    counts those), a chat chunk's text, reasoning or tool call (not the opening chunk's role)."""
    choices = chunk.get("choices")
    if not choices:
        return False
    delta = choices[0].get("delta")
    if delta is None:  # the completions API
        return True
    return any(delta.get(key) for key in ("content", "reasoning_content", "reasoning", "tool_calls"))


async def _one_request(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict
) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    num_chunks, usage = 0, None  # chunks that carried output; the usage the server reported
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not isinstance(chunk, dict):
                    raise ValueError(f"a streamed event that is not a JSON object: {line[:200]!r}")
                if chunk.get("error"):  # an error after the stream began (vLLM and jaxserve send one so)
                    result.error = f"error in the stream: {json.dumps(chunk['error'])[:200]}"
                    break
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.num_output_tokens = usage["completion_tokens"]
                    result.num_prompt_tokens = usage.get("prompt_tokens")
                    result.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if not _carries_output(chunk):
                    continue
                num_chunks += 1
                now = time.perf_counter()
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    except httpx.HTTPError as e:
        result.error = repr(e)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # a body that is not the API's
        result.error = f"malformed stream: {e!r}"[:300]
    result.e2e_s = time.perf_counter() - start
    if result.error is None and num_chunks == 0:  # vLLM's bench fails it too: it has no first token
        result.error = "the stream carried no output (no text, reasoning or tool call)"
    elif usage is None:  # a server without stream usage: each output chunk a token, a lower bound if it merges
        result.num_output_tokens, result.usage_reported = num_chunks, False
    return result


def _body(request: BenchRequest, model: str | None, sampling: dict[str, Any], chat: bool) -> dict:
    """One request's body: the prompt, its output length with EOS ignored, the sampling fields, streamed
    with usage; for the chat API, the prompt as one user message and the length as max_completion_tokens."""
    if chat:
        if not isinstance(request.prompt, str):
            raise ValueError("the chat API takes text: decode token-id prompts first (datasets.as_text)")
        prompt: dict = {"messages": [{"role": "user", "content": request.prompt}],
                        "max_completion_tokens": request.output_len}
    else:
        prompt = {"prompt": request.prompt, "max_tokens": request.output_len}
    return {**({"model": model} if model else {}), **prompt, "ignore_eos": True, **sampling,
            "stream": True, "stream_options": {"include_usage": True}}


def request_fields(config: ServeBenchConfig) -> dict[str, Any]:
    """The fields every request carries besides its prompt and length: the sampling settings given, logprobs
    (the completions API's count; the chat API's flag and top_logprobs), then --extra-body's, which win."""
    fields: dict[str, Any] = {
        "temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k, "min_p": config.min_p,
        "frequency_penalty": config.frequency_penalty, "presence_penalty": config.presence_penalty,
        "repetition_penalty": config.repetition_penalty,
    }
    if config.logprobs is not None:
        fields.update({"logprobs": True, "top_logprobs": config.logprobs} if config.chat else
                      {"logprobs": config.logprobs})
    return {**{key: value for key, value in fields.items() if value is not None}, **(config.extra_body or {})}


def arrival_offsets(num_prompts: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds from the start, as vLLM's `bench serve` schedules them: a gap
    before each request (the first too) drawn from a gamma distribution of shape `burstiness` and mean
    1 / `request_rate` (burstiness 1: exponential gaps, a Poisson process), the sums then scaled so that the
    last request goes at exactly num_prompts / request_rate, which steadies the offered rate across seeds.
    An infinite rate sends every request at once; an infinite burstiness (the gamma's limit) spaces them
    evenly, 1 / `request_rate` apart."""
    if math.isinf(request_rate):
        return [0.0] * num_prompts
    if math.isinf(burstiness):
        return [(i + 1) / request_rate for i in range(num_prompts)]
    rng = np.random.default_rng(seed)
    offsets = np.cumsum(rng.gamma(burstiness, 1.0 / (request_rate * burstiness), num_prompts))
    return (offsets * (num_prompts / request_rate / offsets[-1])).tolist()


def _percentile_key(percentile: float) -> str:
    return f"p{percentile:g}"  # p99, p99.9, as vLLM names them


def _percentiles(values: list[float], percentiles: tuple[float, ...] = (99.0,)) -> dict[str, float]:
    """Mean, standard deviation, median (p50) and `percentiles` of `values` (seconds), in milliseconds."""
    array = np.asarray(values or [0.0]) * 1000.0
    summary = {"mean": float(array.mean()), "std": float(array.std()), "p50": float(np.percentile(array, 50))}
    return summary | {_percentile_key(p): float(np.percentile(array, p)) for p in percentiles}


def _meets(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a request met every SLO (vLLM's goodput: a request of one token has a TPOT of 0)."""
    tpot = (result.e2e_s - result.ttft_s) / (result.num_output_tokens - 1) if result.num_output_tokens > 1 else 0.0
    measured = {"ttft": result.ttft_s, "tpot": tpot, "e2el": result.e2e_s}
    return all(measured[metric] * 1000.0 <= bound for metric, bound in slos_ms.items())


def _client(in_flight: int, verify: bool) -> httpx.AsyncClient:
    # A connection per request: some servers (llama-server) drop idle kept-alive connections, and a request
    # sent on one fails before reaching them. A local connect costs well under a millisecond.
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), verify=verify,
                             limits=httpx.Limits(max_connections=in_flight, max_keepalive_connections=0))


def _headers(api_key: str | None, headers: dict[str, str] | None) -> dict[str, str]:
    return {**({"Authorization": f"Bearer {api_key}"} if api_key else {}), **(headers or {})}


def _url(base_url: str, chat: bool) -> str:
    return f"{base_url.rstrip('/')}/{'chat/completions' if chat else 'completions'}"


async def run_level(
    base_url: str,
    model: str | None,
    concurrency: int | None,
    requests: list[BenchRequest],
    api_key: str | None = None,
    seed: int = 0,
    sampling: dict[str, Any] | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    chat: bool = False,
    headers: dict[str, str] | None = None,
    request_id_prefix: str | None = None,
    percentiles: tuple[float, ...] = (99.0,),
    goodput: dict[str, float] | None = None,
    verify: bool = True,
) -> dict:
    """Sends `requests` at `request_rate` per second, at most `concurrency` in flight (None: no cap);
    returns the vLLM-style summary. `sampling`: fields sent with every request (those set to None are
    left out); greedy by default. `seed`: the arrival times'. `chat`: to /v1/chat/completions, each prompt
    (text) one user message, as vLLM's openai-chat backend sends it; else to /v1/completions. `headers`:
    sent with each request, with X-Request-Id `request_id_prefix` and the request's number where given.
    Each latency is summed up by its mean, deviation, median and `percentiles`; `goodput` (SLOs in ms on
    ttft, tpot, e2el) adds the rate of requests that met them all."""
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError(f"request_rate and burstiness must be > 0 (inf: all at once), got {request_rate}, "
                         f"{burstiness}")
    sampling = {key: value for key, value in (sampling or {"temperature": 0.0}).items() if value is not None}
    url = _url(base_url, chat)
    sent_headers = _headers(api_key, headers)
    bodies = [_body(request, model, sampling, chat) for request in requests]
    request_headers = [sent_headers if request_id_prefix is None else
                       {**sent_headers, "X-Request-Id": f"{request_id_prefix}{i}"} for i in range(len(requests))]
    num_prompts = len(requests)
    in_flight = concurrency or num_prompts
    limit = asyncio.Semaphore(in_flight)
    async with _client(in_flight, verify) as client:

        async def bounded(body: dict, request_headers: dict[str, str], offset: float) -> RequestResult:
            await asyncio.sleep(offset - (time.perf_counter() - start))  # its arrival; a negative wait is none
            async with limit:
                return await _one_request(client, url, request_headers, body)

        start = time.perf_counter()
        offsets = arrival_offsets(num_prompts, request_rate, burstiness, seed)
        results = await asyncio.gather(*(bounded(b, h, t) for b, h, t in zip(bodies, request_headers, offsets,
                                                                                  strict=True)))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    num_output = sum(r.num_output_tokens for r in ok)
    num_prompt = sum(request.prompt_len if r.num_prompt_tokens is None else r.num_prompt_tokens
                     for r, request in zip(results, requests, strict=True) if r.error is None)
    tpot = [(r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1]
    summary = {
        "concurrency": concurrency,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",  # vLLM's JSON: strict JSON
        "burstiness": burstiness if math.isfinite(burstiness) else "inf",
        "num_prompts": num_prompts,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": num_output / duration,
        "total_tokens_per_s": (num_output + num_prompt) / duration,
        "prompt_tokens": num_prompt,
        "output_tokens": num_output,
        "cached_prompt_tokens": sum(r.num_cached_tokens for r in ok),
        "requests_without_usage": sum(not r.usage_reported for r in ok),  # their tokens counted as chunks
        "ttft_ms": _percentiles([r.ttft_s for r in ok], percentiles),
        "tpot_ms": _percentiles(tpot, percentiles),
        "itl_ms": _percentiles([gap for r in ok for gap in r.itl_s], percentiles),
        "e2e_ms": _percentiles([r.e2e_s for r in ok], percentiles),
    }
    if goodput:
        summary["goodput_slos_ms"] = dict(goodput)
        summary["request_goodput"] = sum(_meets(r, goodput) for r in ok) / duration
    return summary


async def wait_until_ready(base_url: str, body: dict, chat: bool, timeout_s: float, headers: dict[str, str],
                           verify: bool = True, retry_s: float = 1.0) -> float:
    """vLLM's ready check: sends `body` until the server answers it with a 200, retrying while nothing
    listens, while the server says it is busy or starting (429, 5xx) and its stream breaks off; a request it
    refuses otherwise (4xx) stops at once, since sending it again cannot help. Returns the seconds waited."""
    url, start = _url(base_url, chat), time.perf_counter()
    async with _client(1, verify) as client:
        while True:
            result = await _one_request(client, url, headers, body)
            if result.error is None:
                return time.perf_counter() - start
            status = result.error.split()[1].rstrip(":") if result.error.startswith("HTTP ") else ""
            if status.startswith("4") and status != "429":
                raise ValueError(f"the server refused the ready check's request ({result.error}); the benchmark's "
                                 f"requests would fail alike")
            if time.perf_counter() - start + retry_s > timeout_s:
                raise ValueError(f"{url} was not ready within {timeout_s:g} s (the last try: {result.error})")
            await asyncio.sleep(retry_s)


async def warm_up(base_url: str, model: str | None, request: BenchRequest, count: int, in_flight: int,
                  sampling: dict[str, Any], chat: bool, headers: dict[str, str], verify: bool = True) -> int:
    """vLLM's --num-warmups: `count` requests of the first prompt, `in_flight` at a time, not measured.
    Returns how many failed."""
    body, url, limit = _body(request, model, sampling, chat), _url(base_url, chat), asyncio.Semaphore(in_flight)
    async with _client(in_flight, verify) as client:

        async def bounded() -> RequestResult:
            async with limit:
                return await _one_request(client, url, headers, body)

        results = await asyncio.gather(*(bounded() for _ in range(count)))
    return sum(r.error is not None for r in results)


_METRIC_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2el": "e2e_ms"}
_TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E"}


def format_report(results: list[dict], metrics: tuple[str, ...] = tuple(_METRIC_KEYS),
                  percentiles: tuple[float, ...] = (99.0,), goodput: bool = False) -> str:
    """A header, a row per level and a footnote: req/s, output tok/s, then each of `metrics`' mean, median
    and `percentiles`, the goodput (req/s within the SLOs) where measured, and the request rate."""
    stats = ["mean", "p50", *(_percentile_key(p) for p in percentiles if p != 50)]
    header = f"{'conc':>5} {'req/s':>7} {'out tok/s':>10} " + " ".join(
        f"{_TITLES[m] + ' ' + s:>12}" for m in metrics for s in stats)
    lines = [header + (f" {'good/s':>7}" if goodput else "") + f" {'rate':>6}"]
    for r in results:
        row = f"{r['concurrency'] or '-':>5} {r['request_throughput']:>7.2f} {r['output_tokens_per_s']:>10.1f} "
        row += " ".join(f"{r[_METRIC_KEYS[m]][s]:>12.1f}" for m in metrics for s in stats)
        if goodput:
            row += f" {r['request_goodput']:>7.2f}"
        row += f" {r['request_rate']:>6}"  # requests sent per second (inf: all at once)
        if r["failed"]:
            row += f"   ({r['failed']} failed: {r['errors']})"
        lines.append(row)
    lines.append("(latencies in ms)")
    return "\n".join(lines)


def level_requests(config: ServeBenchConfig) -> Callable[[int], list[BenchRequest]]:
    """A level's requests by its prompt count, from `config`'s dataset: a file is read (and its tokenizer
    loaded) once, here, and every level takes its first prompts, as each of vLLM's runs does."""
    if config.dataset_name == "random" and not config.chat:
        return lambda num_prompts: random_requests(num_prompts, config.input_len, config.output_len,
                                                   config.prefix_len, config.range_ratio, config.seed)
    tokenizer = _tokenizer(config)
    if config.dataset_name == "random":  # the chat API takes text: the ids decoded, as vLLM's dataset sends them
        return lambda num_prompts: as_text(random_requests(num_prompts, config.input_len, config.output_len,
                                                           config.prefix_len, config.range_ratio, config.seed),
                                           tokenizer)
    oversample, shuffle = not config.no_oversample, not config.disable_shuffle
    if config.dataset_name == "sharegpt":
        sharegpt = ShareGPTDataset(config.dataset_path, config.seed, shuffle)
        return lambda num_prompts: sharegpt.sample(tokenizer, num_prompts, config.sharegpt_output_len, oversample)
    custom = CustomDataset(config.dataset_path, config.seed, shuffle)
    return lambda num_prompts: custom.sample(tokenizer, num_prompts, config.custom_output_len,
                                             _templated_here(config), oversample)


def _templated_here(config: ServeBenchConfig) -> bool:
    """Whether the custom dataset's prompts are put in the chat template here: not where the chat API's
    server puts them there (vLLM's bench would template them twice), nor with --skip-chat-template."""
    return not config.skip_chat_template and not config.chat


def _served_model(config: ServeBenchConfig) -> str:
    """The model the server names first in /v1/models: its `root` (the path or hub id it loaded, where the
    server gives one, as jaxserve and vLLM do), else its id. ValueError where the server names none."""
    try:
        response = httpx.get(f"{config.openai_base_url}/models", headers=_headers(config.api_key, dict(config.headers)),
                             timeout=30.0, verify=not config.insecure)
        response.raise_for_status()
        card = response.json()["data"][0]
        return card.get("root") or card["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
        raise ValueError(f"{config.openai_base_url}/models named no model ({error!r})") from None


def _tokenizer(config: ServeBenchConfig) -> Any:
    """--tokenizer, else --model, else the model the server names in /v1/models. Random prompts need it only
    for the chat API, which takes them as text."""
    from jaxserve.models.source import resolve_tokenizer
    from jaxserve.models.tokenizer import is_fallback_template, load_tokenizer

    name = config.tokenizer or config.model
    uses = "decodes its token ids for the chat API" if config.dataset_name == "random" else "counts tokens"
    if name is None:
        try:
            name = _served_model(config)
        except ValueError as error:
            raise ValueError(f"the {config.dataset_name} dataset {uses} with the model's tokenizer, and {error}: "
                             f"give --tokenizer or --model") from None
    try:
        tokenizer = load_tokenizer(resolve_tokenizer(name))
    except (OSError, RuntimeError, ValueError) as error:
        raise ValueError(f"no tokenizer from {name!r} for the {config.dataset_name} dataset ({error}); give "
                         f"--tokenizer: a directory, a .gguf file or a hub id") from None
    if config.dataset_name == "custom" and _templated_here(config) and is_fallback_template(tokenizer):
        raise ValueError(f"{name} has no chat template for the custom dataset's prompts (vLLM's bench stops "
                         f"there too): give --skip-chat-template to send them as written")
    return tokenizer


def vllm_names(result: dict) -> dict:
    """A level's figures under the flat names of vLLM's saved results, so that scripts reading those read
    these: totals, throughputs, and each latency's mean, median, deviation and percentiles in ms."""
    flat = {"duration": result["duration_s"], "completed": result["completed"], "failed": result["failed"],
            "total_input_tokens": result["prompt_tokens"], "total_output_tokens": result["output_tokens"],
            "request_throughput": result["request_throughput"], "output_throughput": result["output_tokens_per_s"],
            "total_token_throughput": result["total_tokens_per_s"], "max_concurrency": result["concurrency"]}
    if "request_goodput" in result:
        flat["request_goodput"] = result["request_goodput"]
    for metric, key in _METRIC_KEYS.items():
        for stat, value in result[key].items():
            flat[f"{'median' if stat == 'p50' else stat}_{metric}_ms"] = value
    return flat


def result_path(config: ServeBenchConfig, model_id: str | None, date: str) -> str:
    """Where --save-result writes, as vLLM names the file: --result-filename, else the label (else the
    backend), the rate, the levels' caps, the model's last path part and the time; inside --result-dir."""
    caps = [str(c) for c in config.levels if c is not None]
    levels = "-concurrency" + "-".join(caps) if caps else ""
    model = (model_id or "model").rstrip("/").split("/")[-1]
    label = config.label or config.backend
    name = config.result_filename or f"{label}-{config.request_rate}qps{levels}-{model}-{date}.json"
    return str(Path(config.result_dir) / name) if config.result_dir else name


def main(config: ServeBenchConfig) -> None:
    """The command: the ready check and the warm-up requests where asked for, then one level per
    `config.concurrency`, each row printed as soon as it is measured (after the header), the results written
    to `config.json` and, with --save-result, to `result_path`, each level a record with the run's settings."""
    sampling, chat, verify = request_fields(config), config.chat, not config.insecure
    model = config.served_model_name or config.model
    headers = _headers(config.api_key, dict(config.headers))
    # The prompts first (a file's errors before any output), unless the server must name their tokenizer
    needs_server = config.tokenizer is None and config.model is None and (config.dataset_name != "random" or chat)
    requests_of = None if needs_server else level_requests(config)
    if config.ready_check_timeout_sec > 0:  # vLLM's probe: the first request (else a greeting of its length)
        print(f"waiting up to {config.ready_check_timeout_sec:g} s for the server to answer", flush=True)
        first = requests_of(1)[0] if requests_of else BenchRequest("Hello", 1, config.output_len)
        waited = asyncio.run(wait_until_ready(config.openai_base_url, _body(first, model, sampling, chat), chat,
                                              config.ready_check_timeout_sec, headers, verify))
        print(f"the server answered after {waited:.1f} s", flush=True)
    if requests_of is None:
        requests_of = level_requests(config)
    prefix = config.request_id_prefix if config.request_id_prefix is not None else f"bench-{uuid.uuid4().hex[:8]}-"
    if config.num_warmups:
        first_cap = config.levels[0] or config.num_warmups
        failed = asyncio.run(warm_up(config.openai_base_url, model, requests_of(1)[0], config.num_warmups,
                                     min(first_cap, config.num_warmups), sampling, chat, headers, verify))
        print(f"warm-up: {config.num_warmups} requests, {failed} failed", flush=True)
    goodput = dict(config.goodput)
    report = {"metrics": config.percentile_metrics, "percentiles": config.metric_percentiles,
              "goodput": bool(goodput)}
    header, footer = format_report([], **report).splitlines()  # no rows: the header and the footnote
    print(header, flush=True)
    results = []
    for level, concurrency in enumerate(config.levels):
        requests = requests_of(config.prompts_per_level(concurrency))
        results.append(asyncio.run(run_level(
            config.openai_base_url, model, concurrency, requests, api_key=config.api_key, seed=config.seed,
            sampling=sampling, request_rate=config.request_rate, burstiness=config.burstiness, chat=chat,
            headers=dict(config.headers), request_id_prefix=f"{prefix}{level}-", percentiles=config.metric_percentiles,
            goodput=goodput, verify=verify,
        )))
        print("\n".join(format_report(results[-1:], **report).splitlines()[1:-1]), flush=True)
    print(footer)
    if config.json or config.save_result:
        _write_results(config, results)
    if failing := [r for r in results if not r["completed"]]:  # a script's run must not pass on no answers
        level = failing[0]["concurrency"] or "unbounded"
        raise RuntimeError(f"no request succeeded at concurrency {level}: {'; '.join(failing[0]['errors'])}")


def _write_results(config: ServeBenchConfig, results: list[dict]) -> None:
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    model_id = config.model
    if model_id is None:
        with contextlib.suppress(ValueError):
            model_id = _served_model(config)
    run = {"date": date, "backend": config.backend, "endpoint": BENCH_BACKENDS[config.backend],
           "label": config.label, "model_id": model_id, "tokenizer_id": config.tokenizer or model_id,
           "dataset_name": config.dataset_name, **dict(config.metadata)}
    records = [{**run, **result, **vllm_names(result)} for result in results]
    for path in [config.json] * bool(config.json) + [result_path(config, model_id, date)] * config.save_result:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(records, indent=2, allow_nan=False))
        print(f"results written to {path}")
