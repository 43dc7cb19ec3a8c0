"""Weights kept in 8 bits: FP8 (e4m3) values with a float32 scale per output channel (`--quantization fp8`,
vLLM's flag), quantized as they load from a 16- or 32-bit checkpoint, or an FP8 checkpoint's own values and
scales (`fp8_checkpoint_tensors`; a per-tensor scale is that channel scale for every channel).

A quantized weight is an `Fp8Weight` where the plain array was: the same shape, `values` in e4m3 and
`scale` over the output axes (the weight's trailing axes, after the `contracted` ones it is multiplied
over). `layers.dense` multiplies by the values widened to the activations' dtype and scales the
result. Compiled for an H100, XLA fuses the widening into its Triton GEMM, which then reads one byte
per weight instead of two (docs/benchmarks.md). The token embeddings, the LM head, norms, biases and
a mixture's experts stay as they are, as in vLLM's FP8 scheme.

Which parameters are quantized is the model family's `QUANTIZED_WEIGHTS`: a layer parameter's name
maps to its number of contracted axes (1 for [D, N, H] or [K, N]; 2 for an output projection [N, H, D]).
"""

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

logger = logging.getLogger(__name__)

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448


def layer_weight_itemsize(quantization: str | None) -> int | None:
    """Bytes per quantized layer weight (the roofline's `layer_itemsize`); None: the weights' own dtype."""
    return None if quantization is None else np.dtype(FP8).itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    values: Any  # f8e4m3fn[*contracted_axes, *output_axes]
    scale: Any  # f32[*output_axes]: values * scale is the weight
    contracted: int = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    def __getitem__(self, key: Any) -> "Fp8Weight":  # `param[...]` reads the whole weight
        if key is not Ellipsis:
            raise TypeError("an Fp8Weight is read whole (`param[...]`)")
        return self

    def reshape(self, *shape: int) -> "Fp8Weight":
        """A 2-D view [K, N] for one matmul: the contracted axes flattened into K, the output axes into N."""
        values = self.values.reshape(*shape)
        if values.ndim != 2 or values.shape[1] != math.prod(self.scale.shape):
            raise ValueError(f"an Fp8Weight {self.shape} reshapes to [contracted, output] only, not {values.shape}")
        return Fp8Weight(values, self.scale.reshape(-1), contracted=1)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        return (self.values.astype(jnp.float32) * self.scale).astype(dtype)


def quantize_fp8(w: jax.Array, contracted: int) -> Fp8Weight:
    """w [*contracted_axes, *output_axes] -> e4m3 values and the scale that maps each output channel's largest
    |w| to 448 (a zero channel keeps scale 1)."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=tuple(range(contracted)))  # [*output_axes]
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    values = jnp.clip(w32 / scale, -FP8_MAX, FP8_MAX).astype(FP8)
    return Fp8Weight(values, scale, contracted=contracted)


def matmul(x: jax.Array, w: Fp8Weight) -> jax.Array:
    """x [T, K] @ w [K, N] in x's dtype: float32 sums over the values widened to x's dtype, then the scale."""
    y = jnp.dot(x, w.values.astype(x.dtype), preferred_element_type=jnp.float32)  # [T, N]
    return (y * w.scale).astype(x.dtype)


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
    lists), and their quantized form: of an array (jit-compiled once per shape and sharding), or of a
    ShapeDtypeStruct (its shape). The loader quantizes each weight as it arrives, so a whole 16-bit model is
    never on the device."""

    def __init__(self, family: Any, quantization: str) -> None:
        table = getattr(family, "QUANTIZED_WEIGHTS", None)
        if table is None:
            raise ValueError(f"--quantization {quantization}: not supported for "
                             f"{family.__name__.rsplit('.', 1)[-1]}")
        self.table, self.layers_key = table, family.LAYERS_KEY
        self.embedding_tables = getattr(family, "EMBEDDING_TABLES", ())
        self.expert_weights = getattr(family, "EXPERT_WEIGHTS", ())
        self._quantize = jax.jit(quantize_fp8, static_argnums=1)

    def covers(self, path: tuple) -> bool:
        return path[0] == self.layers_key and path[-1] in self.table

    def covers_table(self, path: tuple) -> bool:  # a token-embedding table GGUF blocks can stay in
        return len(path) == 1 and path[0] in self.embedding_tables

    def covers_experts(self, path: tuple) -> bool:  # a mixture's stacked experts GGUF blocks can stay in
        return path[0] == self.layers_key and path[-1] in self.expert_weights

    def stored(self, path: tuple, values: np.ndarray, channel_scale: np.ndarray) -> Fp8Weight:
        """A checkpoint's own e4m3 values, already in the model's layout, with its per-channel scale f32[out]
        laid out over the weight's output axes."""
        contracted = self.table[path[-1]]
        scale = np.asarray(channel_scale, np.float32).reshape(values.shape[contracted:])
        return Fp8Weight(jax.device_put(values), jax.device_put(scale), contracted=contracted)

    def __call__(self, path: tuple, value: Any) -> Any:
        if not self.covers(path) or isinstance(value, Fp8Weight):
            return value
        contracted = self.table[path[-1]]
        if isinstance(value, jax.ShapeDtypeStruct):
            return jax.eval_shape(functools.partial(quantize_fp8, contracted=contracted), value)
        return self._quantize(value, contracted)


