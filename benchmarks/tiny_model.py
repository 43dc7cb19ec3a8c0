"""A tiny random Llama as a local Hugging Face directory, for benchmarks of the host's share of a step.

2 layers, hidden 64, SmolLM2's tokenizer and 49,152-token vocabulary: the device's work is small, the
host's (scheduling, batches, detokenizing, HTTP) is what a real model's would be. Written with numpy and
safetensors only, so no PyTorch is needed.
"""

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from transformers import LlamaConfig

from jaxserve.models.gguf_cache import converted_dir
from jaxserve.models.loader import bundled_model_path
from jaxserve.models.tokenizer import load_tokenizer

TINY_LLAMA = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def write_tiny_llama(directory: Path, seed: int = 0) -> Path:
    config = LlamaConfig(**TINY_LLAMA)
    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv_heads, head_dim = (config.hidden_size, config.intermediate_size,
                                                config.num_attention_heads, config.num_key_value_heads, 16)

    def weight(*shape: int) -> np.ndarray:  # HF layout: [out, in]
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    tensors = {"model.embed_tokens.weight": weight(config.vocab_size, hidden),
               "model.norm.weight": np.ones(hidden, np.float32), "lm_head.weight": weight(config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": weight(inter, hidden),
            prefix + "mlp.up_proj.weight": weight(inter, hidden),
            prefix + "mlp.down_proj.weight": weight(hidden, inter),
            prefix + "input_layernorm.weight": np.ones(hidden, np.float32),
            prefix + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        }
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    load_tokenizer(converted_dir(bundled_model_path())).save_pretrained(directory)
    return directory
