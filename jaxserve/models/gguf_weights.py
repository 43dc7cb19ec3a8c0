"""GGUF weights kept in their 2- to 8-bit blocks (`--quantization gguf`, vLLM's name): on a CPU, the layers'
dense weights and token embeddings of a GGUF file stay as the file stores them and `cpu_kernels.matmul_gguf`
multiplies by them in integers (the activations rounded to 8 bits per block of 32, as llama.cpp does), where the
default path dequantizes every tensor to float32 or bfloat16 at load.

A file's tensor arrives as a `GgufTensor` (its blocks, one output feature per row, as llama.cpp lays them out)
and, where the family's `QUANTIZED_WEIGHTS` lists the parameter, becomes a `GgufWeight` in the model's state:
the same blocks, packed 16 output features at a time for the kernel (`ops/gguf_packing.py`), with the
parameter's shape, [*contracted_axes, *output_axes]. A token-embedding table or an untied LM head the
family's `EMBEDDING_TABLES` lists becomes a `GgufTable`: a table's rows are decoded where looked up, and the
LM head's logits (tied or not) come from the same kernel. A mixture's experts, stacked [E, out, in] as
llama.cpp stores them (or stacked here from one tensor an expert), become `GgufExperts` where the family's
`EXPERT_WEIGHTS` lists them: each expert's blocks packed as a weight's, multiplied by
`cpu_kernels.grouped_matmul_gguf` for the rows routed to it. Every other tensor (norms, formats the kernel
does not read) is dequantized as before.
"""

import collections
import dataclasses
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.ops import cpu_kernels, gguf_packing

logger = logging.getLogger(__name__)

GGUF = "gguf"
KEPT_KINDS = tuple(cpu_kernels.GGUF_KINDS)  # Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS: the formats kept as they are


class _ReadWhole:
    """What a model reads of a parameter kept in blocks: `param[...]` (the whole of it) and its dtype (u8)."""

    blocks: Any

    @property
    def dtype(self) -> Any:
        return self.blocks.dtype

    def __getitem__(self, key: Any) -> Any:
        if key is not Ellipsis:
            raise TypeError(f"a {type(self).__name__} is read whole (`param[...]`)")
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GgufWeight(_ReadWhole):
    blocks: Any  # u8[ceil(N / 16), group_bytes]: the blocks packed 16 features at a time (`gguf_packing`)
    kind: str = dataclasses.field(metadata={"static": True})  # a key of KEPT_KINDS
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})  # [*contracted_axes, *output_axes]
    contracted: int = dataclasses.field(metadata={"static": True})

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape: int) -> "GgufWeight":
        """A 2-D view [K, N] for one matmul: the contracted axes flattened into K, the output axes into N."""
        k, n = math.prod(self.shape[: self.contracted]), math.prod(self.shape[self.contracted:])
        if shape not in ((k, n), (k, -1), (-1, n)):
            raise ValueError(f"a GgufWeight {self.shape} reshapes to [contracted, output] only, not {shape}")
        return GgufWeight(self.blocks, self.kind, (k, n), contracted=1)

    @property
    def features(self) -> int:  # N, the output features
        return math.prod(self.shape[self.contracted:])

    def file_blocks(self) -> "GgufTensor":
        """The blocks as the file stores them, [N, K / 32 * block_bytes]."""
        return GgufTensor(gguf_packing.unpack(np.asarray(self.blocks), self.kind, self.features), self.kind)

    def dequantize(self) -> jax.Array:  # f32[*shape], on the host: for tests and conversions
        return jnp.asarray(self.file_blocks().dequantize().T.reshape(self.shape))


