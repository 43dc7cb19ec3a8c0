"""What a GPU compile costs, and what XLA's flags change: one engine per flag set, each in a fresh process.

Each child builds an engine on a two-rung ladder (the 2,048-token mixed bucket and the 256-row decode
bucket with its greedy variant), with random weights and no persistent cache, and reports the seconds to
load the weights, to compile (warm-up), and the TPOT of a 256-sequence greedy wave, so a flag that makes
compiles cheaper is seen together with what it does to the step.

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
}
LADDER = """
buckets:
  token_buckets: [{tokens}]
  request_buckets: [{reqs}]
  greedy_decodes: true
scheduler:
  max_num_seqs: {reqs}
  max_num_batched_tokens: {tokens}
  async_scheduling: true
cache:
  page_size: 16
  num_kv_pages: {pages}
"""


def child(model: str, tokens: int, reqs: int, input_len: int, output_len: int) -> dict:
    import numpy as np

    from jaxserve.bench.offline import run_wave
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    pages = reqs * -(-(input_len + output_len) // 16) + 16
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(LADDER.format(tokens=tokens, reqs=reqs, pages=pages))
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig.from_preset(Path(f.name), model=model, load_format="dummy",
                                                compilation_cache_dir=""))
    startup = time.perf_counter() - start
    rng = np.random.default_rng(0)
    run_wave(engine, 1, input_len, 4, rng)
    wave = run_wave(engine, reqs, input_len, output_len, rng)
    engine.shutdown()
    return {"startup_s": round(startup, 1), "warmup_s": round(engine.warmup_seconds, 1),
            "tpot_ms": round(wave.mean_tpot_ms, 3), "out_tok_s": round(wave.output_tokens_per_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--sets", nargs="+", default=list(FLAG_SETS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=60.0, help="per flag set")
    args = parser.parse_args()
    tokens, reqs, input_len, output_len = (64, 4, 16, 8) if args.cpu else (2048, 256, 128, 64)
    if args.child:
        print(json.dumps(child(args.model, tokens, reqs, input_len, output_len)), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.sets:
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + FLAG_SETS[name]).strip())
        command = [sys.executable, __file__, "--model", args.model, "--out", str(args.out), "--child"]
        command += ["--cpu"] if args.cpu else []
        began = time.perf_counter()
        with open(args.out / f"compile_probe_{name}.log", "w") as log:
            try:
                done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                      timeout=args.timeout)
                row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
                    "error": f"exit {done.returncode}"}
            except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as e:
                row = {"error": type(e).__name__}
        rows.append({"flags": name, "process_s": round(time.perf_counter() - began, 1), **row})
        print(json.dumps(rows[-1]), flush=True)
        (args.out / "compile_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
