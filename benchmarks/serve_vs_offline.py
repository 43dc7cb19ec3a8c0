"""HTTP + tokenization overhead: the same load through `jaxserve serve` and through the engine in-process.

One run, same machine, same config: start a server subprocess, send one wave of C streaming requests
(C concurrent, `input_len` prompt tokens, `output_len` output tokens each), stop it; then run the
same wave on an in-process LLMEngine. Prints both throughputs and their ratio.

    .venv/bin/python benchmarks/serve_vs_offline.py --config cpu --concurrency 16
"""

import argparse
import asyncio
import json

import numpy as np
from server import start_server, stop_server

from jaxserve.bench.offline import run_wave
from jaxserve.bench.serve import run_level
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    c = args.concurrency

    server = start_server(args.config, args.port, args.dtype)
    try:
        base_url = f"http://127.0.0.1:{args.port}/v1"
        asyncio.run(run_level(base_url, None, c, c, args.input_len, 4))  # warm the server's paths
        http = asyncio.run(run_level(base_url, None, c, c, args.input_len, args.output_len))
    finally:
        stop_server(server)

    engine = LLMEngine(EngineConfig.from_preset(args.config, dtype=args.dtype))
    rng = np.random.default_rng(0)
    run_wave(engine, c, args.input_len, 4, rng)  # same warm-up
    offline = run_wave(engine, c, args.input_len, args.output_len, rng)

    ratio = http["output_tokens_per_s"] / offline.output_tokens_per_s
    print(json.dumps({
        "concurrency": c,
        "http_output_tokens_per_s": round(http["output_tokens_per_s"], 1),
        "offline_output_tokens_per_s": round(offline.output_tokens_per_s, 1),
        "http_over_offline": round(ratio, 3),
        "http_ttft_ms_mean": round(http["ttft_ms"]["mean"], 1),
        "offline_ttft_ms_mean": round(offline.mean_ttft_ms, 1),
        "failed": http["failed"],
    }, indent=2))


if __name__ == "__main__":
    main()
