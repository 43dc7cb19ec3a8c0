"""Weights kept in 8 bits: FP8 (e4m3) values with float32 scales. `--quantization fp8` (vLLM's flag) quantizes
a 16- or 32-bit checkpoint's weights as they load, with a scale per output channel. An FP8 checkpoint keeps
its own values and scales (`fp8_checkpoint_tensors`): per tensor (that scale for every channel), per output
channel, or per block of 128 x 128 (DeepSeek-V3's and most released FP8 checkpoints' `weight_block_size`,
compressed-tensors' "block" strategy). Its weights stored in 16 bits stay as they are stored, as in vLLM.

A quantized weight is an `Fp8Weight` where the plain array was: the same shape, `values` in e4m3 and
`scale` over the output axes (the weight's trailing axes, after the `contracted` ones it is multiplied
over), with a leading axis of contracted blocks where the checkpoint's scales vary along them.
`layers.dense` multiplies by the values widened to the activations' dtype and scales the result (compiled
for an H100, XLA fuses the widening into its Triton GEMM, which then reads one byte per weight instead of
two: docs/benchmarks.md); block scales scale the widened values (`block_matmul`). On GPUs with FP8 tensor
cores, steps of many rows round the activations to e4m3 too (W8A8, as vLLM runs such weights there:
`activations_in_fp8`): a scale per token for weights with a scale per channel, a scale per token and block
of the weight's contracted rows for block-scaled ones (1 x 128, DeepSeek-V3's scheme), where the block
kernel's e4m3 dot runs on FP8 tensor cores (Ada), or on Hopper through a Mosaic GPU kernel over the weights
stored K-major (`fp8_layout.py`, opt-in). A mixture's stacked experts
are an `Fp8Experts` (values [E, K, N], scales [E, K blocks, N]), which `moe.grouped_matmul` widens in the
same way. The token embeddings, the LM head, the routers, norms and biases stay as they are, as in vLLM's FP8
scheme.

Which parameters are quantized is the model family's `QUANTIZED_WEIGHTS`: a layer parameter's name
maps to its number of contracted axes (1 for [D, N, H] or [K, N]; 2 for an output projection [N, H, D]);
and its `EXPERT_WEIGHTS`, stacked experts [E, K, N].
"""

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import PartitionSpec

from jaxserve.ops import fp8_block_matmul
from jaxserve.ops.attention import AttentionConfig
from jaxserve.parallel import TP_AXIS

logger = logging.getLogger(__name__)

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448

MIN_EXPERT_BLOCK = 16  # `experts_block`
# The fewest rows whose products take activations in FP8 where a GPU can (`activations_in_fp8`): from about
# here an H100's GEMM over one-byte weights is bound by its 16-bit tensor cores rather than by reading the
# weight (docs/benchmarks.md), and FP8 ones run at twice their rate; fewer rows read the weight at the same
# speed either way, and keep 16-bit activations.
W8A8_MIN_ROWS = 256
MIN_ROW_SCALE = 1 / (FP8_MAX * 512)  # `quantize_rows`
BlockOf = Callable[[tuple, tuple[int, ...]], int]  # (parameter path, shape) -> its scales' block (0: per channel)


