"""EAGLE-1 drafter checkpoints with random weights, for the tests (`models/eagle.py`)."""

import json

import numpy as np
from safetensors.numpy import save_file


def greedy_pick(logits: np.ndarray) -> tuple[int, float]:
    """A reference drafter's greedy choice among `logits` [V], and the gap between its logit and the next
    largest (a near tie is where the engine's float32 may choose the other)."""
    top2 = np.sort(logits)[-2:]
    return int(np.argmax(logits)), float(top2[1] - top2[0])


def write_eagle(directory, target_config: dict, fc_bias: bool = True, para_norms: bool = False, seed: int = 0,
                scale: float = 0.3, **config_changes) -> None:
    """An EAGLE-1 checkpoint for a Llama of `target_config` (its config.json's): that config with one layer, and
    random weights under the EAGLE authors' names (no input norm on the layer, `fc` over [embedding ; feature],
    the target's embeddings beside them); `para_norms`: HASS's norms of both before `fc` (`add_para_norm`)."""
    rng = np.random.default_rng(seed)
    hidden, ffn = target_config["hidden_size"], target_config["intermediate_size"]
    heads, kv_heads = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    head_dim = target_config.get("head_dim") or hidden // heads

    def weight(*shape):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    config = {**target_config, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"], **config_changes}
    tensors = {
        "fc.weight": weight(hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": weight(heads * head_dim, hidden),
        "layers.0.self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
        "layers.0.self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
        "layers.0.self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": weight(ffn, hidden),
        "layers.0.mlp.up_proj.weight": weight(ffn, hidden),
        "layers.0.mlp.down_proj.weight": weight(hidden, ffn),
        "layers.0.post_attention_layernorm.weight": (1 + weight(hidden)).astype(np.float32),
        "embed_tokens.weight": weight(config["vocab_size"], hidden),  # the target's copy: never read
    }
    if fc_bias:
        tensors["fc.bias"] = weight(hidden)
    if para_norms:
        config["add_para_norm"] = True
        for name in ("embedding_layernorm", "hidden_states_layernorm"):
            tensors[f"{name}.weight"] = (1 + weight(hidden)).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))


def write_eagle3(directory, target_config: dict, target_layers: tuple[int, ...], draft_vocab_size: int | None = None,
                 own_embeddings: bool = False, norm_before_residual: bool = False, seed: int = 0,
                 scale: float = 0.3) -> None:
    """An EAGLE-3 checkpoint for a Llama of `target_config`, as the EAGLE authors save one: `midlayer` (its
    attention over [embedding ; feature]), `fc` over the inputs of `target_layers`, a final norm, and an LM head
    over `draft_vocab_size` random target ids (`d2t`: target id - draft id; None: the whole vocabulary)."""
    rng = np.random.default_rng(seed)
    hidden, ffn = target_config["hidden_size"], target_config["intermediate_size"]
    heads, kv_heads = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    head_dim = target_config.get("head_dim") or hidden // heads
    vocab = target_config["vocab_size"]
    draft_vocab = draft_vocab_size or vocab

    def weight(*shape):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    draft_ids = np.sort(rng.choice(vocab, draft_vocab, replace=False)) if draft_vocab_size else np.arange(vocab)
    config = {**target_config, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"],
              "draft_vocab_size": draft_vocab, "norm_before_residual": norm_before_residual,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(target_layers), "use_aux_hidden_state": True}}
    tensors = {
        "fc.weight": weight(hidden, len(target_layers) * hidden),
        "midlayer.self_attn.q_proj.weight": weight(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": weight(ffn, hidden),
        "midlayer.mlp.up_proj.weight": weight(ffn, hidden),
        "midlayer.mlp.down_proj.weight": weight(hidden, ffn),
        **{f"midlayer.{name}.weight": (1 + weight(hidden)).astype(np.float32)
           for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm")},
        "norm.weight": (1 + weight(hidden)).astype(np.float32),
        "lm_head.weight": weight(draft_vocab, hidden),
        "d2t": (draft_ids - np.arange(draft_vocab)).astype(np.int64),
        "t2d": np.isin(np.arange(vocab), draft_ids),
    }
    if own_embeddings:
        tensors["embed_tokens.weight"] = weight(vocab, hidden)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
