"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen2-MoE, GPT-OSS, OLMoE, Granite-MoE, DeepSeek): top-k
routing and the experts' matmuls grouped by expert, and a shared expert, a dense SwiGLU MLP every token goes
through (Qwen2-MoE's output scaled by a sigmoid gate of the token; DeepSeek's and Granite's not).

Each token's router picks its `top_k` experts (softmax over all experts in float32, then the top k, their
weights renormalised where the model says so; GPT-OSS: the top k logits, then a softmax over those k).
GPT-OSS's router and experts have biases, and its SwiGLU is clamped: (clip(up) + 1) * g * sigmoid(alpha * g)
with g = min(gate, limit). The T x k (token, expert) assignments are sorted by expert,
so each expert's tokens are one contiguous run of rows, and one grouped matmul multiplies every run by its
own expert's weights: gate and up [E, D, F], then down [E, F, D]. Each row's output, times its routing
weight, is added back to its token. Compute follows the T x k assignments, never T x E.

The grouped matmul (`grouped_matmul`): on Hopper (compute capability 9.0), for steps of many rows, JAX's
Mosaic GPU ragged dot (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`: TMA loads, wgmma, one pass over each
expert's rows); on CUDA GPUs of sm_80 and later, for the other steps (on Hopper, those of few rows: decode),
`ops.grouped_matmul_triton`, which cuts each expert's rows into tiles of its own and reads each expert that has
rows once; on a CPU with the native kernels and bfloat16 experts, `cpu_kernels.grouped_matmul_bf16`, which
multiplies each expert's rows by its weights and reads no other expert's (and a GGUF file's experts kept in
their blocks, `gguf_weights.GgufExperts`, the same way in integers); elsewhere `jax.lax.ragged_dot`, which
XLA:GPU and XLA:CPU compute densely, every row against every expert (E times the work), which is right but
slow.

FP8 experts (`quantization.Fp8Experts`: an FP8 checkpoint's, or `--quantization fp8`'s) keep half the memory
of 16-bit ones. On CUDA GPUs of sm_89 and later (and with the interpreted kernels), every step multiplies them
through the same Triton kernel, which widens their e4m3 tiles in registers: one byte a weight. On Ada (sm_89)
steps whose experts have `quantization.W8A8_MIN_ROWS` rows each or more on average round the rows to e4m3
too, as the dense layers do (`quantization.experts_in_fp8`), and the kernel multiplies e4m3 by e4m3 on FP8
tensor cores. Elsewhere they
take the paths above: with a scale per expert and output channel, over their values widened to the rows'
dtype, each row's product then scaled by its own expert's scales; with block scales (DeepSeek-V3's), over the
experts dequantized for the step.

With a mesh the experts run under `shard_map`, in one of two layouts (`MoeConfig.expert_parallel`):
- tensor parallel (vLLM's default): every device holds every expert's slice of the F axis; the down
  projection's partial sums are added over devices.
- expert parallel (`--enable-expert-parallel`): each device holds E / n whole experts and computes the
  rows routed to them (the sorted rows rolled so its own experts' rows come first; rows past them come back
  as zeros from `ragged_dot`); the per-device outputs are added over devices.
Tokens and routing are replicated on every device either way, as the attention's output is.

Axis letters: T tokens, D hidden, E experts, F expert MLP width, A = T * k assignments.
"""

import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve.models import gguf_weights
from jaxserve.models.gguf_weights import GgufExperts, GgufTensor, stack_expert_tensors
from jaxserve.models.layers import GatedMlp, param
from jaxserve.models.quantization import Fp8Experts, Fp8Tensor, experts_in_fp8, quantize_rows
from jaxserve.ops import cpu_kernels, grouped_matmul_triton
from jaxserve.ops.attention import AttentionConfig
from jaxserve.parallel import TP_AXIS


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's F
    normalize_top_k: bool  # renormalise the k chosen weights to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob)
    expert_parallel: bool = False  # with a mesh: whole experts per device, not slices of every expert
    shared_expert_size: int = 0  # Qwen2-MoE, Granite-MoE-Shared: the shared expert's F (0: none)
    shared_expert_gated: bool = True  # Qwen2-MoE's shared expert's output scaled by a sigmoid gate a token
    softmax_after_top_k: bool = False  # GPT-OSS: the k largest logits first, then a softmax over them
    biases: bool = False  # GPT-OSS: the router's logits and every expert projection's output have biases
    swiglu_limit: float | None = None  # GPT-OSS's clamped SwiGLU (module docstring); None: silu(gate) * up
    swiglu_alpha: float = 1.0
    # DeepSeek's routers (`route_deepseek`): scores by softmax or sigmoid (V3), a choice limited to the best
    # `top_groups` of `num_groups` groups of experts, a learned bias on the scores for the choice only (V3's
    # `e_score_correction_bias`), the chosen weights scaled by `routed_scaling`
    scoring: str = "softmax"
    num_groups: int = 1
    top_groups: int = 1
    score_correction: bool = False
    routed_scaling: float = 1.0

    @property
    def deepseek_routing(self) -> bool:
        return self.scoring != "softmax" or self.num_groups > 1 or self.score_correction or self.routed_scaling != 1.0


def expert_activation(gate: jax.Array, up: jax.Array, limit: float | None, alpha: float) -> jax.Array:
    """silu(gate) * up, or GPT-OSS's clamped SwiGLU where the config gives a limit."""
    if limit is None:
        return jax.nn.silu(gate) * up
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1.0) * gate * jax.nn.sigmoid(gate * alpha)


def route(logits: jax.Array, top_k: int, normalize: bool, after_top_k: bool = False) -> tuple[jax.Array, jax.Array]:
    """f32[T, E] router logits -> (f32[T, k] weights, i32[T, k] experts): softmax, then the top k; with
    `after_top_k`, the top k logits, then their softmax."""
    if after_top_k:
        top, experts = jax.lax.top_k(logits.astype(jnp.float32), top_k)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def route_deepseek(logits: jax.Array, moe: MoeConfig, correction: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """f32[T, E] router logits -> (f32[T, k] weights, i32[T, k] experts), as DeepSeek-V2 and V3 route: each
    expert's score (softmax over the experts, or its sigmoid); with groups, only the experts of the
    `top_groups` best groups eligible, a group scored by its best expert (V2) or, with V3's correction bias
    (f32[E], added to the scores for the choice), its best two; the top k eligible; their weights are their
    scores (without the bias), renormalised where the model says so, times `routed_scaling`."""
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if moe.scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if correction is None else scores + correction
    if moe.num_groups > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.reshape(num_tokens, moe.num_groups, num_experts // moe.num_groups)  # [T, G, E/G]
        group_scores = grouped.max(axis=-1) if correction is None else jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
        best_groups = jax.lax.top_k(group_scores, moe.top_groups)[1]  # i32[T, top_groups]
        eligible = jax.nn.one_hot(best_groups, moe.num_groups, dtype=jnp.bool_).any(axis=1)  # [T, G]
        choice = jnp.where(jnp.repeat(eligible, num_experts // moe.num_groups, axis=1), choice, -jnp.inf)
    experts = jax.lax.top_k(choice, moe.top_k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.normalize_top_k:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * moe.routed_scaling, experts.astype(jnp.int32)


def grouped_expert_mlp(
    x: jax.Array,  # [T, D]
    weights: jax.Array,  # f32[T, k]
    experts: jax.Array,  # i32[T, k], global expert ids
    gate: jax.Array,  # [E_local, D, F_local]
    up: jax.Array,  # [E_local, D, F_local]
    down: jax.Array,  # [E_local, F_local, D]
    *,
    num_experts: int,
    first_expert: jax.Array | int = 0,  # the global id of this device's first expert (expert parallel)
    hopper: bool = False,  # compiled for compute capability 9.0: the Mosaic GPU grouped matmul
    native: bool = False,  # the native CPU kernel for bfloat16 experts (`grouped_matmul`)
    kernel: str | None = None,  # `grouped_matmul`'s Triton kernel for 16-bit experts: "compiled", "interpret"
    fp8_kernel: str | None = None,  # and for FP8 experts (None: XLA's paths)
    fp8_rows: bool = False,  # FP8 experts through it meet rows in e4m3 (`quantization.experts_in_fp8`)
    gate_bias: jax.Array | None = None,  # [E_local, F_local] (GPT-OSS)
    up_bias: jax.Array | None = None,  # [E_local, F_local]
    swiglu_limit: float | None = None,  # `expert_activation`
    swiglu_alpha: float = 1.0,
) -> jax.Array:  # f32[T, D]: this device's share of sum_k weight * expert(x), less the down biases
    """The routed experts' SwiGLU MLP over the assignments, grouped by expert. Rows routed to experts this
    device does not hold contribute zeros (the grouped matmuls return zeros for rows past their groups)."""
    num_tokens, top_k = experts.shape
    num_local = gate.shape[0]
    flat_experts = experts.reshape(-1)  # i32[A]
    order = jnp.argsort(flat_experts, stable=True)  # assignments by expert
    token_of_row = order // top_k  # i32[A]
    counts = jnp.zeros(num_experts, jnp.int32).at[flat_experts].add(1)  # i32[E]: rows per expert
    local_counts = jax.lax.dynamic_slice_in_dim(counts, first_expert, num_local)  # i32[E_local]
    rows_before = jnp.cumsum(counts) - counts  # i32[E]: each expert's first sorted row
    shift = rows_before[first_expert]
    rows = x[token_of_row]  # [A, D]
    if num_local != num_experts:  # this device's experts' rows first; the rows past them come back as zeros
        rows = jnp.roll(rows, -shift, axis=0)
    h = grouped_matmul(rows, gate, local_counts, hopper, native, kernel, fp8_kernel, fp8_rows)  # f32[A, F]
    u = grouped_matmul(rows, up, local_counts, hopper, native, kernel, fp8_kernel, fp8_rows)
    if gate_bias is not None:  # each row's own expert's biases (rows of other devices' experts come to 0 later)
        expert_of_row = flat_experts[order]  # i32[A], sorted
        if num_local != num_experts:
            expert_of_row = jnp.roll(expert_of_row, -shift)
        local = jnp.clip(expert_of_row - first_expert, 0, num_local - 1)
        h, u = h + gate_bias[local].astype(jnp.float32), u + up_bias[local].astype(jnp.float32)
    h = expert_activation(h, u, swiglu_limit, swiglu_alpha).astype(x.dtype)
    out = grouped_matmul(h, down, local_counts, hopper, native, kernel, fp8_kernel, fp8_rows)  # f32[A, D]
    if num_local != num_experts:
        out = jnp.roll(out, shift, axis=0)
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[token_of_row].add(out)


# The Mosaic GPU kernel's tiles: rows of the sorted assignments, output columns, the contraction's step.
_MGPU_TILES = dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)


# On Hopper, where XLA's own ragged dot's dense [G, A, N] temporary would pass this (steps of many rows), 16-bit
# experts take the Mosaic GPU kernel (wgmma); the steps of fewer rows take the Triton kernel, or the ragged dot
# without it. Which kernel serves which rows better is for a GPU to measure (`benchmarks/experts_matmul.py`).
_DENSE_TEMP_BYTES = 64 * 2**20


def _mgpu_tiles(k: int, n: int) -> dict[str, int] | None:
    """The Mosaic GPU kernel's tiles for [K, N] experts, or None where none fit: output columns 128 at a time,
    or 64 where N is no multiple of 128 (GPT-OSS's 2,880; the kernel's own tuning tries both)."""
    if k % _MGPU_TILES["block_k"]:
        return None
    block_n = next((size for size in (_MGPU_TILES["block_n"], 64) if n % size == 0), None)
    return None if block_n is None else {**_MGPU_TILES, "block_n": block_n}


def grouped_matmul(
    rows: jax.Array,  # [A, K], sorted by group
    w: jax.Array | GgufExperts | Fp8Experts,  # [G, K, N]
    group_sizes: jax.Array,  # i32[G]: rows of each group, in order; rows past their sum come back as zeros
    hopper: bool = False,
    native: bool = False,  # a CPU with the native kernels: bfloat16 operands go to `grouped_matmul_bf16`
    kernel: str | None = None,  # `AttentionConfig.expert_kernel`: 16-bit experts through `grouped_matmul_triton`
    fp8_kernel: str | None = None,  # `AttentionConfig.fp8_expert_kernel`: FP8 experts through it
    fp8_rows: bool = False,  # those meet the rows rounded to e4m3 (`quantization.experts_in_fp8`)
) -> jax.Array:  # f32[A, N]
    """rows[group g] @ w[g] for every group: a GGUF file's blocks through their native kernel, FP8 experts
    through the Triton kernel where it runs and fits, else widened (module docstring), the Mosaic GPU kernel on
    Hopper where the shapes fit its tiles and the rows are many (`_DENSE_TEMP_BYTES`), the native kernel on a
    CPU for bfloat16 operands, the Triton kernel for 16-bit experts where it runs and fits, else
    `jax.lax.ragged_dot`."""
    if isinstance(w, GgufExperts):
        return gguf_weights.grouped_matmul(rows, w, group_sizes)
    (num_rows, k), (num_groups, _, n) = rows.shape, w.shape
    if isinstance(w, Fp8Experts):
        if fp8_kernel is not None and grouped_matmul_triton.fits(k, n, w.block):
            row_scale = None
            if fp8_rows and grouped_matmul_triton.fits(k, n, w.block, fp8_rows=True):
                # a scale per row, or per row and block of the experts' scales (the dense layers' W8A8)
                rows, row_scale = quantize_rows(rows, 0 if w.per_channel else w.block)
            return grouped_matmul_triton.grouped_matmul(rows, w.values, group_sizes, w.scale, w.block, row_scale,
                                                        interpret=fp8_kernel == "interpret")
        if not w.per_channel:  # widened in 16 bits, then as 16-bit experts are
            return grouped_matmul(rows, w.dequantize(rows.dtype), group_sizes, hopper, native, kernel)
        out = grouped_matmul(rows, w.values.astype(rows.dtype), group_sizes, hopper, native)  # f32[A, N]
        return out * w.scale[group_of_rows(group_sizes, num_rows), 0]  # rows past the groups stay zeros
    rows = rows.astype(w.dtype)  # a layer's experts may mix kept blocks (float32 rows) with 16-bit weights
    if native and w.dtype == jnp.bfloat16:
        return cpu_kernels.grouped_matmul_bf16(rows, w, group_sizes)
    few_rows = num_groups * num_rows * max(k, n) * 4 <= _DENSE_TEMP_BYTES
    tiles = _mgpu_tiles(k, n) if hopper and not few_rows else None
    if tiles is None:
        if (kernel is not None and w.dtype in grouped_matmul_triton.SIXTEEN_BIT
                and grouped_matmul_triton.fits(k, n)):
            return grouped_matmul_triton.grouped_matmul(rows, w, group_sizes, interpret=kernel == "interpret")
        return jax.lax.ragged_dot(rows, w, group_sizes, preferred_element_type=jnp.float32)
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    out = ragged_dot_mgpu.ragged_dot(rows, w, group_sizes=group_sizes, **tiles).astype(jnp.float32)
    covered = jnp.arange(rows.shape[0]) < group_sizes.sum()  # the kernel leaves rows past the groups unwritten
    return jnp.where(covered[:, None], out, 0.0)


def group_of_rows(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """i32[A]: each sorted row's group (rows past the groups: the last group)."""
    ends = jnp.cumsum(group_sizes)  # i32[G]
    group = jnp.searchsorted(ends, jnp.arange(num_rows), side="right", method="compare_all")  # no loop: [A, G] compares
    return jnp.minimum(group, group_sizes.shape[0] - 1)


def is_hopper(attention: AttentionConfig) -> bool:
    """Whether the step is compiled for a Hopper GPU (the Mosaic GPU kernels' target)."""
    return attention.hopper


class SparseMoeBlock(nnx.Module):
    """Router [D, E] and the experts' SwiGLU weights, stacked by expert; Qwen2-MoE's shared expert and its
    gate [D, 1] beside them."""

    def __init__(self, cfg: MoeConfig, hidden_size: int, attention: AttentionConfig, weight_dtype: Any) -> None:
        e, d, f = cfg.num_experts, hidden_size, cfg.intermediate_size
        if attention.mesh is not None:  # each device's share must be whole
            split, what = (e, "experts") if cfg.expert_parallel else (f, "experts' MLP width")
            if split % attention.mesh.size:
                raise ValueError(f"{split} {what} do not split over {attention.mesh.size} devices"
                                 + ("" if cfg.expert_parallel else "; try --enable-expert-parallel"))
        self.router = param(d, e, dtype=weight_dtype)
        self.experts_gate = param(e, d, f, dtype=weight_dtype)
        self.experts_up = param(e, d, f, dtype=weight_dtype)
        self.experts_down = param(e, f, d, dtype=weight_dtype)
        if cfg.shared_expert_size:
            self.shared_expert = GatedMlp(d, cfg.shared_expert_size, weight_dtype, attention, None, "silu")
            if cfg.shared_expert_gated:
                self.shared_expert_gate = param(d, 1, dtype=weight_dtype)
        if cfg.score_correction:
            self.router_correction = param(e, dtype=jnp.float32)
        if cfg.biases:
            self.router_bias = param(e, dtype=weight_dtype)
            self.experts_gate_bias = param(e, f, dtype=weight_dtype)
            self.experts_up_bias = param(e, f, dtype=weight_dtype)
            self.experts_down_bias = param(e, d, dtype=weight_dtype)
        self.moe = cfg
        self.attention = attention

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        routed = self._routed(x)
        if not self.moe.shared_expert_size:
            return routed
        shared = self.shared_expert(x).astype(jnp.float32)
        if self.moe.shared_expert_gated:
            gate_w = self.shared_expert_gate[...]
            shared = shared * jax.nn.sigmoid(
                jnp.dot(x.astype(gate_w.dtype), gate_w, preferred_element_type=jnp.float32))  # * f32[T, 1]
        return (routed.astype(jnp.float32) + shared).astype(x.dtype)

    def _routed(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, D]: sum_k weight * expert(x)
        router = self.router[...]
        # Router logits summed and kept in float32: rounded to a 16-bit dtype, near-tied experts swap places.
        logits = jnp.dot(x.astype(router.dtype), router, preferred_element_type=jnp.float32)  # f32[T, E]
        moe = self.moe
        if moe.biases:
            logits = logits + self.router_bias[...].astype(jnp.float32)
        if moe.deepseek_routing:
            correction = self.router_correction[...] if moe.score_correction else None
            weights, experts = route_deepseek(logits, moe, correction)
        else:
            weights, experts = route(logits, moe.top_k, moe.normalize_top_k, moe.softmax_after_top_k)
        gate, up, down = self.experts_gate[...], self.experts_up[...], self.experts_down[...]
        rows = x if isinstance(gate, GgufExperts | Fp8Experts) else x.astype(gate.dtype)  # blocks take x as it is
        num_experts, mesh, hopper = moe.num_experts, self.attention.mesh, is_hopper(self.attention)
        biases = (self.experts_gate_bias[...], self.experts_up_bias[...]) if moe.biases else ()
        activation = dict(swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha)
        if mesh is None:
            out = grouped_expert_mlp(rows, weights, experts, gate, up, down, num_experts=num_experts, hopper=hopper,
                                     native=self.attention.native_matmuls, **self._kernels(x.shape[0]),
                                     **_named(biases), **activation)
        else:
            out = self._split_over_mesh(rows, weights, experts, gate, up, down, biases, activation)
        if moe.biases:  # sum_k weight * the chosen experts' down biases, once whatever the mesh
            chosen = self.experts_down_bias[...].astype(jnp.float32)[experts]  # f32[T, k, D]
            out = out + jnp.einsum("tk,tkd->td", weights, chosen)
        return out.astype(x.dtype)

    def _kernels(self, num_tokens: int) -> dict[str, Any]:
        """The Triton grouped matmul's modes for 16-bit and FP8 experts, and whether FP8 ones meet rows in e4m3
        in a step of `num_tokens` (`grouped_expert_mlp`)."""
        rows_per_expert = num_tokens * self.moe.top_k // self.moe.num_experts
        return {"kernel": self.attention.expert_kernel, "fp8_kernel": self.attention.fp8_expert_kernel,
                "fp8_rows": experts_in_fp8(rows_per_expert, self.attention)}

    def _split_over_mesh(self, rows, weights, experts, gate, up, down, biases, activation) -> jax.Array:
        """The experts under `shard_map`: each device its slice of every expert's F, or its whole experts
        (module docstring), the outputs added over the devices."""
        num_experts, hopper, expert_parallel = self.moe.num_experts, is_hopper(self.attention), self.moe.expert_parallel
        kernels = self._kernels(rows.shape[0])

        def local(rows, weights, experts, gate, up, down, *biases):  # one device's experts, or its slice of each
            first = jax.lax.axis_index(TP_AXIS) * gate.shape[0] if expert_parallel else 0
            out = grouped_expert_mlp(rows, weights, experts, gate, up, down, num_experts=num_experts,
                                     first_expert=first, hopper=hopper, **kernels, **_named(biases), **activation)
            return jax.lax.psum(out, TP_AXIS)

        whole = PartitionSpec()
        specs = [expert_spec(w, axis) for w, axis in zip((gate, up, down), expert_split_axes(expert_parallel),
                                                          strict=True)]
        bias_spec = PartitionSpec(TP_AXIS) if expert_parallel else PartitionSpec(None, TP_AXIS)  # [E, F]
        return jax.shard_map(local, mesh=self.attention.mesh,
                             in_specs=(whole, whole, whole, *specs, *(bias_spec for _ in biases)), out_specs=whole,
                             check_vma=False)(rows, weights, experts, gate, up, down, *biases)


def expert_spec(w: jax.Array | Fp8Experts, axis: int) -> PartitionSpec | Fp8Experts:
    """The experts' split along `axis` as `shard_map` takes it: FP8 experts' scales split with their values,
    but a scale per channel (one block of K) whole where K is split."""
    spec = PartitionSpec(*(None,) * axis, TP_AXIS)
    if not isinstance(w, Fp8Experts):
        return spec
    return Fp8Experts(spec, PartitionSpec() if w.scale.shape[axis] == 1 else spec, w.block)


def _named(biases: tuple) -> dict[str, jax.Array]:
    """The experts' (gate, up) biases, or none, as `grouped_expert_mlp` takes them."""
    return dict(zip(("gate_bias", "up_bias"), biases, strict=True)) if biases else {}


_EXPERT_RE = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_KIND = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class ExpertStacker:
    """A checkpoint's per-expert weights (`model.layers.i.mlp.experts.j.gate_proj.weight`, Mixtral's `w1`...)
    stacked into one [E, out, in] tensor per layer and kind (`model.layers.i.mlp.experts_gate`...), each
    once its last expert has arrived (a GGUF file's blocks stacked as blocks, `stack_expert_tensors`; an FP8
    checkpoint's values with their scales, `Fp8Tensor.stack`)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.pending: dict[tuple[str, str], dict[int, Any]] = {}

    def add(self, name: str, tensor: Any) -> list[tuple[str, Any]] | None:
        """None where `name` is no expert's weight; else what it completes: its layer and kind's stack, or
        nothing yet."""
        if not self.num_experts or (match := _EXPERT_RE.match(name)) is None:
            return None
        layer, expert, kind = match.group(1), int(match.group(2)), _EXPERT_KIND[match.group(3)]
        experts = self.pending.setdefault((layer, kind), {})
        experts[expert] = tensor if isinstance(tensor, GgufTensor | Fp8Tensor) else np.asarray(tensor)  # blocks stay
        if len(experts) < self.num_experts:
            return []
        del self.pending[(layer, kind)]
        ordered = [experts[e] for e in range(len(experts))]
        if all(isinstance(tensor, Fp8Tensor) for tensor in ordered):  # an FP8 checkpoint's e4m3 values and scales
            stacked = Fp8Tensor.stack(ordered)
        else:  # a GGUF file's blocks of one format stay blocks; any other mix becomes floats
            stacked = stack_expert_tensors(ordered)
        return [(f"model.layers.{layer}.mlp.experts_{kind}", stacked)]

    def check_complete(self) -> None:
        if self.pending:
            (layer, kind), experts = next(iter(self.pending.items()))
            raise ValueError(f"layer {layer}'s {kind} weights: {len(experts)} of {self.num_experts} experts found")


def expert_split_axes(expert_parallel: bool) -> tuple[int, int, int]:
    """The axis of (experts_gate, experts_up, experts_down) split over the mesh: the experts' axis, or F."""
    return (0, 0, 0) if expert_parallel else (2, 2, 1)