def layer_weight_itemsize(quantization: str | None) -> int | None:
    """Bytes per quantized layer weight (the roofline's `layer_itemsize`); None: the weights' own dtype."""
    return None if quantization is None else np.dtype(FP8).itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """`block` 0: `scale` f32[*output_axes], values * scale is the weight. `block` B > 0: `scale`
    f32[ceil(K / B), *output_axes], one per output channel and run of B rows of the flattened contracted axis
    (of length K); row k of that axis is scaled by `scale[k // B]`.

    `k_major`: the values are stored transposed, [N, K] over the flattened axes (one output channel's
    contracted values contiguous, as checkpoints store a linear layer), for Hopper's FP8 wgmma, which reads
    both operands so (`fp8_layout.kernel_layout`); `dims` is then the weight's shape [*contracted_axes,
    *output_axes], which `shape` reports, and its scales keep their form."""

    values: Any  # f8e4m3fn[*contracted_axes, *output_axes], or [N, K] where k_major
    scale: Any  # f32[*output_axes] or f32[contracted_blocks, *output_axes]
    contracted: int = dataclasses.field(metadata={"static": True})
    block: int = dataclasses.field(default=0, metadata={"static": True})
    k_major: bool = dataclasses.field(default=False, metadata={"static": True})
    dims: tuple[int, ...] | None = dataclasses.field(default=None, metadata={"static": True})  # where k_major

    def __post_init__(self) -> None:
        if self.k_major and self.dims is None:
            raise ValueError("a K-major Fp8Weight needs its dims (the weight's shape)")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.dims if self.k_major else tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    def __getitem__(self, key: Any) -> "Fp8Weight":  # `param[...]` reads the whole weight
        if key is not Ellipsis:
            raise TypeError("an Fp8Weight is read whole (`param[...]`)")
        return self

    def reshape(self, *shape: int) -> "Fp8Weight":
        """A 2-D view [K, N] for one matmul: the contracted axes flattened into K, the output axes into N."""
        if self.k_major:  # stored [N, K] already
            k, n = math.prod(self.dims[: self.contracted]), self.values.shape[0]
            if tuple(shape) not in ((k, n), (-1, n), (k, -1)):
                raise ValueError(f"a K-major Fp8Weight {self.dims} reshapes to [{k}, {n}] only, not {shape}")
            return Fp8Weight(self.values, self.scale.reshape(self.scale.shape[0], -1), contracted=1, block=self.block,
                             k_major=True, dims=(k, n))
        values = self.values.reshape(*shape)
        outputs = self.scale.shape[1 if self.block else 0:]
        if values.ndim != 2 or values.shape[1] != math.prod(outputs):
            raise ValueError(f"an Fp8Weight {self.shape} reshapes to [contracted, output] only, not {values.shape}")
        scale = self.scale.reshape(self.scale.shape[0], -1) if self.block else self.scale.reshape(-1)
        return Fp8Weight(values, scale, contracted=1, block=self.block)

    def row_major(self) -> "Fp8Weight":
        """The weight with its values in [*contracted_axes, *output_axes] (a K-major one's transposed back)."""
        if not self.k_major:
            return self
        return Fp8Weight(self.values.T.reshape(self.dims), self.scale, self.contracted, self.block)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        if self.k_major:
            return self.row_major().dequantize(dtype)
        if not self.block:
            return (self.values.astype(jnp.float32) * self.scale).astype(dtype)
        k = math.prod(self.shape[: self.contracted])
        values = self.values.reshape(k, -1).astype(jnp.float32)  # [K, N]
        scales = row_scales(self.scale.reshape(self.scale.shape[0], -1), self.block, k)  # [K, N]
        return (values * scales).astype(dtype).reshape(self.shape)


def row_scales(scale: jax.Array, block: int, rows: int) -> jax.Array:
    """scale f32[ceil(rows / block), N] -> f32[rows, N]: each contracted row's scale."""
    return jnp.repeat(scale, block, axis=0, total_repeat_length=scale.shape[0] * block)[:rows]


