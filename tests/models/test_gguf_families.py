"""GGUF files of the families beyond Llama: a tiny random Qwen3 written as llama.cpp lays a GGUF out (its
tensor names, the architecture's metadata, SmolLM2's tokenizer fields), loaded through the GGUF path, gives
the logits of the transformers model it was written from."""

import numpy as np
import pytest
import torch

from jaxserve.models.gguf import read_gguf
from jaxserve.models.loader import load_model
from tests.models.test_parity import TOL, PagedForward

pytestmark = pytest.mark.slow  # the transformers reference

# HF name (after `model.layers.N.`) -> llama.cpp's name (after `blk.N.`), per architecture
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GEMMA_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_MOE_NAMES = {**_LAYER_NAMES, "mlp.gate": "ffn_gate_inp", "mlp.experts_gate": "ffn_gate_exps",
              "mlp.experts_up": "ffn_up_exps", "mlp.experts_down": "ffn_down_exps"}
_SHARED_EXPERT_NAMES = {"mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                        "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_ARCH_NAMES = {"qwen3": _LAYER_NAMES, "gemma2": _GEMMA_NAMES, "gemma3": _GEMMA_NAMES,
               "qwen3moe": _MOE_NAMES, "llama": _MOE_NAMES, "qwen2moe": {**_MOE_NAMES, **_SHARED_EXPERT_NAMES},
               "phi3": {**_LAYER_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
               "granite": _LAYER_NAMES, "smollm3": _LAYER_NAMES, "gemma": _LAYER_NAMES,
               "olmo2": {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                         "post_feedforward_layernorm": "post_ffw_norm"}}
_PERMUTED = ("llama", "granite", "smollm3")  # written as llama.cpp's LlamaModel writes them: Q/K rows permuted
_ROTARY_ROWS = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str, arch: str = "qwen3") -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if rest.startswith("mlp.experts_"):  # stacked experts: no suffix in either naming
        return f"blk.{layer}.{_ARCH_NAMES[arch][rest]}.weight"
    if rest.startswith("mlp.expert."):  # one expert's weight, as older Mixtral files hold them: mlp.expert.E.kind
        _, _, expert, kind, _ = rest.split(".")
        return f"blk.{layer}.ffn_{kind}.{expert}.weight"
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_ARCH_NAMES[arch][module]}.{suffix}"


def assert_logits_match(loaded, hf, seed: int) -> None:
    """The loaded file's logits over 19 random tokens, prompt then chunks through the paged cache, equal the
    transformers model's, to TOL."""
    tokens = np.random.default_rng(seed).integers(0, loaded.cfg.vocab_size, size=19).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0].numpy()
    got = PagedForward(loaded, list(range(1, 9)))(tokens)
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)


def write_gguf(path, arch: str, cfg, tensors, tokenizer_gguf) -> None:
    """A GGUF of a transformers config and its HF-named `tensors` (name -> array, in the dtype to store, or
    (blocks, GGMLQuantizationType) to store quantized), laid out as llama.cpp's converter lays it out (Gemma's
    norms stored as 1 + w), with the tokenizer fields of `tokenizer_gguf`."""
    write_gguf_tensors(path, arch, cfg, _as_llama_cpp_names(arch, cfg, tensors), tokenizer_gguf)


def _as_llama_cpp_names(arch: str, cfg, tensors):
    for name, tensor in tensors:
        if isinstance(tensor, tuple):  # (blocks, GGMLQuantizationType): stored quantized
            yield gguf_name(name, arch), tensor
            continue
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1.0
        elif arch in _PERMUTED and name.endswith(_ROTARY_ROWS):  # llama.cpp's rotary rows
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            tensor = tensor.reshape(heads, 2, -1, *tensor.shape[1:]).swapaxes(1, 2).reshape(tensor.shape)
        yield gguf_name(name, arch), tensor


