"""A roofline for one step: analytic flops and bytes from the model's shapes and the bucket (no jax).

A step's predicted time is the larger of flops / peak matmul rate and bytes / memory bandwidth: the time
it would take if it ran at the device's peak on whichever resource it needs most. It is a lower bound,
not a measurement: it ignores kernel launch and host overheads (which dominate tiny steps), imperfect
overlap, the sampler's sorts, and how well each kernel actually uses the device.

Counts, per step of a bucket of T tokens and R requests, each request attending `context_len` keys:
- flops: 2 x T x (the layers' matmul weights) + 2 x R x V x D (logits for the R sampled rows)
  + 4 x T x context_len x N x H x L (attention's QK^T and PV); the layers' matmuls at the FP8 peak where
  activations are FP8 too (W8A8), the rest at the activations' dtype's;
- bytes: every weight once (the embedding table only for the T rows it gathers), the KV cache that the
  R requests read (R x context_len x 2 x K x H x L x itemsize, or 1 x where the values are the keys; a layer
  with a sliding window reads at most its window) and the T tokens' K/V it writes.
- a mixture of experts: each token's k experts add 2 x k x (one expert's weights) flops per MoE layer,
  and a step reads the experts its T tokens touch, E x (1 - (1 - k / E)^T) per layer if routing spreads
  tokens evenly (all of them from a few dozen tokens on for Qwen3-30B-A3B's 8 of 128).
Activations are left out: at these sizes they stay in cache or are small next to the weights.
"""

from dataclasses import dataclass
from typing import Any

from jaxserve.models import kv_arrays


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs to know about a decoder: read off the model config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_weights: int  # parameters per decoder layer
    head_weights: int  # the output projection's parameters (V x D; tied or not, it is read once per step)
    other_weights: int  # the rest: norms, biases, GPT-2's position table (an untied embedding is not read whole)
    # A mixture of experts: per MoE layer, its experts (each `expert_weights`), `top_k` routed per token.
    num_moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_weights: int = 0
    windows: tuple[int | None, ...] = ()  # per layer: its sliding window (None: every key); empty: none
    kv_arrays: int = 2  # K and V, or 1 where the cache keeps K alone (its values are its keys: DeepSeek's latent)

    @property
    def weights_read_per_step(self) -> int:
        """Weights every step reads, whatever its tokens (routed experts apart: `experts_read`)."""
        return self.num_layers * self.layer_weights + self.head_weights + self.other_weights

    def experts_read(self, num_tokens: int) -> float:
        """Expert weights a step of `num_tokens` tokens reads: the experts they touch, routed evenly."""
        if not self.num_moe_layers:
            return 0.0
        touched = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** num_tokens)
        return self.num_moe_layers * touched * self.expert_weights

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return self.kv_arrays * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def kv_read_per_request(self, context_len: int, itemsize: int) -> int:
        """The K/V bytes one request's query reads: every layer's keys, up to its window where it has one."""
        per_layer_key = self.kv_arrays * self.num_kv_heads * self.head_dim * itemsize
        windows = self.windows or (None,) * self.num_layers
        return sum(min(context_len, window or context_len) for window in windows) * per_layer_key


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float
    compute_seconds: float | None  # flops / peak; None when the device's peak is unknown
    memory_seconds: float | None  # bytes / bandwidth

    @property
    def seconds(self) -> float | None:
        times = [t for t in (self.compute_seconds, self.memory_seconds) if t is not None]
        return max(times) if times else None

    @property
    def bound(self) -> str | None:
        if self.compute_seconds is None or self.memory_seconds is None:
            return None
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"


def model_shape(num_params: int, cfg: Any) -> ModelShape:
    """Splits a model's parameter count (from its abstract state) into per-layer, head and the rest."""
    d, v = cfg.hidden_size, cfg.vocab_size
    n, k, h, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    # Matmul weights of one layer (q, k, v, o and the MLP); norms and biases are a rounding error.
    gated = hasattr(cfg, "rms_norm_eps")  # Llama-style SwiGLU MLP has three projections, GPT-2's two
    mlp = (3 if gated else 2) * d * f
    moe = getattr(cfg, "moe", None)
    num_moe = sum(getattr(cfg, "moe_layers", ())) if moe is not None else 0
    expert = 3 * d * moe.intermediate_size if moe is not None else 0
    # The dense MLP's weights spread over every layer, so `layer` x L counts the dense layers' MLPs.
    layer = d * (n + 2 * k) * h + n * h * d + mlp * (cfg.num_layers - num_moe) // cfg.num_layers
    tied = getattr(cfg, "tie_word_embeddings", True)
    head = v * d
    embedding = 0 if tied else v * d  # an untied input table is only gathered from, T rows a step
    experts = num_moe * moe.num_experts * expert if moe is not None else 0  # the routers stay in `other`
    other = max(0, num_params - cfg.num_layers * layer - head - embedding - experts)
    return ModelShape(
        vocab_size=v, hidden_size=d, num_layers=cfg.num_layers, num_heads=n, num_kv_heads=k, head_dim=h,
        layer_weights=layer, head_weights=head, other_weights=other, num_moe_layers=num_moe,
        num_experts=moe.num_experts if moe is not None else 0, top_k=moe.top_k if moe is not None else 0,
        expert_weights=expert, windows=tuple(getattr(cfg, "sliding_windows", ())),
        kv_arrays=kv_arrays(cfg),
    )


def step_cost(
    shape: ModelShape,
    num_tokens: int,
    num_reqs: int,
    context_len: int,
    itemsize: int,
    peak_flops: float | None,
    memory_bandwidth: float | None,
    layer_itemsize: int | None = None,
    layer_peak_flops: float | None = None,
) -> StepCost:
    """The roofline of one step: `num_tokens` tokens of `num_reqs` requests, each seeing `context_len` keys.
    `layer_itemsize`: the layers' dense weights' and routed experts' bytes each where they differ from
    `itemsize` (quantized). `layer_peak_flops`: the rate of the layers' dense matmuls where it is not
    `peak_flops` (activations in FP8 too: `quantization.activations_in_fp8`)."""
    s = shape
    attention_flops = 4 * num_tokens * context_len * s.num_heads * s.head_dim * s.num_layers
    expert_flops = 2 * num_tokens * s.num_moe_layers * s.top_k * s.expert_weights
    layer_flops = 2 * num_tokens * s.num_layers * s.layer_weights
    flops = layer_flops + 2 * num_reqs * s.head_weights + attention_flops + expert_flops
    weight_bytes = (s.weights_read_per_step + s.experts_read(num_tokens) + num_tokens * s.hidden_size) * itemsize
    if layer_itemsize is not None:
        weight_bytes -= (s.num_layers * s.layer_weights + s.experts_read(num_tokens)) * (itemsize - layer_itemsize)
    kv_bytes = num_reqs * s.kv_read_per_request(context_len, itemsize) + num_tokens * s.kv_bytes_per_token(itemsize)
    total_bytes = weight_bytes + kv_bytes
    return StepCost(
        flops=float(flops),
        bytes=float(total_bytes),
        compute_seconds=(flops - layer_flops) / peak_flops + layer_flops / (layer_peak_flops or peak_flops)
        if peak_flops else None,
        memory_seconds=total_bytes / memory_bandwidth if memory_bandwidth else None,
    )
