"""The native bfloat16 matmul (`cpu_kernels.matmul_bf16`) and the native GGUF matmul on Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS blocks (`cpu_kernels.matmul_gguf`, float32 activations) against
XLA:CPU's float32 and bfloat16 dots.

SmolLM2-135M's shapes (`--shapes smollm2`, whose widths are not whole K-quant super-blocks) or Qwen3-30B-A3B's
dense ones (`--shapes qwen3-30b-a3b`) at 1, 4, 16 and 64 rows: the attention and MLP projections (weights
[K, N]) and the LM head (the [V, D] embedding table). The K-quants' and IQ4 formats' blocks are random bytes
with float16 scales of a real file's size (the gguf package does not quantize to them): the kernel's work does not
depend on the values. Each case runs `--copies` different weight matrices back to back in
one jitted function, each call taking the one before's output (as a model's layers do, so that XLA does not
run them at once), so that the weights come from memory as in a served step (64 copies of a 576 x 1536
matrix are 113 MB in bfloat16, past a 32 MB L3), and reports the median time per matrix over alternating
rounds, with GFLOP/s and the weights' GB/s.

    python benchmarks/cpu_matmul.py --rows 1 4 8 16 64 512 --rounds 3
    python benchmarks/cpu_matmul.py --impls "xla float32" "native bfloat16" "native Q4_1" "native Q8_0"
    python benchmarks/cpu_matmul.py --shapes qwen3-30b-a3b --impls "native bfloat16" "native Q8_0" "native Q4_K" \
        "native Q6_K" --rows 1 4 16 --copies 8
"""

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from jaxserve.ops import cpu_kernels, gguf_packing
from jaxserve.platform import prepare_jax_platform

SHAPES = {  # name -> (K, N, output-major weights)
    "smollm2": {
        "q/o proj 576x576": (576, 576, False),
        "k/v proj 576x192": (576, 192, False),
        "gate/up 576x1536": (576, 1536, False),
        "down 1536x576": (1536, 576, False),
        "LM head 49152x576": (576, 49152, True),
    },
    "qwen3-30b-a3b": {
        "q proj 2048x4096": (2048, 4096, False),
        "k/v proj 2048x512": (2048, 512, False),
        "o proj 4096x2048": (4096, 2048, False),
        "LM head 151936x2048": (2048, 151936, True),
    },
}
DEFAULT_IMPLS = ("xla float32", "xla bfloat16", "native bfloat16", "native Q4_0", "native Q4_1", "native Q8_0")
IMPLS = (*DEFAULT_IMPLS, *(f"native {kind}" for kind in ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                                                         "Q6_K", "IQ4_NL", "IQ4_XS")))
GGUF_KINDS = {impl: kind for impl in IMPLS if (kind := impl.removeprefix("native ")) in cpu_kernels.GGUF_KINDS}
GGUF_BYTES = {  # bytes per weight, from the gguf package's (weights, bytes) per block
    impl: GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1] / GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
    for impl, kind in GGUF_KINDS.items()}
RANDOM_BLOCKS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
                 "IQ4_XS": (0,)}  # where their f16 scales lie in a block


