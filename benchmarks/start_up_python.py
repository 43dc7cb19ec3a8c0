"""Two parts of a start that are Python rather than XLA, each timed in fresh processes, this tree's way and
the way of a tree named by `--before` (its checkout, put first on the path), side by side:

- `gguf`: the first load of a GGUF that is not the bundled one (the bundled file with bytes appended, so
  its conversion is not shipped): transformers reads its config and tokenizer, jaxserve its head size and
  weights. `load_model` with an empty jaxserve cache.
- `collector`: an in-process engine on the bundled model with the `cpu` preset, every bucket warmed up
  from a filled persistent cache (a warm start's tracing and lowering), with the time the cyclic garbage
  collector took in each generation.
- `sizing`: the same engine sized as on a GPU: a GPU's memory statistics stood in (a 2 GiB pool of which
  the weights use what they take here), so the KV cache is sized by compiles of the largest buckets
  (`runner/kv_sizing.py`); the sizing's time on a warm start, every compile a persistent-cache hit, and
  the engine's. On a GPU a hit also compiles the step's Mosaic GPU kernels again; not here.
- `loading`: the `sizing` engine on `--model` (default: the bundled model, dequantized), cold (an empty
  persistent cache) and warm: where the weights load beside the sizing's compiles, and where they do not.

    python benchmarks/start_up_python.py --before /tmp/before --runs 2
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_GGUF = """
import json, sys, time
from jaxserve.models.loader import load_model
start = time.perf_counter()
load_model(sys.argv[1], dtype="float32")
print(json.dumps({"load_s": round(time.perf_counter() - start, 2)}))
"""

_COLLECTOR = """
import gc, json, sys, time
spent, started = {}, {}
def timed(phase, info):
    if phase == "start":
        started["at"] = time.perf_counter()
    else:
        n, t = spent.get(info["generation"], (0, 0.0))
        spent[info["generation"]] = (n + 1, t + time.perf_counter() - started["at"])
from jaxserve import LLM
gc.callbacks.append(timed)
start = time.perf_counter()
LLM(config="cpu", compilation_cache_dir=sys.argv[1], warmup_mode="full")
print(json.dumps({"engine_s": round(time.perf_counter() - start, 2),
                  "collections": {g: [n, round(t, 2)] for g, (n, t) in sorted(spent.items())}}))
"""

_SIZING = """
import json, sys, time
from jaxserve import LLM
from jaxserve.runner import model_runner
pool = 2 * 2**30
model_runner.device_memory_stats = lambda device: {"bytes_limit": pool, "bytes_in_use": 300 * 2**20}
size, spent = model_runner.size_kv_cache, []
def timed(*args, **kwargs):
    start = time.perf_counter()
    sized = size(*args, **kwargs)
    spent.append((time.perf_counter() - start, sized.budget.num_pages))
    return sized
model_runner.size_kv_cache = timed
start = time.perf_counter()
LLM(sys.argv[2] or None, config="cpu", compilation_cache_dir=sys.argv[1], warmup_mode="full",
    gpu_memory_utilization=0.9, quantization=sys.argv[3] or None)
print(json.dumps({"engine_s": round(time.perf_counter() - start, 2), "sizing_s": round(spent[0][0], 2),
                  "pages": spent[0][1]}))
"""


def _run(code: str, tree: Path, *args: str, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **env, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}, cwd=tree)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the version to compare with")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--parts", nargs="+", default=["gguf", "collector"],
                        choices=["gguf", "collector", "sizing", "loading"])
    parser.add_argument("--model", default="", help="the `loading` part's --model (default: the bundled one)")
    args = parser.parse_args()
    from jaxserve.models.loader import bundled_model_path

    trees = {"before": args.before.resolve(), "after": Path(__file__).resolve().parents[1]}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        other = scratch / "other.gguf"
        shutil.copyfile(bundled_model_path(), other)
        with other.open("ab") as f:
            f.write(bytes(64))
        caches = {name: scratch / f"xla-{name}" for name in trees}
        for run in range(args.runs):
            for name, tree in trees.items():  # side by side, alternating
                result: dict = {"run": run, "tree": name}
                if "gguf" in args.parts:
                    empty = tempfile.mkdtemp(dir=scratch)
                    result["gguf"] = _run(_GGUF, tree, str(other), env={"JAXSERVE_CACHE_DIR": empty})
                if "collector" in args.parts:
                    if run == 0:  # fills the persistent cache: every later start is warm
                        _run(_COLLECTOR, tree, str(caches[name]), env={})
                    result["collector"] = _run(_COLLECTOR, tree, str(caches[name]), env={})
                if "sizing" in args.parts:
                    sized_cache = str(caches[name]) + "-sized"
                    fraction = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
                    if run == 0:
                        result["sizing_cold"] = _run(_SIZING, tree, sized_cache, "", "", env=fraction)
                    result["sizing"] = _run(_SIZING, tree, sized_cache, "", "", env=fraction)
                if "loading" in args.parts:
                    empty = tempfile.mkdtemp(dir=scratch)  # a cold start, then a warm one on its cache
                    fraction = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
                    result["loading_cold"] = _run(_SIZING, tree, empty, args.model, "", env=fraction)
                    result["loading_warm"] = _run(_SIZING, tree, empty, args.model, "", env=fraction)
                print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
