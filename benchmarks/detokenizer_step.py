"""The frontend's per-token detokenizer cost (`IncrementalDetokenizer.add_token`, a stop string armed), this
checkout's against a git revision's, alternating in one process: microseconds per token and their ratio.

    python -m benchmarks.detokenizer_step --rev 1d71ff9 --tokenizer path/to/model_dir
"""

import argparse
import importlib.util
import statistics
import subprocess
import tempfile
import time

from transformers import AutoTokenizer

from jaxserve.engine import detokenizer as current
from jaxserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", required=True, help="the git revision to compare with")
    parser.add_argument("--tokenizer", required=True, help="a folder holding a fast tokenizer")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    source = subprocess.run(["git", "show", f"{args.rev}:jaxserve/engine/detokenizer.py"], check=True,
                            capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(source)
        f.flush()
        spec = importlib.util.spec_from_file_location("detokenizer_then", f.name)
        then = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(then)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 400)[:4096]
    params = SamplingParams(max_tokens=5000, stop=["zzz-never"])

    def per_token_us(module) -> float:
        detokenizer = module.IncrementalDetokenizer.for_prompt(tokenizer, ids[:5], params)
        start = time.perf_counter()
        for token_id in ids:
            detokenizer.add_token(token_id)
        return (time.perf_counter() - start) / len(ids) * 1e6

    times: dict[str, list[float]] = {args.rev: [], "this checkout": []}
    for _ in range(args.rounds):
        times[args.rev].append(per_token_us(then))
        times["this checkout"].append(per_token_us(current))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name}: {median:.3f} us/token")
    print(f"ratio: {medians['this checkout'] / medians[args.rev]:.3f}")


if __name__ == "__main__":
    main()