def matmul(x: jax.Array, w: GgufWeight) -> jax.Array:
    """x [T, K] @ w [K, N] in x's dtype: x rounded to 8 bits per block of 32 times the blocks, float32 sums."""
    return cpu_kernels.matmul_gguf(x.astype(jnp.float32), w.blocks, w.kind, w.features).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GgufExperts(_ReadWhole):
    """A mixture's stacked expert weights [E, K, N] kept in their blocks: each expert's [N, K] blocks packed 16
    output features at a time, as a `GgufWeight`'s."""

    blocks: Any  # u8[E, ceil(N / 16), group_bytes]
    kind: str = dataclasses.field(metadata={"static": True})  # a key of KEPT_KINDS
    shape: tuple[int, int, int] = dataclasses.field(metadata={"static": True})  # [E, K, N], the parameter's

    ndim = 3

    def dequantize(self) -> jax.Array:  # f32[E, K, N], on the host: for tests
        blocks = np.asarray(self.blocks)
        return jnp.asarray(np.stack([GgufTensor(gguf_packing.unpack(expert, self.kind, self.shape[2]), self.kind)
                                     .dequantize().T for expert in blocks]))


def grouped_matmul(rows: jax.Array, w: GgufExperts, group_sizes: jax.Array) -> jax.Array:
    """rows [A, K] sorted by expert, group_sizes i32[E] -> f32[A, N]: each expert's rows times its blocks, the
    rows rounded to 8 bits per block of 32 (`matmul`'s arithmetic)."""
    return cpu_kernels.grouped_matmul_gguf(rows.astype(jnp.float32), w.blocks, group_sizes, w.kind, w.shape[2])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GgufTable(_ReadWhole):
    """A token-embedding table [V, D] kept in its blocks: rows looked up by decoding their blocks, and (tied or
    not) the LM head's logits by the native kernel, the table being output-major as the kernel reads it."""

    blocks: Any  # u8[ceil(V / 16), group_bytes(kind, D)]: the file's [V, D] blocks packed (`gguf_packing`)
    kind: str = dataclasses.field(metadata={"static": True})  # one of KEPT_KINDS
    shape: tuple[int, int] = dataclasses.field(metadata={"static": True})  # [V, D]

    ndim = 2

    def lookup(self, ids: jax.Array) -> jax.Array:  # i32[T] -> f32[T, D]
        """The ids' rows, decoded as ggml dequantizes them (the same float32 products of codes and scales, in
        the same order). Each field is one gather of only the ids' own bytes in their group's tiles
        (`gguf_packing`'s layout: a feature's bytes lie at a fixed stride from feature 0's)."""
        return _decode_rows(self.kind, self.blocks, ids, self.shape[1])

    def logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]
        return cpu_kernels.matmul_gguf(hidden.astype(jnp.float32), self.blocks, self.kind, self.shape[0])

    def dequantize(self) -> jax.Array:  # f32[V, D], on the host: for tests
        blocks = gguf_packing.unpack(np.asarray(self.blocks), self.kind, self.shape[0])
        return jnp.asarray(GgufTensor(blocks, self.kind).dequantize())