def gguf_blocks(w: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:  # [N, K] -> u8[N, row bytes]
    if kind not in RANDOM_BLOCKS:
        return quantize(w, GGMLQuantizationType[kind])
    (weights, size), scales = GGML_QUANT_SIZES[GGMLQuantizationType[kind]], RANDOM_BLOCKS[kind]
    blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // weights, size), dtype=np.uint8)
    scale = np.full(blocks.shape[:2], 0.01, np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    for at in scales:
        blocks[..., at: at + 2] = scale
    return blocks.reshape(w.shape[0], -1)


def case_fn(impl: str, output_major: bool, n: int):
    def one(x, w):
        if impl in GGUF_BYTES:
            return cpu_kernels.matmul_gguf(x, w, impl.removeprefix("native "), n)
        if impl == "native bfloat16":
            return cpu_kernels.matmul_bf16(x, w, output_major_w=output_major)
        f32 = jnp.float32 if impl == "xla bfloat16" else None
        if output_major:
            return jnp.einsum("md,vd->mv", x, w, preferred_element_type=f32)
        return jnp.dot(x, w, preferred_element_type=f32)

    def chained(x, ws):  # each call waits for the one before, as a model's layers do
        for w in ws:
            x = x + (one(x, w)[:, :1] * 1e-30).astype(x.dtype)
        return x

    return jax.jit(chained)


def timed(fn, x, ws, reps: int) -> float:
    fn(x, ws).block_until_ready()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(x, ws).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / len(ws)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 512])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS))
    parser.add_argument("--shapes", choices=list(SHAPES), default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--copies", type=int, default=64, help="weight matrices per case (at most 8 for the head)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    prepare_jax_platform()  # the CPU, quietly: no CUDA plugin tracebacks on a machine without a GPU
    if (error := cpu_kernels.kernel_error()) is not None:
        raise SystemExit(f"the native kernels are unavailable: {error}")

    k_quants = [impl for impl in args.impls
                if impl in GGUF_KINDS and GGML_QUANT_SIZES[GGMLQuantizationType[GGUF_KINDS[impl]]][0] == 256]
    if k_quants and any(k % 256 for k, _, _ in SHAPES[args.shapes].values()):
        parser.error(f"{', '.join(k_quants)} need widths in whole super-blocks of 256: --shapes qwen3-30b-a3b")
    rng = np.random.default_rng(0)
    rows = []
    columns = " | ".join(f"{impl} us (GFLOP/s, GB/s)" for impl in args.impls)
    versus = "xla float32" in args.impls and any(impl.startswith("native") for impl in args.impls)
    print(f"| case | rows | {columns} |" + (" f32 / best native |" if versus else ""))
    print("|---|---|" + "---|" * (len(args.impls) + versus))
    for name, (k, n, output_major) in SHAPES[args.shapes].items():
        copies = min(args.copies, 8) if output_major else args.copies
        shape = (n, k) if output_major else (k, n)

        def weight(copy: int, shape: tuple[int, int] = shape) -> np.ndarray:  # each copy's float32 values, made
            return np.random.default_rng(copy).standard_normal(shape, np.float32) * 0.05  # where needed only

        weights32 = [jnp.asarray(weight(i)) for i in range(copies)] if "xla float32" in args.impls else []
        weights16 = [jnp.asarray(weight(i), jnp.bfloat16) for i in range(copies)
                     if {"xla bfloat16", "native bfloat16"} & set(args.impls)]
        blocks = {  # GGUF's blocks [N, K / 32 * bytes], packed 16 output features at a time for the kernel
            impl: [jnp.asarray(gguf_packing.pack(gguf_blocks(weight(i) if output_major else weight(i).T, kind, rng),
                                                 kind)) for i in range(copies)]
            for impl in args.impls if impl in GGUF_BYTES for kind in [impl.removeprefix("native ")]}
        for m in args.rows:
            x32 = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            fns = {impl: case_fn(impl, output_major, n) for impl in args.impls}
            seconds: dict[str, list[float]] = {impl: [] for impl in args.impls}
            for _ in range(args.rounds):  # alternating, so drift hits every implementation alike
                for impl in args.impls:
                    f32 = impl == "xla float32" or impl in GGUF_BYTES
                    ws = blocks[impl] if impl in GGUF_BYTES else weights32 if f32 else weights16
                    seconds[impl].append(timed(fns[impl], x32 if f32 else x32.astype(jnp.bfloat16), ws, args.reps))
            row = {"case": name, "rows": m}
            cells = []
            for impl in args.impls:
                t = float(np.median(seconds[impl]))
                nbytes = k * n * (4 if impl == "xla float32" else GGUF_BYTES.get(impl, 2))
                row[impl] = {"us": t * 1e6, "gflops": 2 * m * k * n / t / 1e9, "weight_gbps": nbytes / t / 1e9}
                cells.append(f"{t * 1e6:.1f} ({row[impl]['gflops']:.0f}, {row[impl]['weight_gbps']:.1f})")
            if versus:
                best_native = min(row[impl]["us"] for impl in args.impls if impl.startswith("native"))
                cells.append(f"{row['xla float32']['us'] / best_native:.2f}x")
            print(f"| {name} | {m} | " + " | ".join(cells) + " |", flush=True)
            rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
