"""Per-layer scales for an FP8 KV cache, folded into the weights.

Why. e4m3 keeps 3 mantissa bits for magnitudes from 2^-6 to 448 and loses precision below (subnormals):
SmolLM2's first layer writes V values with a median of 0.02, 39% of them below 2^-6, which a cache with a
scale of 1 rounds coarsely, and greedy outputs part from a 16-bit cache's within a few tokens
(docs/benchmarks.md). A per-layer scale maps each layer's K and V range onto e4m3's.

How. A calibration pass runs the model once over seeded random tokens with a cache in the model's dtype
and reads each layer's largest |K| and |V|. Each scale is the power of two that brings that maximum to
at most half of 448 (headroom for values the calibration did not see; larger ones saturate). The scales
are folded into the layer's weights, so neither the step nor any attention kernel changes: the K and V
projections (and biases) are divided by their scales, so the cache holds K / s_k and V / s_v; the query
projection is multiplied by s_k, so q.k is unchanged; the output projection by s_v, so softmax(.) V is.
Powers of two make every one of those products exact in floating point. Each model family says which of
its parameters take which factor (`kv_scale_factor` in its module); RoPE is linear, so it commutes.

A checkpoint calibrated for an FP8 cache (vLLM's and llm-compressor's `model.layers.N.self_attn.k_scale` and
`v_scale`: K is about its e4m3 value times k_scale, so the calibration saw a maximum of k_scale x 448) gives
those maxima instead of the calibration pass; the same rule turns them into powers of two.
"""

import logging
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jaxserve.models import quantization, values_are_keys
from jaxserve.models.layers import AttentionMetadata, kv_cache_layers
from jaxserve.ops.attention import kv_cache_shape

logger = logging.getLogger(__name__)

HEADROOM = 2.0  # the calibrated maximum lands at or below 448 / HEADROOM
CALIBRATION_TOKENS = 256
_PAGE_SIZE = 16
# A checkpoint's KV-cache scale: `model.layers.N.self_attn.k_scale` (GPT-2's `transformer.h.N.attn.`), or an
# older `kv_scale` for both; the decoder's own layers only (not a vision tower's). Other layouts (ModelOpt's
# `k_proj.k_scale`) are not read: the calibration pass runs.
_CHECKPOINT_KV_SCALE = re.compile(
    r"^(?:(?:model\.)?layers\.(\d+)\.self_attn|(?:transformer\.)?h\.(\d+)\.attn)\.(k|v|kv)_scale$")
CHECKPOINT_FP8_MAX = 448.0  # e4m3fn's largest value: what a checkpoint's scales map its maxima onto


def checkpoint_kv_scale(name: str) -> tuple[int, str] | None:
    """(layer, "k", "v" or "kv") where checkpoint tensor `name` is a calibrated KV-cache scale; else None."""
    match = _CHECKPOINT_KV_SCALE.match(name)
    return None if match is None else (int(match.group(1) or match.group(2)), match.group(3))


def checkpoint_amax(found: dict[tuple[int, str], float], num_layers: int, keys_only: bool = False) -> np.ndarray | None:
    """f32[L, 2]: each layer's (K, V) maximum that a checkpoint's scales (`checkpoint_kv_scale`'s finds, by
    layer and kind) were calibrated for; None where it has none. Raises where only some layers have them.
    `keys_only` (a cache of keys alone, `models.values_are_keys`): a layer's `k_scale` serves for both."""
    if not found:
        return None
    amax = np.zeros((num_layers, 2), np.float32)
    for layer in range(num_layers):
        for column, kind in enumerate("kv"):
            scale = found.get((layer, kind), found.get((layer, "kv")))
            if scale is None and keys_only:
                scale = found.get((layer, "k"))
            if scale is None:
                raise ValueError(f"the checkpoint has KV-cache scales for some layers, but no {kind}_scale for "
                                 f"layer {layer}")
            amax[layer, column] = scale * CHECKPOINT_FP8_MAX
    return amax


