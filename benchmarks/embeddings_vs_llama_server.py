"""Embedding throughput of jaxserve against llama.cpp's llama-server, side by side on this machine, one server at
a time, alternating from round to round: both serve the same BERT (an HF directory for jaxserve, its GGUF made by
llama.cpp's own converter for llama-server) and embed the same token ids ([CLS] ... [SEP], lengths drawn
uniformly from a range), mean-pooled, sent by `--clients` concurrent clients in requests of `--batch` inputs.
llama-server is given what its batch embedding needs (`--embedding --pooling mean`, `-np` slots for every input
in flight, one physical batch of `--ubatch` tokens, 2 threads); jaxserve is `jaxserve serve` with
`--pooling-type mean` and `--dtype`, its other settings the CPU preset's. Each server embeds the workload once
untimed (its warm-up), then once timed; the vectors of the two are compared (cosine).

    python -m benchmarks.embeddings_vs_llama_server --model-dir HF_DIR --gguf FILE [--dtype float32]
        [--lengths 8 128] [--prompts 512] [--clients 4] [--batch 32] [--rounds 2]
"""

import argparse
import asyncio
import json
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.server import start_server, stop_server, wait_until_healthy

PEERS = Path.home() / "peers"
CLS, SEP = 101, 102  # bert-base-uncased's


def start_llama_server(binary: Path, gguf: Path, port: int, slots: int, ubatch: int) -> subprocess.Popen:
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--embedding",
               "--pooling", "mean", "-np", str(slots), "-c", str(512 * slots), "-ub", str(ubatch), "-b", str(ubatch),
               "-t", "2", "-tb", "2"]
    return wait_until_healthy(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port,
                              timeout_s=120)


async def _embed_all(url: str, body_of, vectors_of, prompts: list[list[int]], clients: int, batch: int
                     ) -> tuple[np.ndarray, float]:
    """Every prompt embedded, `clients` requests of `batch` prompts in flight; (vectors [N, D], seconds)."""
    batches = [list(range(i, min(i + batch, len(prompts)))) for i in range(0, len(prompts), batch)]
    vectors: list = [None] * len(prompts)
    queue = list(reversed(batches))

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            rows = queue.pop()
            response = await http.post(url, json=body_of([prompts[r] for r in rows]))
            response.raise_for_status()
            for row, vector in zip(rows, vectors_of(response.json()), strict=True):
                vectors[row] = vector

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return np.asarray(vectors, np.float64), time.perf_counter() - start


def _jaxserve_request(port: int):
    return (f"http://127.0.0.1:{port}/v1/embeddings",
            lambda ids: {"input": ids, "encoding_format": "float", "normalize": False},
            lambda answer: [d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])])


def _llama_request(port: int):
    return (f"http://127.0.0.1:{port}/embedding", lambda ids: {"content": ids, "embd_normalize": -1},
            lambda answer: [d["embedding"][0] for d in sorted(answer, key=lambda d: d["index"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--llama-server", type=Path, default=PEERS / "llama.cpp/build/bin/llama-server")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", type=int, nargs=2, default=[8, 128])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ubatch", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=18950)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    lengths = rng.integers(args.lengths[0], args.lengths[1] + 1, size=args.prompts)
    prompts = [[CLS, *rng.integers(1000, 30000, size=n - 2).tolist(), SEP] for n in lengths]
    num_tokens = int(lengths.sum())
    servers = {
        f"jaxserve-{args.dtype}": lambda port: start_server(None, port, args.dtype, "--model", str(args.model_dir),
                                                             "--pooling-type", "mean"),
        f"llama-server-{args.gguf.stem}": lambda port: start_llama_server(
            args.llama_server, args.gguf, port, min(256, args.clients * args.batch), args.ubatch),
    }
    requests = {name: (_jaxserve_request if name.startswith("jaxserve") else _llama_request) for name in servers}
    seconds: dict[str, list[float]] = {name: [] for name in servers}
    vectors = {}
    for round_index in range(args.rounds):
        order = list(servers) if round_index % 2 == 0 else list(reversed(servers))
        for name in order:
            process = servers[name](args.port)
            try:
                request = requests[name](args.port)
                asyncio.run(_embed_all(*request, prompts, args.clients, args.batch))  # warm-up
                vectors[name], took = asyncio.run(_embed_all(*request, prompts, args.clients, args.batch))
            finally:
                stop_server(process) if name.startswith("jaxserve") else (process.terminate(), process.wait(60))
            seconds[name].append(took)
            print(json.dumps({"round": round_index, "server": name, "seconds": round(took, 3),
                              "prompts_per_s": round(args.prompts / took, 1),
                              "tokens_per_s": round(num_tokens / took)}), flush=True)
    ours, theirs = (vectors[name] for name in servers)
    cosine = np.sum(ours * theirs, 1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    best = {name: min(times) for name, times in seconds.items()}
    jax_name, llama_name = servers
    print(json.dumps({"prompts": args.prompts, "tokens": num_tokens, "lengths": args.lengths,
                      "best_seconds": {k: round(v, 3) for k, v in best.items()},
                      "jaxserve_over_llama_server": round(best[llama_name] / best[jax_name], 2),
                      "min_cosine": float(cosine.min())}))


if __name__ == "__main__":
    main()
