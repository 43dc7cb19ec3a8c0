"""Logits parity with transformers' PyTorch models (float32) for tiny random models of every family."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxserve.models import values_are_keys
from jaxserve.models.layers import AttentionMetadata, kv_cache_layers
from jaxserve.models.loader import load_model
from jaxserve.ops.attention import kv_cache_shape
from jaxserve.ops.kv_write import padding_slot

pytestmark = pytest.mark.slow  # real models or the transformers reference: `make test-fast` skips these

PAGE_SIZE = 4
NUM_PAGES = 40
MAX_PAGES = 16
TOL = 1e-4


@jax.jit(static_argnums=0)
def _forward(graphdef, state, ids, positions, kv, md):  # -> (f32[T, V] logits, the updated cache)
    model = nnx.merge(graphdef, state)
    hidden, kv = model(ids, positions, kv, md)
    return model.compute_logits(hidden), kv


class PagedForward:
    """Runs a loaded model over one request's paged cache, a chunk of tokens at a time: one compiled call a
    chunk shape (eager op-by-op dispatch compiled every primitive on its own, ~30 s a model on a GPU)."""

    def __init__(self, loaded, page_ids: list[int]) -> None:
        import jax.numpy as jnp

        self.graphdef, self.state = loaded.graphdef, loaded.state
        cfg = loaded.cfg
        shape = kv_cache_shape(NUM_PAGES, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.kv = kv_cache_layers(cfg.num_layers, values_are_keys(cfg), lambda: jnp.full(shape, jnp.nan))
        self.pages = np.asarray(page_ids, np.int32)
        self.num_computed = 0

    def __call__(self, token_ids: list[int], num_padding: int = 3) -> np.ndarray:  # f32[T, V]
        n = len(token_ids)
        positions = np.arange(self.num_computed, self.num_computed + n, dtype=np.int32)
        slots = self.pages[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        # Padding tokens after the real ones must change nothing.
        ids = np.concatenate([token_ids, np.zeros(num_padding, np.int32)]).astype(np.int32)
        positions = np.concatenate([positions, np.zeros(num_padding, np.int32)])
        slots = np.concatenate([slots, np.full(num_padding, padding_slot(NUM_PAGES, PAGE_SIZE))])
        page_table = np.zeros((2, MAX_PAGES), np.int32)
        page_table[0, : len(self.pages)] = self.pages
        md = AttentionMetadata(
            slot_mapping=slots.astype(np.int32),
            kv_lens=np.array([self.num_computed + n, 0], np.int32),
            page_table=page_table,
            cu_q_lens=np.array([0, n, n], np.int32),
        )
        logits, self.kv = _forward(self.graphdef, self.state, ids, positions, self.kv, md)
        self.num_computed += n
        return np.asarray(logits[:n])


# mistral, qwen2-window, phi3 and the Gemmas have sliding windows shorter than the prompt; phi3 has LongRoPE
# (past its original context, so the long factors) and partial rotary; yarn is Llama with YaRN scaling;
# mixtral and qwen3-moe route each token to 2 of their experts (qwen3-moe with a dense layer between), qwen2-moe
# too, with its gated shared expert; granite scales by its multipliers; smollm3 has a layer without RoPE; olmo2
# norms each block's output and all heads' queries and keys at once, and olmo3 adds windows and a RoPE per layer
# kind; olmoe norms all heads' queries and keys before its blocks, clips q, k and v, and routes to 2 of 6 experts;
# granite-moe scales as granite does and softmaxes its top 2 logits, and granite-moe-shared adds an ungated shared
# expert; glm4 rotates adjacent pairs over half of each head and norms each block's input and output; glm4-moe
# (GLM-4.5) rotates half of each head, norms each head's q and k, and routes as DeepSeek-V3 does; gemma is
# Gemma 2 without its norms after;
# gpt-oss has attention sinks, windows of 5, YaRN, and experts with biases and a clamped SwiGLU.
PARITY_KINDS = ["gpt2", "llama", "qwen2", "qwen3", "mistral", "qwen2-window", "phi3", "yarn", "gemma2", "gemma3",
                "mixtral", "qwen3-moe", "qwen2-moe", "granite", "smollm3", "olmo2", "olmo3", "gemma", "gpt-oss",
                "olmoe", "granite-moe", "granite-moe-shared", "glm4", "glm4-moe", "deepseek-v2", "deepseek-v3"]
# On a GPU (`make test-gpu`, in full float32: tests/conftest.py), one kind per device code path: learned
# positions and LayerNorm, RoPE with GQA, windows and soft caps in the kernels, the grouped expert matmuls.
# Each costs ~30 s there (an H200: its compiles), and the others differ only in host-side shapes and maps.
GPU_PARITY_KINDS = {"gpt2", "llama", "gemma2", "qwen3-moe"}


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.gpu) if k in GPU_PARITY_KINDS else k
                                  for k in PARITY_KINDS])
def test_logits_match_transformers(kind, tiny_model_dir, tiny_hf_model):
    loaded = load_model(str(tiny_model_dir(kind)), dtype="float32")
    hf = tiny_hf_model(kind)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, loaded.cfg.vocab_size, size=23).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0].numpy()  # [T, V]

    # The whole prompt at once, pages shuffled.
    page_ids = rng.permutation(np.arange(1, NUM_PAGES))[:MAX_PAGES].tolist()
    full = PagedForward(loaded, page_ids)(tokens)
    np.testing.assert_allclose(full, expected, atol=TOL, rtol=0)

    # A prefill chunk, then token by token through the paged cache.
    step = PagedForward(loaded, page_ids)
    got = [step(tokens[:6])]
    got += [step([t]) for t in tokens[6:]]
    np.testing.assert_allclose(np.concatenate(got), expected, atol=TOL, rtol=0)


def test_glm45_s_multi_token_prediction_layer_is_left_unloaded(tiny_model_dir, tiny_hf_model, tmp_path):
    """GLM-4.5's checkpoints hold a multi-token prediction layer past `num_hidden_layers` (layer 46 of 46
    in GLM-4.5-Air's: a block with its own experts, and `eh_proj`, `enorm`, `hnorm`, `shared_head`), which
    transformers does not load and which serving does not use: written into the tiny model's file, it is left
    out, and the logits stay transformers'."""
    import shutil

    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "with-mtp"
    shutil.copytree(tiny_model_dir("glm4-moe"), directory)
    tensors = load_file(directory / "model.safetensors")
    last = max(int(name.split(".")[2]) for name in tensors if name.startswith("model.layers."))
    rng = np.random.default_rng(2)
    extra = {name.replace(f"model.layers.{last}.", f"model.layers.{last + 1}.", 1):
             rng.normal(size=tensor.shape).astype(tensor.dtype)
             for name, tensor in tensors.items() if name.startswith(f"model.layers.{last}.")}
    hidden = tensors["model.norm.weight"].shape[0]
    extra |= {f"model.layers.{last + 1}.eh_proj.weight": np.ones((hidden, 2 * hidden), np.float32),
              f"model.layers.{last + 1}.enorm.weight": np.ones(hidden, np.float32),
              f"model.layers.{last + 1}.hnorm.weight": np.ones(hidden, np.float32),
              f"model.layers.{last + 1}.shared_head.norm.weight": np.ones(hidden, np.float32)}
    assert f"model.layers.{last + 1}.mlp.experts.7.down_proj.weight" in extra  # as the checkpoints hold them
    save_file(tensors | extra, directory / "model.safetensors", metadata={"format": "pt"})

    loaded = load_model(str(directory), dtype="float32")
    assert loaded.cfg.num_layers == last + 1
    tokens = np.random.default_rng(1).integers(0, loaded.cfg.vocab_size, size=11).tolist()
    with torch.no_grad():
        expected = tiny_hf_model("glm4-moe")(torch.tensor([tokens])).logits[0].numpy()
    got = PagedForward(loaded, list(range(1, MAX_PAGES + 1)))(tokens)
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)

    # A checkpoint of another family with a layer more than its config says is refused, as before
    llama = tmp_path / "llama-with-extra-layer"
    shutil.copytree(tiny_model_dir("llama"), llama)
    tensors = load_file(llama / "model.safetensors")
    extra_layer = {name.replace("model.layers.1.", "model.layers.2.", 1): tensor for name, tensor in tensors.items()
                   if name.startswith("model.layers.1.")}
    save_file(tensors | extra_layer, llama / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\..* maps to unknown parameter"):
        load_model(str(llama), dtype="float32")


def test_olmo3_spelled_flat_scales_its_full_layers_only(tiny_hf_model):
    """transformers 4 spells OLMo 3's RoPE flat (`rope_scaling`, `rope_theta`) and runs its windowed layers
    unscaled: the same layers' RoPE as transformers 5's spelling by layer kind."""
    import copy

    from jaxserve.models.llama import LlamaConfig

    nested = tiny_hf_model("olmo3").config
    flat = copy.deepcopy(nested)
    full = dict(nested.rope_parameters["full_attention"])
    flat.rope_parameters, flat.rope_theta = None, full.pop("rope_theta")
    flat.rope_scaling = full
    want, got = LlamaConfig.from_hf(nested), LlamaConfig.from_hf(flat)
    assert got.layer_ropes == want.layer_ropes and got.rope == want.rope
    assert want.layer_ropes[0] == want.layer_ropes[2] != want.layer_ropes[1] == want.rope


def test_the_reference_soft_caps_gemma2s_attention(tiny_model_dir, tiny_hf_model):
    """The parity reference must apply attn_logit_softcapping: transformers' SDPA attention drops it, and
    transformers 5.17 gives Gemma 2 SDPA by default (the GPU image's: its parity failed from the second
    token on, where the cap changes the softmax, while jaxserve's kernels were right)."""
    import transformers

    tokens = torch.tensor([list(range(50, 60))])
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir("gemma2"))
    config.attn_logit_softcapping = None
    uncapped = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("gemma2"), config=config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        capped, plain = tiny_hf_model("gemma2")(tokens).logits[0].numpy(), uncapped(tokens).logits[0].numpy()
    np.testing.assert_allclose(capped[0], plain[0], atol=TOL, rtol=0)  # one key: the softmax is 1 either way
    assert np.abs(capped[1:] - plain[1:]).max() > 100 * TOL


