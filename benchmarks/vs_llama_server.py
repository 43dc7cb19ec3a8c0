"""jaxserve against llama.cpp's llama-server, side by side on this machine, alternating: the speed table.

Both serve SmolLM2-135M-Instruct (jaxserve in float32 from the bundled GGUF, llama-server from the F16 GGUF
that `../shared/peers/build_llama_server.sh` writes) and both are driven by the same client,
`jaxserve bench serve` (streamed /v1/completions, random-token prompts, `ignore_eos`). Each round runs
every concurrency level on both servers, the order swapped from round to round, with a fresh prompt seed
per round (the same prompts for both servers within a round, never twice for one server). llama-server
is restarted per level with `-np` equal to the concurrency (its slots); jaxserve runs one ladder for all
levels. Then a long prompt (`--long-prompt` tokens, `max_tokens` 1) measures TTFT on both.
`--variants` serves one jaxserve per set of extra `jaxserve serve` flags, each in the rotation, so a change
is measured against its predecessor and llama-server in one run. `--gguf FILE` serves FILE on both servers
(jaxserve as `--model FILE`, unless a variant names its own `--model`); the JSON says what each served.

    python benchmarks/vs_llama_server.py --concurrency 1 16 64 --rounds 2 --long-prompt 8000 \
        --json docs/vs-llama-server-cpu.json
    python benchmarks/vs_llama_server.py --variants "--attention-impl cpu" "--attention-impl cpu-native"
    python benchmarks/vs_llama_server.py --defaults --long-prompt 0   # `jaxserve serve` with no flags
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server import start_server, stop_server, wait_until_healthy

PEERS = Path.home() / "peers"
# One ladder for every level: up to 64 sequences, 512-token prefill chunks.
LADDER = {
    "buckets": {"token_buckets": [32, 128, 512], "request_buckets": [1, 4, 16, 64]},
    "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 512},
    "cache": {"page_size": 16, "kv_cache_memory_gib": 2.0},
}


def start_llama_server(binary: Path, gguf: Path, port: int, slots: int, context: int) -> subprocess.Popen:
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
               "-c", str(context), "-t", "2", "-tb", "2", "-a", "m", "-cram", "0"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return wait_until_healthy(process, port, timeout_s=120)


def bench(port: int, concurrency: int, num_prompts: int, input_len: int, output_len: int, seed: int,
          sampling: Sequence[str] = ()) -> dict:
    """One level of `jaxserve bench serve` against the server on `port`; `sampling`: its sampling flags."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [sys.executable, "-m", "jaxserve", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}/v1",
             "--concurrency", str(concurrency), "--num-prompts", str(num_prompts), "--input-len", str(input_len),
             "--output-len", str(output_len), "--seed", str(seed), "--json", out.name, *sampling],
            check=True, stdout=subprocess.DEVNULL)
        (result,) = json.loads(Path(out.name).read_text())
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed: {result['errors']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--long-prompt", type=int, default=8000, help="tokens of the TTFT prompt; 0 skips it")
    parser.add_argument("--llama-server", type=Path, default=PEERS / "llama.cpp/build/bin/llama-server")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the file both servers serve (default: llama-server SmolLM2's F16 file, jaxserve "
                             "its bundled SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--defaults", action="store_true",
                        help="serve jaxserve as `jaxserve serve` starts with no flags: its platform preset and "
                             "dtypes (not this script's ladder, --dtype or --max-model-len)")
    parser.add_argument("--async-scheduling", action="store_true", help="serve jaxserve with --async-scheduling")
    parser.add_argument("--sampling", nargs=argparse.REMAINDER, default=[],
                        help="last: `jaxserve bench serve` sampling flags sent to both servers, e.g. "
                             "--sampling --temperature 1 --top-p 0.9 (default: greedy); top-k, top-p and "
                             "min-p not given are sent switched off, or llama-server would apply its defaults")
    parser.add_argument("--variants", nargs="+", default=[""],
                        help="one jaxserve server per string of extra `jaxserve serve` flags, which may start with "
                             "NAME=value words for its environment (default: one, none)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    jaxserve_model = [] if args.gguf is None else ["--model", str(args.gguf)]
    args.gguf = args.gguf or PEERS / "models/SmolLM2-135M-Instruct.F16.gguf"
    if args.sampling:  # the flags given last win
        args.sampling = ["--top-k", "0", "--top-p", "1", "--min-p", "0", *args.sampling]

    llama_port = 8191
    # name -> port; "jaxserve" alone when one variant is served
    jax_ports = {(f"jaxserve ({flags})" if flags else "jaxserve"): 8192 + i for i, flags in enumerate(args.variants)}
    names = ["llama-server", *jax_ports]
    runs: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ladder = Path(tmp) / "ladder.yaml"
        ladder.write_text(yaml.safe_dump(LADDER))
        max_len = max(args.long_prompt + 64, 1024)
        servers = []
        try:
            for flags, port in zip(args.variants, jax_ports.values(), strict=True):
                chosen = (None, None) if args.defaults else (str(ladder), args.dtype)
                length = [] if args.defaults and not args.long_prompt else ["--max-model-len", str(max_len)]
                own_model = any(w == "--model" or w.startswith("--model=") for w in flags.split())
                servers.append(start_server(
                    chosen[0], port, chosen[1], *length, *([] if own_model else jaxserve_model), *flags.split(),
                    *(["--async-scheduling"] if args.async_scheduling else [])))
            for round_index in range(args.rounds):
                # each round shifts the order by one server, so each takes every place in turn
                order = names[round_index % len(names):] + names[:round_index % len(names)]
                for concurrency in args.concurrency:
                    num_prompts = max(2 * concurrency, 8)
                    seed = 1000 * round_index + concurrency
                    for name in order:
                        if name == "llama-server":
                            context = concurrency * (args.input_len + args.output_len + 64)
                            llama = start_llama_server(args.llama_server, args.gguf, llama_port, concurrency, context)
                            try:
                                result = bench(llama_port, concurrency, num_prompts, args.input_len,
                                               args.output_len, seed, args.sampling)
                            finally:
                                llama.terminate()
                                llama.wait(30)
                        else:
                            result = bench(jax_ports[name], concurrency, num_prompts, args.input_len,
                                           args.output_len, seed, args.sampling)
                        runs.setdefault((name, concurrency), []).append(result)
                        print(f"round {round_index + 1} c={concurrency} {name}: "
                              f"{result['output_tokens_per_s']:.1f} out tok/s, TPOT p50 "
                              f"{result['tpot_ms']['p50']:.1f} ms", flush=True)
                if args.long_prompt:
                    for name in order:
                        seed = 7 + round_index
                        if name == "llama-server":
                            llama = start_llama_server(args.llama_server, args.gguf, llama_port, 1, max_len)
                            try:
                                result = bench(llama_port, 1, 1, args.long_prompt, 1, seed)
                            finally:
                                llama.terminate()
                                llama.wait(30)
                        else:
                            result = bench(jax_ports[name], 1, 1, args.long_prompt, 1, seed)
                        runs.setdefault((name, -args.long_prompt), []).append(result)
                        print(f"round {round_index + 1} {args.long_prompt}-token prompt {name}: TTFT "
                              f"{result['ttft_ms']['p50'] / 1e3:.2f} s", flush=True)
        finally:
            for server in servers:
                stop_server(server)

    def median(name: str, level: int, metric: str, stat: str | None = None) -> float:
        return statistics.median(r[metric][stat] if stat else r[metric] for r in runs[(name, level)])

    print(f"\nmedians of {args.rounds} alternating rounds, {args.input_len} prompt / {args.output_len} output tokens")
    print("| server | concurrency | jaxserve out tok/s | llama-server out tok/s | ratio "
          "| TPOT p50 jaxserve / llama-server | ratio | TTFT p50 jaxserve / llama-server | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in jax_ports:
        for concurrency in args.concurrency:
            j, ll = (median(n, concurrency, "output_tokens_per_s") for n in (name, "llama-server"))
            jt, lt = (median(n, concurrency, "tpot_ms", "p50") for n in (name, "llama-server"))
            jf, lf = (median(n, concurrency, "ttft_ms", "p50") for n in (name, "llama-server"))
            rows.append({"server": name, "concurrency": concurrency, "jaxserve_tok_s": j, "llama_tok_s": ll,
                         "jaxserve_tpot_ms": jt, "llama_tpot_ms": lt, "jaxserve_ttft_ms": jf, "llama_ttft_ms": lf})
            print(f"| {name} | {concurrency} | {j:.1f} | {ll:.1f} | {j / ll:.2f} | {jt:.1f} / {lt:.1f} ms "
                  f"| {jt / lt:.2f} | {jf:.0f} / {lf:.0f} ms | {jf / lf:.2f} |")
        if args.long_prompt:
            jt, lt = (median(n, -args.long_prompt, "ttft_ms", "p50") / 1e3 for n in (name, "llama-server"))
            rows.append({"server": name, "long_prompt": args.long_prompt, "jaxserve_ttft_s": jt, "llama_ttft_s": lt})
            print(f"\n{name}, {args.long_prompt}-token prompt, TTFT: {jt:.2f} s, llama-server {lt:.2f} s, "
                  f"ratio {jt / lt:.2f}")
    if args.json:
        default = jaxserve_model[1] if jaxserve_model else "bundled SmolLM2"
        served = {"llama-server": str(args.gguf), **{name: _model_of(flags.split(), default)
                                                     for name, flags in zip(jax_ports, args.variants, strict=True)}}
        Path(args.json).write_text(json.dumps({"served": served, "summary": rows, "runs": [
            {"server": name, "level": level, "results": results} for (name, level), results in runs.items()]},
            indent=2))


def _model_of(flags: list[str], default: str) -> str:
    """The `--model` a variant's flags give, else `default`."""
    for index, word in enumerate(flags):
        if word.startswith("--model="):
            return word.removeprefix("--model=")
        if word == "--model" and index + 1 < len(flags):
            return flags[index + 1]
    return default


if __name__ == "__main__":
    main()
