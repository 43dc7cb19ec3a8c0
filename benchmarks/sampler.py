"""The jitted sampler alone, per batch size and sampling setting, on random logits of a real vocabulary.

The sampler's cost grows with rows x vocabulary and does not shrink with the model, so at 16-256 rows it
can rival a small model's step. Runs whatever `jaxserve` is importable, so two trees compare side by side:

    PYTHONPATH=<before tree> python benchmarks/sampler.py --json before.json
    python benchmarks/sampler.py --json after.json
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

SETTINGS = {  # name -> per-row sampling values (and whether rows ask for logprobs)
    "greedy": dict(temperature=0.0),
    "greedy + logprobs 5": dict(temperature=0.0, logprobs=5),
    "temperature 1": dict(temperature=1.0),
    "temperature 1 + logprobs 0": dict(temperature=1.0, logprobs=0),
    "top_p 0.9": dict(temperature=1.0, top_p=0.9),
    "top_k 50": dict(temperature=1.0, top_k=50),
    "top_k 50, top_p 0.9, min_p 0.05": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
}
NUM_TOP = 20  # the top logprobs the step computes when any row asks for some (vLLM's --max-logprobs default)


def sampling_arrays(rows: int, vocab: int, setting: dict):
    from jaxserve.runner.step_batch import SamplingArrays

    logprobs = setting.get("logprobs")
    values = {
        "temperature": np.full(rows, setting.get("temperature", 1.0), np.float32),
        "top_k": np.full(rows, setting.get("top_k", 0), np.int32),
        "top_p": np.full(rows, setting.get("top_p", 1.0), np.float32),
        "min_p": np.full(rows, setting.get("min_p", 0.0), np.float32),
        "seeds": np.arange(rows, dtype=np.uint32),
        "output_index": np.zeros(rows, np.int32),
        "bias_token_ids": np.full((rows, 1), vocab, np.int32),
        "bias_values": np.zeros((rows, 1), np.float32),
        "penalty_slots": np.full(rows, rows, np.int32),
        "penalty_drafts": np.full((rows, 0), vocab, np.int32),
        "repetition_penalty": np.ones(rows, np.float32),
        "frequency_penalty": np.zeros(rows, np.float32),
        "presence_penalty": np.zeros(rows, np.float32),
        "wants_logprobs": np.full(rows, logprobs is not None),
        "wants_top_logprobs": np.full(rows, bool(logprobs)),
        "token_bitmask": np.full((rows, -(-vocab // 32)), -1, np.int32),
        "constrained": np.zeros(rows, np.bool_),
    }
    return SamplingArrays(**{f.name: values[f.name] for f in dataclasses.fields(SamplingArrays)})


def measure(rows: int, vocab: int, setting: dict, repeats: int, logit_scale: float, on_cuda: bool) -> float:
    import jax

    from jaxserve.runner.penalties import PenaltyTables
    from jaxserve.runner.sampler import sample

    logits = jax.numpy.asarray(np.random.default_rng(0).standard_normal((rows, vocab), np.float32) * logit_scale)
    params, tables = sampling_arrays(rows, vocab, setting), PenaltyTables.zeros(rows, vocab)
    step = jax.jit(lambda logits, params, tables: sample(logits, params, tables, NUM_TOP, on_cuda))
    jax.block_until_ready(step(logits, params, tables))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(logits, params, tables))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--logit-scale", type=float, default=3.0,
                        help="logits are normal x this: 3 is flat (top-p 0.9 keeps ~1,500 tokens of 49,152), "
                             "4 about 50, 5 about 5")
    parser.add_argument("--cpu-form", action="store_true",
                        help="on a CUDA GPU, the sampler as CPUs compile it (conditional stages, top-k whole)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from jaxserve.device import local_facts

    on_cuda = local_facts().compute_capability is not None and not args.cpu_form
    results = []
    print("| setting | " + " | ".join(f"{r} rows ms" for r in args.rows) + " |")
    print("|---" * (len(args.rows) + 1) + "|")
    for name in args.settings:
        row = {r: measure(r, args.vocab, SETTINGS[name], args.repeats, args.logit_scale, on_cuda) for r in args.rows}
        results.append({"setting": name, "vocab": args.vocab, "logit_scale": args.logit_scale, "on_cuda": on_cuda,
                        "median_ms": row})
        print(f"| {name} | " + " | ".join(f"{row[r]:.2f}" for r in args.rows) + " |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
