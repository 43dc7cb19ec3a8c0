"""What a GPU compile costs, and what XLA's flags change: one engine per flag set, each in a fresh process.

Each child builds an engine on a small ladder (the 2,048-token mixed bucket and the 1-, 64- and 256-row
decode buckets with their greedy variants), with random weights and no persistent cache, and reports the
seconds to load the weights, to compile (warm-up), and the TPOT of greedy waves at 1, 64 and 256
sequences, so a flag that makes compiles cheaper is seen together with what it does to the step where
launches matter most (one sequence) and least (256).

    python benchmarks/gpu_compile_probe.py --model DIR --out OUT            # on a GPU
    python benchmarks/gpu_compile_probe.py --model DIR --out OUT --cpu      # here: tiny levels, same code
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLAG_SETS = {
    "default": "",
    "no-triton-gemm": "--xla_gpu_enable_triton_gemm=false",
    "autotune-0": "--xla_gpu_autotune_level=0",
    # each compile's kernels through LLVM and ptxas on XLA's thread pool, not one after another (a deviceless
    # compile's backend is ~3/4 of it, 149 kernels for GPT-2's step, each compiled alone: docs/benchmarks.md)
    "parallel-llvm": "--xla_gpu_enable_llvm_module_compilation_parallelism=true",
}
LADDER = """
buckets:
  token_buckets: [{tokens}]
  request_buckets: {levels}
  greedy_decodes: true
scheduler:
  max_num_seqs: {reqs}
  max_num_batched_tokens: {tokens}
  async_scheduling: true
cache:
  page_size: 16
  num_kv_pages: {pages}
"""


def child(model: str, tokens: int, levels: tuple[int, ...], input_len: int, output_len: int) -> dict:
    import numpy as np

    from jaxserve.bench.offline import run_wave
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    reqs = max(levels)
    pages = reqs * -(-(input_len + output_len) // 16) + 16
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(LADDER.format(tokens=tokens, levels=list(levels), reqs=reqs, pages=pages))
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig.from_preset(Path(f.name), model=model, load_format="dummy",
                                                compilation_cache_dir=""))
    startup = time.perf_counter() - start
    rng = np.random.default_rng(0)
    run_wave(engine, 1, input_len, 4, rng)
    waves = [run_wave(engine, level, input_len, output_len, rng) for level in levels]
    engine.shutdown()
    return {"startup_s": round(startup, 1), "warmup_s": round(engine.warmup_seconds, 1),
            "tpot_ms": {str(w.concurrency): round(w.mean_tpot_ms, 3) for w in waves},
            "out_tok_s": {str(w.concurrency): round(w.output_tokens_per_s) for w in waves}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--sets", nargs="+", default=list(FLAG_SETS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, nargs="+", default=[60.0],
                        help="per flag set, in --sets' order (the last one for the rest)")
    args = parser.parse_args()
    tokens, levels, input_len, output_len = (64, (1, 4), 16, 8) if args.cpu else (2048, (1, 64, 256), 128, 64)
    if args.child:
        print(json.dumps(child(args.model, tokens, levels, input_len, output_len)), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, name in enumerate(args.sets):
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + FLAG_SETS[name]).strip())
        command = [sys.executable, __file__, "--model", args.model, "--out", str(args.out), "--child"]
        command += ["--cpu"] if args.cpu else []
        began = time.perf_counter()
        with open(args.out / f"compile_probe_{name}.log", "w") as log:
            try:
                done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                      timeout=args.timeout[min(i, len(args.timeout) - 1)])
                row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
                    "error": f"exit {done.returncode}"}
            except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as e:
                row = {"error": type(e).__name__}
        rows.append({"flags": name, "process_s": round(time.perf_counter() - began, 1), **row})
        print(json.dumps(rows[-1]), flush=True)
        (args.out / "compile_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
