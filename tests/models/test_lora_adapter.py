"""Reading PEFT adapters (`models/lora.py`): the layout and scale each projection's slot receives, fused
projections split, and every adapter jaxserve cannot serve as it means refused with its reason."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.models import llama
from jaxserve.models.peft import LoraLayout, read_adapter, slot_values

# A two-layer model's stacks: (in, out) per projection; layer 1's MLP is a mixture of experts (no stacks).
D, Q, KV, F = 8, 12, 4, 16
SHAPES = {("layers", 0, "self_attn", "lora", "q"): (D, Q), ("layers", 0, "self_attn", "lora", "k"): (D, KV),
          ("layers", 0, "self_attn", "lora", "v"): (D, KV), ("layers", 0, "self_attn", "lora", "o"): (Q, D),
          ("layers", 0, "mlp", "lora", "gate"): (D, F), ("layers", 0, "mlp", "lora", "up"): (D, F),
          ("layers", 0, "mlp", "lora", "down"): (F, D), ("layers", 1, "self_attn", "lora", "q"): (D, Q)}
LAYOUT = LoraLayout(SHAPES, llama.LORA_TARGETS, llama.LORA_FUSED_TARGETS, 16)


def _write(directory, tensors, **config):
    directory.mkdir(exist_ok=True)
    save_file({k: v.astype(np.float32) for k, v in tensors.items()}, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, **config}))
    return str(directory)


def _pair(rng, module: str, in_dim: int, out_dim: int, rank: int = 2, layer: int = 0):
    stem = f"base_model.model.model.layers.{layer}.{module}"
    return {f"{stem}.lora_A.weight": rng.normal(size=(rank, in_dim)),
            f"{stem}.lora_B.weight": rng.normal(size=(out_dim, rank))}


@pytest.mark.parametrize("rslora", [False, True])
def test_a_and_b_are_transposed_and_b_takes_the_scale(tmp_path, rslora):
    rng = np.random.default_rng(0)
    tensors = _pair(rng, "self_attn.o_proj", Q, D)
    adapter = read_adapter("x", _write(tmp_path / "a", tensors, use_rslora=rslora), LAYOUT)
    a, b = adapter.weights[("layers", 0, "self_attn", "lora", "o")]
    scale = 4 / np.sqrt(2) if rslora else 4 / 2
    stem = "base_model.model.model.layers.0.self_attn.o_proj"
    np.testing.assert_allclose(a, tensors[f"{stem}.lora_A.weight"].T, rtol=1e-6)
    np.testing.assert_allclose(b, scale * tensors[f"{stem}.lora_B.weight"].T, rtol=1e-6)
    assert adapter.rank == 2 and len(adapter.weights) == 1
    x = rng.normal(size=(3, Q))  # the delta a token gets: x A^T B^T scale, as PEFT computes it
    np.testing.assert_allclose(x @ a @ b, scale * (x @ tensors[f"{stem}.lora_A.weight"].T
                                                   @ tensors[f"{stem}.lora_B.weight"].T), rtol=1e-5)


def test_fused_projections_split_their_b_rows(tmp_path):
    """Phi-3's qkv_proj and gate_up_proj: one A, B's rows q | k | v (gate | up), each stack its part."""
    rng = np.random.default_rng(1)
    tensors = {**_pair(rng, "self_attn.qkv_proj", D, Q + 2 * KV), **_pair(rng, "mlp.gate_up_proj", D, 2 * F)}
    adapter = read_adapter("x", _write(tmp_path / "a", tensors), LAYOUT)
    b = tensors["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"]
    for name, rows in (("q", b[:Q]), ("k", b[Q : Q + KV]), ("v", b[Q + KV :])):
        np.testing.assert_allclose(adapter.weights[("layers", 0, "self_attn", "lora", name)][1], 2 * rows.T, rtol=1e-6)
    up = tensors["base_model.model.model.layers.0.mlp.gate_up_proj.lora_B.weight"][F:]
    np.testing.assert_allclose(adapter.weights[("layers", 0, "mlp", "lora", "up")][1], 2 * up.T, rtol=1e-6)


def test_slot_values_pad_the_rank_and_zero_what_the_adapter_leaves(tmp_path):
    rng = np.random.default_rng(2)
    adapter = read_adapter("x", _write(tmp_path / "a", _pair(rng, "mlp.down_proj", F, D)), LAYOUT)
    values = slot_values(adapter, SHAPES, 8, np.float32)
    a, b = values[("layers", 0, "mlp", "lora", "down")]
    assert a.shape == (F, 8) and b.shape == (8, D)
    own_a, own_b = adapter.weights[("layers", 0, "mlp", "lora", "down")]
    np.testing.assert_array_equal(a[:, :2], own_a)
    np.testing.assert_array_equal(b[:2], own_b)
    assert not a[:, 2:].any() and not b[2:].any()
    assert not any(a.any() or b.any() for stack, (a, b) in values.items() if stack[-1] != "down")
    assert not any(a.any() for a, _ in slot_values(None, SHAPES, 8, np.float32).values())


@pytest.mark.parametrize(("tensors", "config", "error"), [
    ({}, {"use_dora": True}, "DoRA not supported"),
    ({}, {"bias": "all"}, "trained biases"),
    ({}, {"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({}, {"rank_pattern": {"q_proj": 4}}, "per-module ranks"),
    ({}, {"r": 32}, "rank 32 is above --max-lora-rank 16"),
    ({}, {"r": 0}, "positive integer"),
    ({}, {"r": True}, "positive integer"),
    ({}, {"lora_alpha": None}, "lora_alpha must be a number"),
    ({}, {"lora_alpha": "8"}, "lora_alpha must be a number"),
    ("not-finite", {}, "not finite"),
    ({}, {}, "no LoRA weights"),
    ({"base_model.model.lm_head.lora_A.weight": np.ones((2, D))}, {}, "not a LoRA weight of a decoder layer"),
    ("mlp-of-experts", {}, "layer 1's mlp.gate_proj is not a projection"),
    ("wrong-shape", {}, r"has A \[2, 9\] and B"),
    ("only-a", {}, "lora_A only"),
])
def test_adapters_that_cannot_be_served_are_refused(tmp_path, tensors, config, error):
    rng = np.random.default_rng(3)
    if tensors == "mlp-of-experts":
        tensors = _pair(rng, "mlp.gate_proj", D, F, layer=1)
    elif tensors == "wrong-shape":
        tensors = _pair(rng, "self_attn.q_proj", D + 1, Q)
    elif tensors == "not-finite":
        tensors = _pair(rng, "self_attn.q_proj", D, Q)
        next(iter(tensors.values()))[0, 0] = np.inf
    elif tensors == "only-a":
        tensors = {k: v for k, v in _pair(rng, "self_attn.q_proj", D, Q).items() if "lora_A" in k}
    with pytest.raises(ValueError, match=error):
        read_adapter("x", _write(tmp_path / "a", tensors, **config), LAYOUT)


def test_a_missing_directory_or_file(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        read_adapter("x", str(tmp_path / "nowhere"), LAYOUT)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="cannot read"):
        read_adapter("x", str(tmp_path / "empty"), LAYOUT)


def test_a_config_that_is_not_an_object(tmp_path):
    path = _write(tmp_path / "a", _pair(np.random.default_rng(4), "self_attn.q_proj", D, Q))
    (tmp_path / "a" / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        read_adapter("x", path, LAYOUT)


def test_bfloat16_and_float16_tensors_read_as_their_values(tmp_path):
    """PEFT saves adapters in the model's dtype: bfloat16's bits are a float32's top half."""
    import ml_dtypes
    from safetensors.numpy import save_file as save

    rng = np.random.default_rng(5)
    a, b = rng.normal(size=(2, D)), rng.normal(size=(Q, 2))
    stem = "base_model.model.model.layers.0.self_attn.q_proj"
    (tmp_path / "a").mkdir()
    save({f"{stem}.lora_A.weight": a.astype(ml_dtypes.bfloat16), f"{stem}.lora_B.weight": b.astype(np.float16)},
         tmp_path / "a" / "adapter_model.safetensors")
    (tmp_path / "a" / "adapter_config.json").write_text('{"r": 2, "lora_alpha": 2}')
    got_a, got_b = read_adapter("x", str(tmp_path / "a"), LAYOUT).weights[("layers", 0, "self_attn", "lora", "q")]
    np.testing.assert_array_equal(got_a, a.astype(ml_dtypes.bfloat16).astype(np.float32).T)
    np.testing.assert_array_equal(got_b, b.astype(np.float16).astype(np.float32).T)