def quantize_fp8(w: jax.Array, contracted: int, block: int = 0) -> Fp8Weight:
    """w [*contracted_axes, *output_axes] -> e4m3 values and the scale that maps each output channel's largest
    |w| to 448 (a zero channel keeps scale 1); with `block`, each output channel's largest in each run of
    `block` rows of the flattened contracted axis (the form of an FP8 checkpoint's block scales)."""
    w32 = w.astype(jnp.float32)
    if block:
        k = math.prod(w.shape[:contracted])
        blocks = -(-k // block)
        rows = jnp.pad(w32.reshape(k, -1), ((0, blocks * block - k), (0, 0)))  # [blocks * block, N]
        amax = jnp.max(jnp.abs(rows.reshape(blocks, block, -1)), axis=1)  # [blocks, N]
        scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
        values = jnp.clip(w32.reshape(k, -1) / row_scales(scale, block, k), -FP8_MAX, FP8_MAX).astype(FP8)
        return Fp8Weight(values.reshape(w.shape), scale.reshape(blocks, *w.shape[contracted:]), contracted, block)
    amax = jnp.max(jnp.abs(w32), axis=tuple(range(contracted)))  # [*output_axes]
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    values = jnp.clip(w32 / scale, -FP8_MAX, FP8_MAX).astype(FP8)
    return Fp8Weight(values, scale, contracted=contracted)


def quantize_rows(x: jax.Array, group: int = 0) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (e4m3 [T, K], f32 [T, K / group]): each row (group 0: a scale [T, 1], vLLM's dynamic
    per-token activation scales), or each run of `group` columns of it (vLLM's per-token-group scales,
    DeepSeek-V3's 1 x 128), over the scale that maps its largest |x| to 448; no scale under MIN_ROW_SCALE
    (vLLM's floor), so that a zero or vanishing row (padding) keeps a normal float32 scale and quantizes to
    zeros."""
    rows, k = x.shape
    group = group or k
    x32 = x.astype(jnp.float32).reshape(rows, k // group, group)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)  # [T, K / group, 1]
    scale = jnp.maximum(amax / FP8_MAX, MIN_ROW_SCALE)
    return jnp.clip(x32 / scale, -FP8_MAX, FP8_MAX).astype(FP8).reshape(rows, k), scale[..., 0]


def activations_in_fp8(rows: int, w: Fp8Weight, attention: AttentionConfig | None) -> bool:
    """Whether x [rows, K] @ w multiplies x rounded to e4m3: where the GPU has FP8 tensor cores
    (`AttentionConfig.fp8_activations`), in steps of W8A8_MIN_ROWS rows or more, where the GEMM is bound by
    the tensor cores rather than by reading the weight; for weights with a scale per output channel
    (`w8a8_matmul`; block-scaled checkpoints' too under a mesh, which quantizes them per channel again), and
    for block-scaled ones where the block kernel takes e4m3 rows (`AttentionConfig.fp8_block_activations`) and
    their shapes fit it (`block_matmul`), and for those stored K-major for Hopper's Mosaic GPU kernel
    (`fp8_layout.kernel_layout`)."""
    if attention is None or not attention.fp8_activations or rows < W8A8_MIN_ROWS:
        return False
    if not w.block or w.k_major:
        return True
    k = math.prod(w.shape[: w.contracted])
    return attention.fp8_block_activations and fp8_block_matmul.fits(k, math.prod(w.shape) // k, w.block,
                                                                     fp8_rows=True)


def experts_in_fp8(rows_per_expert: int, attention: AttentionConfig | None) -> bool:
    """Whether a mixture's FP8 experts multiply their rows rounded to e4m3 (a scale per row, or per row and
    block for block-scaled experts: `moe.grouped_matmul`, where the shapes fit): where their kernel takes e4m3
    rows (`AttentionConfig.fp8_expert_activations`), in steps whose experts have W8A8_MIN_ROWS rows each or
    more on average (tokens x top-k / experts): each expert's product is bound by its tensor cores from there
    on, as a dense product is."""
    return attention is not None and attention.fp8_expert_activations and rows_per_expert >= W8A8_MIN_ROWS


def matmul(x: jax.Array, w: Fp8Weight, attention: AttentionConfig | None = None,
           split_contracted: bool = False) -> jax.Array:
    """x [T, K] @ w [K, N] in x's dtype: float32 sums over the values widened to x's dtype, then the scale
    (block scales: `block_matmul`; activations in FP8 too where `activations_in_fp8`: `w8a8_matmul`, which
    `split_contracted` tells that a mesh splits w along K)."""
    if w.block:
        return block_matmul(x, w, attention)
    if activations_in_fp8(x.shape[0], w, attention):
        if split_contracted and attention.mesh is not None and x.shape[1] % attention.mesh.size == 0:
            return w8a8_row_parallel(x, w, attention.mesh)
        return w8a8_matmul(x, w)
    y = jnp.dot(x, w.values.astype(x.dtype), preferred_element_type=jnp.float32)  # [T, N]
    return (y * w.scale).astype(x.dtype)


def w8a8_matmul(x: jax.Array, w: Fp8Weight) -> jax.Array:
    """x [T, K] @ w [K, N] in x's dtype with both operands in e4m3: x's rows quantized (`quantize_rows`), float32
    sums of e4m3 products (FP8 tensor cores), times each output channel's scale, rounded to x's dtype, then
    times each row's scale. XLA fuses the channel scale into its GEMM (where it does not split K) but not a
    row scale, so that one is applied after, where it fuses into the GEMM's consumer (the MLP's activation, the
    residual add)."""
    xq, row_scale = quantize_rows(x)  # [T, K] e4m3, f32[T, 1]
    y = jax.lax.dot_general(xq, w.values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)  # [T, N]
    y = (y * w.scale).astype(x.dtype)
    return (y.astype(jnp.float32) * row_scale).astype(x.dtype)


def w8a8_row_parallel(x: jax.Array, w: Fp8Weight, mesh: Any) -> jax.Array:
    """`w8a8_matmul` for a weight split along K over `mesh` (an output or down projection), under `shard_map`:
    each device quantizes its own share of each row, with a scale of its own (vLLM's, each rank quantizing its
    input), and the partial products' all-reduce is the one the split needs anyway. A scale over the whole
    row would add an all-reduce of the rows' maxima before every such product."""
    def local(x: jax.Array, values: jax.Array, scale: jax.Array) -> jax.Array:  # [T, K / devices] x [K / devices, N]
        return jax.lax.psum(w8a8_matmul(x, Fp8Weight(values, scale, contracted=1)), TP_AXIS)

    split, whole = PartitionSpec(None, TP_AXIS), PartitionSpec()
    return jax.shard_map(local, mesh=mesh, in_specs=(split, PartitionSpec(TP_AXIS, None), whole), out_specs=whole,
                         check_vma=False)(x, w.values, w.scale)


def block_matmul(x: jax.Array, w: Fp8Weight, attention: AttentionConfig | None = None) -> jax.Array:
    """x [T, K] @ w [K, N] for block scales, in x's dtype, float32 sums: through `ops.fp8_block_matmul`'s
    kernel where `attention` has it and the shapes fit (with FP8 activations, each row quantized with a scale
    per block of its columns, the weight's block), else over the values times their rows' scales (in float32,
    then rounded to x's dtype), which XLA writes out whole. A weight stored K-major for Hopper
    (`fp8_layout.kernel_layout`) takes e4m3 rows through `ops.fp8_block_matmul_mgpu`'s kernel on FP8 wgmma
    where they apply, and 16-bit rows through the Triton kernel reading its K-major values."""
    (rows, k), n = x.shape, w.shape[1]
    mode = None if attention is None else attention.fp8_block_kernel
    options = {"interpret": mode == "interpret"}
    if mode is not None and attention.num_sms:
        options["num_sms"] = attention.num_sms
    if w.k_major:  # Hopper's layout (`fp8_layout`): e4m3 rows on FP8 wgmma, fewer rows through the Triton kernel
        if mode is not None and activations_in_fp8(rows, w, attention):
            from jaxserve.ops.fp8_block_matmul_mgpu import fp8_block_matmul_mgpu

            xq, x_scale = quantize_rows(x, w.block)  # e4m3 [T, K], f32 [T, K / block]
            return fp8_block_matmul_mgpu(xq, x_scale, w.values, w.scale, w.block, out_dtype=x.dtype, **options)
        if mode is not None:
            return fp8_block_matmul.fp8_block_matmul(x, w.values, w.scale, w.block, k_major=True, **options)
        w = w.row_major()
    if mode is not None and activations_in_fp8(rows, w, attention):
        xq, x_scale = quantize_rows(x, w.block)  # e4m3 [T, K], f32 [T, K / block]
        return fp8_block_matmul.fp8_block_matmul(xq, w.values, w.scale, w.block, x_scale=x_scale, out_dtype=x.dtype,
                                                 **options)
    if mode is not None and fp8_block_matmul.fits(k, n, w.block):
        return fp8_block_matmul.fp8_block_matmul(x, w.values, w.scale, w.block, **options)
    weights = (w.values.astype(jnp.float32) * row_scales(w.scale, w.block, x.shape[1])).astype(x.dtype)  # [K, N]
    return jnp.dot(x, weights, preferred_element_type=jnp.float32).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Experts:
    """A mixture's stacked experts in e4m3 with float32 scales: expert e's weight at contracted row k and
    output column n is `values[e, k, n] * scale[e, k // block, n]`. A scale per expert and output channel is
    one block of all K rows (what `--quantization fp8` gives); an FP8 checkpoint's block scales keep their
    block (DeepSeek-V3's 128)."""

    values: Any  # f8e4m3fn[E, K, N]
    scale: Any  # f32[E, ceil(K / block), N]
    block: int = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return 3

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    @property
    def per_channel(self) -> bool:
        """One scale for all of an expert's contracted rows, which can scale the product instead of the weight."""
        return self.scale.shape[1] == 1

    def __getitem__(self, key: Any) -> "Fp8Experts":  # `param[...]` reads the whole weight
        if key is not Ellipsis:
            raise TypeError("an Fp8Experts is read whole (`param[...]`)")
        return self

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:  # [E, K, N]
        blocks, k = self.scale.shape[1], self.values.shape[1]  # under shard_map, this device's rows and blocks
        scales = jnp.repeat(self.scale, self.block, axis=1, total_repeat_length=blocks * self.block)[:, :k]
        return (self.values.astype(jnp.float32) * scales).astype(dtype)


def quantize_experts(w: jax.Array, block: int = 0) -> Fp8Experts:
    """w [E, K, N] -> e4m3 values and the scales that map the largest |w| of each expert's output channel, in
    each run of `block` contracted rows (all K where 0), to 448 (a zero run keeps scale 1)."""
    num_experts, k, n = w.shape
    block = block or k
    blocks = -(-k // block)
    w32 = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, blocks * block - k), (0, 0)))  # [E, blocks * block, N]
    amax = jnp.max(jnp.abs(w32.reshape(num_experts, blocks, block, n)), axis=2)  # [E, blocks, N]
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    values = jnp.clip(w32 / jnp.repeat(scale, block, axis=1), -FP8_MAX, FP8_MAX)[:, :k].astype(FP8)
    return Fp8Experts(values, scale, block)


