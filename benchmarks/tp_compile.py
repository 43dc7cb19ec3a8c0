"""The step of a model compiled for one GPU and split over a node of them, side by side, without a GPU.

For a few buckets of the `gpu` ladder: compile seconds, per-device argument and temp memory, the
collectives XLA put in the step, and the KV pages each layout leaves room for.

    python benchmarks/tp_compile.py --model llama-3-8b --target h100 --tp 1 8 --json docs/compile/llama-3-8b-tp.json
"""

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from jaxserve.device import use_cpu_platform

MIB, GIB = 2**20, 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--buckets", nargs="+", default=["1x1d", "256x256d", "2048x256"],
                        help="TOKENSxREQS, with a trailing d for decode-only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    use_cpu_platform()
    from jaxserve.compile_ladder import compile_ladder
    from jaxserve.runner.buckets import Bucket

    buckets = []
    for text in args.buckets:
        tokens, reqs = text.rstrip("d").split("x")
        buckets.append(Bucket(int(tokens), int(reqs), decode_only=text.endswith("d")))
    reports = []
    print("| TP | bucket | compile s | weights GiB/device | args GiB/device | temp MiB/device | collectives "
          "| KV pages (16 tokens) |")
    print("|---|---|---|---|---|---|---|---|")
    for tp in args.tp:
        report = compile_ladder(args.model, target=args.target, preset="gpu", dtype="bfloat16", xla_cost=False,
                                variants=False, buckets=buckets, tensor_parallel_size=tp)
        reports.append(asdict(report))
        for b in report.buckets:
            kind = " decode" if b.decode_only else ""
            collectives = ", ".join(f"{n} {k}" for k, n in b.collectives.items()) or "none"
            print(f"| {tp} | {b.num_tokens}x{b.num_reqs}{kind} | {b.compile_seconds:.1f} | "
                  f"{report.weights_bytes / GIB:.2f} | {b.argument_bytes / GIB:.1f} | {b.temp_bytes / MIB:.0f} | "
                  f"{collectives} | {report.num_kv_pages:,} |", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(reports, indent=2, default=str))


if __name__ == "__main__":
    main()