def _lane_bytes(blocks: jax.Array, ids: jax.Array, offsets: np.ndarray, stride: int) -> jax.Array:
    """u8[T, *offsets.shape]: for each id, the bytes at `offsets` (feature 0's, in its group's row of packed
    tiles) moved `stride` bytes a feature along, to the id's own feature."""
    lane = (ids % gguf_packing.FEATURES).reshape(-1, *([1] * offsets.ndim))
    return blocks[(ids // gguf_packing.FEATURES).reshape(lane.shape), jnp.asarray(offsets) + lane * stride]


def _halves(blocks: jax.Array, ids: jax.Array, offsets: np.ndarray) -> jax.Array:  # f16 at offsets -> f32[T, ...]
    pairs = _lane_bytes(blocks, ids, offsets[..., None] + np.arange(2), 2)
    return jax.lax.bitcast_convert_type(pairs, jnp.float16).astype(jnp.float32)


def _nibbles(codes: jax.Array) -> jax.Array:  # u8[..., chunk, j] -> [..., half, chunk, j]: weight 16 half + 4c + j
    return jnp.stack([codes & 15, codes >> 4], axis=-3)


def _with_fifth_bits(nibbles: jax.Array, plane: jax.Array) -> jax.Array:  # [..., half, chunk, j], plane [..., j]
    return nibbles | (((plane[..., None, None, :] >> gguf_packing.FIFTH_BIT_SHIFTS) & 1) << 4)


def _decode_rows(kind: str, blocks: jax.Array, ids: jax.Array, width: int) -> jax.Array:  # -> f32[T, width]
    """Rows `ids` of a table kept in `kind`'s packed blocks, as the gguf package dequantizes them."""
    if kind == "Q6_K":
        return _decode_q6_k_rows(blocks, ids, width)
    if kind == "IQ4_XS":
        return _decode_iq4_xs_rows(blocks, ids, width)
    if kind in gguf_packing.TWO_BIT_HEAD:
        return _decode_two_bit_rows(kind, blocks, ids, width)
    if kind in gguf_packing.SUPER_KINDS:
        return _decode_scaled_super_rows(kind, blocks, ids, width)
    return _decode_block_rows(kind, blocks, ids, width)


# A chunk's 4 bytes of each feature, [chunk, j]: chunk c's byte j of a feature holds weight 4c + j (its low
# nibble) and 16 + 4c + j (its high nibble), or, in Q8_0's 8 chunks, weight 4c + j.
_CHUNK, _BYTE = np.arange(4)[:, None], np.arange(4)[None, :]


def _decode_q6_k_rows(blocks: jax.Array, ids: jax.Array, width: int) -> jax.Array:
    """Q6_K: per super-block d, 16 int8 scales (one per sub-block of 16), and each block of 32 as Q4 nibbles
    (the codes' low 4 bits) followed by two planes of their high 2 bits; w = d * sc * (q - 32)."""
    t, supers = ids.shape[0], width // gguf_packing.SUPER
    at = (np.arange(supers) * gguf_packing.Q6_K_TILE)[:, None]  # [super, 1]
    d = _halves(blocks, ids, at[:, 0])  # [T, super]
    block_at = at + gguf_packing.Q6_K_HEAD + np.arange(8)[None, :] * gguf_packing.Q6_K_BLOCK  # [super, block]
    codes = _lane_bytes(blocks, ids, block_at[..., None, None] + 64 * _CHUNK + _BYTE, 4)  # [T, S, block, chunk, j]
    planes = _lane_bytes(blocks, ids, block_at[..., None, None] + 256 + 64 * np.arange(2)[:, None] + _BYTE, 4)
    high = (planes[..., :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [.., half, chunk, j]
    q = (_nibbles(codes) | (high << 4)).astype(jnp.int8) - jnp.int8(gguf_packing.Q6_K_BIAS)  # [T, S, block, half, c, j]
    scale_at = at + gguf_packing.Q6_K_SCALES_AT + 16 * np.arange(16)  # [super, sub-block]
    scales = jax.lax.bitcast_convert_type(_lane_bytes(blocks, ids, scale_at, 1), jnp.int8)
    scale = (d[..., None] * scales.astype(jnp.float32)).reshape(t, supers, 8, 2, 1)  # per sub-block of 16
    return (scale * q.reshape(t, supers, 8, 2, 16).astype(jnp.float32)).reshape(t, width)


def _decode_two_bit_rows(kind: str, blocks: jax.Array, ids: jax.Array, width: int) -> jax.Array:
    """Q3_K, Q2_K: per super-block d (Q2_K: and dmin) and each sub-block of 16's scale (Q3_K: int8; Q2_K: a byte
    sc | mn << 4), then each block of 32 as two chunks of 2-bit codes (and Q3_K's plane of third bits);
    w = d * sc * (q - 4) (Q3_K) or d * sc * q - dmin * mn (Q2_K)."""
    t, supers = ids.shape[0], width // gguf_packing.SUPER
    at = (np.arange(supers) * gguf_packing.super_tile(kind))[:, None]  # [super, 1]
    d = _halves(blocks, ids, at[:, 0])[..., None]  # [T, S, 1]
    scales = _lane_bytes(blocks, ids, at + gguf_packing.TWO_BIT_SCALES_AT[kind] + 16 * np.arange(16), 1)  # [T, S, 16]
    block_at = at + gguf_packing.TWO_BIT_HEAD[kind] + np.arange(8) * gguf_packing.TWO_BIT_BLOCK[kind]  # [S, block]
    chunks = _lane_bytes(blocks, ids, block_at[..., None, None] + 64 * np.arange(2)[:, None] + _BYTE, 4)
    shifts = (2 * np.arange(4, dtype=np.uint8))[:, None, None]  # [s, 1, 1]
    q = ((chunks[..., None, :, :] >> shifts) & 3).reshape(t, supers, 16, 16)  # [.., s, k, j]: weight 8s + 4k + j
    if kind == "Q2_K":
        dmin = _halves(blocks, ids, at[:, 0] + 2 * gguf_packing.FEATURES)[..., None]
        scale, low = d * (scales & 15).astype(jnp.float32), dmin * (scales >> 4).astype(jnp.float32)
        return (scale[..., None] * q.astype(jnp.float32) - low[..., None]).reshape(t, width)
    plane = _lane_bytes(blocks, ids, block_at[..., None] + 128 + np.arange(4), 4)  # [T, S, block, j]
    third = (plane[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [.., t, j]: weight 4t + j
    values = (q | (third.reshape(t, supers, 16, 16) << 2)).astype(jnp.int8) - jnp.int8(gguf_packing.Q3_K_BIAS)
    scale = d * jax.lax.bitcast_convert_type(scales, jnp.int8).astype(jnp.float32)
    return (scale[..., None] * values.astype(jnp.float32)).reshape(t, width)


def _decode_scaled_super_rows(kind: str, blocks: jax.Array, ids: jax.Array, width: int) -> jax.Array:
    """Q4_K, Q5_K: per super-block d, dmin, and 8 scales and mins (a byte each), then each block of 32 as Q4
    nibbles (Q5_K: after the block's plane of 5th bits); w = d * sc * q - dmin * mn."""
    t, supers = ids.shape[0], width // gguf_packing.SUPER
    plane = gguf_packing.FEATURES * gguf_packing.PLANE_BYTES.get(kind, 0)
    at = (np.arange(supers) * gguf_packing.super_tile(kind))[:, None]  # [super, 1]
    block = np.arange(8)[None, :]
    d, dmin = _halves(blocks, ids, at[:, 0]), _halves(blocks, ids, at[:, 0] + gguf_packing.Q4_K_DMIN_AT)  # [T, S]
    sc, mn = (_lane_bytes(blocks, ids, at + start + 16 * block, 1).astype(jnp.float32)
              for start in (gguf_packing.Q4_K_SCALES_AT, gguf_packing.Q4_K_MINS_AT))
    block_at = at + gguf_packing.Q4_K_HEAD + block * (plane + 256)  # [super, block]: (plane,) codes
    q = _nibbles(_lane_bytes(blocks, ids, block_at[..., None, None] + plane + 64 * _CHUNK + _BYTE, 4))
    if plane:
        q = _with_fifth_bits(q, _lane_bytes(blocks, ids, block_at[..., None] + np.arange(4), 4))
    values = q.reshape(t, supers, 8, 32).astype(jnp.float32)
    scale, low = (d[..., None] * sc)[..., None], (dmin[..., None] * mn)[..., None]  # [T, S, block, 1]
    return (scale * values - low).reshape(t, width)


def _iq4_values(codes: jax.Array) -> jax.Array:  # u8[...] of 0 .. 15 -> f32[...]: the IQ4 formats' table
    from gguf.quants import IQ4_NL

    return jnp.asarray(IQ4_NL.kvalues, jnp.float32)[codes]


def _decode_iq4_xs_rows(blocks: jax.Array, ids: jax.Array, width: int) -> jax.Array:
    """IQ4_XS: per super-block d and 8 int8 scales (the file's 6 bits less 32), then each block of 32 as Q4
    nibbles indexing the IQ4 table; w = d * sc * value(q)."""
    t, supers = ids.shape[0], width // gguf_packing.SUPER
    at = (np.arange(supers) * gguf_packing.IQ4_XS_TILE)[:, None]  # [super, 1]
    block = np.arange(8)[None, :]
    d = _halves(blocks, ids, at[:, 0])  # [T, S]
    sc = jax.lax.bitcast_convert_type(_lane_bytes(blocks, ids, at + gguf_packing.IQ4_XS_SCALES_AT + 16 * block, 1),
                                      jnp.int8).astype(jnp.float32)  # [T, S, block]
    block_at = at + gguf_packing.IQ4_XS_HEAD + block * 256  # [super, block]
    q = _nibbles(_lane_bytes(blocks, ids, block_at[..., None, None] + 64 * _CHUNK + _BYTE, 4))
    return ((d[..., None] * sc)[..., None] * _iq4_values(q).reshape(t, supers, 8, 32)).reshape(t, width)


def _decode_block_rows(kind: str, blocks: jax.Array, ids: jax.Array, width: int) -> jax.Array:
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: per block of 32 d (and m), (Q5: a plane of 5th bits,) then the
    codes; w = d * (q - bias) (Q4_0: bias 8, Q5_0: 16, Q8_0: signed codes), d * q + m, or d * value(q) (IQ4_NL)."""
    t, num_blocks, features = ids.shape[0], width // 32, gguf_packing.FEATURES
    scales, plane = gguf_packing.SCALES[kind], features * gguf_packing.PLANE_BYTES.get(kind, 0)
    at = (np.arange(num_blocks) * gguf_packing.tile_bytes(kind))[:, None]  # [block, 1]
    factors = _halves(blocks, ids, at + 2 * features * np.arange(scales))  # [T, block, d (m)]
    chunks = np.arange(gguf_packing.CODE_BYTES[kind] // 4)[:, None]  # [chunk, 1]
    codes = _lane_bytes(blocks, ids, at[..., None] + 2 * scales * features + plane + 64 * chunks + _BYTE, 4)
    if kind == "Q8_0":
        values = jax.lax.bitcast_convert_type(codes, jnp.int8).reshape(t, num_blocks, 32).astype(jnp.float32)
        return (values * factors[..., :1]).reshape(t, width)
    q = _nibbles(codes)  # [T, block, half, chunk, j]
    if plane:
        q = _with_fifth_bits(q, _lane_bytes(blocks, ids, at + 2 * scales * features + np.arange(4), 4))
    q = q.reshape(t, num_blocks, 32)
    if kind == "IQ4_NL":
        return (_iq4_values(q) * factors[..., :1]).reshape(t, width)
    if kind in ("Q4_0", "Q5_0"):  # signed codes: q - 8 (Q5_0: q - 16)
        offset = 8 if kind == "Q4_0" else 16
        return ((q.astype(jnp.int8) - jnp.int8(offset)).astype(jnp.float32) * factors[..., :1]).reshape(t, width)
    return (q.astype(jnp.float32) * factors[..., :1] + factors[..., 1:]).reshape(t, width)


@dataclasses.dataclass(frozen=True)
class GgufTensor:
    """One quantized tensor of a GGUF file as it is stored: blocks u8[out, in / 32 * block_bytes] (HF's Linear
    layout, [out, in], in blocks along `in`) and their format."""

    blocks: np.ndarray  # u8[out, row_bytes], or u8[E, out, row_bytes] for a mixture's stacked experts
    kind: str  # a key of KEPT_KINDS

    @property
    def shape(self) -> tuple[int, ...]:  # the weight's [out, in] (or [E, out, in])
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[self.kind]]
        return *self.blocks.shape[:-1], self.blocks.shape[-1] // block_bytes * block_size

    def __getitem__(self, rows: slice) -> "GgufTensor":
        """Output rows (what a fused projection's split takes)."""
        return GgufTensor(self.blocks[rows], self.kind)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:  # where a tensor is taken whole
        return self.dequantize() if dtype is None else self.dequantize().astype(dtype)

    def dequantize(self) -> np.ndarray:  # f32[out, in] (or [E, out, in]), as ggml computes it
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return np.asarray(dequantize(self.blocks, GGMLQuantizationType[self.kind]), np.float32)

    def as_table(self, shape: tuple[int, ...]) -> GgufTable:
        """These blocks as an embedding table [V, D] (the file's own layout), on the default device."""
        if tuple(shape) != self.shape:
            raise ValueError(f"GGUF {self.kind} tensor {list(self.shape)} does not fit table {tuple(shape)}")
        return GgufTable(jax.device_put(gguf_packing.pack(self.blocks, self.kind)), self.kind, self.shape)

    def as_weight(self, shape: tuple[int, ...], contracted: int) -> GgufWeight:
        """These blocks as the parameter of `shape` [*contracted_axes, *output_axes] (the transposed [in, out]
        laid out over the parameter's axes), on the default device."""
        out, inner = self.shape
        if math.prod(shape[:contracted]) != inner or math.prod(shape[contracted:]) != out:
            raise ValueError(f"GGUF {self.kind} tensor [{out}, {inner}] does not fit parameter {shape}")
        packed = jax.device_put(gguf_packing.pack(self.blocks, self.kind))
        return GgufWeight(packed, self.kind, tuple(shape), contracted)

    def as_experts(self, shape: tuple[int, ...]) -> GgufExperts:
        """These stacked blocks [E, out, in] as the experts' parameter [E, in, out], on the default device."""
        if len(self.shape) != 3 or tuple(shape) != (self.shape[0], self.shape[2], self.shape[1]):
            raise ValueError(f"GGUF {self.kind} experts {list(self.shape)} do not fit parameter {tuple(shape)}")
        return GgufExperts(jax.device_put(gguf_packing.pack_experts(self.blocks, self.kind)), self.kind, tuple(shape))


def stack_expert_tensors(tensors: list[Any]) -> Any:
    """One kind of a layer's expert weights, [out, in] each, as one [E, out, in]: a GGUF file's blocks of one
    format stay blocks (a `GgufTensor`), anything else becomes a float array."""
    kinds = {tensor.kind for tensor in tensors if isinstance(tensor, GgufTensor)}
    if len(kinds) == 1 and all(isinstance(tensor, GgufTensor) for tensor in tensors):
        return GgufTensor(np.stack([tensor.blocks for tensor in tensors]), kinds.pop())
    return np.stack([np.asarray(tensor) for tensor in tensors])


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


def keeps_blocks_by_default(gguf_file: str | None, tensor_parallel_size: int, family: Any) -> bool:
    """`--quantization auto`: a GGUF file's blocks are kept wherever `--quantization gguf` runs (a CPU, one
    device, the native kernels built, a family that lists its quantized weights); elsewhere it dequantizes."""
    return (gguf_file is not None and tensor_parallel_size == 1 and jax.default_backend() == "cpu"
            and hasattr(family, "QUANTIZED_WEIGHTS") and cpu_kernels.kernel_error() is None)


def log_kept_weights(state: Any) -> int:
    """The start-up line saying what each kind of weight runs as; returns how many tensors are kept."""
    kept_types = (GgufWeight, GgufExperts, GgufTable)
    leaves = jax.tree.leaves(state, is_leaf=lambda leaf: isinstance(leaf, kept_types))
    layers = collections.Counter(leaf.kind for leaf in leaves if isinstance(leaf, GgufWeight | GgufExperts))
    tables = collections.Counter(leaf.kind for leaf in leaves if isinstance(leaf, GgufTable))
    kept_bytes = sum(leaf.blocks.nbytes for leaf in leaves if isinstance(leaf, kept_types))
    other = [leaf for leaf in leaves if not isinstance(leaf, kept_types)]
    dtypes = sorted({jnp.dtype(leaf.dtype).name for leaf in other})

    def counted(counter: collections.Counter) -> str:
        return ", ".join(f"{count} {kind}" for kind, count in sorted(counter.items())) or "no"

    logger.info("quantization gguf: %s layer weights and %s embedding tables kept in their blocks (%.1f MiB), "
                "multiplied by the native kernel; the other %d tensors (norms, tensors in formats it does not "
                "keep) in %s", counted(layers), counted(tables), kept_bytes / 2**20, len(other), "/".join(dtypes))
    return sum(layers.values()) + sum(tables.values())
