"""k-step decodes synchronous against overlapped (async scheduling), side by side on one engine.

The same engine runs `bench offline`-style waves with `Scheduler.overlap_decode_steps` off, then on, in
alternating rounds, so both see the same compiled steps and the same machine state. On a CPU the host and
the "device" share cores; the figure that matters is a GPU's (`scripts/gpu_check.sh profile` measures the
step's idle device time there).

    python benchmarks/overlapped_decode_steps.py [--model DIR] [--ladder YAML] [--concurrency 1 4] [--rounds 2]
"""

import argparse
from pathlib import Path

import numpy as np

from jaxserve.bench.offline import run_wave
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.platform import prepare_jax_platform


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a bundled shape or a model directory")
    parser.add_argument("--ladder", type=Path, default=Path(__file__).with_name("gpu_check_ladder.yaml"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    prepare_jax_platform()
    engine = LLMEngine(EngineConfig.from_preset(args.ladder, model=args.model, load_format="dummy",
                                                compilation_cache_dir=""))
    if engine.runner.num_decode_steps < 2:
        raise SystemExit(f"{args.ladder} runs single decode steps: give a ladder with num_scheduler_steps > 1")
    rng = np.random.default_rng(0)
    run_wave(engine, 1, args.input_len, 8, rng)  # every code path once before timing
    print("| round | k-step calls | sequences | out tok/s | TPOT ms | TTFT ms |\n|---|---|---|---|---|---|")
    for round_ in range(args.rounds):
        for overlap in (False, True):
            engine.scheduler.overlap_decode_steps = overlap
            for concurrency in args.concurrency:
                wave = run_wave(engine, concurrency, args.input_len, args.output_len, rng)
                print(f"| {round_} | {'overlapped' if overlap else 'synchronous'} | {concurrency} "
                      f"| {wave.output_tokens_per_s:.1f} | {wave.mean_tpot_ms:.2f} | {wave.mean_ttft_ms:.1f} |",
                      flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
