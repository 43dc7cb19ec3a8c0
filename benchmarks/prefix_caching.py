"""Prefix caching on against off: one shared system prompt, short user turns, through `jaxserve serve`.

One run, same machine, same config: for each setting (`--enable-prefix-caching` and
`--no-enable-prefix-caching`, alternating when `--rounds` > 1) start a server, send each concurrency
level of streamed /v1/completions (a `prefix_len`-token prefix every request shares, then `input_len`
tokens of its own, `output_len` generated), and read the prefix-cache counters from /metrics around each
level. Prints a table and the on/off ratios of TTFT and output throughput; `--json` keeps everything.

    .venv/bin/python benchmarks/prefix_caching.py --config cpu --prefix-len 1000 --concurrency 1 16
"""

import argparse
import asyncio
import json

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server import start_server, stop_server

from jaxserve.bench.datasets import random_requests
from jaxserve.bench.serve import run_level


def prefix_counters(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    wanted = {"jaxserve:prefix_cache_queries_total": "queries", "jaxserve:prefix_cache_hits_total": "hits"}
    return {wanted[s.name]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in wanted}


def measure(args: argparse.Namespace, caching: bool) -> list[dict]:
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    server = start_server(args.config, args.port, args.dtype, flag, "--max-model-len", str(args.max_model_len))
    base_url = f"http://127.0.0.1:{args.port}"
    try:
        # Warm the server's paths with prompts of another prefix (nothing of the measured one is cached).
        warm = random_requests(2, args.input_len, 4, args.prefix_len, seed=999)
        asyncio.run(run_level(f"{base_url}/v1", None, 2, warm))
        rows = []
        for concurrency in args.concurrency:
            before = prefix_counters(base_url)
            num_prompts = args.num_prompts or max(4 * concurrency, 8)
            requests = random_requests(num_prompts, args.input_len, args.output_len, args.prefix_len, seed=concurrency)
            result = asyncio.run(run_level(f"{base_url}/v1", None, concurrency, requests, seed=concurrency))
            after = prefix_counters(base_url)
            queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
            rows.append({"caching": caching, **result, "metrics_hit_rate": hits / queries if queries else 0.0})
            print(f"caching={'on ' if caching else 'off'} c={concurrency:>3}: "
                  f"out {result['output_tokens_per_s']:7.1f} tok/s, TTFT mean {result['ttft_ms']['mean']:8.1f} ms "
                  f"p50 {result['ttft_ms']['p50']:8.1f} ms, cached {result['cached_prompt_tokens']}/"
                  f"{result['prompt_tokens']} prompt tokens, /metrics hit rate {rows[-1]['metrics_hit_rate']:.3f}",
                  flush=True)
        return rows
    finally:
        stop_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefix-len", type=int, default=1000, help="tokens of the shared system prompt")
    parser.add_argument("--input-len", type=int, default=16, help="tokens of each request's own turn")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--num-prompts", type=int, default=None, help="per level (default: 4 x concurrency, >= 8)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=1, help="off/on pairs, alternating order")
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    rows = []
    for round_index in range(args.rounds):
        for caching in ((False, True) if round_index % 2 == 0 else (True, False)):
            rows += measure(args, caching)

    print("\nconcurrency  TTFT mean off/on  TTFT p50 off/on  out tok/s on/off  hit rate (on)")
    for concurrency in args.concurrency:
        def mean_of(caching: bool, key: str, stat: str | None = None, c: int = concurrency) -> float:
            values = [r[key][stat] if stat else r[key] for r in rows if r["caching"] == caching
                      and r["concurrency"] == c]
            return sum(values) / len(values)

        print(f"{concurrency:>11}  {mean_of(False, 'ttft_ms', 'mean') / mean_of(True, 'ttft_ms', 'mean'):>16.2f}  "
              f"{mean_of(False, 'ttft_ms', 'p50') / mean_of(True, 'ttft_ms', 'p50'):>15.2f}  "
              f"{mean_of(True, 'output_tokens_per_s') / mean_of(False, 'output_tokens_per_s'):>16.2f}  "
              f"{mean_of(True, 'metrics_hit_rate'):>13.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