def test_qwen2_biases_are_loaded(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("qwen2")), dtype="float32")
    assert loaded.cfg.qkv_bias
    bias = np.asarray(nnx.to_pure_dict(loaded.state)["layers"][0]["self_attn"]["q_bias"])
    assert np.abs(bias).max() > 0


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gemma3", "phi3", "mixtral", "qwen3-moe", "qwen2-moe", "granite",
                                  "olmo2", "gpt-oss", "granite-moe-shared", "glm4", "glm4-moe"])
def test_bfloat16_weights_track_float32(kind, tiny_model_dir, tiny_hf_model):
    """bf16 is a serving dtype, not a parity one: its logits stay close and mostly agree on argmax, as close
    as transformers' own bfloat16 model's do. (The tiny Qwen3-MoE's routing is fragile: rounded to bfloat16,
    transformers' own logits move by 15% of their mean size, near-tied experts swapping places.)"""
    tokens = list(range(100, 120))
    f32 = PagedForward(load_model(str(tiny_model_dir(kind)), dtype="float32"), list(range(1, 9)))(tokens)
    bf16 = PagedForward(load_model(str(tiny_model_dir(kind)), dtype="bfloat16"), list(range(1, 9)))(tokens)
    with torch.no_grad():
        hf_bf16 = tiny_hf_model(kind).to(torch.bfloat16)(torch.tensor([tokens])).logits[0].float().numpy()
    hf_error = np.abs(f32 - hf_bf16).mean()
    assert np.abs(f32 - bf16).mean() < max(0.05 * np.abs(f32).mean(), 1.25 * hf_error)
    agreement = min(0.8, (f32.argmax(-1) == hf_bf16.argmax(-1)).mean() - 0.1)
    assert (f32.argmax(-1) == bf16.argmax(-1)).mean() >= agreement


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_bfloat16_weights_under_a_float32_model(kind, tiny_model_dir):
    """`weight_dtype`: the matmul weights (projections, token embeddings) in bfloat16, everything else
    (norms, biases, GPT-2's position embeddings, the activations) in float32. Its logits sit closer to
    float32's than a bfloat16 model's do: only the weights and the matmuls' inputs are rounded."""
    tokens = list(range(100, 120))
    models = {name: load_model(str(tiny_model_dir(kind)), dtype=dtype, weight_dtype=weights)
              for name, dtype, weights in (("f32", "float32", "auto"), ("mixed", "float32", "bfloat16"),
                                           ("bf16", "bfloat16", "auto"))}
    weights = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
               "lm_head", "qkv", "attn_out", "fc", "proj", "wte"}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(models["mixed"].state))[0]:
        name = path[-1].key
        assert leaf.dtype == (jnp.bfloat16 if name in weights else jnp.float32), name
    assert models["mixed"].dtype == jnp.float32 and models["mixed"].weight_dtype == jnp.bfloat16
    logits = {name: PagedForward(model, list(range(1, 9)))(tokens) for name, model in models.items()}
    error = {name: np.abs(logits[name] - logits["f32"]).mean() for name in ("mixed", "bf16")}
    assert 0 < error["mixed"] < error["bf16"]
    assert error["mixed"] < 0.02 * np.abs(logits["f32"]).mean()
    assert (logits["mixed"].argmax(-1) == logits["f32"].argmax(-1)).mean() >= 0.9


