"""What a draft model's rounds cost beside the target's steps, and the acceptance they need to pay.

One engine serves `--model` with `--draft` as its draft model (`--speculative-config`'s "model"). Per stream
count R, R greedy requests of `--output-len` tokens run twice: with the proposer off (plain decodes: seconds a
step), and with every draft run (`num_speculative_tokens` k per request a round: seconds a round of the
draft, seconds a verification step of R * (k + 1) rows). A round and a verification give a request
1 + a + ... + a^k tokens at acceptance a, a plain step 1; the break-even acceptance is the a where both give
as many tokens a second. Random weights (`--load-format dummy`) time the same as real ones; their acceptance
means nothing, and the break-even is what this reports. The draft policy makes the same comparison at run
time with its own measurements (`engine/draft_policy.py`).

    python benchmarks/draft_rounds.py --streams 1 4 16 --output-len 64     # the bundled model, its own draft
    # a GPU: the Llama-3-8B shape drafted by the Llama-3.2-1B shape (one vocabulary), random weights
    python benchmarks/draft_rounds.py --config gpu --model .gpu_check/llama-3-8b \
        --draft .gpu_check/llama-3.2-1b --load-format dummy --streams 1 16 64
"""

import argparse
import contextlib
import json
import time

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.models.loader import bundled_model_path
from jaxserve.sampling_params import SamplingParams


def run(engine: LLMEngine, streams: int, input_len: int, output_len: int, seed: int) -> tuple[float, int]:
    """Seconds for `streams` greedy requests submitted at once, and the engine steps they took."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"{seed}-{i}", rng.integers(100, 20000, input_len).tolist(), params)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return time.perf_counter() - start, steps


@contextlib.contextmanager
def drafting(engine: LLMEngine, on: bool):
    """The proposer off, or every draft run (steps cost alike to the policy, proposals nothing); the time
    spent proposing is summed in the yielded dict."""
    scheduler = engine.scheduler
    proposer, policy = scheduler.proposer, scheduler.draft_policy
    spent = {"seconds": 0.0, "rounds": 0}
    propose_batch = proposer.propose_batch

    def timed(requests, max_drafts):
        start = time.perf_counter()
        try:
            return propose_batch(requests, max_drafts)
        finally:
            spent["seconds"] += time.perf_counter() - start
            spent["rounds"] += 1

    costs = policy.costs
    if on:
        proposer.propose_batch = timed
        policy.costs = dict.fromkeys(policy.row_buckets, 1.0)
        policy.observe_step = lambda *timed_step: None
        policy.observe_proposal = lambda num_requests, seconds: None
    else:
        scheduler.proposer = None
    scheduler._draft_pause = 0
    try:
        yield spent
    finally:
        scheduler.proposer, policy.costs = proposer, costs
        proposer.__dict__.pop("propose_batch", None)
        for name in ("observe_step", "observe_proposal"):
            policy.__dict__.pop(name, None)
        scheduler._draft_pause = 0


def break_even(step: float, verify: float, round_: float, k: int) -> float | None:
    """The acceptance a at which 1 + a + ... + a^k tokens per (verify + round) equal 1 per step; None if
    even every draft accepted does not pay."""
    need = (verify + round_) / step
    if need > k + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(mid**i for i in range(k + 1)) < need else (low, mid)
    return round(high, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="the target (default: the bundled model, dequantized)")
    parser.add_argument("--draft", default=None, help="the draft (default: the bundled model's own file)")
    parser.add_argument("--config", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bundled = str(bundled_model_path())
    k = args.num_speculative_tokens
    options = {"load_format": args.load_format, "warmup_mode": "full",
               "speculative_config": {"model": args.draft or bundled, "num_speculative_tokens": k}}
    if args.model is None:
        options["quantization"] = "none"  # the bundled file dequantized, its own 4-bit blocks the draft
    if args.gpu_memory_utilization is not None:
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    options["max_num_seqs"] = max(max(args.streams), 1)
    engine = LLMEngine(EngineConfig.from_preset(args.config, model=args.model or bundled, **options))
    results = []
    for streams in args.streams:
        run(engine, streams, args.input_len, 4, seed=0)  # each bucket's first run
        with drafting(engine, True):
            run(engine, streams, args.input_len, 4, seed=1)
        plain, speculative = [], []
        for index in range(args.rounds):
            with drafting(engine, False):
                seconds, steps = run(engine, streams, args.input_len, args.output_len, seed=10 + index)
            plain.append(seconds / steps)
            with drafting(engine, True) as spent:
                seconds, steps = run(engine, streams, args.input_len, args.output_len, seed=10 + index)
            speculative.append(((seconds - spent["seconds"]) / steps, spent["seconds"] / max(spent["rounds"], 1)))
        step = float(np.median(plain))
        verify = float(np.median([v for v, _ in speculative]))
        round_ = float(np.median([r for _, r in speculative]))
        result = {"streams": streams, "k": k, "step_ms": round(step * 1e3, 2),
                  "verify_step_ms": round(verify * 1e3, 2), "draft_round_ms": round(round_ * 1e3, 2),
                  "break_even_acceptance": break_even(step, verify, round_, k)}
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"model": args.model or bundled, "draft": args.draft or bundled, "results": results}, file,
                      indent=1)


if __name__ == "__main__":
    main()
