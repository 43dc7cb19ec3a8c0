"""What beam search costs against sampling the same number of sequences: one completions request of
`--output-len` tokens with `use_beam_search` and n beams, against n sampled choices (one engine request),
alternating, on a `jaxserve serve` of the bundled model with its defaults. Beam search runs one engine
round per token (each live beam's next token), so its time is per-round latency x output length.

    python benchmarks/beam_search.py --widths 1 4 --output-len 32 --rounds 3

`--offline N`: `LLM.beam_search` of N prompts instead, each round's beams of every prompt in one engine batch
(the default) against one prompt at a time (`concurrency_limit=1`), alternating.

    python benchmarks/beam_search.py --offline 8 --widths 4 --output-len 32 --rounds 3
"""

import argparse
import json
import statistics
import time

import httpx

from benchmarks.server import start_server, stop_server

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def timed(client: httpx.Client, body: dict) -> float:
    start = time.perf_counter()
    response = client.post("/v1/completions", json=body)
    response.raise_for_status()
    return time.perf_counter() - start


def offline(num_prompts: int, widths: list[int], output_len: int, rounds: int) -> list[dict]:
    from jaxserve import LLM, BeamSearchParams

    llm = LLM()
    prompts = [f"{PROMPT} Chapter {i + 1}:" for i in range(num_prompts)]
    llm.beam_search(prompts, BeamSearchParams(max(widths), output_len))  # first use of each shape
    llm.beam_search(prompts, BeamSearchParams(max(widths), output_len), concurrency_limit=1)
    rows = []
    for width in widths:
        params = BeamSearchParams(width, output_len, ignore_eos=True)
        times: dict[str, list[float]] = {"batched": [], "one_at_a_time": []}
        for _ in range(rounds):
            for name, limit in (("batched", None), ("one_at_a_time", 1)):
                start = time.perf_counter()
                llm.beam_search(prompts, params, concurrency_limit=limit)
                times[name].append(time.perf_counter() - start)
        batched, alone = statistics.median(times["batched"]), statistics.median(times["one_at_a_time"])
        rows.append({"prompts": num_prompts, "width": width, "output_len": output_len, "batched_s": round(batched, 2),
                     "one_at_a_time_s": round(alone, 2), "speedup": round(alone / batched, 2)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--json", default=None)
    parser.add_argument("--offline", type=int, default=None, metavar="N", help="LLM.beam_search of N prompts")
    parser.add_argument("extra", nargs="*", help="more `jaxserve serve` flags (after --)")
    args = parser.parse_args()
    if args.offline is not None:
        rows = offline(args.offline, args.widths, args.output_len, args.rounds)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    server = start_server(None, args.port, None, *args.extra)
    rows = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=600) as client:
            common = {"prompt": PROMPT, "max_tokens": args.output_len, "ignore_eos": True}
            timed(client, {**common, "use_beam_search": True, "n": max(args.widths)})  # first use of each shape
            for width in args.widths:
                times: dict[str, list[float]] = {"beam": [], "sampled": []}
                for _ in range(args.rounds):
                    times["beam"].append(timed(client, {**common, "use_beam_search": True, "n": width}))
                    times["sampled"].append(timed(client, {**common, "n": width, "temperature": 1.0, "seed": 0}))
                beam, sampled = statistics.median(times["beam"]), statistics.median(times["sampled"])
                rows.append({"width": width, "output_len": args.output_len, "beam_s": round(beam, 3),
                             "sampled_s": round(sampled, 3), "ratio": round(beam / sampled, 2),
                             "beam_ms_per_round": round(1000 * beam / args.output_len, 1)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stop_server(server)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
