"""--load-format dummy: random weights in a model's real shapes, with no checkpoint and no network."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.loader import load_model, resolve_model_config

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49408, hidden_size=64,
             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2)


def write_config(directory, **values) -> str:
    path = directory / "config.json"
    path.write_text(json.dumps({**LLAMA, **values}))
    return str(path)


def test_a_config_alone_loads_with_random_weights_in_their_dtypes(tmp_path):
    model = load_model(write_config(tmp_path), dtype="float32", weight_dtype="bfloat16", load_format="dummy")
    leaves = dict(jax.tree_util.tree_leaves_with_path(model.state))
    assert leaves, "no parameters"
    by_name = {jax.tree_util.keystr(path): leaf for path, leaf in leaves.items()}
    embed = next(v for k, v in by_name.items() if "embed" in k)
    assert embed.dtype == jnp.bfloat16 and embed.shape == (49408, 64), "a matmul weight, in the weight dtype"
    assert 0.015 < float(jnp.std(embed.astype(jnp.float32))) < 0.025  # transformers' initializer range
    norms = [v for k, v in by_name.items() if "scale" in k]
    assert norms and all(v.dtype == jnp.float32 and bool(jnp.all(v == 1)) for v in norms), "norms are ones"
    assert len(model.tokenizer) == 49152, "no tokenizer here: the bundled SmolLM2 one"
    assert model.eos_token_ids == (2,) and model.name == "config"


def test_a_vocabulary_smaller_than_the_bundled_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="more than the model's vocabulary of 1000"):
        load_model(write_config(tmp_path, vocab_size=1000), dtype="float32", load_format="dummy")


def test_bundled_shapes_resolve_offline():
    for name, layers in (("gpt2", 12), ("llama-3.2-1b", 16), ("llama-3-8b", 32)):
        source, hf_config = resolve_model_config(name)
        assert source.name == name and hf_config.num_hidden_layers == layers and source.gguf_file is None


def test_an_engine_serves_dummy_weights_and_repeats_itself(llama_dir):
    """The model directory's own tokenizer is used; two engines with the same seed agree token for token."""
    from tests.engine.helpers import make_engine, make_prompts, run_staggered

    outputs = []
    for _ in range(2):
        engine = make_engine(llama_dir, load_format="dummy")
        assert len(engine.tokenizer) == 49152
        prompts = make_prompts(3)
        outputs.append(run_staggered(engine, prompts, [6, 6, 6], [0, 0, 1]))
    assert outputs[0] == outputs[1] and all(len(tokens) == 6 for tokens in outputs[0].values())
    assert len({tuple(t) for t in outputs[0].values()}) > 1 or len(set(outputs[0][0])) > 1, "not a constant output"
    assert np.all([0 <= t < 49408 for tokens in outputs[0].values() for t in tokens])
