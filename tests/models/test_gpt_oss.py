"""GPT-OSS checkpoints as they are published: experts in MXFP4 (blocks of 32 E2M1 codes and a power-of-two
scale), decoded on load; the rest in bfloat16. The logits parity of the unquantized layout, the sinks and
the clamped experts is in test_parity.py."""

import json

import numpy as np
import pytest
import torch

from jaxserve.models.loader import load_model
from jaxserve.models.mxfp4 import decode_mxfp4
from tests.models.test_parity import TOL, PagedForward

pytestmark = pytest.mark.slow  # the transformers reference


def random_mxfp4(rng: np.random.Generator, rows: tuple[int, ...], features: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks u8[*rows, features / 32, 16] of every code, and scales u8[*rows, features / 32] of 2^-6..2^1."""
    blocks = rng.integers(0, 256, size=(*rows, features // 32, 16), dtype=np.uint8)
    scales = rng.integers(127 - 6, 127 + 2, size=(*rows, features // 32), dtype=np.uint8)
    return blocks, scales


def tiny_gpt_oss(**overrides):
    """Two layers (sliding, full) of 4 experts, 2 a token, widths of 64 (whole MXFP4 blocks), with random biases
    and sinks (transformers starts them at zero)."""
    import transformers

    from tests.conftest import TINY_VOCAB

    torch.manual_seed(0)
    config = transformers.GptOssConfig(**{**dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.3,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"]), **overrides})
    hf = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if name.endswith(("_bias", ".bias", ".sinks")):
                tensor.normal_(std=0.3)
    return hf


def test_mxfp4_decodes_as_transformers_does():
    """Every E2M1 code (both nibbles of every byte value) and scales from 2^-127 up, against
    transformers' own MXFP4 dequantization (which it transposes to [E, in, out] for its experts)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = np.tile(np.arange(256, dtype=np.uint8), (3, 4, 1)).reshape(3, 4, 16, 16)  # [E, out, G, 16]
    scales = rng.integers(0, 255, size=(3, 4, 16), dtype=np.uint8)
    scales[0, 0, :3] = (0, 127, 130)  # 2^-127, 1, 8
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    got = decode_mxfp4(blocks, scales)  # [E, out, in]
    np.testing.assert_array_equal(got, want.transpose(1, 2).numpy())
    # Block 1 starts with byte 0x10 (low nibble first: 0, then 0.5), block 2 with 0x20 and 0x21, times 8.
    assert got[0, 0, 32:34].tolist() == [0.0, 0.5] and got[0, 0, 64:68].tolist() == [0.0, 8.0, 4.0, 8.0]


def test_mxfp4_blocks_without_their_scales_are_refused():
    with pytest.raises(ValueError, match="do not match"):
        decode_mxfp4(np.zeros((2, 3, 16), np.uint8), np.zeros((2, 4), np.uint8))


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_matches_transformers(tmp_path, smollm2_tokenizer):
    """The published layout: `gate_up_proj_blocks` [E, 2F, D / 32, 16] and `down_proj_blocks` [E, D, F / 32, 16]
    with their scales, gate and up in alternate rows, and `quantization_config` {"quant_method": "mxfp4"}.
    The reference is the transformers model holding the same experts dequantized by transformers."""
    import safetensors.numpy
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = tiny_gpt_oss(swiglu_limit=3.0)
    rng = np.random.default_rng(1)
    tensors = {}
    with torch.no_grad():
        for layer in hf.model.layers:
            experts = layer.mlp.experts
            for kind, rows, features in (("gate_up_proj", 2 * 64, 64), ("down_proj", 64, 64)):
                blocks, scales = random_mxfp4(rng, (4, rows), features)
                weight = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                    dtype=torch.float32)  # [E, in, out]
                getattr(experts, kind).copy_(weight)
                prefix = f"model.layers.{layer.self_attn.layer_idx}.mlp.experts.{kind}"
                tensors[f"{prefix}_blocks"], tensors[f"{prefix}_scales"] = blocks, scales
    for name, tensor in hf.state_dict().items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensor.numpy().astype(np.float32)
    directory = tmp_path / "tiny-gpt-oss-mxfp4"
    directory.mkdir()
    safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"))
    config_dict = {**hf.config.to_dict(), "architectures": ["GptOssForCausalLM"],
                   "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}}
    (directory / "config.json").write_text(json.dumps(config_dict))
    smollm2_tokenizer.save_pretrained(directory)

    loaded = load_model(str(directory), dtype="float32")
    tokens = np.random.default_rng(2).integers(0, loaded.cfg.vocab_size, size=19).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0].numpy()
    got = PagedForward(loaded, list(range(1, 9)))(tokens)
    np.testing.assert_allclose(got, expected, atol=TOL * 10, rtol=0)


