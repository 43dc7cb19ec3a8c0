"""The roofline's analytic counts: parameter bookkeeping, the bound it picks, and agreement with XLA."""

from types import SimpleNamespace

import pytest

from jaxserve.device import target_facts
from jaxserve.roofline import model_shape, step_cost

# Llama-3-8B: 8.03 B parameters, untied 128256 x 4096 embedding and head.
LLAMA_3_8B = SimpleNamespace(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
)
LLAMA_3_8B_PARAMS = 8_030_261_248


def test_llama_3_8b_parameters_split_into_layers_head_and_the_rest():
    shape = model_shape(LLAMA_3_8B_PARAMS, LLAMA_3_8B)
    assert shape.layer_weights == 218_103_808  # q, k, v, o and the SwiGLU MLP
    assert shape.head_weights == 128256 * 4096
    assert 0 <= shape.other_weights < 2_000_000  # the norms
    # A step reads every weight but the embedding table, of which it gathers rows.
    assert shape.weights_read_per_step == LLAMA_3_8B_PARAMS - 128256 * 4096


def test_decode_is_memory_bound_and_a_long_prefill_compute_bound_on_an_h100():
    h100 = target_facts("h100")
    shape = model_shape(LLAMA_3_8B_PARAMS, LLAMA_3_8B)
    peak = h100.peak_flops_for("bfloat16")
    decode = step_cost(shape, 1, 1, 1024, 2, peak, h100.memory_bandwidth)
    assert decode.bound == "memory"
    # One token reads ~15 GB of bf16 weights: ~4.5 ms at 3.35 TB/s.
    assert decode.seconds == pytest.approx(shape.weights_read_per_step * 2 / 3.352e12, rel=0.02)
    prefill = step_cost(shape, 2048, 1, 1024, 2, peak, h100.memory_bandwidth)
    assert prefill.bound == "compute"
    assert prefill.seconds == pytest.approx(prefill.flops / 989.4e12)
    assert prefill.seconds == max(prefill.compute_seconds, prefill.memory_seconds)


def test_fp8_activations_run_the_layers_matmuls_at_the_fp8_peak():
    """A 2,048-token prefill of Llama-3-8B with FP8 weights on an H100: with activations in FP8 too (W8A8) its
    layers' matmuls take half the time at 1,979 TFLOP/s; attention and the head stay at the 16-bit rate."""
    h100 = target_facts("h100")
    shape = model_shape(LLAMA_3_8B_PARAMS, LLAMA_3_8B)
    bf16, fp8 = h100.peak_flops_for("bfloat16"), h100.peak_flops_for("float8_e4m3fn")
    assert fp8 == pytest.approx(2 * bf16, rel=1e-3)
    weights_only = step_cost(shape, 2048, 1, 1024, 2, bf16, h100.memory_bandwidth, layer_itemsize=1)
    both = step_cost(shape, 2048, 1, 1024, 2, bf16, h100.memory_bandwidth, layer_itemsize=1, layer_peak_flops=fp8)
    assert both.flops == weights_only.flops and both.bytes == weights_only.bytes
    layer_flops = 2 * 2048 * 32 * shape.layer_weights
    assert weights_only.compute_seconds - both.compute_seconds == pytest.approx(layer_flops / bf16 - layer_flops / fp8)
    assert both.bound == "compute" and 0.5 < both.seconds / weights_only.seconds < 0.6


def test_unknown_peaks_give_no_prediction():
    shape = model_shape(LLAMA_3_8B_PARAMS, LLAMA_3_8B)
    cost = step_cost(shape, 8, 8, 128, 4, None, None)
    assert cost.seconds is None and cost.bound is None and cost.flops > 0


def test_a_mixture_of_experts_reads_the_experts_its_tokens_touch():
    """Qwen3-30B-A3B: the routers and the always-read weights each step, plus the experts the tokens touch
    (8 of 128 per token): one token reads 8 experts a layer, 256 tokens nearly all 128."""
    from jaxserve.models.moe import MoeConfig

    cfg = SimpleNamespace(hidden_size=2048, vocab_size=151936, num_heads=32, num_kv_heads=4, head_dim=128,
                          intermediate_size=6144, num_layers=48, rms_norm_eps=1e-6, tie_word_embeddings=False,
                          moe=MoeConfig(128, 8, 768, True), moe_layers=(True,) * 48)
    attention = 2048 * (32 + 8) * 128 + 32 * 128 * 2048
    expert = 3 * 2048 * 768
    num_params = 48 * (attention + 128 * (expert + 2048)) + 2 * 151936 * 2048  # norms left out
    shape = model_shape(num_params, cfg)
    assert shape.layer_weights == attention and shape.expert_weights == expert
    assert shape.other_weights == 48 * 128 * 2048, "the routers, read every step"
    assert shape.experts_read(1) == pytest.approx(48 * 8 * expert)
    assert shape.experts_read(256) == pytest.approx(48 * 128 * expert, rel=1e-6)
    one = step_cost(shape, 1, 1, 0, 2, 989e12, 3.35e12)
    assert one.flops == pytest.approx(2 * (48 * (attention + 8 * expert) + 151936 * 2048), rel=1e-6)
    active_bytes = (48 * (attention + 8 * expert) + 151936 * 2048 + 2048) * 2
    kv_write = 2 * 48 * 4 * 128 * 2
    assert one.bytes == pytest.approx(active_bytes + 48 * 128 * 2048 * 2 + kv_write)  # + routers: 3.3B active, not 30B
    # FP8 layer weights and experts: a byte each for what the step reads of them; the routers and head stay 16-bit
    fp8 = step_cost(shape, 1, 1, 0, 2, 989e12, 3.35e12, layer_itemsize=1)
    assert one.bytes - fp8.bytes == pytest.approx(48 * (attention + 8 * expert))


def test_layers_with_a_sliding_window_read_only_the_window():
    """Gemma 3 1B's five local layers of six read 512 keys at most; its global ones every key."""
    from jaxserve.roofline import ModelShape

    windows = (512, 512, 512, 512, 512, None) * 2
    shape = ModelShape(vocab_size=10, hidden_size=8, num_layers=12, num_heads=4, num_kv_heads=1, head_dim=256,
                       layer_weights=0, head_weights=0, other_weights=0, windows=windows)
    per_key = 2 * 256 * 2
    assert shape.kv_read_per_request(4096, 2) == (10 * 512 + 2 * 4096) * per_key
    assert shape.kv_read_per_request(100, 2) == 12 * 100 * per_key
    assert ModelShape(**{**shape.__dict__, "windows": ()}).kv_read_per_request(4096, 2) == 12 * 4096 * per_key