def write_gguf_tensors(path, arch: str, cfg, tensors, tokenizer_gguf, extra: dict | None = None) -> None:
    """A GGUF of a transformers config's metadata (and `extra` {key: (value, GGUFValueType[, an array's item
    type])}, which replaces a key the config would give), the tokenizer fields of `tokenizer_gguf`, and
    `tensors` already under llama.cpp's names (array, or (blocks, type))."""
    import gguf

    extra = extra or {}
    writer = gguf.GGUFWriter(str(path), arch=arch)
    keys, types = gguf.Keys, gguf.GGUFValueType
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3's: the global layers'
    for key, value, value_type in (
            (keys.LLM.BLOCK_COUNT, cfg.num_hidden_layers, types.UINT32),
            (keys.LLM.CONTEXT_LENGTH, cfg.max_position_embeddings, types.UINT32),
            (keys.LLM.EMBEDDING_LENGTH, cfg.hidden_size, types.UINT32),
            (keys.LLM.FEED_FORWARD_LENGTH, cfg.intermediate_size, types.UINT32),
            (keys.Attention.HEAD_COUNT, cfg.num_attention_heads, types.UINT32),
            (keys.Attention.HEAD_COUNT_KV, cfg.num_key_value_heads, types.UINT32),
            (keys.Attention.KEY_LENGTH, head_dim, types.UINT32),
            (keys.Attention.VALUE_LENGTH, head_dim, types.UINT32),
            (keys.Rope.FREQ_BASE, rope.get("rope_theta", 10000.0), types.FLOAT32),
            (keys.Attention.LAYERNORM_RMS_EPS, cfg.rms_norm_eps, types.FLOAT32)):
        if key.format(arch=arch) not in extra:
            writer.add_key_value(key.format(arch=arch), value, value_type)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    if rope.get("rope_type") == "longrope":  # as llama.cpp writes Phi-3 128k: the factors as tensors
        writer.add_key_value(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"],
                             gguf.GGUFValueType.UINT32)
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], np.float32))
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts and f"{arch}.expert_count" not in extra:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None) and f"{arch}.expert_feed_forward_length" not in extra:
        # Qwen3-MoE's; Mixtral's experts are intermediate_size wide
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):  # Qwen2-MoE's
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    reader = read_gguf(tokenizer_gguf)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and key not in extra:
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for key, (value, value_type, *sub_type) in extra.items():
        writer.add_key_value(key, value, value_type, sub_type=sub_type[0] if sub_type else None)
    for name, tensor in tensors:
        raw_dtype = None
        if isinstance(tensor, tuple):
            tensor, raw_dtype = tensor
        writer.add_tensor(name, tensor, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_qwen3_gguf(path, cfg, tensors, tokenizer_gguf) -> None:
    write_gguf(path, "qwen3", cfg, tensors, tokenizer_gguf)


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
    assert_logits_match(loaded, hf, seed=3)


def tiny_model(kind: str):
    """Gemma 2 (3 layers, local ones of window 6, transformers' GGUF defaults for what the file does not say:
    query_pre_attn_scalar 256, soft caps 50 and 30), Gemma 3 (5:1 local:global defaults) and Phi-3."""
    import transformers

    from tests.conftest import TINY_VOCAB

    torch.manual_seed(0)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, sliding_window=None))
    elif kind == "phi3-longrope":  # a 128k variant's scaling; the prompt runs past the original context, where
        # transformers switches to the long factors that jaxserve takes throughout (the context exceeds the original)
        factors = np.random.default_rng(7).uniform(1.0, 4.0, size=(2, 8)).tolist()
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            **common, sliding_window=None, original_max_position_embeddings=8, rope_scaling={
                "rope_type": "longrope", "long_factor": factors[0], "short_factor": factors[1]}))
    elif kind == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, head_dim=32, sliding_window=6))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 7}, head_dim=32, sliding_window=6))
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if kind.startswith("gemma") and name.endswith("norm.weight"):
                tensor.normal_(std=0.3)
    return model.eval()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi3", "phi3-longrope"])
def test_gemma_and_phi3_ggufs_match_transformers(kind, smollm2_gguf, tmp_path, monkeypatch):
    """Gemma's four norms under llama.cpp's names and stored as 1 + w; Phi-3's fused qkv and gate/up, and a
    128k variant's LongRoPE factors, which its file holds as tensors."""
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_model(kind)
    path = tmp_path / f"tiny-{kind}.gguf"
    tensors = [(name, tensor.numpy().astype(np.float32)) for name, tensor in hf.state_dict().items()
               if not (kind.startswith("gemma") and name == "lm_head.weight")]  # tied
    write_gguf(path, kind.removesuffix("-longrope"), hf.config, tensors, smollm2_gguf)
    loaded = load_model(str(path), dtype="float32")
    assert_logits_match(loaded, hf, seed=4)


