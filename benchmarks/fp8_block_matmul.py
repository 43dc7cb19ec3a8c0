"""Block-scaled FP8 weights (DeepSeek-V3's and most released FP8 checkpoints' 128 x 128 blocks) against 16-bit
and per-channel FP8 weights: one layer's products at decode and small mixed-step row counts.

Eight ways to multiply [rows, K] bfloat16 activations by a [K, N] weight, each through `layers.dense` as a
step runs it on a CUDA GPU (one row padded to two):
- `bf16`: a 16-bit weight (XLA's GEMM);
- `fp8 channel`: e4m3 values with a scale per output channel (`--quantization fp8`: XLA fuses the widening
  into its GEMM, the scale after it), 16-bit activations (JAXSERVE_FP8_ACTIVATIONS=0);
- `fp8 channel w8a8`: the same weight with the activations rounded to e4m3 as well, a scale per token, as a
  GPU with FP8 tensor cores runs steps of `quantization.W8A8_MIN_ROWS` rows or more (fewer rows: as above);
- `fp8 block xla`: e4m3 values with block scales, widened and scaled by XLA, which writes the widened
  weight and reads it back (what a GPU without the kernel runs: an A100's dispatch);
- `fp8 block kernel`: the same weight through `ops.fp8_block_matmul`'s Triton kernel, 16-bit activations;
- `fp8 block w8a8`: the same kernel with the activations rounded to e4m3, a scale per token and block of 128
  columns, from `quantization.W8A8_MIN_ROWS` rows (fewer rows: as above). Ada runs large steps so; a Hopper
  GPU only with JAXSERVE_FP8_ACTIVATIONS=1, as this case runs it there, to measure its float16 MMAs
  (`AttentionConfig.fp8_block_activations`);
- `fp8 block mosaic`: the same weight stored K-major (`models/fp8_layout.py`, JAXSERVE_MOSAIC_FP8_BLOCK=1), as a
  Hopper step runs it: from `quantization.W8A8_MIN_ROWS` rows, activations rounded to e4m3 as for `fp8 block
  w8a8` on `ops.fp8_block_matmul_mgpu`'s Mosaic GPU kernel (Hopper's FP8 wgmma); fewer rows through the Triton
  kernel reading the K-major values. Hopper targets and GPUs only (jaxlib 0.10 and 0.11 compile its kernel only
  on a GPU, so deviceless figures there leave its kernel out of the compile, not out of the roofline);
- `fp8 block mosaic side by side`: the same kernel, called directly, its two consumers walking the stages side by
  side rather than taking turns on the tensor cores (`ping_pong=False`), at `W8A8_MIN_ROWS` rows or more: what
  the ping-pong schedule gains.

Without a GPU (the default on a CPU), each is compiled deviceless for `--target` and the script reports what
the executable moves: its arguments and output read or written once, its temporaries written and read once,
and the roofline: the longer of that traffic at the target's memory bandwidth and the product's flops at its
tensor-core peak for the operands' dtype (FP8 for `w8a8` where it applies, else bfloat16). On a GPU it times
each (the median of `--iters` calls) and reports the achieved bandwidth of the ideal traffic (the weight, its
scales, the activations and the output, each once) and the achieved TFLOP/s, as fractions of the device's.

    python benchmarks/fp8_block_matmul.py --json docs/fp8_block_matmul.json   # deviceless, for an H100
    python benchmarks/fp8_block_matmul.py --rows 1 64 --models llama-3-8b       # on a GPU: timed
    python benchmarks/fp8_block_matmul.py --models llama-3-8b --rows 256 2048 --impls bf16 "fp8 channel" \
        "fp8 channel w8a8"                                                      # activations in FP8 or not
    python benchmarks/fp8_block_matmul.py --target l40s --rows 16 256 2048 --impls bf16 "fp8 block xla" \
        "fp8 block kernel" "fp8 block w8a8"                                     # block weights on Ada
"""

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.fp8_layout import k_major
from jaxserve.models.layers import dense
from jaxserve.models.quantization import FP8, W8A8_MIN_ROWS, Fp8Weight, activations_in_fp8, quantize_fp8, quantize_rows
from jaxserve.ops.attention import AttentionConfig, cuda_compute_capability
from jaxserve.ops.fp8_block_matmul import FP8_MMA_COMPUTE_CAPABILITIES
from jaxserve.ops.fp8_block_matmul_mgpu import fp8_block_matmul_mgpu