def experts_block(shape: tuple[int, ...], block: int, split_axis: int | None, devices: int) -> int:
    """The block of scales experts [E, K, N] with scales per `block` contracted rows (0: per channel) keep when
    split along `split_axis` over `devices`: `block`, unless K is split and a device's rows are not whole
    blocks; then the largest block that divides both (`Fp8Tensor.with_block`: each scale repeated over the
    finer blocks it covers, the same weights exactly), so that every device holds its rows' own scales. Below
    16 rows (Triton's smallest dot; and the scales would cost a quarter of the values' bytes or more), 0: the
    experts are quantized again per channel."""
    if not block or split_axis != 1 or devices == 1:
        return block
    refined = math.gcd(block, shape[1] // devices)
    return refined if refined >= MIN_EXPERT_BLOCK else 0


def scaled(w: Any, factor: Any) -> Fp8Weight:
    """An Fp8Weight times a factor broadcast against its full shape (a scalar, or constant over the contracted
    axes): the factor goes into the scale, the values stay."""
    factor = jnp.asarray(factor, jnp.float32)
    if factor.ndim == w.ndim:
        if any(n != 1 for n in factor.shape[: w.contracted]):
            raise ValueError("a factor that varies over an Fp8Weight's contracted axes cannot go into its scale")
        factor = factor.reshape(factor.shape[w.contracted:])
    return dataclasses.replace(w, scale=w.scale * factor)


class Quantizer:
    """Which of a model family's parameters `quantization` covers (the layers' weights its `QUANTIZED_WEIGHTS`
    lists, and its stacked experts, `EXPERT_WEIGHTS`), and their quantized form: of an array (jit-compiled once
    per shape and sharding), or of a ShapeDtypeStruct (its shape). The loader quantizes each weight as it
    arrives, so a whole 16-bit model is never on the device."""

    def __init__(self, family: Any, quantization: str, block: int = 0, block_of: BlockOf | None = None) -> None:
        """`block`: scales per run of that many contracted rows and output channel (an FP8 checkpoint's
        block scales' form, for its dummy weights and its compile), 0 per output channel; `block_of`, where
        given, each weight's own instead (`AbstractModel.fp8_block_of`: as a load places them on a mesh)."""
        table = getattr(family, "QUANTIZED_WEIGHTS", None)
        if table is None:
            raise ValueError(f"--quantization {quantization}: not supported for "
                             f"{family.__name__.rsplit('.', 1)[-1]}")
        self.table, self.layers_key = table, family.LAYERS_KEY
        self.embedding_tables = getattr(family, "EMBEDDING_TABLES", ())
        self.expert_weights = getattr(family, "EXPERT_WEIGHTS", ())
        self.block, self.block_of = block, block_of
        self._quantize = jax.jit(quantize_fp8, static_argnums=(1, 2))
        self._quantize_experts = jax.jit(quantize_experts, static_argnums=1)

    def covers(self, path: tuple) -> bool:
        return path[0] == self.layers_key and path[-1] in self.table

    def covers_table(self, path: tuple) -> bool:  # a token-embedding table GGUF blocks can stay in
        return len(path) == 1 and path[0] in self.embedding_tables

    def covers_experts(self, path: tuple) -> bool:  # a mixture's stacked experts GGUF blocks can stay in
        return path[0] == self.layers_key and path[-1] in self.expert_weights

    def stored(self, path: tuple, values: np.ndarray, row_scale: np.ndarray, block: int = 0) -> Fp8Weight:
        """A checkpoint's own e4m3 values, already in the model's layout, with its scales by output row
        (`Fp8Tensor.row_scale`: f32[out], or f32[out, contracted_blocks] for blocks of `block`) laid out over
        the weight's output axes."""
        contracted = self.table[path[-1]]
        outputs = values.shape[contracted:]
        row_scale = np.asarray(row_scale, np.float32)
        if block:
            blocks = -(-math.prod(values.shape[:contracted]) // block)
            if row_scale.shape != (math.prod(outputs), blocks):
                raise ValueError(f"{path}: block scales {row_scale.shape} for a weight {values.shape} in blocks "
                                 f"of {block}")
            scale = row_scale.T.reshape(blocks, *outputs)
        else:
            scale = row_scale.reshape(outputs)
        return Fp8Weight(jax.device_put(values), jax.device_put(scale), contracted=contracted, block=block)

    def stored_experts(self, values: np.ndarray, row_scale: np.ndarray, block: int,
                       place: Any = jax.device_put) -> Fp8Experts:
        """A checkpoint's stacked e4m3 experts in the model's layout [E, K, N], with their scales by output row
        (`Fp8Tensor.row_scale` of the stack: f32[E, N], or f32[E, N, K blocks] for blocks of `block`), placed
        by `place(array)` (each device's share under a mesh)."""
        row_scale = np.asarray(row_scale, np.float32)
        scale = row_scale[:, None, :] if not block else np.swapaxes(row_scale, 1, 2)  # [E, K blocks, N]
        if scale.shape[::2] != values.shape[::2] or scale.shape[1] != -(-values.shape[1] // (block or values.shape[1])):
            raise ValueError(f"expert scales {row_scale.shape} for experts {values.shape} in blocks of {block}")
        return Fp8Experts(place(values), place(scale), block or values.shape[1])

    def __call__(self, path: tuple, value: Any) -> Any:
        if isinstance(value, Fp8Weight | Fp8Experts):
            return value
        experts = self.covers_experts(path) and len(value.shape) == 3  # not a GGUF file's kept blocks
        if not experts and not self.covers(path):
            return value
        block = self.block if self.block_of is None else self.block_of(path, tuple(value.shape))
        if experts:
            if isinstance(value, jax.ShapeDtypeStruct):
                return jax.eval_shape(functools.partial(quantize_experts, block=block), value)
            return self._quantize_experts(value, block)
        contracted = self.table[path[-1]]
        if isinstance(value, jax.ShapeDtypeStruct):
            return jax.eval_shape(functools.partial(quantize_fp8, contracted=contracted, block=block), value)
        return self._quantize(value, contracted, block)


def quantize_state(state: nnx.State, family: Any, quantization: str, block: int = 0,
                   block_of: BlockOf | None = None) -> int:
    """Replaces, in place, each weight `Quantizer` covers by its quantized form (scales per `block` contracted
    rows where given, or per `block_of` the weight); returns how many are quantized (those that already were
    included, experts too)."""
    quantizer = Quantizer(family, quantization, block, block_of)
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    flat = {path: quantizer(path, value) for path, value in flat.items()}
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(flat))
    return sum(isinstance(v, Fp8Weight | Fp8Experts) for v in flat.values())


def quantize_model_state(state: nnx.State, family: Any, quantization: str | None, block: int = 0,
                         block_of: BlockOf | None = None) -> None:
    """`quantize_state` with the start-up log line; nothing without a quantization."""
    if quantization is None:
        return
    start = time.perf_counter()
    count = quantize_state(state, family, quantization, block, block_of)
    jax.block_until_ready(jax.tree.leaves(state))
    scales = f"per {block} contracted rows and output channel" if block else "per output channel"
    logger.info("quantization %s: %d layer weights (stacked experts included) in e4m3 with a scale %s (%.1fs); "
                "the embeddings, the LM head and the routers keep their dtype", quantization, count, scales,
                time.perf_counter() - start)
    _warn_on_cpu(quantization)


def _warn_on_cpu(quantization: str) -> None:
    if jax.default_backend() == "cpu":
        logger.warning("quantization %s on a CPU saves memory, not time: XLA:CPU widens each weight every step "
                       "(a GPU's GEMM reads the 8-bit values)", quantization)


def layer_matmul_dtype(state: nnx.State, rows: int, attention: AttentionConfig) -> str | None:
    """The dtype whose tensor-core rate the layers' dense matmuls of a step of `rows` rows run at, where it
    is not the activations' (the roofline's `layer_peak_flops`): e4m3 where `state` has FP8 weights that
    `activations_in_fp8` gives FP8 activations, else None. (The roofline counts experts' matmuls at the
    activations' rate, e4m3 rows or not: a step's experts are rarely bound by their tensor cores.)"""
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    fp8 = any(isinstance(value, Fp8Weight) and activations_in_fp8(rows, value, attention) for value in flat.values())
    return jnp.dtype(FP8).name if fp8 else None


def log_stored_fp8(state: nnx.State, family: Any) -> None:
    """The start-up line of an FP8 checkpoint's load: its weights in e4m3 and the layer weights it stores in
    16 bits (kept so)."""
    quantizer = Quantizer(family, "fp8")
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    fp8 = [value for value in flat.values() if isinstance(value, Fp8Weight)]
    experts = [value for value in flat.values() if isinstance(value, Fp8Experts)]
    kept = sum((quantizer.covers(path) or quantizer.covers_experts(path))
               and not isinstance(value, Fp8Weight | Fp8Experts) for path, value in flat.items())
    blocks = sorted({value.block for value in fp8} | {value.block for value in experts if not value.per_channel})
    if any(value.per_channel for value in experts):
        blocks.append(0)
    logger.info("quantization fp8 (the checkpoint's): %d layer weights%s in e4m3 with its scales (%s)%s", len(fp8),
                f" and {len(experts)} stacks of experts" if experts else "",
                ", ".join(f"per {b} contracted rows and output channel" if b else "per output channel"
                          for b in sorted(set(blocks))) or "none",
                f"; {kept} it stores in 16 bits stay so" if kept else "")
    if fp8 or experts:
        _warn_on_cpu("fp8")


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """One weight of an FP8 checkpoint as it is stored: e4m3 values [out, in] (HF's Linear layout; a mixture's
    experts stacked [E, out, in], `stack`) and the scale they were divided by: per tensor, per output channel,
    or (`block` B > 0) per output row and run of B input columns (`from_blocks` spreads a checkpoint's block
    grid over the rows)."""

    values: np.ndarray  # f8e4m3fn[*rows, in]: rows [out] or [E, out]
    # f32[] or f32[1] (per tensor), f32[*rows] or f32[*rows, 1] (per channel), f32[*rows, ceil(in / B)] (blocks)
    scale: np.ndarray
    block: int = 0

    @classmethod
    def stack(cls, tensors: "list[Fp8Tensor]") -> "Fp8Tensor":
        """One kind of a layer's experts, [out, in] each with the same form of scales, as one [E, out, in]."""
        if len({tensor.block for tensor in tensors}) != 1:
            raise ValueError("a layer's experts stored with different forms of FP8 scales")
        return cls(np.stack([t.values for t in tensors]), np.stack([t.row_scale() for t in tensors]), tensors[0].block)

    @classmethod
    def from_blocks(cls, values: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> "Fp8Tensor":
        """A weight with a scale per block of `block` = (rows, columns): scale f32[ceil(out / rows),
        ceil(in / columns)] (`weight_scale_inv`, despite its name the factor that dequantizes)."""
        rows, columns = block
        if values.ndim != 2:
            raise ValueError(f"block scales for a {values.ndim}-D weight {values.shape} (stored stacked experts): "
                             "jaxserve reads them for [out, in] weights")
        grid = tuple(-(-n // b) for n, b in zip(values.shape, block, strict=True))
        scale = np.asarray(scale, np.float32)
        if scale.shape != grid:
            raise ValueError(f"block scales {scale.shape} for a weight {values.shape} in blocks of {block}: "
                             f"expected {grid}")
        return cls(values, np.repeat(scale, rows, axis=0)[: values.shape[0]], columns)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def __getitem__(self, rows: slice | np.ndarray) -> "Fp8Tensor":
        """Output rows (what a fused projection's split takes, and a row reorder), with their scales."""
        return Fp8Tensor(self.values[rows], self.row_scale()[rows], self.block)

    def with_block(self, block: int) -> "Fp8Tensor":
        """The same weight with scales per `block` input columns, a divisor of its block: each scale repeated over
        the finer blocks it covers."""
        if not self.block or self.block % block:
            raise ValueError(f"blocks of {block} do not refine an FP8 weight's scales per {self.block or 'channel'}")
        blocks = -(-self.values.shape[-1] // block)
        return Fp8Tensor(self.values, np.repeat(self.row_scale(), self.block // block, axis=-1)[..., :blocks], block)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:  # where a tensor is taken whole
        return self.dequantize() if dtype is None else self.dequantize().astype(dtype)

    def row_scale(self) -> np.ndarray:  # f32[*rows], or f32[*rows, ceil(in / block)]
        scale = np.asarray(self.scale, np.float32)
        if self.block:
            return scale
        rows = self.values.shape[:-1]
        return np.broadcast_to(scale.reshape(()), rows) if scale.size == 1 else scale.reshape(rows)

    def dequantize(self) -> np.ndarray:  # f32[*rows, in]
        values = np.asarray(self.values, np.float32)
        if self.block:
            return values * np.repeat(self.row_scale(), self.block, axis=-1)[..., : values.shape[-1]]
        return values * self.row_scale()[..., None]


def checkpoint_quantization(hf_config: Any) -> str | None:
    """The quantization a checkpoint's `quantization_config` says its weights are in: "fp8" for FP8 weights
    with per-tensor, per-output-channel or per-block scales (vLLM's `fp8` method, or `compressed-tensors` float
    8-bit), None for an unquantized checkpoint; a format jaxserve cannot read raises (rather than loading its
    quantized values as if they were weights)."""
    return None if _fp8_format(hf_config) is None else "fp8"


def checkpoint_fp8_block(hf_config: Any) -> tuple[int, int] | None:
    """An FP8 checkpoint's scale block (rows, columns) of its weights [out, in], or None for per-tensor or
    per-channel scales (and for other checkpoints)."""
    fp8 = _fp8_format(hf_config)
    return None if fp8 is None or fp8 == _PER_TENSOR_OR_CHANNEL else fp8


def checkpoint_contracted_block(hf_config: Any) -> int:
    """How many contracted rows share a scale in the model's form of an FP8 checkpoint's weights (its block's
    columns), 0 where they do not (per-tensor, per-channel, not FP8): the form `Quantizer` gives its dummy
    weights and its deviceless compile."""
    block = checkpoint_fp8_block(hf_config)
    return 0 if block is None else block[1]


_PER_TENSOR_OR_CHANNEL = (0, 0)  # `_fp8_format`'s answer for scales that are not per block


def _fp8_format(hf_config: Any) -> tuple[int, int] | None:
    """None (not FP8), `_PER_TENSOR_OR_CHANNEL`, or the scale block (rows, columns); raises for a
    quantization jaxserve cannot read."""
    config = getattr(hf_config, "quantization_config", None)
    if not config:
        return None
    config = config if isinstance(config, dict) else config.to_dict()
    method = config.get("quant_method")
    if method == "mxfp4":  # GPT-OSS's experts: decoded to the weight dtype as they load (`mxfp4.py`)
        return None
    if method == "fp8":
        block = config.get("weight_block_size")
        return _PER_TENSOR_OR_CHANNEL if not block else _block(block, config)
    if method == "compressed-tensors":
        weights = [group.get("weights") or {} for group in (config.get("config_groups") or {}).values()]
        fp8 = [w for w in weights if w.get("type") == "float" and w.get("num_bits") == 8]
        if weights and len(fp8) == len(weights):
            if all(w.get("strategy") in ("tensor", "channel") for w in fp8):
                return _PER_TENSOR_OR_CHANNEL
            blocks = {tuple(w.get("block_structure") or ()) for w in fp8 if w.get("strategy") == "block"}
            if len(blocks) == 1 and all(w.get("strategy") == "block" for w in fp8):
                return _block(blocks.pop(), config)
    raise ValueError(f"a quantized checkpoint (quant_method {method!r}, {config}) that jaxserve cannot read: it "
                     "reads FP8 weights with per-tensor, per-channel or per-block scales (fp8, compressed-tensors)")


def _block(block: Any, config: dict) -> tuple[int, int]:
    """A config's scale block as (rows, columns); raises for anything else."""
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"an FP8 checkpoint whose scale block {block!r} is not [rows, columns], which jaxserve "
                         f"cannot read ({config})")
    return int(block[0]), int(block[1])


_STATIC_SCALES = (".input_scale",)  # activations' calibrated scales (the KV cache's go on to the loader)


_WEIGHT_SCALES = (".weight_scale", ".weight_scale_inv")  # compressed-tensors' and fp8's; DeepSeek-V3's blocks'


def fp8_checkpoint_tensors(tensors: Iterator[tuple[str, Any]], block: tuple[int, int] | None = None
                           ) -> Iterator[tuple[str, Any]]:
    """An FP8 checkpoint's (name, tensor) stream with each e4m3 `X.weight` paired with its `X.weight_scale`
    (or `X.weight_scale_inv`) into one `Fp8Tensor`, its scales per block of `block` (rows, columns) where
    given (`checkpoint_fp8_block`). Tensors stored in other dtypes pass as they are. The static activation
    scales are dropped: activations stay in 16 bits here."""
    pending: dict[str, dict[str, Any]] = {}  # weight name -> whichever of its values and scale came first
    for name, tensor in tensors:
        if name.endswith(_STATIC_SCALES):
            continue
        scale_suffix = next((suffix for suffix in _WEIGHT_SCALES if name.endswith(suffix)), None)
        if not (scale_suffix or (name.endswith(".weight") and np.dtype(tensor.dtype) == np.dtype(FP8))):
            yield name, tensor
            continue
        weight = name.removesuffix(scale_suffix or "") + (".weight" if scale_suffix else "")
        parts = pending.setdefault(weight, {})
        parts["scale" if scale_suffix else "values"] = np.asarray(tensor)
        if len(parts) == 2:
            del pending[weight]
            values, scale = parts["values"], parts["scale"]
            yield weight, (Fp8Tensor(values, scale) if block is None else Fp8Tensor.from_blocks(values, scale, block))
    if pending:
        raise ValueError(f"FP8 weights without their scales, or scales without weights: {sorted(pending)[:4]}")

