"""GGUF files of the families beyond Llama: a tiny random Qwen3 written as llama.cpp lays a GGUF out (its
tensor names, the architecture's metadata, SmolLM2's tokenizer fields), loaded through the GGUF path, gives
the logits of the transformers model it was written from."""

import numpy as np
import pytest
import torch

from jaxserve.models.loader import load_model
from tests.models.test_parity import TOL, PagedForward

pytestmark = pytest.mark.slow  # the transformers reference

# HF name (after `model.layers.N.`) -> llama.cpp's name (after `blk.N.`)
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{suffix}"


def write_qwen3_gguf(path, cfg, tensors, tokenizer_gguf) -> None:
    """A GGUF of a Qwen3 config (transformers' `Qwen3Config`) and its HF-named `tensors` (name -> array, in
    the dtype to store), with the tokenizer fields of `tokenizer_gguf`."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="qwen3")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for name, tensor in tensors:
        writer.add_tensor(gguf_name(name), tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_qwen3():
    """Heads of 32 under a hidden size of 64 with 4 heads, as Qwen3-0.6B's 128 under 1024 / 16: the head size
    must come from the file's `key_length`."""
    import transformers

    from tests.conftest import TINY_VOCAB

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.3)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.normal_(mean=1.0, std=0.3)
    return model


def test_a_qwen3_gguf_matches_transformers(smollm2_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_qwen3()
    path = tmp_path / "tiny-qwen3.gguf"
    tensors = ((name, tensor.numpy().astype(np.float32)) for name, tensor in hf.state_dict().items())
    write_qwen3_gguf(path, hf.config, tensors, smollm2_gguf)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.cfg.qk_norm and loaded.cfg.head_dim == hf.config.head_dim
    tokens = np.random.default_rng(3).integers(0, loaded.cfg.vocab_size, size=19).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0].numpy()
    got = PagedForward(loaded, list(range(1, 9)))(tokens)
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)
