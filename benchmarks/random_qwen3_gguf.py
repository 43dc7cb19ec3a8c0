"""A random-weight GGUF in Qwen3-0.6B's shapes, for speed runs of a Qwen3 against llama-server on a machine
without the hub: 28 layers, 16 query and 8 KV heads of 128 (per-head q/k norms), an MLP of 3,072, float16,
and SmolLM2's tokenizer (49,152 tokens, its fields copied from the bundled GGUF) in place of Qwen's 151,936.
Its outputs are noise; its step costs are a Qwen3's but for the smaller vocabulary.

    python benchmarks/random_qwen3_gguf.py ~/peers/models/qwen3-0.6b-shape.F16.gguf
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.models.test_gguf_families import write_qwen3_gguf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    args = parser.parse_args()
    import transformers

    from jaxserve.model_configs import bundled_config_values
    from jaxserve.models.loader import bundled_model_path

    values = {**bundled_config_values("qwen3-0.6b"), "vocab_size": 49152, "tie_word_embeddings": False}
    dropped = ("architectures", "model_type", "bos_token_id", "eos_token_id")  # the tokenizer brings its own
    cfg = transformers.Qwen3Config(**{k: v for k, v in values.items() if k not in dropped})
    rng = np.random.default_rng(0)
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    n, k = cfg.num_attention_heads, cfg.num_key_value_heads
    layer = {"self_attn.q_proj.weight": (n * h, d), "self_attn.k_proj.weight": (k * h, d),
             "self_attn.v_proj.weight": (k * h, d), "self_attn.o_proj.weight": (d, n * h),
             "self_attn.q_norm.weight": (h,), "self_attn.k_norm.weight": (h,), "input_layernorm.weight": (d,),
             "post_attention_layernorm.weight": (d,), "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
             "mlp.down_proj.weight": (d, f)}

    def draw(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)  # norms stay float32 in llama.cpp's files
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)

    def tensors():
        yield "model.embed_tokens.weight", draw("embed", (cfg.vocab_size, d))
        for i in range(cfg.num_hidden_layers):
            for name, shape in layer.items():
                yield f"model.layers.{i}.{name}", draw(name, shape)
        yield "model.norm.weight", draw("norm.weight", (d,))
        yield "lm_head.weight", draw("lm_head", (cfg.vocab_size, d))

    args.path.parent.mkdir(parents=True, exist_ok=True)
    write_qwen3_gguf(args.path, cfg, tensors(), bundled_model_path())
    print(f"wrote {args.path} ({args.path.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
