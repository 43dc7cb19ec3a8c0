"""vLLM's `--hf-overrides`: fields of the model's transformers config replaced before the model is built
(RoPE's merged into transformers 5's `rope_parameters`, the base frequency kept), and the context a YaRN
scaling gives (vLLM's rule)."""

import json
import logging
import re
import shutil

import numpy as np
import pytest
import transformers

from jaxserve.models.layers import context_length
from jaxserve.models.source import with_hf_overrides
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import make_engine, make_prompts

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}


def _qwen2(**values) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=8,
                                    max_position_embeddings=32768, rope_theta=1e6, **values)


@pytest.mark.parametrize("overrides,field", [({"num_hidden_layers": "two"}, "num_hidden_layers"),
                                             ({"rms_norm_eps": "small"}, "rms_norm_eps")])
def test_a_value_of_the_wrong_type_is_refused_in_one_line_naming_its_field(overrides, field):
    with pytest.raises(ValueError, match=rf"^--hf-overrides .*Validation error for field '{field}'"):
        with_hf_overrides(_qwen2(), overrides)


def test_a_rope_scaling_keeps_the_model_s_theta_in_either_spelling():
    """Qwen's model cards give `{"rope_scaling": {"rope_type": "yarn", ...}}` for vLLM: built as a config
    field beside transformers 5's `rope_parameters`, it would take the default theta (10,000, not the
    model's 1,000,000); here it is merged into them."""
    config = _qwen2()
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32768}
    for spelling in ({"rope_type": "yarn"}, {"type": "yarn"}):
        scaled = with_hf_overrides(config, {"rope_scaling": {**spelling, **yarn}})
        assert scaled.rope_parameters == {"rope_theta": 1e6, "rope_type": "yarn", **yarn}
    assert with_hf_overrides(config, {"rope_theta": 5e5}).rope_parameters == {"rope_theta": 5e5,
                                                                              "rope_type": "default"}
    given = with_hf_overrides(config, {"rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    assert given.rope_parameters == {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}
    other = with_hf_overrides(config, {"max_position_embeddings": 65536, "rms_norm_eps": 1e-3})
    assert (other.max_position_embeddings, other.rms_norm_eps, other.rope_parameters["rope_theta"]) == (65536, 1e-3,
                                                                                                          1e6)
    assert config.max_position_embeddings == 32768  # the model's own config is left as it was
    assert with_hf_overrides(config, None) is config and with_hf_overrides(config, {}) is config
    with pytest.raises(ValueError, match="rope_scaling must be an object"):
        with_hf_overrides(config, {"rope_scaling": 4.0})


def test_what_a_new_scaling_keeps_and_what_is_refused():
    """A scaling keeps the theta and the rotated fraction (which transformers 5 keeps in `rope_parameters`),
    null removes it, and parameters by layer type are refused where the model's are not."""
    config = with_hf_overrides(_qwen2(), {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                              "partial_rotary_factor": 0.5}})
    scaled = with_hf_overrides(config, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert scaled.rope_parameters == {"rope_theta": 1e6, "partial_rotary_factor": 0.5, "rope_type": "linear",
                                      "factor": 2.0}
    assert with_hf_overrides(scaled, {"rope_scaling": None}).rope_parameters == {
        "rope_theta": 1e6, "partial_rotary_factor": 0.5, "rope_type": "default"}
    with pytest.raises(ValueError, match="not per layer type: give rope_parameters as one set"):
        with_hf_overrides(config, {"rope_parameters": {"full_attention": {"rope_type": "default"}}})


def test_rope_parameters_by_layer_type_and_sub_configs():
    """Gemma 3 keys its RoPE by layer type: parameters are given by layer type. The older spellings, which
    transformers maps onto those layer types in each model's own way (Gemma 3's theta is its full layers'
    alone), are refused with what to give instead. A dict for a sub-config updates its fields."""
    gemma = transformers.Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                          intermediate_size=8, head_dim=16)
    linear = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    full = with_hf_overrides(gemma, {"rope_parameters": {"full_attention": linear}}).rope_parameters
    assert full == {"sliding_attention": gemma.rope_parameters["sliding_attention"], "full_attention": linear}
    for key, value in (("rope_scaling", {"rope_type": "linear", "factor": 8.0}), ("rope_theta", 5e4),
                       ("rope_local_base_freq", 5e4)):
        with pytest.raises(ValueError, match=re.escape(
                f"per layer type (sliding_attention, full_attention): give rope_parameters as "
                f"{{layer type: parameters}}, not {key}")):
            with_hf_overrides(gemma, {key: value})
    text = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=8)
    llava = transformers.LlavaConfig(text_config=text.to_dict())
    nested = with_hf_overrides(llava, {"text_config": {"max_position_embeddings": 4096}})
    assert nested.text_config.max_position_embeddings == 4096
    assert nested.text_config.hidden_size == 64 and nested.vision_config.to_dict() == llava.vision_config.to_dict()