BLOCK = 128
# One layer's dense products [K, N] by model (their HF checkpoints' FP8 releases use blocks of 128 x 128).
SHAPES = {
    "llama-3-8b": {"q, o": (4096, 4096), "k, v": (4096, 1024), "gate, up": (4096, 14336), "down": (14336, 4096)},
    "deepseek-v3": {"q_a": (7168, 1536), "kv_a": (7168, 576), "q_b": (1536, 24576), "o": (16384, 7168),
                    "shared gate, up": (7168, 2048), "shared down": (2048, 7168)},
}
IMPLS = ("bf16", "fp8 channel", "fp8 channel w8a8", "fp8 block xla", "fp8 block kernel", "fp8 block w8a8",
         "fp8 block mosaic", "fp8 block mosaic side by side")
# The environment while an impl traces (JAXSERVE_FP8_ACTIVATIONS, JAXSERVE_MOSAIC_FP8_BLOCK); the others' as the
# GPU would run them
ENVIRONMENT = {"fp8 channel": {"JAXSERVE_FP8_ACTIVATIONS": "0"}, "fp8 block kernel": {"JAXSERVE_FP8_ACTIVATIONS": "0"},
               "fp8 block w8a8": {"JAXSERVE_FP8_ACTIVATIONS": "1"},
               "fp8 block mosaic": {"JAXSERVE_FP8_ACTIVATIONS": "1", "JAXSERVE_MOSAIC_FP8_BLOCK": "1"}}
HOPPER_ONLY = ("fp8 block mosaic", "fp8 block mosaic side by side")


def runs(impl: str, rows: int, attention: AttentionConfig) -> bool:
    """Whether `impl` is timed or compiled at `rows` for `attention`'s GPU: the Mosaic GPU kernel on Hopper only,
    and called directly (side by side) only where a step would take it."""
    if impl in HOPPER_ONLY and not attention.hopper:
        return False
    return impl != "fp8 block mosaic side by side" or rows >= W8A8_MIN_ROWS


