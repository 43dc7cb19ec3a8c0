"""Packing a GGUF file's blocks for the native CPU matmul (`ops/gguf_packing.pack`), per format, at a model's
shapes, on random blocks (packing moves bytes and bits; their values do not change its cost).

Every start that keeps a GGUF file's blocks packs each kept tensor once, on the host, before the first step,
so for a large file this is start-up time a user waits for. Runs whatever `jaxserve` is importable, so two
trees compare side by side:

    PYTHONPATH=<before tree> python benchmarks/gguf_packing.py --json before.json
    python benchmarks/gguf_packing.py --json after.json

`--model llama-3-8b` times one layer of Llama-3-8B's weights in each format and reports 32 layers' worth (the
file's own mix of formats, such as Q4_K_M's Q4_K and Q6_K, is the reader's sum).
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS")
MODELS = {  # name -> (layers, one layer's weights [out, in])
    "llama-3-8b": (32, ((4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096),
                        (4096, 14336))),
    "smollm2-135m": (30, ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))),
}


def random_blocks(kind: str, out: int, inner: int, rng: np.random.Generator) -> np.ndarray:  # u8[out, row bytes]
    block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return rng.integers(0, 256, (out, inner // block_size * block_bytes), dtype=np.uint8)


def time_layer(kind: str, shapes: tuple[tuple[int, int], ...], repeats: int) -> tuple[float, int]:
    """The best of `repeats` packings of one layer's weights in `kind`: (seconds, bytes)."""
    from jaxserve.ops.gguf_packing import pack

    rng = np.random.default_rng(0)
    tensors = [random_blocks(kind, out, inner, rng) for out, inner in shapes]
    for blocks in tensors:
        pack(blocks, kind)  # the first call pays for lazily made tables
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for blocks in tensors:
            pack(blocks, kind)
        best = min(best, time.perf_counter() - start)
    return best, sum(blocks.nbytes for blocks in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-3-8b")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    layers, shapes = MODELS[args.model]
    rows = []
    print(f"{'format':8s} {'MiB a layer':>12s} {'ms a layer':>11s} {'MB/s':>7s} {f'{layers} layers, s':>14s}")
    for kind in args.kinds:
        seconds, size = time_layer(kind, shapes, args.repeats)
        rows.append(dict(kind=kind, model=args.model, layer_bytes=size, layer_seconds=seconds,
                         model_seconds=layers * seconds))
        print(f"{kind:8s} {size / 2**20:12.1f} {seconds * 1e3:11.1f} {size / seconds / 1e6:7.0f} "
              f"{layers * seconds:14.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
