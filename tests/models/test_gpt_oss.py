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
    import transformers
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tests.conftest import TINY_VOCAB

    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.3,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=5, swiglu_limit=3.0,
        layer_types=["sliding_attention", "full_attention"])
    hf = transformers.GptOssForCausalLM(config).eval()
    rng = np.random.default_rng(1)
    tensors = {}
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if name.endswith(("_bias", ".bias", ".sinks")):
                tensor.normal_(std=0.3)
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
