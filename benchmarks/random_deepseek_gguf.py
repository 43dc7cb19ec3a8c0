"""A random-weight GGUF in DeepSeek-V2-Lite's shapes, for speed runs against llama-server on a machine without the hub.

DeepSeek-V2-Lite's layers (16 query heads over a latent of 512 and a RoPE key of 64, 128-dim no-RoPE query and
value heads; a dense first layer of 10,944, then 64 experts of 2,048 x 1,408, 6 routed a token, and 2 shared),
as many as `--layers` says (its 27 would be 31 GB in float16), laid out as llama.cpp's converter writes a
`deepseek2` file (`tests/models/test_gguf_deepseek.py`: the up-projections split, one KV head). Float16, and
SmolLM2's tokenizer (49,152 tokens, its fields copied from the bundled GGUF) in place of DeepSeek's 102,400.
Its outputs are noise; its step costs are the model's but for the smaller vocabulary (and the layers).
`llama-quantize` makes the quantized files from it.

    python benchmarks/random_deepseek_gguf.py --layers 4 ~/peers/models/deepseek-v2-lite-4l.F16.gguf
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from random_gguf import random_tensor  # noqa: E402

from tests.models.test_gguf_deepseek import write_deepseek_gguf  # noqa: E402

# llama.cpp reads `q_lora_rank` from every `deepseek2` file but one of V2-Lite's 26 or 27 layers; 0 says its
# queries take one projection, as V2-Lite's do (jaxserve reads 0 as none)
_NO_QUERY_LATENT = {"deepseek2.attention.q_lora_rank": (0, "UINT32")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--layers", type=int, default=4, help="layers of the model's 27 (the first one dense)")
    args = parser.parse_args()
    import gguf
    import transformers

    from jaxserve.model_configs import bundled_config_values
    from jaxserve.models.loader import bundled_model_path

    values = {**bundled_config_values("deepseek-v2-lite"), "vocab_size": 49152, "num_hidden_layers": args.layers}
    dropped = ("architectures", "model_type", "bos_token_id", "eos_token_id")  # the tokenizer brings its own
    cfg = transformers.DeepseekV2Config(**{k: v for k, v in values.items() if k not in dropped})
    rng = np.random.default_rng(0)
    d, n, c, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    p, v, e, fe = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.n_routed_experts, cfg.moe_intermediate_size
    attention = {"self_attn.q_proj.weight": (n * (p + r), d), "self_attn.kv_a_proj_with_mqa.weight": (c + r, d),
                 "self_attn.kv_a_layernorm.weight": (c,), "self_attn.kv_b_proj.weight": (n * (p + v), c),
                 "self_attn.o_proj.weight": (d, n * v), "input_layernorm.weight": (d,),
                 "post_attention_layernorm.weight": (d,)}
    dense = {"mlp.gate_proj.weight": (cfg.intermediate_size, d), "mlp.up_proj.weight": (cfg.intermediate_size, d),
             "mlp.down_proj.weight": (d, cfg.intermediate_size)}
    shared = fe * cfg.n_shared_experts
    experts = {"mlp.gate.weight": (e, d), "mlp.experts_gate": (e, fe, d), "mlp.experts_up": (e, fe, d),
               "mlp.experts_down": (e, d, fe), "mlp.shared_experts.gate_proj.weight": (shared, d),
               "mlp.shared_experts.up_proj.weight": (shared, d), "mlp.shared_experts.down_proj.weight": (d, shared)}

    def draw(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return random_tensor(rng, name, shape)

    def tensors():
        yield "model.embed_tokens.weight", draw("embed", (cfg.vocab_size, d))
        for i in range(cfg.num_hidden_layers):
            mlp = dense if i < cfg.first_k_dense_replace else experts
            for name, shape in {**attention, **mlp}.items():
                yield f"model.layers.{i}.{name}", draw(name, shape)
        yield "model.norm.weight", draw("norm.weight", (d,))
        yield "lm_head.weight", draw("lm_head", (cfg.vocab_size, d))

    args.path.parent.mkdir(parents=True, exist_ok=True)
    extra = {key: (value, gguf.GGUFValueType[kind]) for key, (value, kind) in _NO_QUERY_LATENT.items()}
    write_deepseek_gguf(args.path, cfg, tensors(), bundled_model_path(), extra=extra)
    print(f"wrote {args.path} ({args.path.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
