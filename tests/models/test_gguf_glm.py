"""GLM-4.5 GGUF files (llama.cpp's `glm4moe` architecture), laid out as llama.cpp's converter lays them out: its
metadata keys (RoPE's share of each head, the experts' counts, scale, normalisation and sigmoid gating, the dense
layers before them, the multi-token prediction layers counted in the block count), its tensor names (the norm
before the MLP as `post_attention_norm`, the router's correction bias, the shared experts), the routed experts
stacked, the rows as the checkpoint holds them (rotate-half RoPE, not permuted). Loaded through the GGUF path, a
file gives the logits of the transformers model it was written from, its prediction layer left out."""

import gguf
import numpy as np
import pytest

from jaxserve.models.loader import load_model
from tests.models.test_gguf_deepseek import llama_cpp_name
from tests.models.test_gguf_families import assert_logits_match, experts_as_llama_cpp_stores_them, write_gguf_tensors

pytestmark = pytest.mark.slow  # the transformers reference

_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp", "mlp.experts_gate": "ffn_gate_exps",
    "mlp.experts_up": "ffn_up_exps", "mlp.experts_down": "ffn_down_exps",
}


def _llama_cpp_name(hf_name: str) -> str:
    return llama_cpp_name(hf_name, _NAMES)


def _metadata(cfg, mtp_layers: int, groups: bool = True) -> dict:
    """llama.cpp's `glm4moe` keys for a transformers GLM-4.5 config (its converter's choices; without `groups`, a
    file of an older converter, which wrote no group keys)."""
    types = gguf.GGUFValueType
    u32, f32 = types.UINT32, types.FLOAT32
    rope = cfg.rope_parameters
    keys = {
        "block_count": (cfg.num_hidden_layers + mtp_layers, u32), "nextn_predict_layers": (mtp_layers, u32),
        "rope.dimension_count": (int(cfg.head_dim * rope["partial_rotary_factor"]), u32),
        "expert_shared_count": (cfg.n_shared_experts, u32),
        "leading_dense_block_count": (cfg.first_k_dense_replace, u32), "expert_gating_func": (2, u32),
        "expert_weights_scale": (cfg.routed_scaling_factor, f32),
        "expert_weights_norm": (cfg.norm_topk_prob, types.BOOL),
    }
    if groups:
        keys.update({"expert_group_count": (cfg.n_group, u32), "expert_group_used_count": (cfg.topk_group, u32)})
    return {f"glm4moe.{key}": value for key, value in keys.items()}


def _with_prediction_layer(tensors: list, layer: int) -> list:
    """The tensors and a multi-token prediction layer after the last one, as a GLM-4.5 checkpoint holds it: a
    block like the others (random: reading it would change the logits) and its own projections and norms."""
    rng = np.random.default_rng(3)
    last = f"model.layers.{layer - 1}."
    block = [(name.replace(last, f"model.layers.{layer}.", 1), rng.normal(size=array.shape).astype(np.float32))
             for name, array in tensors if name.startswith(last)]
    hidden = next(array for name, array in tensors if name == "model.norm.weight").shape[0]
    nextn = [(f"blk.{layer}.nextn.eh_proj.weight", np.ones((hidden, 2 * hidden), np.float32)),
             *((f"blk.{layer}.nextn.{norm}.weight", np.ones(hidden, np.float32)) for norm in ("enorm", "hnorm"))]
    return [(_llama_cpp_name(name), array) for name, array in tensors + block] + nextn


def test_a_glm45_gguf_matches_transformers(tiny_hf_model, smollm2_gguf, tmp_path, monkeypatch):
    """GLM-4.5's shape: RoPE over half of each head, q/k/v biases and per-head q/k norms, a dense layer, then 8
    experts and a shared one, routed by sigmoid scores with a correction bias over 2 of 4 groups, renormalised and
    scaled; and the file's prediction layer (block 3 of 4), which serving does not load."""
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_hf_model("glm4-moe")
    cfg = hf.config
    path = tmp_path / "tiny-glm4moe.gguf"
    tensors = _with_prediction_layer(experts_as_llama_cpp_stores_them(hf), cfg.num_hidden_layers)
    write_gguf_tensors(path, "glm4moe", cfg, tensors, smollm2_gguf, _metadata(cfg, mtp_layers=1, groups=True))
    loaded = load_model(str(path), dtype="float32")
    read = loaded.hf_config
    assert read.model_type == "glm4_moe" and read.num_hidden_layers == 3 and read.num_nextn_predict_layers == 1
    assert (read.n_group, read.topk_group, read.routed_scaling_factor, read.first_k_dense_replace) == (4, 2, 2.5, 1)
    assert read.rope_parameters["partial_rotary_factor"] == 0.5 and read.attention_bias and read.use_qk_norm
    assert_logits_match(loaded, hf, seed=13)


def test_a_glm45_file_without_group_keys_has_one_group_and_a_rope_scaling_is_refused(tiny_hf_model, smollm2_gguf,
                                                                                     tmp_path, monkeypatch):
    """A file without group keys routes over one group, as GLM-4.5 and 4.6 do. A file with RoPE scaling, which no
    GLM-4.5 config has, is refused by name rather than served unscaled."""
    from jaxserve.models.gguf_cache import _fill_from_metadata

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_hf_model("glm4-moe")
    cfg = hf.config
    tensors = [(_llama_cpp_name(name), array) for name, array in experts_as_llama_cpp_stores_them(hf)]
    plain = tmp_path / "plain.gguf"
    write_gguf_tensors(plain, "glm4moe", cfg, tensors, smollm2_gguf, _metadata(cfg, mtp_layers=0, groups=False))
    read = load_model(str(plain), dtype="float32").hf_config
    assert (read.n_group, read.topk_group, read.num_nextn_predict_layers, read.num_hidden_layers) == (1, 1, 0, 3)
    scaled = tmp_path / "scaled.gguf"
    write_gguf_tensors(scaled, "glm4moe", cfg, tensors, smollm2_gguf, {
        **_metadata(cfg, mtp_layers=0, groups=False), "glm4moe.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)})
    with pytest.raises(ValueError, match="`glm4moe` file with RoPE scaling"):
        _fill_from_metadata(read, scaled)
