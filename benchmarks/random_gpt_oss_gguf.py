"""A random-weight GGUF in gpt-oss-20b's shapes, its experts in MXFP4 as llama.cpp stores them, for speed runs
against llama-server on a machine without the hub.

gpt-oss-20b's layers (64 query and 8 KV heads of 64 with sinks, a window of 128 on every other layer, YaRN; 32
experts of 2,880 x 2,880, 4 routed a token, with biases), as many as `--layers` says (24 would be 12 GB).
The experts in MXFP4 (random codes, scales of 2^-7 .. 2^-5), the other matrices in float16, biases, sinks and
norms in float32; SmolLM2's tokenizer (49,152 tokens, its fields copied from the bundled GGUF) in place of
gpt-oss's 201,088. Its outputs are noise; its step costs are the model's but for the vocabulary and the layers.

    python benchmarks/random_gpt_oss_gguf.py --layers 4 ~/peers/models/gpt-oss-20b-4l.MXFP4.gguf
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.models.test_gguf_families import write_gguf_tensors  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--layers", type=int, default=4, help="layers of the model's 24")
    args = parser.parse_args()
    import gguf
    import transformers

    from jaxserve.model_configs import bundled_config_values
    from jaxserve.models.loader import bundled_model_path
    from jaxserve.models.mxfp4 import GGML_MXFP4_BYTES

    values = {**bundled_config_values("gpt-oss-20b"), "vocab_size": 49152, "num_hidden_layers": args.layers}
    values["layer_types"] = values["layer_types"][: args.layers]
    dropped = ("architectures", "model_type", "eos_token_id", "pad_token_id")  # the tokenizer brings its own
    cfg = transformers.GptOssConfig(**{k: v for k, v in values.items() if k not in dropped and not k.startswith("_")})
    rng = np.random.default_rng(0)
    d, f, h, e = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_local_experts
    n, k = cfg.num_attention_heads, cfg.num_key_value_heads

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(np.float16)

    def small(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float32)

    def mxfp4_experts(rows: int, cols: int) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:  # [E, rows, cols]
        raw = rng.integers(0, 256, size=(e, rows, cols // 32 * GGML_MXFP4_BYTES), dtype=np.uint8)
        raw[..., ::GGML_MXFP4_BYTES] = rng.integers(127 - 7, 127 - 4, size=raw[..., ::GGML_MXFP4_BYTES].shape)
        return raw, gguf.GGMLQuantizationType.MXFP4

    def tensors():
        yield "token_embd.weight", matrix(cfg.vocab_size, d)
        for i in range(cfg.num_hidden_layers):
            blk = f"blk.{i}"
            for name, rows, cols in (("attn_q", n * h, d), ("attn_k", k * h, d), ("attn_v", k * h, d),
                                     ("attn_output", d, n * h)):
                yield f"{blk}.{name}.weight", matrix(rows, cols)
                yield f"{blk}.{name}.bias", small(rows)
            yield f"{blk}.attn_sinks.weight", small(n)
            yield f"{blk}.attn_norm.weight", np.ones(d, np.float32)
            yield f"{blk}.post_attention_norm.weight", np.ones(d, np.float32)
            yield f"{blk}.ffn_gate_inp.weight", small(e, d)
            yield f"{blk}.ffn_gate_inp.bias", small(e)
            for kind, rows, cols in (("gate", f, d), ("up", f, d), ("down", d, f)):
                yield f"{blk}.ffn_{kind}_exps.weight", mxfp4_experts(rows, cols)
                yield f"{blk}.ffn_{kind}_exps.bias", small(e, rows)
        yield "output_norm.weight", np.ones(d, np.float32)
        yield "output.weight", matrix(cfg.vocab_size, d)

    rope = cfg.rope_parameters
    u32, f32, text = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING
    extra = {"gpt-oss.rope.scaling.type": ("yarn", text), "gpt-oss.rope.scaling.factor": (rope["factor"], f32),
             "gpt-oss.rope.scaling.original_context_length": (rope["original_max_position_embeddings"], u32),
             "gpt-oss.expert_feed_forward_length": (f, u32)}
    args.path.parent.mkdir(parents=True, exist_ok=True)
    write_gguf_tensors(args.path, "gpt-oss", cfg, tensors(), bundled_model_path(), extra=extra)
    print(f"wrote {args.path} ({args.path.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
