"""Logits parity with transformers' PyTorch models (float32) for tiny random GPT-2, Llama, Qwen2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxserve.models.layers import AttentionMetadata
from jaxserve.models.loader import load_model
from jaxserve.ops.attention import kv_cache_shape
from jaxserve.ops.kv_write import padding_slot

pytestmark = pytest.mark.slow  # real models or the transformers reference: `make test-fast` skips these

PAGE_SIZE = 4
NUM_PAGES = 40
MAX_PAGES = 16
TOL = 1e-4


class PagedForward:
    """Runs a loaded model eagerly over one request's paged cache, a chunk of tokens at a time."""

    def __init__(self, loaded, page_ids: list[int]) -> None:
        import jax.numpy as jnp

        self.model = nnx.merge(loaded.graphdef, loaded.state)
        cfg = loaded.cfg
        shape = kv_cache_shape(NUM_PAGES, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [(jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan)) for _ in range(cfg.num_layers)]
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
        hidden, self.kv = self.model(ids, positions, self.kv, md)
        self.num_computed += n
        return np.asarray(self.model.compute_logits(hidden[:n]))


@pytest.mark.gpu  # on the device (in full float32 on a GPU: tests/conftest.py)
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "qwen3"])
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


def test_qwen2_biases_are_loaded(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("qwen2")), dtype="float32")
    assert loaded.cfg.qkv_bias
    bias = np.asarray(nnx.to_pure_dict(loaded.state)["layers"][0]["self_attn"]["q_bias"])
    assert np.abs(bias).max() > 0


def test_bfloat16_weights_track_float32(tiny_model_dir):
    """bf16 is a serving dtype, not a parity one: its logits stay close and mostly agree on argmax."""
    tokens = list(range(100, 120))
    f32 = PagedForward(load_model(str(tiny_model_dir("llama")), dtype="float32"), list(range(1, 9)))(tokens)
    bf16 = PagedForward(load_model(str(tiny_model_dir("llama")), dtype="bfloat16"), list(range(1, 9)))(tokens)
    assert np.abs(f32 - bf16).mean() < 0.05 * np.abs(f32).mean()
    assert (f32.argmax(-1) == bf16.argmax(-1)).mean() >= 0.8


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


def test_sliding_window_models_are_capped_at_the_window():
    import transformers

    from jaxserve.models.llama import LlamaConfig

    mistral = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, sliding_window=64)
    assert LlamaConfig.from_hf(mistral).max_position_embeddings == 64
    mistral.sliding_window = None
    assert LlamaConfig.from_hf(mistral).max_position_embeddings == 512
