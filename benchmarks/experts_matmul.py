"""A mixture's grouped matmul, 16-bit and FP8 experts (`Fp8Experts`), through XLA's ragged dot and through
`ops.grouped_matmul_triton`: one projection of one layer's experts at decode and mixed-step token counts.

Six ways to multiply a step's [tokens x top_k, K] sorted bfloat16 rows by experts [E, K, N], each through
`moe.grouped_matmul` as a step runs it on a CUDA GPU:
- `bf16`: 16-bit experts through XLA's ragged dot (every row against every expert through an f32[E, A, N]
  temporary; on Hopper, steps of many rows take the Mosaic GPU kernel instead, which this script does not
  time), what jaxserve ran before the Triton kernel;
- `bf16 kernel`: the same experts through the Triton kernel;
- `fp8 channel xla`, `fp8 block xla`: e4m3 experts with a scale per channel or per block of 128 contracted rows
  through the same ragged dot (per channel, XLA fuses the widening into it; blocks are widened and written
  out first): what runs with JAXSERVE_TRITON_EXPERTS=0 (an A100 sends widened block-scaled experts through
  the kernel as 16-bit ones);
- `fp8 channel kernel`, `fp8 block kernel`: the same experts through the Triton kernel.

Without a GPU (the default on a CPU), each is compiled deviceless for `--target` and the script reports what
the executable moves: its arguments (all the experts) and output read or written once, its temporaries written
and read once, and that traffic's time at the target's memory bandwidth (a bound, not a timing; the kernel
reads only the experts that have rows, which this count does not see). On a GPU it times each (the median of
`--iters` calls) over a random routing and reports the bandwidth of the ideal traffic (the experts that have
rows, their scales, the rows and the output, each once) as a fraction of the device's.

    python benchmarks/experts_matmul.py --json docs/experts_matmul.json   # deviceless, for an H100
    python benchmarks/experts_matmul.py --tokens 1 16 64                  # on a GPU: timed
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.moe import grouped_matmul
from jaxserve.models.quantization import Fp8Experts, quantize_experts

BLOCK = 128
# (experts, routed a token, {projection: (K, N)}): one device's experts
SHAPES = {
    "qwen3-30b-a3b": (128, 8, {"gate, up": (2048, 768), "down": (768, 2048)}),
    "deepseek-v3 tp8": (256, 8, {"gate, up": (7168, 256), "down": (256, 7168)}),  # each expert's width / 8
    "mixtral-8x7b": (8, 2, {"w1, w3": (4096, 14336), "w2": (14336, 4096)}),
}
IMPLS = ("bf16", "bf16 kernel", "fp8 channel xla", "fp8 channel kernel", "fp8 block xla", "fp8 block kernel")


def experts(impl: str, e: int, k: int, n: int, concrete: bool, sharding=None):
    """The experts for `impl`: random arrays on the default device, or ShapeDtypeStructs for a compile."""
    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    if concrete:
        w = jnp.asarray(np.random.default_rng(0).normal(size=(e, k, n)) * 0.02, jnp.bfloat16)
        return w if impl.startswith("bf16") else quantize_experts(w, BLOCK if "block" in impl else 0)
    if impl.startswith("bf16"):
        return struct((e, k, n), jnp.bfloat16)
    blocks = k // BLOCK if "block" in impl else 1
    return Fp8Experts(struct((e, k, n), jnp.float8_e4m3fn), struct((e, blocks, n), jnp.float32),
                      BLOCK if "block" in impl else k)


def product(impl: str):
    mode = "compiled" if impl.endswith("kernel") else None
    return lambda rows, w, sizes: grouped_matmul(rows, w, sizes, kernel=mode, fp8_kernel=mode)


def routing(tokens: int, e: int, top_k: int) -> np.ndarray:
    """i32[E]: rows an expert for a random top-k routing of `tokens` tokens."""
    rng = np.random.default_rng(tokens)
    chosen = np.stack([rng.choice(e, top_k, replace=False) for _ in range(tokens)]).reshape(-1)
    return np.bincount(chosen, minlength=e).astype(np.int32)


def ideal_bytes(impl: str, sizes: np.ndarray, k: int, n: int) -> int:
    touched = int((sizes > 0).sum())
    weight = 2 * k * n if impl.startswith("bf16") else k * n + 4 * n * (k // BLOCK if "block" in impl else 1)
    return touched * weight + 2 * int(sizes.sum()) * k + 4 * int(sizes.sum()) * n


def deviceless(models: list[str], tokens_list: list[int], target: str) -> list[dict]:
    from jaxserve.device import deviceless_device, target_facts
    from jaxserve.parallel import on_one_device

    device, facts = deviceless_device(target), target_facts(target)
    sharding = on_one_device(device)
    results = []
    for model in models:
        e, top_k, projections = SHAPES[model]
        for name, (k, n) in projections.items():
            for tokens in tokens_list:
                rows = jax.ShapeDtypeStruct((tokens * top_k, k), jnp.bfloat16, sharding=sharding)
                sizes = jax.ShapeDtypeStruct((e,), jnp.int32, sharding=sharding)
                for impl in IMPLS:
                    with jax.default_device(device):
                        compiled = jax.jit(product(impl)).trace(
                            rows, experts(impl, e, k, n, False, sharding), sizes).lower().compile()
                    memory = compiled.memory_analysis()
                    moved = memory.argument_size_in_bytes + memory.output_size_in_bytes + 2 * memory.temp_size_in_bytes
                    results.append({"model": model, "projection": name, "k": k, "n": n, "tokens": tokens,
                                    "impl": impl, "temp_bytes": memory.temp_size_in_bytes, "moved_bytes": moved,
                                    "roofline_us": moved / facts.memory_bandwidth * 1e6, "target": target})
                    print(json.dumps(results[-1]), flush=True)
    return results


def timed(models: list[str], tokens_list: list[int], iters: int) -> list[dict]:
    from jaxserve.device import local_facts

    facts, device = local_facts(), jax.devices()[0]
    results = []
    for model in models:
        e, top_k, projections = SHAPES[model]
        for name, (k, n) in projections.items():
            for tokens in tokens_list:
                sizes = routing(tokens, e, top_k)
                rows = jnp.asarray(np.random.default_rng(1).normal(size=(tokens * top_k, k)), jnp.bfloat16)
                for impl in IMPLS:
                    w = experts(impl, e, k, n, concrete=True)
                    fn = jax.jit(product(impl))
                    jax.block_until_ready(fn(rows, w, jnp.asarray(sizes)))
                    times = []
                    for _ in range(iters):
                        start = time.perf_counter()
                        jax.block_until_ready(fn(rows, w, jnp.asarray(sizes)))
                        times.append(time.perf_counter() - start)
                    seconds = statistics.median(times)
                    bandwidth = ideal_bytes(impl, sizes, k, n) / seconds
                    results.append({"model": model, "projection": name, "k": k, "n": n, "tokens": tokens,
                                    "impl": impl, "experts_with_rows": int((sizes > 0).sum()), "us": seconds * 1e6,
                                    "tb_per_s": bandwidth / 1e12,
                                    "of_peak": bandwidth / facts.memory_bandwidth if facts.memory_bandwidth else None,
                                    "device": device.device_kind})
                    print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 64, 256])
    parser.add_argument("--target", default="h100", help="deviceless compiles' target (without a GPU)")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per case (on a GPU)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    results = (timed(args.models, args.tokens, args.iters) if on_gpu
               else deviceless(args.models, args.tokens, args.target))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
