"""HTTP + tokenization overhead: the same load through `jaxserve serve` and through the engine in-process.

One run, same machine, same config: start a server subprocess, send one wave of C streaming requests
(C concurrent, `input_len` prompt tokens, `output_len` output tokens each), stop it; then run the
same wave on an in-process LLMEngine. Prints both throughputs and their ratio.

    .venv/bin/python benchmarks/serve_vs_offline.py --config cpu --concurrency 16

`--tiny` serves a tiny random Llama (benchmarks/tiny_model.py) instead of the bundled model, so the
host's work dominates: the rate at which the event loop (tokenizing, detokenized deltas, SSE) and the
engine thread, sharing the GIL, can feed many streams. Engine options pass through:

    .venv/bin/python benchmarks/serve_vs_offline.py --tiny --concurrency 256 --max-num-seqs 256 \
        --token-buckets 256 512 --request-buckets 64 128 256 --output-len 64
"""

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import numpy as np
from server import start_server, stop_server
from tiny_model import write_tiny_llama

from jaxserve.bench.datasets import random_requests
from jaxserve.bench.offline import run_wave
from jaxserve.bench.serve import run_level
from jaxserve.config import EngineConfig, load_preset
from jaxserve.engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of the bundled model")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--token-buckets", type=int, nargs="+", default=None)
    parser.add_argument("--request-buckets", type=int, nargs="+", default=None)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="(default: the preset's; the bundled presets schedule asynchronously)")
    parser.add_argument("--engine-process", action="store_true",
                        help="the server runs its engine core in its own process (the offline engine does not)")
    args = parser.parse_args()
    c = args.concurrency

    model = str(write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny-llama")) if args.tiny else None
    options = dict(model=model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   token_buckets=args.token_buckets, request_buckets=args.request_buckets,
                   async_scheduling=args.async_scheduling)
    config = EngineConfig.from_preset(args.config, dtype=args.dtype, **options)
    sections = load_preset(args.config)  # the server gets the same engine config: the preset and the options
    sections.setdefault("scheduler", {}).update(max_num_seqs=config.scheduler.max_num_seqs,
                                                max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                                                async_scheduling=config.scheduler.async_scheduling)
    sections.setdefault("buckets", {}).update(token_buckets=list(config.buckets.token_buckets),
                                              request_buckets=list(config.buckets.request_buckets))
    config_file = Path(tempfile.mkdtemp()) / "engine.yaml"
    config_file.write_text(json.dumps(sections))  # JSON is YAML
    server = start_server(str(config_file), args.port, args.dtype, *(["--model", model] if model else []),
                          *(["--engine-process"] if args.engine_process else []))
    try:
        base_url = f"http://127.0.0.1:{args.port}/v1"
        asyncio.run(run_level(base_url, None, c, random_requests(c, args.input_len, 4)))  # warm the server's paths
        http = asyncio.run(run_level(base_url, None, c, random_requests(c, args.input_len, args.output_len)))
    finally:
        stop_server(server)

    engine = LLMEngine(config)
    rng = np.random.default_rng(0)
    run_wave(engine, c, args.input_len, 4, rng)  # same warm-up
    offline = run_wave(engine, c, args.input_len, args.output_len, rng)

    ratio = http["output_tokens_per_s"] / offline.output_tokens_per_s
    print(json.dumps({
        "concurrency": c,
        "model": "tiny random Llama" if args.tiny else "bundled",
        "async_scheduling": config.scheduler.async_scheduling,
        "server_engine_process": args.engine_process,
        "http_output_tokens_per_s": round(http["output_tokens_per_s"], 1),
        "offline_output_tokens_per_s": round(offline.output_tokens_per_s, 1),
        "http_over_offline": round(ratio, 3),
        "http_ttft_ms_mean": round(http["ttft_ms"]["mean"], 1),
        "offline_ttft_ms_mean": round(offline.mean_ttft_ms, 1),
        "failed": http["failed"],
    }, indent=2))


if __name__ == "__main__":
    main()
