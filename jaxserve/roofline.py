"""A roofline for one step: analytic flops and bytes from the model's shapes and the bucket (no jax).

A step's predicted time is the larger of flops / peak matmul rate and bytes / memory bandwidth: the time
it would take if it ran at the device's peak on whichever resource it needs most. It is a lower bound,
not a measurement: it ignores kernel launch and host overheads (which dominate tiny steps), imperfect
overlap, the sampler's sorts, and how well each kernel actually uses the device.

Counts, per step of a bucket of T tokens and R requests, each request attending `context_len` keys:
- flops: 2 x T x (the layers' matmul weights) + 2 x R x V x D (logits for the R sampled rows)
  + 4 x T x context_len x N x H x L (attention's QK^T and PV);
- bytes: every weight once (the embedding table only for the T rows it gathers), the KV cache that the
  R requests read (R x context_len x 2 x K x H x L x itemsize) and the T tokens' K/V it writes.
Activations are left out: at these sizes they stay in cache or are small next to the weights.
"""

from dataclasses import dataclass
from typing import Any


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

    @property
    def weights_read_per_step(self) -> int:
        return self.num_layers * self.layer_weights + self.head_weights + self.other_weights

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


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
    layer = d * (n + 2 * k) * h + n * h * d + (3 if gated else 2) * d * f
    tied = getattr(cfg, "tie_word_embeddings", True)
    head = v * d
    embedding = 0 if tied else v * d  # an untied input table is only gathered from, T rows a step
    other = max(0, num_params - cfg.num_layers * layer - head - embedding)
    return ModelShape(
        vocab_size=v, hidden_size=d, num_layers=cfg.num_layers, num_heads=n, num_kv_heads=k, head_dim=h,
        layer_weights=layer, head_weights=head, other_weights=other,
    )


def step_cost(
    shape: ModelShape,
    num_tokens: int,
    num_reqs: int,
    context_len: int,
    itemsize: int,
    peak_flops: float | None,
    memory_bandwidth: float | None,
) -> StepCost:
    """The roofline of one step: `num_tokens` tokens of `num_reqs` requests, each seeing `context_len` keys."""
    s = shape
    attention_flops = 4 * num_tokens * context_len * s.num_heads * s.head_dim * s.num_layers
    flops = 2 * num_tokens * s.num_layers * s.layer_weights + 2 * num_reqs * s.head_weights + attention_flops
    weight_bytes = (s.weights_read_per_step + num_tokens * s.hidden_size) * itemsize
    kv_bytes = (num_reqs * context_len + num_tokens) * s.kv_bytes_per_token(itemsize)
    total_bytes = weight_bytes + kv_bytes
    return StepCost(
        flops=float(flops),
        bytes=float(total_bytes),
        compute_seconds=flops / peak_flops if peak_flops else None,
        memory_seconds=total_bytes / memory_bandwidth if memory_bandwidth else None,
    )