def test_unknown_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["BertForMaskedLM"], "model_type": "bert"}')
    with pytest.raises(ValueError, match=r"unsupported model architecture \['BertForMaskedLM'\]"):
        load_model(str(tmp_path))


# kind -> each layer's window
WINDOWED = {"mistral": (7, 7), "qwen2-window": (None, 5), "phi3": (9, 9, 9), "gemma2": (6, None, 6),
            "gemma3": (6, None, 6)}


@pytest.mark.parametrize("kind", sorted(WINDOWED))
def test_sliding_windows_are_per_layer_and_they_matter(kind, tiny_model_dir, tiny_hf_model):
    """Each layer's window is read from the config as transformers reads it, the context is not capped at
    the window, and the windows change the logits (so the parity above tests them)."""
    import transformers

    loaded = load_model(str(tiny_model_dir(kind)), dtype="float32")
    assert tuple(loaded.cfg.window(i) for i in range(loaded.cfg.num_layers)) == WINDOWED[kind]
    assert loaded.cfg.max_position_embeddings == 512
    tokens = list(range(50, 73))
    ours = PagedForward(loaded, list(range(1, 9)))(tokens)
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir(kind))
    config.sliding_window = 10_000  # windows past the context: the reference without them
    unwindowed = type(tiny_hf_model(kind)).from_pretrained(tiny_model_dir(kind), config=config,
                                                          attn_implementation="eager").eval()
    with torch.no_grad():
        full = unwindowed(torch.tensor([tokens])).logits[0].numpy()
    assert np.abs(ours - full).max() > 100 * TOL