def _as_llama_cpp_stores_gpt_oss(hf, rng: np.random.Generator) -> list:
    """The tiny model's tensors under llama.cpp's gpt-oss names and layout: gate and up split out of their
    alternate columns and stacked [E, out, in] in ggml's MXFP4 blocks (random codes; the transformers model
    takes their values as the gguf package decodes them), their biases apart, the sinks as `attn_sinks`."""
    import gguf
    from gguf.quants import dequantize

    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    block_bytes = gguf.GGML_QUANT_SIZES[mxfp4][1]  # 17: a scale byte and 16 bytes of codes
    tensors = []
    with torch.no_grad():
        for index, layer in enumerate(hf.model.layers):
            blk, experts = f"blk.{index}", layer.mlp.experts
            num_experts, hidden, double_width = experts.gate_up_proj.shape
            stacked = {}
            for kind, rows, features in (("gate", double_width // 2, hidden), ("up", double_width // 2, hidden),
                                         ("down", hidden, double_width // 2)):
                raw = rng.integers(0, 256, size=(num_experts, rows, features // 32 * block_bytes), dtype=np.uint8)
                scales = raw[..., ::block_bytes]
                raw[..., ::block_bytes] = rng.integers(127 - 8, 127 - 4, size=scales.shape)  # 2^-8 .. 2^-5
                stacked[kind] = dequantize(raw, mxfp4).reshape(num_experts, rows, features)  # [E, out, in]
                tensors.append((f"{blk}.ffn_{kind}_exps.weight", (raw, mxfp4)))
            gate_up = np.empty((num_experts, hidden, double_width), np.float32)
            gate_up[..., 0::2], gate_up[..., 1::2] = stacked["gate"].swapaxes(1, 2), stacked["up"].swapaxes(1, 2)
            experts.gate_up_proj.copy_(torch.from_numpy(gate_up))
            experts.down_proj.copy_(torch.from_numpy(stacked["down"].swapaxes(1, 2).copy()))
            bias = experts.gate_up_proj_bias.numpy()
            tensors += [(f"{blk}.ffn_gate_exps.bias", bias[:, 0::2].copy()),
                        (f"{blk}.ffn_up_exps.bias", bias[:, 1::2].copy()),
                        (f"{blk}.ffn_down_exps.bias", experts.down_proj_bias.numpy())]
            attention = layer.self_attn
            for ours, theirs in (("attn_q", attention.q_proj), ("attn_k", attention.k_proj),
                                 ("attn_v", attention.v_proj), ("attn_output", attention.o_proj),
                                 ("ffn_gate_inp", layer.mlp.router)):
                tensors += [(f"{blk}.{ours}.weight", theirs.weight.numpy()),
                            (f"{blk}.{ours}.bias", theirs.bias.numpy())]
            tensors += [(f"{blk}.attn_sinks.weight", attention.sinks.numpy()),
                        (f"{blk}.attn_norm.weight", layer.input_layernorm.weight.numpy()),
                        (f"{blk}.post_attention_norm.weight", layer.post_attention_layernorm.weight.numpy())]
    tensors += [("token_embd.weight", hf.model.embed_tokens.weight.detach().numpy()),
                ("output_norm.weight", hf.model.norm.weight.detach().numpy()),
                ("output.weight", hf.lm_head.weight.detach().numpy())]
    return [(name, t if isinstance(t, tuple) else np.ascontiguousarray(t, np.float32)) for name, t in tensors]


def test_a_gpt_oss_gguf_matches_transformers(smollm2_gguf, tmp_path, monkeypatch):
    """A `gpt-oss` file as llama.cpp writes it (its experts in ggml's MXFP4, decoded by the gguf package on
    load): llama.cpp's names for the sinks, the router and its bias, the experts' biases and the norm before
    the MLP; the YaRN scaling, window and head size from the file's metadata."""
    from tests.models.test_gguf_families import write_gguf_tensors

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_gpt_oss()
    tensors = _as_llama_cpp_stores_gpt_oss(hf, np.random.default_rng(3))
    path = tmp_path / "tiny-gpt-oss.gguf"
    write_gguf_tensors(path, "gpt-oss", hf.config, tensors, smollm2_gguf, extra=_gpt_oss_metadata(hf.config))
    loaded = load_model(str(path), dtype="float32")
    cfg = loaded.cfg
    assert cfg.attention_sinks and cfg.sliding_windows == (5, None) and cfg.head_dim == 16
    assert cfg.rope.attention_factor == pytest.approx(0.1 * np.log(32.0) + 1.0)
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, size=19).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0].numpy()
    got = PagedForward(loaded, list(range(1, 9)))(tokens)
    np.testing.assert_allclose(got, expected, atol=TOL * 10, rtol=0)


def test_mxfp4_blocks_become_q5_0_blocks_of_the_same_weights():
    """Every code and every scale float16 holds (2^-24 .. 2^15 for the doubled values): the gguf package
    decodes the Q5_0 blocks to exactly the MXFP4 blocks' weights; a scale past float16's is left to decode."""
    import gguf
    from gguf.quants import dequantize

    from jaxserve.models.mxfp4 import ggml_mxfp4_as_q5_0

    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(40, 8 * 17), dtype=np.uint8)
    raw[:, ::17] = np.arange(104, 144, dtype=np.uint8)[:, None]  # row r's blocks at scale 2^(r - 24), doubled
    q5_0 = ggml_mxfp4_as_q5_0(raw)
    assert q5_0.shape == (40, 8 * 22)
    mxfp4_values = dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(dequantize(q5_0, gguf.GGMLQuantizationType.Q5_0), mxfp4_values)
    for scale in (103, 144):
        raw[0, 0] = scale
        assert ggml_mxfp4_as_q5_0(raw) is None
    raw[0, :17] = (0, *[0x80] * 16)  # a block of -0s at scale 2^-127: zeros whatever the scale
    zeros = dequantize(ggml_mxfp4_as_q5_0(raw), gguf.GGMLQuantizationType.Q5_0)
    assert (zeros[0, :32] == 0).all()
    np.testing.assert_array_equal(zeros[1:], mxfp4_values[1:])


def test_a_gpt_oss_gguf_keeps_its_mxfp4_experts_as_q5_0_blocks(smollm2_gguf, tmp_path, monkeypatch):
    """`--quantization gguf` on a gpt-oss file: each layer's MXFP4 experts stay in blocks (as Q5_0's, the
    same weights), run through the grouped native kernel with their biases, and the logits follow the
    dequantized model's."""
    from jaxserve.models.gguf_weights import GgufExperts
    from tests.models.test_gguf_families import write_gguf_tensors
    from tests.models.test_gguf_quantized import _flat, assert_logits_follow

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_gpt_oss()
    path = tmp_path / "tiny-gpt-oss.gguf"
    write_gguf_tensors(path, "gpt-oss", hf.config, _as_llama_cpp_stores_gpt_oss(hf, np.random.default_rng(6)),
                       smollm2_gguf, extra=_gpt_oss_metadata(hf.config))
    kept = load_model(str(path), dtype="float32", quantization="gguf")
    plain = load_model(str(path), dtype="float32")
    kept_flat, plain_flat = _flat(kept), _flat(plain)
    experts = {path: v for path, v in kept_flat.items() if isinstance(v, GgufExperts)}
    assert len(experts) == 3 * 2 and {v.kind for v in experts.values()} == {"Q5_0"}
    for where, weight in experts.items():
        np.testing.assert_array_equal(np.asarray(weight.dequantize()), np.asarray(plain_flat[where]), str(where))
    assert_logits_follow(kept, plain)


def _gpt_oss_metadata(config) -> dict:
    """The keys llama.cpp's converter writes for gpt-oss beyond the common ones: its window, YaRN scaling and
    experts' width (values, types)."""
    import gguf

    rope = config.rope_parameters
    u32, f32, text = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING
    return {"gpt-oss.rope.scaling.type": ("yarn", text), "gpt-oss.rope.scaling.factor": (rope["factor"], f32),
            "gpt-oss.rope.scaling.original_context_length": (rope["original_max_position_embeddings"], u32),
            "gpt-oss.expert_feed_forward_length": (config.intermediate_size, u32)}
