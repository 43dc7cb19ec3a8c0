"""What the draft model's prefix cache saves where requests share a long system prompt.

One engine serves `--model` with `--draft` as its draft model, every draft run (as `draft_rounds.py` runs
them). `--streams` greedy requests, each a shared `--prefix-len`-token prompt and `--input-len` tokens of its
own, arrive at once, after one request on the same prefix has run (as a server's first chat on a system
prompt would); `--output-len` tokens each. Run twice, the draft's prefix cache on and then off (the target's
on in both): the tokens the draft computed in its rounds, the seconds those rounds took, and the whole
run's seconds.

    python benchmarks/draft_prefix.py --streams 8 --prefix-len 512     # the bundled model, its own draft
"""

import argparse
import json
import time

import numpy as np

from benchmarks.draft_rounds import drafting
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.models.loader import bundled_model_path
from jaxserve.sampling_params import SamplingParams


def run(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def measure(engine: LLMEngine, shared: bool, prefix: list[int], args: argparse.Namespace, seed: int) -> dict:
    """One run with the draft's prefix cache on or off, both caches' keys forgotten first."""
    proposer = engine.scheduler.proposer
    engine.scheduler.kv_cache.reset_prefix_cache()
    proposer.pages.reset_prefix_cache()
    proposer.pages.enable_prefix_caching = shared
    rng = np.random.default_rng(seed)
    own = [rng.integers(100, 20000, args.input_len).tolist() for _ in range(args.streams + 1)]
    launch, computed = proposer.runner.launch, [0]

    def counting_launch(plan):
        computed[0] += sum(plan.num_new_tokens)
        return launch(plan)

    proposer.runner.launch = counting_launch
    try:
        with drafting(engine, True):
            run(engine, [prefix + own[0]], args.output_len, f"{seed}-first")
        computed[0] = 0
        with drafting(engine, True) as spent:
            seconds = run(engine, [prefix + tokens for tokens in own[1:]], args.output_len, f"{seed}-all")
    finally:
        del proposer.runner.launch
    return {"draft_prefix_cache": shared, "streams": args.streams, "prefix_len": len(prefix),
            "draft_tokens_computed": computed[0], "draft_rounds_s": round(spent["seconds"], 3),
            "draft_rounds": spent["rounds"], "run_s": round(seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="the target (default: the bundled model, dequantized)")
    parser.add_argument("--draft", default=None, help="the draft (default: the bundled model's own file)")
    parser.add_argument("--config", default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    bundled = str(bundled_model_path())
    rows = args.streams * (args.num_speculative_tokens + 1)  # a verification's rows: a draft per row
    options = {"warmup_mode": "full", "max_num_seqs": rows,
               "speculative_config": {"model": args.draft or bundled,
                                      "num_speculative_tokens": args.num_speculative_tokens}}
    if args.model is None:
        options["quantization"] = "none"  # the bundled file dequantized, its own 4-bit blocks the draft
    engine = LLMEngine(EngineConfig.from_preset(args.config, model=args.model or bundled, **options))
    prefix = np.random.default_rng(0).integers(100, 20000, args.prefix_len).tolist()
    measure(engine, True, prefix, args, seed=1)  # each bucket's first run
    for index in range(args.rounds):
        for shared in (True, False):
            print(json.dumps(measure(engine, shared, prefix, args, seed=10 + index)), flush=True)


if __name__ == "__main__":
    main()