@pytest.mark.parametrize(("layers", "scalar"), [(26, 256), (46, 4608 // 32)], ids=["gemma-2-2b", "gemma-2-27b"])
def test_gemma2_query_scale_follows_llama_cpp(layers, scalar, smollm2_gguf, tmp_path, monkeypatch):
    """A Gemma 2 file does not say its query scale; llama.cpp scales 27B's (46 layers) queries by (hidden /
    heads)^-1/2 and the others' by head_size^-1/2, and so does the converted config."""
    import json

    import transformers

    from jaxserve.models.gguf_cache import converted_dir

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    config = transformers.Gemma2Config(hidden_size=4608, intermediate_size=36864, num_hidden_layers=layers,
                                       num_attention_heads=32, num_key_value_heads=16, head_dim=128)
    path = tmp_path / "gemma2-metadata.gguf"
    write_gguf(path, "gemma2", config, [], smollm2_gguf)
    converted = json.loads((converted_dir(path) / "config.json").read_text())
    assert converted["query_pre_attn_scalar"] == scalar


def experts_as_llama_cpp_stores_them(hf, per_expert: bool = False) -> list:
    """`hf`'s float32 tensors with each layer's experts (transformers keeps gate_up_proj [E, 2F, D] fused and
    down_proj [E, D, F]) stacked per kind, or with `per_expert` as one tensor per expert."""
    tensors = []
    for name, tensor in hf.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        stem = name.rsplit(".experts.", 1)[0]  # model.layers.N.mlp
        if name.endswith("mlp.experts.gate_up_proj"):
            half = array.shape[1] // 2
            stacked = {"gate": array[:, :half], "up": array[:, half:]}
        elif name.endswith("mlp.experts.down_proj"):
            stacked = {"down": array}
        else:
            tensors.append((name, array))
            continue
        for kind, weights in stacked.items():
            if per_expert:
                tensors += [(f"{stem}.expert.{e}.{kind}.weight", w) for e, w in enumerate(weights)]
            else:
                tensors.append((f"{stem}.experts_{kind}", weights))
    return tensors


def test_a_qwen3_moe_gguf_matches_transformers(smollm2_gguf, tmp_path, monkeypatch):
    """Experts stacked per layer as llama.cpp stores them ([E, out, in]), the router, and the expert width
    read from the file's `expert_feed_forward_length` (transformers leaves it out)."""
    import transformers

    from tests.conftest import TINY_VOCAB

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
    hf = transformers.Qwen3MoeForCausalLM(config).eval()
    tensors = experts_as_llama_cpp_stores_them(hf)
    path = tmp_path / "tiny-qwen3moe.gguf"
    write_gguf(path, "qwen3moe", hf.config, tensors, smollm2_gguf)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.cfg.moe.intermediate_size == 48 and loaded.cfg.moe.normalize_top_k
    assert_logits_match(loaded, hf, seed=5)


@pytest.mark.parametrize("per_expert", [False, True], ids=["stacked", "per-expert"])
def test_a_mixtral_gguf_matches_transformers(per_expert, smollm2_gguf, tmp_path, monkeypatch):
    """llama.cpp writes Mixtral as a `llama` file with `expert_count` (transformers' reader makes it a dense
    Llama): its experts stacked as newer files hold them or one tensor per expert as older ones do, its Q/K
    rows permuted for llama.cpp's rotary layout."""
    import transformers

    from tests.conftest import TINY_VOCAB

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.3,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    hf = transformers.MixtralForCausalLM(config).eval()
    path = tmp_path / "tiny-mixtral.gguf"
    write_gguf(path, "llama", hf.config, experts_as_llama_cpp_stores_them(hf, per_expert), smollm2_gguf)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.cfg.moe.num_experts == 4 and loaded.cfg.moe.top_k == 2 and loaded.cfg.moe.intermediate_size == 48
    assert_logits_match(loaded, hf, seed=6)


def test_a_qwen2_moe_gguf_matches_transformers(smollm2_gguf, tmp_path, monkeypatch):
    """Qwen2-MoE: the routed experts stacked, the shared expert's weights and its gate (one row, which
    llama.cpp declares [D]) under llama.cpp's `_shexp` names, both widths read from the file's metadata, and
    q/k/v biases."""
    import transformers

    from tests.conftest import TINY_VOCAB

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.3,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=40)
    hf = transformers.Qwen2MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if name.endswith(".bias"):
                tensor.normal_(std=0.3)
    tensors = [(name, array.reshape(-1) if name.endswith("shared_expert_gate.weight") else array)
               for name, array in experts_as_llama_cpp_stores_them(hf)]
    path = tmp_path / "tiny-qwen2moe.gguf"
    write_gguf(path, "qwen2moe", hf.config, tensors, smollm2_gguf)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.cfg.moe.intermediate_size == 48 and loaded.cfg.moe.shared_expert_size == 40
    assert loaded.cfg.qkv_bias and not loaded.cfg.moe.normalize_top_k
    assert_logits_match(loaded, hf, seed=8)


@pytest.mark.parametrize("kind", ["granite", "smollm3"])
def test_granite_and_smollm3_ggufs_match_transformers(kind, tiny_hf_model, smollm2_gguf, tmp_path, monkeypatch):
    """Files transformers' GGUF reader does not know, which llama.cpp writes as Llama's (Q/K rows permuted)
    under their own names: Granite's multipliers under llama.cpp's keys (here far from 1, with biases on
    q, k, v and o), and SmolLM3, whose file says nothing of its layers without RoPE (llama.cpp leaves RoPE
    out of every fourth layer, as SmolLM3's config does by default)."""
    import gguf
    import transformers

    from tests.conftest import _build_tiny_hf_model

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    if kind == "granite":
        hf = tiny_hf_model("granite")
        scales = {gguf.Keys.LLM.EMBEDDING_SCALE: hf.config.embedding_multiplier,
                  gguf.Keys.LLM.RESIDUAL_SCALE: hf.config.residual_multiplier,
                  gguf.Keys.Attention.SCALE: hf.config.attention_multiplier,
                  gguf.Keys.LLM.LOGIT_SCALE: hf.config.logits_scaling}
        extra = {key.format(arch=kind): (value, gguf.GGUFValueType.FLOAT32) for key, value in scales.items()}
    else:  # four layers: the default interval leaves the last one without RoPE
        config = _build_tiny_hf_model("smollm3").config
        fields = {k: v for k, v in config.to_dict().items() if k not in ("layer_types", "no_rope_layers")}
        config = transformers.SmolLM3Config(**{**fields, "num_hidden_layers": 4})
        assert config.no_rope_layers == [1, 1, 1, 0]
        torch.manual_seed(0)
        hf, extra = transformers.SmolLM3ForCausalLM(config).eval(), {}
    tensors = [(name, tensor.numpy().astype(np.float32)) for name, tensor in hf.state_dict().items()]
    path = tmp_path / f"tiny-{kind}.gguf"
    write_gguf_tensors(path, kind, hf.config, _as_llama_cpp_names(kind, hf.config, tensors), smollm2_gguf, extra)
    loaded = load_model(str(path), dtype="float32")
    assert_logits_match(loaded, hf, seed=9)


@pytest.mark.parametrize("kind", ["olmo2", "gemma"])
def test_olmo2_and_gemma_ggufs_match_transformers(kind, tiny_hf_model, smollm2_gguf, tmp_path, monkeypatch):
    """OLMo 2 (norms after attention and after the MLP, random here, and q/k norms across all heads) and Gemma 1
    (norms stored as 1 + w, no soft caps or window, which transformers' Gemma 2 reading would add), neither
    with its Q/K rows permuted."""
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_hf_model(kind)
    tensors = [(name, tensor.numpy().astype(np.float32)) for name, tensor in hf.state_dict().items()
               if not (kind == "gemma" and name == "lm_head.weight")]  # tied
    path = tmp_path / f"tiny-{kind}.gguf"
    write_gguf(path, kind, hf.config, tensors, smollm2_gguf)
    loaded = load_model(str(path), dtype="float32")
    assert_logits_match(loaded, hf, seed=10)


@pytest.mark.parametrize("pattern", ["flags", "period"])
def test_an_olmo3_file_matches_transformers(pattern, tiny_hf_model, smollm2_gguf, tmp_path, monkeypatch):
    """llama.cpp writes OLMo 3 under OLMo 2's architecture, with a window, the windowed layers (a flag per layer
    as its converter writes them, or a period: every n-th layer full) and YaRN with the checkpoint's attention
    factor, which applies to the full layers only. Read as OLMo 2 it would load and answer wrongly."""
    import gguf

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_hf_model("olmo3")  # windowed, full, windowed: a period of 2 says the same
    tensors = [(name, tensor.numpy().astype(np.float32)) for name, tensor in hf.state_dict().items()]
    full = hf.config.rope_parameters["full_attention"]
    flags = [kind == "sliding_attention" for kind in hf.config.layer_types]
    extra = {"olmo2.attention.sliding_window_pattern": (flags, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL)
             if pattern == "flags" else (2, gguf.GGUFValueType.UINT32),
             "olmo2.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING),
             "olmo2.rope.scaling.factor": (full["factor"], gguf.GGUFValueType.FLOAT32),
             "olmo2.rope.scaling.yarn_attn_factor": (full["attention_factor"], gguf.GGUFValueType.FLOAT32),
             "olmo2.rope.scaling.original_context_length": (full["original_max_position_embeddings"],
                                                            gguf.GGUFValueType.UINT32)}
    path = tmp_path / "tiny-olmo3.gguf"
    write_gguf_tensors(path, "olmo2", hf.config, _as_llama_cpp_names("olmo2", hf.config, tensors), smollm2_gguf, extra)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.cfg.sliding_windows == (5, None, 5)
    assert_logits_match(loaded, hf, seed=11)
