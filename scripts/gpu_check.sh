#!/usr/bin/env bash
# One short GPU check (benchmarks/gpu_check.py): the decode-step profile and `bench offline` at 1, 64 and 256
# sequences for the GPT-2, Llama-3.2-1B and Llama-3-8B shapes with random weights, in at most ~6 minutes.
#
#   scripts/gpu_check.sh --prepare   # here, once: model directories (bundled shapes + SmolLM2's tokenizer) in
#                                    # .gpu_check/ and the wheels the GPU image lacks in .whl/ (both git-ignored)
#   scripts/gpu_check.sh             # on the GPU machine: writes gpu_check.json, gpu_check.md, gpu_check.log
#                                    # under $OUT (or ./gpu_check_out)
#   scripts/gpu_check.sh --cpu       # here: tiny shapes and levels, the same code, before spending GPU minutes
#
# The device tool sends the checkout along with the ignored paths named in its carry: .gpu_check and .whl.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-gpu}
out=${OUT:-$PWD/gpu_check_out}
shapes=(gpt2 llama-3.2-1b llama-3-8b)

if [[ $mode == --prepare ]]; then
  .venv/bin/python - "${shapes[@]}" smollm2-135m <<'PY'
import json, shutil, sys
from pathlib import Path
from jaxserve.model_configs import bundled_config_values
from jaxserve.models.gguf_cache import converted_dir
from jaxserve.models.loader import bundled_model_path
from jaxserve.models.tokenizer import load_tokenizer

tokenizer = load_tokenizer(converted_dir(bundled_model_path()))
for name in sys.argv[1:]:
    directory = Path(".gpu_check") / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(bundled_config_values(name), indent=1))
    tokenizer.save_pretrained(directory)
    print(f"prepared {directory}")
PY
  if [[ -x ../shared/gpu/prepare-wheels.sh ]]; then ../shared/gpu/prepare-wheels.sh llguidance; fi
  du -sh .gpu_check .whl 2>/dev/null || true
  exit 0
fi

mkdir -p "$out"
if [[ $mode == --cpu ]]; then
  exec .venv/bin/python benchmarks/gpu_check.py --cpu --models .gpu_check/smollm2-135m --out "$out" \
    --ladder benchmarks/gpu_check_ladder.yaml 2> "$out/gpu_check.log"
fi

# On the GPU machine: its image lacks some of jaxserve's dependencies; install them from .whl, off the network.
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl
  export PYTHONPATH=$PWD/.site:$PWD
else
  export PYTHONPATH=$PWD
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$out/device.txt" 2>&1 || true
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$out/device.txt" 2>&1 || true
models=()
for s in "${shapes[@]}"; do models+=(".gpu_check/$s"); done
timeout 345 python3 benchmarks/gpu_check.py --models "${models[@]}" --out "$out" --budget-s 300 \
  2> "$out/gpu_check.log" || echo "gpu_check.py exited with $?"
tail -c 4000 "$out/gpu_check.log" | grep -v "^$" | tail -5
cat "$out/device.txt"
