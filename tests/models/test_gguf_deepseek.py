"""DeepSeek-V2 and V3 GGUF files (llama.cpp's `deepseek2` architecture), laid out as llama.cpp's converter lays
them out: its metadata keys (the latent's widths, the experts' counts, scales and gating function, YaRN's log
multiplier), one KV head, the rows of every projection as the checkpoint holds them (RoPE's adjacent pairs
unpermuted), the routed experts stacked, and `kv_b_proj` split into the keys' part, transposed, and the values'
(or whole, as files written before llama.cpp absorbed the up-projections hold it). Loaded through the GGUF path,
each gives the logits of the transformers model it was written from; with its projections and experts in 8- and
4-bit blocks, kept as they are, it follows the model its dequantized blocks make."""

import re
from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from jaxserve.models.loader import load_model
from jaxserve.ops import cpu_kernels
from tests.models.test_gguf_families import assert_logits_match, experts_as_llama_cpp_stores_them, write_gguf_tensors

pytestmark = pytest.mark.slow  # the transformers reference

_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b", "self_attn.k_b_proj": "attn_k_b",
    "self_attn.v_b_proj": "attn_v_b", "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
    "mlp.experts_gate": "ffn_gate_exps", "mlp.experts_up": "ffn_up_exps", "mlp.experts_down": "ffn_down_exps",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def llama_cpp_name(hf_name: str, names: dict[str, str] = _NAMES) -> str:
    """An HF-named tensor's name in a file of DeepSeek's experts (`deepseek2`, and GLM-4.5's `glm4moe` with its
    own `names` for the rest): the router's correction bias unsuffixed, the stacked experts' weights."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if rest == "mlp.gate.e_score_correction_bias":
        return f"blk.{layer}.exp_probs_b.bias"
    if rest.startswith("mlp.experts_"):
        return f"blk.{layer}.{names[rest]}.weight"
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{names[module]}.{suffix}"


def _metadata(cfg, split_kv_b: bool) -> dict:
    """llama.cpp's `deepseek2` keys for a transformers DeepSeek config (its converter's choices)."""
    types, rope = gguf.GGUFValueType, cfg.rope_parameters
    u32, f32 = types.UINT32, types.FLOAT32
    qk, c, r = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    keys = {
        "attention.head_count_kv": (1, u32), "rope.dimension_count": (r, u32), "attention.kv_lora_rank": (c, u32),
        "leading_dense_block_count": (cfg.first_k_dense_replace, u32),
        "expert_feed_forward_length": (cfg.moe_intermediate_size, u32), "expert_count": (cfg.n_routed_experts, u32),
        "expert_used_count": (cfg.num_experts_per_tok, u32), "expert_shared_count": (cfg.n_shared_experts, u32),
        "expert_weights_scale": (cfg.routed_scaling_factor, f32),
        "expert_gating_func": (2 if cfg.model_type == "deepseek_v3" else 1, u32),
    }
    if split_kv_b:  # the cached latent's widths, and the heads' own under `_mla`
        keys.update({"attention.key_length": (c + r, u32), "attention.value_length": (c, u32),
                     "attention.key_length_mla": (qk, u32), "attention.value_length_mla": (cfg.v_head_dim, u32)})
    else:
        keys.update({"attention.key_length": (qk, u32), "attention.value_length": (cfg.v_head_dim, u32)})
    if cfg.q_lora_rank:
        keys["attention.q_lora_rank"] = (cfg.q_lora_rank, u32)
    if cfg.norm_topk_prob:
        keys["expert_weights_norm"] = (True, types.BOOL)
    if getattr(cfg, "n_group", None):
        keys.update({"expert_group_count": (cfg.n_group, u32), "expert_group_used_count": (cfg.topk_group, u32)})
    if rope.get("rope_type") == "yarn":
        keys.update({"rope.scaling.type": ("yarn", types.STRING), "rope.scaling.factor": (rope["factor"], f32),
                      "rope.scaling.original_context_length": (rope["original_max_position_embeddings"], u32),
                      "rope.scaling.yarn_log_multiplier": (0.1 * rope["mscale_all_dim"], f32)})
    return {f"deepseek2.{key}": value for key, value in keys.items()}


def llama_cpp_tensors(cfg, tensors, split_kv_b: bool) -> Iterator[tuple[str, np.ndarray]]:
    """HF-named tensors (experts stacked, `mlp.experts_gate`...) under llama.cpp's names, `kv_b_proj` split (or
    not)."""
    for name, array in tensors:
        if split_kv_b and name.endswith("kv_b_proj.weight"):
            heads = array.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            stem = name.removesuffix("kv_b_proj.weight")
            yield llama_cpp_name(stem + "k_b_proj.weight"), np.ascontiguousarray(
                heads[:, :cfg.qk_nope_head_dim].transpose(0, 2, 1))  # [N, C, P]
            yield llama_cpp_name(stem + "v_b_proj.weight"), np.ascontiguousarray(
                heads[:, cfg.qk_nope_head_dim:])  # [N, V, C]
        else:
            yield llama_cpp_name(name), array


def write_deepseek_gguf(path, cfg, tensors, tokenizer_gguf, split_kv_b: bool = True, quantized=None,
                        extra: dict | None = None) -> None:
    """A transformers DeepSeek config and its HF-named tensors as llama.cpp writes a `deepseek2` file;
    `quantized(name, array)` may give (blocks, type) for a tensor to store quantized; `extra` adds keys."""
    tensors = llama_cpp_tensors(cfg, tensors, split_kv_b)
    if quantized is not None:
        tensors = ((name, quantized(name, array) or array) for name, array in tensors)
    write_gguf_tensors(path, "deepseek2", cfg, tensors, tokenizer_gguf, {**_metadata(cfg, split_kv_b), **(extra or {})})


def _randomized(hf):
    """Norms around 1 and a router correction bias (zero at initialization) that changes the experts chosen."""
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if name.endswith("norm.weight"):
                tensor.normal_(mean=1.0, std=0.3)
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(std=0.5)
    return hf


def _tied(hf):
    """The same model with its LM head tied to its embeddings (a file without `output.weight`)."""
    config = type(hf.config)(**{**hf.config.to_dict(), "tie_word_embeddings": True})
    torch.manual_seed(1)
    return _randomized(type(hf)(config).eval())


@pytest.mark.parametrize("kind, split_kv_b, tied", [
    ("deepseek-v2", True, False), ("deepseek-v3", True, False), ("deepseek-v2", False, False),
    ("deepseek-v3", True, True)], ids=["v2-lite", "v3", "v2-lite, kv_b whole", "v3, tied"])
def test_a_deepseek_gguf_matches_transformers(kind, split_kv_b, tied, tiny_hf_model, smollm2_gguf, tmp_path,
                                              monkeypatch):
    """V2-Lite's shape (one query projection, a softmax router, YaRN with its mscale) and V3's (queries through a
    latent, a sigmoid router with its correction bias over groups, scaled; also with its LM head tied, which the
    file says by leaving `output.weight` out), each layer's config read back from llama.cpp's keys."""
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = _tied(tiny_hf_model(kind)) if tied else _randomized(tiny_hf_model(kind))
    path = tmp_path / f"tiny-{kind}.gguf"
    tensors = [(name, array) for name, array in experts_as_llama_cpp_stores_them(hf)
               if not (tied and name == "lm_head.weight")]
    write_deepseek_gguf(path, hf.config, tensors, smollm2_gguf, split_kv_b)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.hf_config.model_type == hf.config.model_type
    cfg = loaded.cfg
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        hf.config.q_lora_rank, 32, 16, 8, 12)
    assert cfg.moe.score_correction == (kind == "deepseek-v3") and cfg.first_dense_layers == 1
    assert cfg.tie_word_embeddings == tied
    assert_logits_match(loaded, hf, seed=12)


def _tiny_v3_in_blocks():
    """A V3 whose widths are whole blocks of 32 (every projection's and expert's input), so each can be stored
    quantized. Its router's correction bias, which picks the experts (and not their weights), always picks the
    second group's two: the 8-bit activations would otherwise flip a near-tied choice now and then (one flip
    moves a token's logits by as much as they span). The float test checks the choices themselves."""
    import transformers

    from tests.conftest import TINY_VOCAB

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=8,
        v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, max_position_embeddings=512, initializer_range=0.3,
        pad_token_id=0)
    hf = _randomized(transformers.DeepseekV3ForCausalLM(config).eval())
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.tensor([0.0, 0.0, 6.0, 6.0]))  # a group's sum moves by less than 2 with the scores
    return hf


