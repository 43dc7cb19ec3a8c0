"""Start-up time of `jaxserve serve`: process start to a 200 from /health, cold and warm.

`ready_s` is what a client waits for; with `--warmup background` (and `auto`, serve's default, on one
host) the server is ready after one bucket and `all_compiled_s` says when the last bucket was in.
`--first-requests N` sends N requests at once as soon as the server is ready and records when the last
is answered (`answered_s`, from process start): whether a server that is ready early, compiling the
rest while it serves, answers its first clients sooner than one that compiled everything first.
Cold: empty compilation cache, empty jaxserve cache (the GGUF's converted config and tokenizer) and no
native CPU kernels built: a fresh machine's first start.
Warm: the same command again, the caches filled by the cold start. Each start is a fresh process, and
the server's own log gives the split (loading, KV allocation, warm-up).

    python benchmarks/startup.py --config default --json docs/startup.json
    python benchmarks/startup.py --config cpu --runs 2
    python benchmarks/startup.py --config cpu -- --model CONVERTED_DIR   # weights from `jaxserve convert`
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

_PHASES = {
    # jax's backend started, from the import of jaxserve (a GPU's imports and CUDA start)
    "backend_s": re.compile(r"backend: .*; ready ([\d.]+)s after jaxserve was imported"),
    "load_s": re.compile(r"weights: (?:\d+ tensors loaded|restored from the orbax checkpoint|\d+ random tensors "
                         r"\(.*\) drawn) in ([\d.]+)s"),
    # weights loading beside the compiles: how long the start then waited for them (0 where they were in)
    "weights_wait_s": re.compile(r"weights: in; the start waited ([\d.]+)s for them"),
    "warmup_s": re.compile(r"warm-up: (?:\d+ of )?\d+ buckets compiled in ([\d.]+)s"),
    "all_compiled_s": re.compile(r"warm-up: (?:all )?\d+ buckets compiled in ([\d.]+)s"),
    # of the start's step compiles, jax's tracing and lowering (Python: one compile at a time; runner/trace_time.py)
    "trace_s": re.compile(r"jax traced their steps for ([\d.]+)s"),
    "lower_s": re.compile(r"jax traced their steps for [\d.]+s and lowered them for ([\d.]+)s"),
    "cache_hits": re.compile(r"(\d+) from the persistent cache"),
    # a GPU's KV sizing (runner/kv_sizing.py): the largest buckets' quick compiles (0 on a start that found
    # an earlier start's record, or sized from the step's shapes), then their real ones
    "sizing_quick_s": re.compile(r"temp memory from (?:quick compiles|an earlier start's record|the step's shapes) "
                                 r"in ([\d.]+)s"),
    "sizing_real_s": re.compile(r"the largest buckets' real compiles in ([\d.]+)s"),
}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(port: int, prompt_words: int, max_tokens: int) -> None:
    body = json.dumps({"prompt": " ".join(["word"] * prompt_words), "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        assert response.status == 200, response.status


def _first_requests(port: int, count: int) -> None:
    """`count` requests of ~128 prompt and 64 output tokens, all at once; returns when all are answered."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(count) as pool:
        for future in [pool.submit(_complete, port, 128, 64) for _ in range(count)]:
            future.result()


def start_once(config: str, cache_dir: Path, extra: list[str], timeout: float,
               log_path: Path | None = None, wait_all: bool = True, first_requests: int = 0) -> dict[str, float]:
    """Starts a server, waits for /health, stops it; returns the seconds to ready and the log's phases."""
    port = _free_port()
    env = dict(os.environ, JAXSERVE_CACHE_DIR=str(cache_dir / "jaxserve"),
               JAXSERVE_KERNEL_CACHE=str(cache_dir / "kernels"), HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "jaxserve", "serve", "--config", config, "--port", str(port),
               "--compilation-cache-dir", str(cache_dir / "xla"), *extra]
    start = time.perf_counter()
    # The log goes straight to `log_path` when given, so a start killed from outside still leaves it.
    with open(log_path, "w+") if log_path is not None else tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            while True:
                if server.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the server exited with {server.returncode}:\n{log.read()[-3000:]}")
                if time.perf_counter() - start > timeout:
                    raise TimeoutError(f"not ready after {timeout}s")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                time.sleep(0.05)
            ready = time.perf_counter() - start
            if first_requests:
                _first_requests(port, first_requests)
                answered = time.perf_counter() - start
            while wait_all and time.perf_counter() - start < timeout:  # a background warm-up: until every bucket is in
                log.seek(0)
                if _PHASES["all_compiled_s"].search(log.read()):
                    break
                time.sleep(0.2)
        finally:
            server.terminate()
            server.wait(timeout=60)
        log.seek(0)
        text = log.read()
    result = {"ready_s": round(ready, 2)}
    if first_requests:
        result["answered_s"] = round(answered, 2)
    for name, pattern in _PHASES.items():
        if match := pattern.search(text):
            result[name] = float(match.group(1))
    return result


def cache_entries(xla_dir: Path, largest: int = 4) -> dict[str, object]:
    """What JAX's persistent cache holds after a start: its entry count, bytes, and its largest entries (a
    module name and a key's head): whether a cold start wrote the executables a warm start then missed."""
    files = sorted((f for f in xla_dir.glob("*") if f.is_file() and not f.name.endswith("-atime")),
                   key=lambda f: f.stat().st_size, reverse=True)
    return {"cache_entries": len(files), "cache_mib": round(sum(f.stat().st_size for f in files) / 2**20, 1),
            "cache_largest": [f"{f.name[:48]} {f.stat().st_size / 2**20:.1f} MiB" for f in files[:largest]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="default", help="the preset or YAML whose ladder warm-up compiles")
    parser.add_argument("--runs", type=int, default=1, help="cold/warm pairs, each with fresh caches")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--log-dir", type=Path, default=None, help="keep each start's server log here")
    parser.add_argument("--no-wait-all", action="store_true",
                        help="stop each server once ready, not once a background warm-up has compiled every bucket")
    parser.add_argument("--first-requests", type=int, default=0,
                        help="send this many requests (~128 prompt, 64 output tokens) at once when ready")
    parser.add_argument("extra", nargs="*", help="more `jaxserve serve` flags (after --)")
    args = parser.parse_args()
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as tmp:
            for kind in ("cold", "warm"):
                log_path = args.log_dir / f"serve-{run}-{kind}.log" if args.log_dir else None
                result = start_once(args.config, Path(tmp), args.extra, args.timeout, log_path,
                                    wait_all=not args.no_wait_all, first_requests=args.first_requests)
                rows.append({"run": run, "kind": kind, **result, **cache_entries(Path(tmp) / "xla")})
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