def operands(impl: str, rows: int, k: int, n: int, concrete: bool, sharding=None):
    """(x, weight) for `impl`: random arrays on the default device, or ShapeDtypeStructs for a compile."""
    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.bfloat16) if concrete else struct((rows, k), jnp.bfloat16)
    if impl == "bf16":
        w = jnp.asarray(rng.normal(size=(k, n)) * 0.02, jnp.bfloat16) if concrete else struct((k, n), jnp.bfloat16)
    elif impl.startswith("fp8 channel"):
        w = (quantize_fp8(jnp.asarray(rng.normal(size=(k, n)) * 0.02, jnp.float32), 1) if concrete else
             Fp8Weight(struct((k, n), jnp.float8_e4m3fn), struct((n,), jnp.float32), contracted=1))
    elif concrete:
        values = jnp.asarray(rng.normal(size=(k, n)) * 60, jnp.float32).astype(jnp.float8_e4m3fn)
        w = Fp8Weight(values, jnp.asarray(rng.uniform(1e-4, 1e-3, (k // BLOCK, n)), jnp.float32), 1, BLOCK)
    else:
        w = Fp8Weight(struct((k, n), jnp.float8_e4m3fn), struct((k // BLOCK, n), jnp.float32), 1, BLOCK)
    return x, k_major(w) if impl.startswith("fp8 block mosaic") else w


@contextlib.contextmanager
def environment(settings: dict[str, str]) -> Iterator[None]:
    """The variables in `settings` set while a product traces (`AttentionConfig.fp8_activations`,
    `fp8_block_mosaic`); the others as they are."""
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def product(impl: str, attention: AttentionConfig):
    """The step's product for `impl`; XLA's block path as a GPU without the kernel dispatches it; activations in
    16 bits or e4m3 as `ENVIRONMENT` says, else as the GPU runs them (`fp8 channel w8a8`)."""
    if impl == "fp8 block mosaic side by side":
        sms = {"num_sms": attention.num_sms} if attention.num_sms else {}  # as the step's dispatch passes it
        return lambda x, w: fp8_block_matmul_mgpu(*quantize_rows(x, BLOCK), w.values, w.scale, BLOCK,
                                                  out_dtype=x.dtype, ping_pong=False, **sms)
    if impl == "fp8 block xla":
        attention = dataclasses.replace(attention, compute_capability=8.0)
        assert attention.fp8_block_kernel is None

    def run(x: jax.Array, w: Any) -> jax.Array:
        with environment(ENVIRONMENT.get(impl, {})):  # read as it traces
            return dense(x, w, attention)
    return run


def ideal_bytes(impl: str, rows: int, k: int, n: int) -> int:
    weight = 2 * k * n if impl == "bf16" else k * n + 4 * n if impl.startswith("fp8 channel") else (
        k * n + 4 * (k // BLOCK) * n)
    return weight + 2 * rows * (k + n)


def matmul_dtype(impl: str, rows: int, w: Any, attention: AttentionConfig) -> str:
    """The dtype whose tensor-core peak bounds `impl`'s product: e4m3 where its activations are rounded to it."""
    with environment(ENVIRONMENT.get(impl, {})):
        fp8 = impl.endswith(("w8a8", "mosaic")) and activations_in_fp8(rows, w, attention)
    fp8 = fp8 or impl == "fp8 block mosaic side by side"
    # forced onto a GPU whose Triton widens e4m3 dots to float16 (Hopper): the 16-bit rate at best
    widened = impl == "fp8 block w8a8" and attention.compute_capability not in FP8_MMA_COMPUTE_CAPABILITIES
    return jnp.dtype(FP8).name if fp8 and not widened else "bfloat16"


def deviceless(models: list[str], rows_list: list[int], target: str, impls: list[str]) -> list[dict]:
    from jaxserve.device import deviceless_device, target_facts
    from jaxserve.parallel import on_one_device

    device = deviceless_device(target)
    facts = target_facts(target)
    attention = AttentionConfig("pallas", num_sms=facts.num_sms, compute_capability=facts.compute_capability)
    results = []
    for model in models:
        for name, (k, n) in SHAPES[model].items():
            for rows in rows_list:
                for impl in impls:
                    if not runs(impl, rows, attention):
                        continue
                    x, w = operands(impl, rows, k, n, concrete=False, sharding=on_one_device(device))
                    with jax.default_device(device):
                        compiled = jax.jit(product(impl, attention)).trace(x, w).lower().compile()
                    memory = compiled.memory_analysis()
                    moved = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                             + 2 * memory.temp_size_in_bytes)
                    peak = facts.peak_flops_for(matmul_dtype(impl, rows, w, attention))
                    roofline = max(moved / facts.memory_bandwidth, 2 * rows * k * n / peak)
                    results.append({"model": model, "weight": name, "k": k, "n": n, "rows": rows, "impl": impl,
                                    "temp_bytes": memory.temp_size_in_bytes, "moved_bytes": moved,
                                    "roofline_us": roofline * 1e6, "target": target})
                    print(json.dumps(results[-1]), flush=True)
    return results


def timed(models: list[str], rows_list: list[int], iters: int, impls: list[str]) -> list[dict]:
    from jaxserve.device import local_facts

    facts = local_facts()
    attention = AttentionConfig("pallas", num_sms=facts.num_sms, compute_capability=cuda_compute_capability())
    device = jax.devices()[0]
    results = []
    for model in models:
        for name, (k, n) in SHAPES[model].items():
            for rows in rows_list:
                for impl in impls:
                    if not runs(impl, rows, attention):
                        continue
                    x, w = operands(impl, rows, k, n, concrete=True)
                    fn = jax.jit(product(impl, attention))
                    try:  # a kernel this jax cannot build for this GPU ends its own rows only
                        jax.block_until_ready(fn(x, w))
                    except Exception as e:
                        results.append({"model": model, "weight": name, "rows": rows, "impl": impl,
                                        "error": f"{type(e).__name__}: {str(e)[:300]}"})
                        print(json.dumps(results[-1]), flush=True)
                        continue
                    times = []
                    for _ in range(iters):
                        start = time.perf_counter()
                        jax.block_until_ready(fn(x, w))
                        times.append(time.perf_counter() - start)
                    seconds = statistics.median(times)
                    bandwidth = ideal_bytes(impl, rows, k, n) / seconds
                    flops = 2 * rows * k * n / seconds
                    peak = facts.peak_flops_for(matmul_dtype(impl, rows, w, attention))
                    results.append({"model": model, "weight": name, "k": k, "n": n, "rows": rows, "impl": impl,
                                    "us": seconds * 1e6, "tb_per_s": bandwidth / 1e12,
                                    "of_peak": bandwidth / facts.memory_bandwidth if facts.memory_bandwidth else None,
                                    "tflops": flops / 1e12, "of_flops_peak": flops / peak if peak else None,
                                    "device": device.device_kind})
                    print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 256])
    parser.add_argument("--target", default="h100", help="deviceless compiles' target (without a GPU)")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per case (on a GPU)")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    results = (timed(args.models, args.rows, args.iters, args.impls) if on_gpu
               else deviceless(args.models, args.rows, args.target, args.impls))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