def quantize_state(state: nnx.State, family: Any, quantization: str) -> int:
    """Replaces, in place, each weight `Quantizer` covers by its quantized form; returns how many are
    quantized (those that already were included)."""
    quantizer = Quantizer(family, quantization)
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    flat = {path: quantizer(path, value) for path, value in flat.items()}
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(flat))
    return sum(isinstance(v, Fp8Weight) for v in flat.values())


def quantize_model_state(state: nnx.State, family: Any, quantization: str | None) -> None:
    """`quantize_state` with the start-up log line; nothing without a quantization."""
    if quantization is None:
        return
    start = time.perf_counter()
    count = quantize_state(state, family, quantization)
    jax.block_until_ready(jax.tree.leaves(state))
    logger.info("quantization %s: %d layer weights in e4m3 with a scale per output channel (%.1fs); the "
                "embeddings and the LM head keep their dtype", quantization, count, time.perf_counter() - start)
    if jax.default_backend() == "cpu":
        logger.warning("quantization %s on a CPU saves memory, not time: XLA:CPU widens each weight every step "
                       "(a GPU's GEMM reads the 8-bit values)", quantization)


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """One weight of an FP8 checkpoint as it is stored: e4m3 values [out, in] (HF's Linear layout) and the
    scale they were divided by, per tensor or per output channel."""

    values: np.ndarray  # f8e4m3fn[out, in]
    scale: np.ndarray  # f32[] or f32[1] (per tensor), f32[out] or f32[out, 1] (per channel)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def __getitem__(self, rows: slice) -> "Fp8Tensor":
        """Output rows (what a fused projection's split takes), with their scales."""
        return Fp8Tensor(self.values[rows], self.channel_scale()[rows])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:  # where a tensor is taken whole
        return self.dequantize() if dtype is None else self.dequantize().astype(dtype)

    def channel_scale(self) -> np.ndarray:  # f32[out]
        scale = np.asarray(self.scale, np.float32).reshape(-1)
        return np.broadcast_to(scale, (self.values.shape[0],)) if scale.size == 1 else scale

    def dequantize(self) -> np.ndarray:  # f32[out, in]
        return np.asarray(self.values, np.float32) * self.channel_scale()[:, None]


def checkpoint_quantization(hf_config: Any) -> str | None:
    """The quantization a checkpoint's `quantization_config` says its weights are in: "fp8" for FP8 weights
    with per-tensor or per-output-channel scales (vLLM's `fp8` method, or `compressed-tensors` float 8-bit),
    None for an unquantized checkpoint; a format jaxserve cannot read raises (rather than loading its
    quantized values as if they were weights)."""
    config = getattr(hf_config, "quantization_config", None)
    if not config:
        return None
    config = config if isinstance(config, dict) else config.to_dict()
    method = config.get("quant_method")
    if method == "mxfp4":  # GPT-OSS's experts: decoded to the weight dtype as they load (`mxfp4.py`)
        return None
    if method == "fp8" and not config.get("weight_block_size"):
        return "fp8"
    if method == "compressed-tensors":
        weights = [group.get("weights") or {} for group in (config.get("config_groups") or {}).values()]
        if weights and all(w.get("type") == "float" and w.get("num_bits") == 8
                           and w.get("strategy") in ("tensor", "channel") for w in weights):
            return "fp8"
    raise ValueError(f"a quantized checkpoint (quant_method {method!r}, {config}) that jaxserve cannot read: it "
                     "reads FP8 weights with per-tensor or per-channel scales (fp8, compressed-tensors)")


_STATIC_SCALES = (".input_scale",)  # activations' calibrated scales (the KV cache's go on to the loader)


def fp8_checkpoint_tensors(tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """An FP8 checkpoint's (name, tensor) stream with each e4m3 `X.weight` paired with its `X.weight_scale`
    into one `Fp8Tensor`. The static activation scales are dropped: activations stay in 16 bits here."""
    pending: dict[str, dict[str, Any]] = {}  # weight name -> whichever of its values and scale came first
    for name, tensor in tensors:
        if name.endswith(_STATIC_SCALES):
            continue
        is_scale = name.endswith(".weight_scale")
        if not (is_scale or (name.endswith(".weight") and np.dtype(tensor.dtype) == np.dtype(FP8))):
            yield name, tensor
            continue
        weight = name.removesuffix("_scale")
        parts = pending.setdefault(weight, {})
        parts["scale" if is_scale else "values"] = np.asarray(tensor)
        if len(parts) == 2:
            del pending[weight]
            yield weight, Fp8Tensor(parts["values"], parts["scale"])
    if pending:
        raise ValueError(f"FP8 weights without their scales, or scales without weights: {sorted(pending)[:4]}")

