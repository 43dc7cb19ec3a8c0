"""`jaxserve bench serve`: an HTTP load generator in the manner of `vllm bench serve`.

Each request streams /v1/completions with its prompt (`datasets.py`: random token ids, a ShareGPT
conversation's first turn, a custom file's prompt), or with the openai-chat backend /v1/chat/completions
with the prompt as one user message (random ids decoded to text first), and `ignore_eos`, so it yields
exactly its output length; the server's reported prompt and cached prompt tokens are counted. Requests are sent at
`request_rate` per second on vLLM's schedule (`arrival_offsets`; inf: all at once), and at most
`concurrency` are in flight (None: no cap): one that arrives with that many in flight waits for one to
finish, and its latencies count from when it is sent, as vLLM counts them.
TTFT is the first streamed token, ITL the gaps between tokens, TPOT (E2E - TTFT) / (tokens - 1); a chat
stream's opening chunk, which carries the role and no text, is not a token.
"""

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from jaxserve.bench.datasets import BenchRequest, CustomDataset, ShareGPTDataset, as_text, random_requests
from jaxserve.config import ServeBenchConfig


@dataclass
class RequestResult:
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None  # the server's count (usage), where it reports one
    num_cached_tokens: int = 0
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
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                    result.num_prompt_tokens = chunk["usage"].get("prompt_tokens")
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    result.num_cached_tokens = details.get("cached_tokens") or 0
                if not _carries_output(chunk):
                    continue
                now = time.perf_counter()
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    except httpx.HTTPError as e:
        result.error = repr(e)
    result.e2e_s = time.perf_counter() - start
    return result


def _body(request: BenchRequest, model: str | None, sampling: dict[str, float | int], chat: bool) -> dict:
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


