"""A random-weight GGUF in a Qwen3's shapes, for speed runs against llama-server on a machine without the hub.

`--shape qwen3-0.6b` (the default): 28 layers, 16 query and 8 KV heads of 128 (per-head q/k norms), an MLP
of 3,072. `--shape qwen3-30b-a3b`: Qwen3-30B-A3B's layers (32 query and 4 KV heads of 128, 128 experts of
2,048 x 768, 8 routed a token), as many as `--layers` says (48 would be 61 GB in float16). Float16, and
SmolLM2's tokenizer (49,152 tokens, its fields copied from the bundled GGUF) in place of Qwen's 151,936.
Its outputs are noise; its step costs are the model's but for the smaller vocabulary (and the layers).

    python benchmarks/random_qwen3_gguf.py ~/peers/models/qwen3-0.6b-shape.F16.gguf
    python benchmarks/random_qwen3_gguf.py --shape qwen3-30b-a3b --layers 4 ~/peers/models/qwen3-30b-a3b-4l.F16.gguf
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from random_gguf import random_tensor  # noqa: E402

from tests.models.test_gguf_families import write_gguf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--shape", choices=("qwen3-0.6b", "qwen3-30b-a3b"), default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, help="fewer layers than the model's")
    args = parser.parse_args()
    import transformers

    from jaxserve.model_configs import bundled_config_values
    from jaxserve.models.loader import bundled_model_path

    values = {**bundled_config_values(args.shape), "vocab_size": 49152, "tie_word_embeddings": False}
    if args.layers:
        values["num_hidden_layers"] = args.layers
    dropped = ("architectures", "model_type", "bos_token_id", "eos_token_id")  # the tokenizer brings its own
    values = {k: v for k, v in values.items() if k not in dropped and not k.startswith("_")}
    moe = "num_experts" in values
    cfg = (transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config)(**values)
    rng = np.random.default_rng(0)
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    n, k = cfg.num_attention_heads, cfg.num_key_value_heads
    layer = {"self_attn.q_proj.weight": (n * h, d), "self_attn.k_proj.weight": (k * h, d),
             "self_attn.v_proj.weight": (k * h, d), "self_attn.o_proj.weight": (d, n * h),
             "self_attn.q_norm.weight": (h,), "self_attn.k_norm.weight": (h,), "input_layernorm.weight": (d,),
             "post_attention_layernorm.weight": (d,)}
    if moe:  # stacked as llama.cpp stores them, [E, out, in]
        e, fe = cfg.num_experts, cfg.moe_intermediate_size
        layer.update({"mlp.gate.weight": (e, d), "mlp.experts_gate": (e, fe, d), "mlp.experts_up": (e, fe, d),
                      "mlp.experts_down": (e, d, fe)})
    else:
        layer.update({"mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)})

    def draw(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return random_tensor(rng, name, shape)

    def tensors():
        yield "model.embed_tokens.weight", draw("embed", (cfg.vocab_size, d))
        for i in range(cfg.num_hidden_layers):
            for name, shape in layer.items():
                yield f"model.layers.{i}.{name}", draw(name, shape)
        yield "model.norm.weight", draw("norm.weight", (d,))
        yield "lm_head.weight", draw("lm_head", (cfg.vocab_size, d))

    args.path.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(args.path, "qwen3moe" if moe else "qwen3", cfg, tensors(), bundled_model_path())
    print(f"wrote {args.path} ({args.path.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