def test_a_scaled_rope_serves_its_longer_context():
    """vLLM's rule: Qwen's configs keep 32,768 positions beside a YaRN factor of 4 for 131,072 tokens (the
    original context times the factor); a linear factor multiplies the positions; LongRoPE's and Llama 3's
    positions count the scaled context already; GPT-OSS's 131,072 positions are 4,096 x 32. Per layer type
    (Gemma 3's linear full layers, positions already scaled) only a YaRN layer type counts."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_length(with_hf_overrides(_qwen2(), {"rope_scaling": yarn}), 32768) == 131072
    assert context_length(_qwen2(), 32768) == 32768
    linear = with_hf_overrides(_qwen2(), {"rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    assert context_length(linear, 32768) == 131072
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    assert context_length(with_hf_overrides(_qwen2(), {"rope_scaling": llama3}), 131072) == 131072
    gpt_oss = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}
    assert context_length(with_hf_overrides(_qwen2(), {"rope_scaling": gpt_oss}), 131072) == 131072
    gemma = transformers.Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                          intermediate_size=8, head_dim=16, max_position_embeddings=131072)
    scaled = with_hf_overrides(gemma, {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                              "rope_theta": 1e6}}})
    assert context_length(scaled, 131072) == 131072
    olmo_like = with_hf_overrides(gemma, {"rope_parameters": {"full_attention": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}}})
    assert context_length(olmo_like, 131072) == 262144


def _generate(engine, prompts) -> dict[str, tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                results[output.request_id] = (list(completion.token_ids), list(completion.token_logprobs))
    return results


def test_the_engine_serves_the_overridden_config(tiny_model_dir, tmp_path, caplog):
    """The tiny Llama with `hf_overrides` (a theta and a YaRN scaling) generates what the same model does with
    those values written into its config.json, and not what the model does without them; its context is
    then 4 x 512 tokens, where without the scaling a longer --max-model-len is cut to 512, with a warning."""
    base = tiny_model_dir("llama")
    overrides = {"rope_theta": 500.0, "rope_scaling": YARN}
    edited = tmp_path / "edited"
    shutil.copytree(base, edited)
    config = json.loads((edited / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 500.0, **YARN}
    config.pop("rope_scaling", None)
    config.pop("rope_theta", None)
    (edited / "config.json").write_text(json.dumps(config))
    long = dict(max_model_len=2048, num_kv_pages=600)
    overridden = make_engine(base, warmup=False, hf_overrides=overrides, **long)
    assert overridden.max_model_len == 2048
    assert overridden.core.model.hf_config.rope_parameters == {"rope_theta": 500.0, **YARN}
    prompts = make_prompts(4)
    results = _generate(overridden, prompts)
    expected = _generate(make_engine(edited, warmup=False, **long), prompts)
    for request_id, (tokens, logprobs) in results.items():
        assert tokens == expected[request_id][0], request_id
        np.testing.assert_allclose(logprobs, expected[request_id][1], rtol=1e-5, atol=1e-5)
    with caplog.at_level(logging.WARNING, "jaxserve.engine.core"):
        plain = make_engine(base, warmup=False, **long)
    assert plain.max_model_len == 512
    assert "--max-model-len 2048 is longer than the model's context, 512: serving 512" in caplog.text
    unscaled = _generate(plain, prompts)
    assert any(not np.allclose(results[r][1], unscaled[r][1], atol=1e-3) for r in results)


def test_an_override_makes_a_model_s_embeddings_matryoshka(tiny_model_dir):
    """vLLM's way to serve `dimensions` for a model whose config does not say it may be cut short:
    `--hf-overrides '{"is_matryoshka": true}'`."""
    from starlette.testclient import TestClient

    from jaxserve.api.app import create_app
    from jaxserve.config import ServerConfig
    from jaxserve.engine.async_engine import AsyncEngine

    body = {"input": "The cat sat on the mat.", "dimensions": 16}
    for overrides, status in ((None, 400), ({"is_matryoshka": True}, 200)):
        engine = make_engine(tiny_model_dir("llama"), warmup=False, runner="pooling", hf_overrides=overrides)
        with TestClient(create_app(ServerConfig(), AsyncEngine(engine))) as client:
            response = client.post("/v1/embeddings", json=body)
        assert response.status_code == status, response.text
    vector = np.asarray(response.json()["data"][0]["embedding"])
    assert vector.shape == (16,) and np.linalg.norm(vector) == pytest.approx(1.0, rel=1e-5)
