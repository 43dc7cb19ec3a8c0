"""Speculative decoding by n-gram lookup against plain decoding, side by side in one run: two `jaxserve serve`
processes of the bundled model with the same flags but `--speculative-config`, each sent the same chat
requests in alternating rounds (`--streams` at once), greedy or seeded so both give the same text.

Workloads: `edit` (return a code snippet with one change: the answer repeats the prompt), `quote` (answer
with sentences quoted from a passage) and `free` (open-ended writing: little to find). Reported per workload
and stream count: output tok/s of each server, their ratio, drafts accepted (from /metrics), and whether the
outputs were equal. `--repetition-penalty` sends every request one (Qwen2.5's instruct models give each
request 1.05 from their generation config).

    python benchmarks/speculative.py --streams 1 4 --rounds 3 --speculative-config \
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    python benchmarks/speculative.py --streams 1 4 --workloads edit quote --repetition-penalty 1.05
"""

import argparse
import json
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.server import start_server, stop_server

CODE = '''def summarize(orders, threshold):
    total = 0
    count = 0
    for order in orders:
        if order["amount"] >= threshold:
            total += order["amount"]
            count += 1
    average = total / count if count else 0.0
    return {"total": total, "count": count, "average": average}
'''

PASSAGE = ("The lighthouse stood on the northern cliff for two hundred years. Its keeper climbed one hundred and "
           "twelve steps every evening to light the lamp. Ships passing the strait watched for its beam, which "
           "turned once every ten seconds. In winter the keeper cleared ice from the windows twice a night. The "
           "last keeper left in 1962, when the light was automated.")

WORKLOADS = {
    "edit": [
        f"Rename the variable `total` to `amount_sum` in this function and return the whole function:\n\n{CODE}",
        f"Add a docstring to this function and return the whole function:\n\n{CODE}",
    ],
    "quote": [
        f"{PASSAGE}\n\nQuote, word for word, the sentences of the passage above that mention the keeper.",
        f"{PASSAGE}\n\nCopy the passage above, one sentence per line.",
    ],
    "free": [
        "Write a short story about a fox who learns to play the violin.",
        "Explain why the sky is blue to a ten-year-old.",
    ],
}


def chat(client: httpx.Client, prompt: str, max_tokens: int, seed: int | None,
         repetition_penalty: float | None = None) -> tuple[str, int, float]:
    """(text, completion tokens, seconds) of one chat request: greedy, or sampled at 0.7 with `seed`."""
    sampling = {"temperature": 0.0} if seed is None else {"temperature": 0.7, "seed": seed}
    if repetition_penalty is not None:
        sampling["repetition_penalty"] = repetition_penalty
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, **sampling}
    start = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body)
    seconds = time.perf_counter() - start
    response.raise_for_status()
    answer = response.json()
    return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"], seconds


def accepted_counts(client: httpx.Client) -> tuple[float, float]:
    """(draft tokens, accepted tokens) so far, from the server's /metrics."""
    text = client.get("/metrics").text

    def total(name: str) -> float:
        found = re.search(rf"^jaxserve:{name}_total{{[^}}]*}} (\S+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    return total("spec_decode_num_draft_tokens"), total("spec_decode_num_accepted_tokens")


def one_round(client: httpx.Client, prompts: list[str], streams: int, max_tokens: int, seeded: bool,
              repetition_penalty: float | None = None) -> tuple[list[str], int, float]:
    """`streams` requests at once (the workload's prompts in turn): their texts, tokens and wall time."""
    jobs = [(prompts[i % len(prompts)], None if not seeded else i) for i in range(streams)]
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda job: chat(client, job[0], max_tokens, job[1], repetition_penalty), jobs))
    wall = time.perf_counter() - start
    return [text for text, _, _ in results], sum(tokens for _, tokens, _ in results), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                                          '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeded", action="store_true", help="sampled at temperature 0.7 with seeds, not greedy")
    parser.add_argument("--repetition-penalty", type=float, default=None, help="sent with every request")
    parser.add_argument("--port", type=int, default=8941)
    parser.add_argument("--json", default=None)
    parser.add_argument("extra", nargs="*", help="more `jaxserve serve` flags for both servers (after --)")
    args = parser.parse_args()
    plain = start_server(None, args.port, None, *args.extra)
    speculative = start_server(None, args.port + 1, None, *args.extra, "--speculative-config", args.speculative_config)
    rows = []
    try:
        # Idle connections dropped before the server's keep-alive timeout (5 s) can close one being reused:
        # a round on the other server leaves them idle about that long.
        limits = httpx.Limits(keepalive_expiry=2.0)
        clients = {name: httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=900, limits=limits)
                   for name, port in (("plain", args.port), ("speculative", args.port + 1))}
        for client in clients.values():  # the first request of each shape
            one_round(client, WORKLOADS["free"], max(args.streams), 16, args.seeded, args.repetition_penalty)
        for workload in args.workloads:
            for streams in args.streams:
                rates: dict[str, list[float]] = {"plain": [], "speculative": []}
                texts: dict[str, list[str]] = {}
                drafted0, accepted0 = accepted_counts(clients["speculative"])
                for _ in range(args.rounds):
                    for name, client in clients.items():
                        texts[name], tokens, wall = one_round(client, WORKLOADS[workload], streams,
                                                              args.max_tokens, args.seeded, args.repetition_penalty)
                        rates[name].append(tokens / wall)
                drafted, accepted = accepted_counts(clients["speculative"])
                plain_rate, spec_rate = statistics.median(rates["plain"]), statistics.median(rates["speculative"])
                rows.append({
                    "workload": workload, "streams": streams, "plain_tok_s": round(plain_rate, 1),
                    "speculative_tok_s": round(spec_rate, 1), "ratio": round(spec_rate / plain_rate, 2),
                    "ratios_per_round": [round(s / p, 2) for p, s in zip(rates["plain"], rates["speculative"],
                                                                           strict=True)],
                    "tok_s_per_round": {name: [round(rate, 1) for rate in values] for name, values in rates.items()},
                    "acceptance": round((accepted - accepted0) / max(drafted - drafted0, 1), 2),
                    "same_text": texts["plain"] == texts["speculative"],
                })
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stop_server(speculative)
        stop_server(plain)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