@pytest.mark.cpu_only("the native CPU kernels")
@pytest.mark.skipif(cpu_kernels.kernel_error() is not None, reason=str(cpu_kernels.kernel_error()))
def test_a_quantized_deepseek_gguf_keeps_its_blocks_and_follows_the_dequantized_model(
        smollm2_gguf, tmp_path, monkeypatch):
    """The queries', the latent's and the output projections, the dense and shared MLPs in Q8_0, the routed
    experts in Q4_0: each stays in its blocks (the RoPE rows of the queries' and the latent's projections moved
    as whole rows of blocks) and decodes to the parameter the dequantizing load builds; the up-projections
    (absorbed into the attention), stored in Q8_0 as llama-quantize stores them, are dequantized; the logits
    follow the dequantized model's."""
    from flax import nnx, traverse_util

    from jaxserve.models.gguf_weights import GgufExperts, GgufWeight
    from tests.models.test_gguf_quantized import assert_logits_follow

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = _tiny_v3_in_blocks()

    def quantized(name: str, array: np.ndarray):
        if name.endswith("_exps.weight"):
            kind = GGMLQuantizationType.Q4_0
        elif ((name.startswith("blk.") and array.ndim == 2 and "ffn_gate_inp" not in name)  # not the router
              or name.endswith(("attn_k_b.weight", "attn_v_b.weight"))):  # the up-projections, [N, C, P], [N, V, C]
            kind = GGMLQuantizationType.Q8_0
        else:
            return None
        return quantize(array, kind), kind

    path = tmp_path / "tiny-v3-blocks.gguf"
    write_deepseek_gguf(path, hf.config, experts_as_llama_cpp_stores_them(hf), smollm2_gguf, quantized=quantized)
    from jaxserve.models.gguf import read_gguf

    up_projections = [t for t in read_gguf(path).tensors if t.name.endswith(("attn_k_b.weight", "attn_v_b.weight"))]
    assert len(up_projections) == 4 and {t.tensor_type.name for t in up_projections} == {"Q8_0"}
    kept = load_model(str(path), dtype="float32", quantization="gguf")
    plain = load_model(str(path), dtype="float32")
    kept_flat = traverse_util.flatten_dict(nnx.to_pure_dict(kept.state))
    plain_flat = traverse_util.flatten_dict(nnx.to_pure_dict(plain.state))
    weights = {path[-1] for path, value in kept_flat.items() if isinstance(value, GgufWeight)}
    assert weights == {"q_a_proj", "q_b_proj", "kv_a_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert sum(isinstance(value, GgufExperts) for value in kept_flat.values()) == 3  # layer 1's three kinds
    for path, value in kept_flat.items():
        got = value.dequantize() if isinstance(value, GgufWeight | GgufExperts) else value
        np.testing.assert_array_equal(np.asarray(got), np.asarray(plain_flat[path]), str(path))
    assert_logits_follow(kept, plain)


# `tokenizer.ggml.pre` -> how its tokenizer splits "abc 12345 東京タワー.cpp" (the pieces' text), or None where
# jaxserve warns that it splits as GPT-2 does
SPLITS = {
    "deepseek-v3": ["abc", " ", "123", "45", " ", "東京タワー", ".cpp"],  # digits in threes, CJK and kana runs
    "deepseek-llm": ["abc", " ", "12345", " ", "東京タワー", ".", "cpp"],  # digits whole, letters apart
    "gpt-2": ["abc", " 12345", " 東京タワー", ".", "cpp"],
    "no-such-split": None,
}


@pytest.mark.parametrize("pre", SPLITS)
def test_a_deepseek_file_splits_text_as_its_tokenizer_does(pre, tiny_hf_model, smollm2_gguf, tmp_path, monkeypatch,
                                                           caplog):
    """DeepSeek's files name a pre-tokenizer (`deepseek-v3`, `deepseek-llm`) that transformers' GGUF reader does
    not know (it splits their text as GPT-2 does): the converted tokenizer splits as DeepSeek's own does, and
    as llama.cpp does (benchmarks/tokenizers_vs_llama_cpp.py checks the ids against both, docs/benchmarks.md).
    A name neither knows is split as GPT-2 splits it, with a warning naming the way out. The config is read back
    all the same."""
    import json
    import logging

    from jaxserve.models.gguf_cache import converted_dir
    from jaxserve.models.tokenizer import load_tokenizer

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_hf_model("deepseek-v3")
    path = tmp_path / f"deepseek-{pre}.gguf"
    metadata = {**_metadata(hf.config, split_kv_b=True), "tokenizer.ggml.pre": (pre, gguf.GGUFValueType.STRING)}
    write_gguf_tensors(path, "deepseek2", hf.config, [], smollm2_gguf, metadata)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        converted = converted_dir(path)
    assert json.loads((converted / "config.json").read_text())["q_lora_rank"] == 20
    text = "abc 12345 東京タワー.cpp"
    pieces = load_tokenizer(converted).backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    split = [text[start:end] for _, (start, end) in pieces]
    assert split == (SPLITS[pre] or SPLITS["gpt-2"])
    warned = SPLITS[pre] is None
    assert ("pre-tokenizer 'no-such-split' is not one jaxserve or transformers knows" in caplog.text) == warned
    assert "--tokenizer" in caplog.text if warned else caplog.text == ""


# name -> (the metadata's keys dropped, keys replaced, the refusal)
REFUSED_FILES = {
    # its latent's width unsaid: refused with the key's name, not a TypeError (a key with a default, the query
    # latent's, may be missing: the V2-Lite files of the tests above have none)
    "no-latent": (("attention.kv_lora_rank",), {},
                  re.escape("deepseek-no-latent.gguf: the `deepseek2` file has no `deepseek2.attention.kv_lora_rank`")),
    # llama.cpp's `expert_gating_func` 4 (sqrt-softplus), neither V2's softmax nor V3's sigmoid: not served as V2
    "softplus": ((), {"expert_gating_func": (4, gguf.GGUFValueType.UINT32)},
                 "gating function 4: jaxserve serves its softmax"),
}


@pytest.mark.parametrize("name", REFUSED_FILES)
def test_a_deepseek_file_jaxserve_cannot_read_as_its_model_is_refused(name, tiny_hf_model, smollm2_gguf, tmp_path,
                                                                      monkeypatch):
    """A `deepseek2` file missing a key its config needs, or scoring its experts otherwise, is refused at
    conversion with a message saying what."""
    from jaxserve.models.gguf_cache import converted_dir

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    dropped, replaced, refusal = REFUSED_FILES[name]
    hf = tiny_hf_model("deepseek-v3")
    metadata = {**_metadata(hf.config, split_kv_b=True), **{f"deepseek2.{k}": v for k, v in replaced.items()}}
    for key in dropped:
        del metadata[f"deepseek2.{key}"]
    path = tmp_path / f"deepseek-{name}.gguf"
    write_gguf_tensors(path, "deepseek2", hf.config, [], smollm2_gguf, metadata)
    with pytest.raises(ValueError, match=refusal):
        converted_dir(path)
