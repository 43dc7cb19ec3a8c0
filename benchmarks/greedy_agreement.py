"""Greedy agreement of lower-precision settings with float32, on the bundled SmolLM2.

Each prompt (chat-templated English questions, then random-token prompts) is generated greedily in float32
(weights and KV cache) and under each setting, in one process; it reports how many generations are
identical, and for the others where they first differ. A setting is engine options, comma-separated:

    python benchmarks/greedy_agreement.py --settings kv_cache_dtype=float16 kv_cache_dtype=bfloat16 \
        dtype=bfloat16 --max-tokens 64
"""

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import yaml

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.", "Write a haiku about rain.",
    "List three prime numbers greater than 50.", "Why is the sky blue?", "How do vaccines work?",
    "Give me a recipe for pancakes.", "What does a CPU cache do?", "Translate 'good morning' into Spanish.",
    "Summarise the plot of Romeo and Juliet.", "What is 17 times 23?", "Name the planets of the solar system.",
    "How does a bicycle stay upright?", "What is the difference between weather and climate?",
    "Write a short poem about the sea.", "Explain what a linked list is.",
]


def generate(setting: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    pairs = (item.split("=", 1) for item in setting.split(",") if item)
    options = {"dtype": "float32", **{key: yaml.safe_load(value) for key, value in pairs}}
    config = EngineConfig.from_preset("cpu", **options)
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs: dict[int, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                chosen = [float(entry[token].logprob)  # {token id: Logprob}, the sampled token's among them
                          for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)]
                outputs[int(output.request_id)] = (completion.token_ids, chosen)
    engine.shutdown()
    return [outputs[i] for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["kv_cache_dtype=float16", "kv_cache_dtype=bfloat16",
                                                          "dtype=bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--random-prompts", type=int, default=16, help="random-token prompts of 200 tokens")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from jaxserve.models.gguf_cache import converted_dir
    from jaxserve.models.loader import bundled_model_path
    from jaxserve.models.tokenizer import apply_chat_template, load_tokenizer

    tokenizer = load_tokenizer(converted_dir(bundled_model_path()))
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    rng = np.random.default_rng(0)
    prompts += [rng.integers(100, 40000, 200).tolist() for _ in range(args.random_prompts)]
    reference = generate("", prompts, args.max_tokens)
    report = []
    for setting in args.settings:
        got = generate(setting, prompts, args.max_tokens)
        first_diff = [next((i for i, (a, b) in enumerate(zip(r[0], g[0], strict=True)) if a != b), None)
                      for r, g in zip(reference, got, strict=True)]
        # logprob error: the same token's log-probability under both, at the positions before the first
        # difference (where both have the same context)
        errors = [abs(a - b) for r, g, d in zip(reference, got, first_diff, strict=True)
                  for a, b in list(zip(r[1], g[1], strict=True))[: d if d is not None else args.max_tokens]]
        differing = [d for d in first_diff if d is not None]
        same_tokens = sum(d if d is not None else args.max_tokens for d in first_diff)
        row = {"setting": setting, "prompts": len(prompts), "identical": len(prompts) - len(differing),
               "tokens_before_first_difference": same_tokens / (len(prompts) * args.max_tokens),
               "median_first_difference": statistics.median(differing) if differing else None,
               "mean_abs_logprob_error": statistics.fmean(errors) if errors else None,
               "max_abs_logprob_error": max(errors) if errors else None}
        report.append(row)
        print(f"{setting}: {row['identical']} of {len(prompts)} generations identical to float32's "
              f"({args.max_tokens} tokens each); {100 * row['tokens_before_first_difference']:.1f}% of tokens "
              f"before the first difference; median first difference at token {row['median_first_difference']}; "
              f"logprob error of the same token mean {row['mean_abs_logprob_error']:.4f}, "
              f"max {row['max_abs_logprob_error']:.4f}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