def test_rope_scalings_match_transformers():
    """YaRN and LongRoPE (short and long factors, partial rotary) frequencies and attention factors equal
    transformers' own."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxserve.models.layers import rope_for

    common = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, max_position_embeddings=8192)
    yarn = transformers.LlamaConfig(**common, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=2048, beta_fast=16))
    deepseek = transformers.LlamaConfig(**common, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e4, factor=40.0, original_max_position_embeddings=4096, mscale=0.707,
        mscale_all_dim=0.707))
    factors = dict(short_factor=[1.0 + 0.05 * i for i in range(6)], long_factor=[1.0 + 0.7 * i for i in range(6)])
    longrope = transformers.Phi3Config(**common, original_max_position_embeddings=1024, rope_parameters=dict(
        rope_type="longrope", rope_theta=1e4, partial_rotary_factor=0.75, original_max_position_embeddings=1024,
        **factors))
    for config, seq_len in ((yarn, None), (deepseek, None), (longrope, 4096)):
        kind = config.rope_parameters["rope_type"]
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)
        rope = rope_for(config, 16)
        np.testing.assert_allclose(rope.inv_freq, inv_freq.numpy(), rtol=1e-6)
        assert rope.attention_factor == pytest.approx(factor, rel=1e-6)
    longrope.max_position_embeddings = 1024  # a context within the original one: the short factors
    inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](longrope, None, seq_len=100)
    np.testing.assert_allclose(rope_for(longrope, 16).inv_freq, inv_freq.numpy(), rtol=1e-6)
