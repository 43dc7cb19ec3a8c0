"""GGUF weights kept in their 8- and 4-bit blocks (`--quantization gguf`, vLLM's name): on a CPU, the layers'
dense weights of a GGUF file stay as the file stores them and `cpu_kernels.matmul_gguf` multiplies by them in
integers (the activations rounded to 8 bits per block of 32, as llama.cpp does), where the default path
dequantizes every tensor to float32 or bfloat16 at load.

A file's tensor arrives as a `GgufTensor` (its blocks, one output feature per row, as llama.cpp lays them out)
and, where the family's `QUANTIZED_WEIGHTS` lists the parameter, becomes a `GgufWeight` in the model's state:
the same blocks with the parameter's shape, [*contracted_axes, *output_axes]. Every other tensor (norms, the
token embeddings and so the tied LM head, a mixture's experts, formats the kernel does not read) is
dequantized as before.
"""

import collections
import dataclasses
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.ops import cpu_kernels

logger = logging.getLogger(__name__)

GGUF = "gguf"
KEPT_KINDS = tuple(cpu_kernels.GGUF_KINDS)  # Q4_0, Q4_1, Q8_0: the block formats kept as they are


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GgufWeight:
    blocks: Any  # u8[N, K / 32 * block_bytes]: output feature n's K weights in blocks of 32
    kind: str = dataclasses.field(metadata={"static": True})  # a key of KEPT_KINDS
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})  # [*contracted_axes, *output_axes]
    contracted: int = dataclasses.field(metadata={"static": True})

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> Any:
        return self.blocks.dtype

    def __getitem__(self, key: Any) -> "GgufWeight":  # `param[...]` reads the whole weight
        if key is not Ellipsis:
            raise TypeError("a GgufWeight is read whole (`param[...]`)")
        return self

    def reshape(self, *shape: int) -> "GgufWeight":
        """A 2-D view [K, N] for one matmul: the contracted axes flattened into K, the output axes into N."""
        k, n = math.prod(self.shape[: self.contracted]), math.prod(self.shape[self.contracted:])
        if shape not in ((k, n), (k, -1), (-1, n)):
            raise ValueError(f"a GgufWeight {self.shape} reshapes to [contracted, output] only, not {shape}")
        return GgufWeight(self.blocks, self.kind, (k, n), contracted=1)

    def dequantize(self) -> jax.Array:  # f32[*shape], on the host: for tests and conversions
        values = GgufTensor(np.asarray(self.blocks), self.kind).dequantize()  # [N, K]
        return jnp.asarray(values.T.reshape(self.shape))


def matmul(x: jax.Array, w: GgufWeight) -> jax.Array:
    """x [T, K] @ w [K, N] in x's dtype: x rounded to 8 bits per block of 32 times the blocks, float32 sums."""
    return cpu_kernels.matmul_gguf(x.astype(jnp.float32), w.blocks, w.kind).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class GgufTensor:
    """One quantized tensor of a GGUF file as it is stored: blocks u8[out, in / 32 * block_bytes] (HF's Linear
    layout, [out, in], in blocks along `in`) and their format."""

    blocks: np.ndarray  # u8[out, row_bytes]
    kind: str  # a key of KEPT_KINDS

    @property
    def shape(self) -> tuple[int, int]:  # the weight's [out, in]
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[self.kind]]
        return self.blocks.shape[0], self.blocks.shape[1] // block_bytes * block_size

    def __getitem__(self, rows: slice) -> "GgufTensor":
        """Output rows (what a fused projection's split takes)."""
        return GgufTensor(self.blocks[rows], self.kind)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:  # where a tensor is taken whole
        return self.dequantize() if dtype is None else self.dequantize().astype(dtype)

    def dequantize(self) -> np.ndarray:  # f32[out, in], as ggml computes it
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return np.asarray(dequantize(self.blocks, GGMLQuantizationType[self.kind]), np.float32)

    def as_weight(self, shape: tuple[int, ...], contracted: int) -> GgufWeight:
        """These blocks as the parameter of `shape` [*contracted_axes, *output_axes] (the transposed [in, out]
        laid out over the parameter's axes), on the default device."""
        out, inner = self.shape
        if math.prod(shape[:contracted]) != inner or math.prod(shape[contracted:]) != out:
            raise ValueError(f"GGUF {self.kind} tensor [{out}, {inner}] does not fit parameter {shape}")
        return GgufWeight(jax.device_put(np.ascontiguousarray(self.blocks)), self.kind, tuple(shape), contracted)


def check_gguf_quantization(gguf_file: str | None, tensor_parallel_size: int) -> None:
    """`--quantization gguf` needs a GGUF file, one device, a CPU and the native kernels; else a clear error."""
    if gguf_file is None:
        raise ValueError("--quantization gguf keeps a GGUF file's quantized tensors: --model must be a .gguf file")
    if tensor_parallel_size > 1:
        raise ValueError("--quantization gguf runs on one device (not with --tensor-parallel-size)")
    if jax.default_backend() != "cpu":
        raise ValueError(f"--quantization gguf runs on CPUs (its kernels are native CPU code); the backend "
                         f"here is {jax.default_backend()}: leave it out, and the weights are dequantized")
    if (error := cpu_kernels.kernel_error()) is not None:
        raise ValueError(f"--quantization gguf needs the native CPU kernels, which are unavailable: {error}")


def log_kept_weights(state: Any) -> None:
    """The start-up line saying what each kind of weight runs as."""
    leaves = jax.tree.leaves(state, is_leaf=lambda leaf: isinstance(leaf, GgufWeight))
    kept = collections.Counter(leaf.kind for leaf in leaves if isinstance(leaf, GgufWeight))
    kept_bytes = sum(leaf.blocks.nbytes for leaf in leaves if isinstance(leaf, GgufWeight))
    other = [leaf for leaf in leaves if not isinstance(leaf, GgufWeight)]
    dtypes = sorted({jnp.dtype(leaf.dtype).name for leaf in other})
    logger.info("quantization gguf: %s layer weights kept in their blocks (%.1f MiB), multiplied by the native "
                "kernel; the other %d tensors (embeddings, norms, formats it does not read) in %s",
                ", ".join(f"{count} {kind}" for kind, count in sorted(kept.items())) or "no",
                kept_bytes / 2**20, len(other), "/".join(dtypes))
