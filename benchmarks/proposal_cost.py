"""What a proposal costs the engine's thread: the n-gram and suffix proposers side by side, on token ids of
real text (this repository's docs, through the bundled model's tokenizer), per request and step.

The suffix proposer's output cache first takes `--cached` outputs of 200 tokens; then `--requests` contexts of
each `--context` length are proposed for `--repeats` times (their buffers filled by a first proposal, as a
running request's are), and the mean time a request is reported with the drafts proposed.

    python benchmarks/proposal_cost.py --context 512 4096
"""

import argparse
import gzip
import json
import time
from pathlib import Path
from types import SimpleNamespace

import tokenizers

from jaxserve.engine.ngram_proposer import NgramProposer
from jaxserve.engine.suffix_proposer import SuffixProposer

ROOT = Path(__file__).resolve().parents[1]


def request(request_id: str, tokens: list[int], num_prompt_tokens: int) -> SimpleNamespace:
    """What a proposer reads of a running request."""
    return SimpleNamespace(request_id=request_id, num_tokens=len(tokens), num_prompt_tokens=num_prompt_tokens,
                           max_num_tokens=len(tokens) + 64, cache_salt=None,
                           token_ids=lambda start, end: tokens[start:end])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--cached", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with gzip.open(ROOT / "jaxserve/models/bundled/tokenizer.json.gz", "rt") as file:
        tokenizer = tokenizers.Tokenizer.from_str(file.read())
    ids = tokenizer.encode((ROOT / "docs/benchmarks.md").read_text()).ids
    cached_tokens = args.cached * 200
    if len(ids) < cached_tokens + 2 * max(args.context):
        raise SystemExit(f"{len(ids)} tokens of text: too few for --cached {args.cached} and --context")
    proposers = {"ngram": NgramProposer(4, 2, 4), "suffix": SuffixProposer(16, 24, 10000, 1.0, 0.1)}
    start = time.perf_counter()
    for i in range(args.cached):
        proposers["suffix"].finish(request(f"cached{i}", [0, *ids[i * 200 : (i + 1) * 200]], 1))
    print(json.dumps({"cache_fill_s": round(time.perf_counter() - start, 3), "outputs": args.cached}))
    rest = ids[cached_tokens:]
    for context in args.context:
        stride = (len(rest) - context) // args.requests
        running = [request(f"{context}-{i}", rest[i * stride : i * stride + context], context - 100)
                   for i in range(args.requests)]
        for name, proposer in proposers.items():
            proposer.propose_batch(running, [16] * len(running))
            start = time.perf_counter()
            for _ in range(args.repeats):
                proposals = proposer.propose_batch(running, [16] * len(running))
            seconds = (time.perf_counter() - start) / args.repeats / len(running)
            print(json.dumps({"proposer": name, "context": context, "us_per_request": round(seconds * 1e6, 1),
                              "drafts_per_step": sum(map(len, proposals))}), flush=True)


if __name__ == "__main__":
    main()