def power_of_two_scale(amax: float, limit: float) -> float:
    """The power of two s with amax / s <= limit / HEADROOM (1 for an all-zero layer)."""
    if not np.isfinite(amax) or amax <= 0.0:
        return 1.0
    return float(2.0 ** np.ceil(np.log2(amax * HEADROOM / limit)))


def calibrate_amax(model: Any, num_tokens: int = CALIBRATION_TOKENS, seed: int = 0) -> np.ndarray:
    """f32[L, 2]: each layer's largest |K| and |V| over one sequence of seeded random tokens."""
    cfg = model.cfg
    num_pages = num_tokens // _PAGE_SIZE + 1
    shape = kv_cache_shape(num_pages, _PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, num_tokens).astype(np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.arange(num_tokens, dtype=jnp.int32) + _PAGE_SIZE,  # page 0 stays the scratch page
        kv_lens=jnp.asarray([num_tokens], jnp.int32),
        page_table=jnp.arange(1, num_pages, dtype=jnp.int32)[None],
        cu_q_lens=jnp.asarray([0, num_tokens], jnp.int32),
    )

    @jax.jit
    def amax(state: nnx.State, tokens: jax.Array) -> jax.Array:
        module = nnx.merge(model.graphdef, state)
        caches = kv_cache_layers(cfg.num_layers, values_are_keys(cfg), lambda: jnp.zeros(shape, model.dtype))
        _, caches = module(tokens, jnp.arange(num_tokens, dtype=jnp.int32), caches, md)
        return jnp.stack([jnp.stack([jnp.abs(k.astype(jnp.float32)).max(), jnp.abs((k if v is None else v).astype(
            jnp.float32)).max()]) for k, v in caches])

    return np.asarray(amax(model.state, jnp.asarray(tokens)))


def fold_kv_scales(model: Any, scales: np.ndarray) -> None:
    """Multiplies, in place in `model.state`, each layer's parameters by the factor its family gives them for
    that layer's (k_scale, v_scale) (`scales`: f32[L, 2])."""
    family = model.spec.module
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(model.state))
    scale = jax.jit(lambda x, factor: (x.astype(jnp.float32) * factor).astype(x.dtype))
    for path, value in flat.items():
        if len(path) < 3 or path[0] != family.LAYERS_KEY:
            continue
        k_scale, v_scale = scales[int(path[1])]
        factor = family.kv_scale_factor(model.cfg, tuple(path[2:]), float(k_scale), float(v_scale))
        if factor is not None:
            flat[path] = (quantization.scaled(value, factor) if isinstance(value, quantization.Fp8Weight)
                          else scale(value, jnp.asarray(factor, jnp.float32)))
    nnx.replace_by_pure_dict(model.state, traverse_util.unflatten_dict(flat))


def apply_fp8_kv_scales(model: Any, cache_dtype: Any) -> np.ndarray:
    """Folds the per-layer scales for a cache of `cache_dtype` (an 8-bit float) into the weights, from the
    checkpoint's KV-cache scales where it has them, else from a calibration pass; f32[L, 2]."""
    start = time.perf_counter()
    limit = float(jnp.finfo(cache_dtype).max)
    amax = checkpoint_amax(model.checkpoint_kv_scales, model.cfg.num_layers, values_are_keys(model.cfg))
    source = "the checkpoint's k_scale and v_scale"
    if amax is None:
        amax, source = calibrate_amax(model), "a calibration pass"
    scales = np.asarray([[power_of_two_scale(a, limit) for a in layer] for layer in amax], np.float32)
    fold_kv_scales(model, scales)
    log2 = np.log2(scales).astype(int)
    logger.info("FP8 KV cache: per-layer power-of-two scales from %s (K 2^%d..2^%d, V 2^%d..2^%d) folded into "
                "the weights in %.1fs", source, log2[:, 0].min(), log2[:, 0].max(), log2[:, 1].min(),
                log2[:, 1].max(), time.perf_counter() - start)
    return scales