def arrival_offsets(num_prompts: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds from the start, as vLLM's `bench serve` schedules them: a gap
    before each request (the first too) drawn from a gamma distribution of shape `burstiness` and mean
    1 / `request_rate` (burstiness 1: exponential gaps, a Poisson process), the sums then scaled so that the
    last request goes at exactly num_prompts / request_rate, which steadies the offered rate across seeds.
    An infinite rate sends every request at once."""
    if math.isinf(request_rate):
        return [0.0] * num_prompts
    rng = np.random.default_rng(seed)
    offsets = np.cumsum(rng.gamma(burstiness, 1.0 / (request_rate * burstiness), num_prompts))
    return (offsets * (num_prompts / request_rate / offsets[-1])).tolist()


def _percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    array = np.asarray(values) * scale
    return {"mean": float(array.mean()), "p50": float(np.percentile(array, 50)), "p99": float(np.percentile(array, 99))}


async def run_level(
    base_url: str,
    model: str | None,
    concurrency: int | None,
    requests: list[BenchRequest],
    api_key: str | None = None,
    seed: int = 0,
    sampling: dict[str, float | int | None] | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    chat: bool = False,
) -> dict:
    """Sends `requests` at `request_rate` per second, at most `concurrency` in flight (None: no cap);
    returns the vLLM-style summary. `sampling`: fields sent with every request (those set to None are
    left out); greedy by default. `seed`: the arrival times'. `chat`: to /v1/chat/completions, each prompt
    (text) one user message, as vLLM's openai-chat backend sends it; else to /v1/completions."""
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError(f"request_rate and burstiness must be > 0 (inf: all at once), got {request_rate}, "
                         f"{burstiness}")
    sampling = {key: value for key, value in (sampling or {"temperature": 0.0}).items() if value is not None}
    url = f"{base_url.rstrip('/')}/{'chat/completions' if chat else 'completions'}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    bodies = [_body(request, model, sampling, chat) for request in requests]
    num_prompts = len(requests)
    in_flight = concurrency or num_prompts
    limit = asyncio.Semaphore(in_flight)
    timeout = httpx.Timeout(None, connect=30.0)
    # A connection per request: some servers (llama-server) drop idle kept-alive connections, and a request
    # sent on one fails before reaching them. A local connect costs well under a millisecond.
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def bounded(body: dict, offset: float) -> RequestResult:
            await asyncio.sleep(offset - (time.perf_counter() - start))  # its arrival; a negative wait is none
            async with limit:
                return await _one_request(client, url, headers, body)

        start = time.perf_counter()
        offsets = arrival_offsets(num_prompts, request_rate, burstiness, seed)
        results = await asyncio.gather(*(bounded(b, t) for b, t in zip(bodies, offsets, strict=True)))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    num_output = sum(r.num_output_tokens for r in ok)
    num_prompt = sum(request.prompt_len if r.num_prompt_tokens is None else r.num_prompt_tokens
                     for r, request in zip(results, requests, strict=True) if r.error is None)
    tpot = [(r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1]
    return {
        "concurrency": concurrency,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",  # vLLM's JSON: strict JSON
        "burstiness": burstiness,
        "num_prompts": num_prompts,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": num_output / duration,
        "total_tokens_per_s": (num_output + num_prompt) / duration,
        "prompt_tokens": num_prompt,
        "cached_prompt_tokens": sum(r.num_cached_tokens for r in ok),
        "ttft_ms": _percentiles([r.ttft_s for r in ok]),
        "tpot_ms": _percentiles(tpot),
        "itl_ms": _percentiles([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": _percentiles([r.e2e_s for r in ok]),
    }


def format_report(results: list[dict]) -> str:
    lines = [
        f"{'conc':>5} {'req/s':>7} {'out tok/s':>10} "
        + " ".join(f"{m + ' ' + s:>12}" for m in ("TTFT", "TPOT", "ITL", "E2E") for s in ("mean", "p50", "p99"))
        + f" {'rate':>6}"
    ]
    for r in results:
        row = f"{r['concurrency'] or '-':>5} {r['request_throughput']:>7.2f} {r['output_tokens_per_s']:>10.1f} "
        row += " ".join(f"{r[m][s]:>12.1f}" for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
                        for s in ("mean", "p50", "p99"))
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


def _tokenizer(config: ServeBenchConfig) -> Any:
    """--tokenizer, else --model, else the model the server names in /v1/models (its `root`, the path or
    hub id it loaded, where the server gives one, as jaxserve and vLLM do; else its id). Random prompts need
    it only for the chat API, which takes them as text."""
    from jaxserve.models.source import resolve_tokenizer
    from jaxserve.models.tokenizer import is_fallback_template, load_tokenizer

    name = config.tokenizer or config.model
    uses = "decodes its token ids for the chat API" if config.dataset_name == "random" else "counts tokens"
    if name is None:
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        try:
            response = httpx.get(f"{config.openai_base_url}/models", headers=headers, timeout=30.0)
            response.raise_for_status()
            card = response.json()["data"][0]
            name = card.get("root") or card["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
            raise ValueError(f"the {config.dataset_name} dataset {uses} with the model's tokenizer, and "
                             f"{config.openai_base_url}/models named no model ({error!r}): give --tokenizer "
                             f"or --model") from None
    try:
        tokenizer = load_tokenizer(resolve_tokenizer(name))
    except (OSError, RuntimeError, ValueError) as error:
        raise ValueError(f"no tokenizer from {name!r} for the {config.dataset_name} dataset ({error}); give "
                         f"--tokenizer: a directory, a .gguf file or a hub id") from None
    if config.dataset_name == "custom" and _templated_here(config) and is_fallback_template(tokenizer):
        raise ValueError(f"{name} has no chat template for the custom dataset's prompts (vLLM's bench stops "
                         f"there too): give --skip-chat-template to send them as written")
    return tokenizer


def main(config: ServeBenchConfig) -> None:
    """The command: one level per `config.concurrency`, each row printed as soon as it is measured (after
    the header), the results written to `config.json`."""
    requests_of = level_requests(config)  # a file's errors before any output
    header, footer = format_report([]).splitlines()  # no rows: the header and the footnote
    print(header, flush=True)
    results = []
    for concurrency in config.levels:
        requests = requests_of(config.prompts_per_level(concurrency))
        sampling = {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
                    "min_p": config.min_p}
        results.append(asyncio.run(run_level(
            config.openai_base_url, config.model, concurrency, requests, api_key=config.api_key, seed=config.seed,
            sampling=sampling, request_rate=config.request_rate, burstiness=config.burstiness, chat=config.chat,
        )))
        print("\n".join(format_report(results[-1:]).splitlines()[1:-1]), flush=True)
    print(footer)
    if config.json:
        with open(config.json, "w") as f:
            json.dump(results, f, indent=2, allow_nan=False)
