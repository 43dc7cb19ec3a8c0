"""--runner pooling: prompts embedded through the scheduler and the bucketed step, against transformers'
final hidden states (last token and mean), with chunked prefill, prefix caching and batching."""

import numpy as np
import pytest
import torch

from jaxserve.llm import LLM
from jaxserve.sampling_params import InvalidParam, SamplingParams
from tests.engine.helpers import LADDER, make_prompts

pytestmark = pytest.mark.slow  # transformers reference


def _llm(model_dir, pooling_type: str) -> LLM:
    options = {**LADDER, "max_num_batched_tokens": 16, "token_buckets": (16,)}  # prompts over 16: chunked
    return LLM(model=str(model_dir), dtype="float32", runner="pooling", pooling_type=pooling_type, page_size=4,
               num_kv_pages=256, max_model_len=256, compilation_cache_dir=None, **options)


def _reference(hf_model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0]  # [T, D], after the final norm
    return hidden.double().numpy()


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_embeddings_match_transformers_final_hidden_states(llama_dir, tiny_hf_model, pooling_type):
    hf_model = tiny_hf_model("llama")
    llm = _llm(llama_dir, pooling_type)
    prompts = make_prompts(8)  # 1 to 40 tokens: several chunks of 16, batched together
    prompts.append(prompts[3][:30])  # shares a cached prefix with prompts[3]
    outputs = llm.embed(prompts, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        hidden = _reference(hf_model, prompt)
        expected = hidden[-1] if pooling_type == "last" else hidden.mean(axis=0)
        np.testing.assert_allclose(output.outputs.embedding, expected, rtol=2e-4, atol=2e-4)
        assert output.finished and len(output.outputs.embedding) == hidden.shape[1]


def test_embeddings_cross_the_core_process_pipe(llama_dir):
    """--runner pooling with the engine core in its own process (--engine-process, or each data-parallel
    rank): the pooled hidden states reach the frontend as the in-process engine gives them (the pipe's wire
    format once dropped them)."""
    prompts = make_prompts(3)
    expected = [o.outputs.embedding for o in _llm(llama_dir, "last").embed(prompts, use_tqdm=False)]
    options = {**LADDER, "max_num_batched_tokens": 16, "token_buckets": (16,)}
    llm = LLM(model=str(llama_dir), dtype="float32", runner="pooling", page_size=4, num_kv_pages=256,
              max_model_len=256, compilation_cache_dir=None, engine_process=True, **options)
    try:
        got = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert all(e is not None for e in got)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-6)


def test_a_pooling_engine_refuses_to_generate(llama_dir):
    llm = _llm(llama_dir, "last")
    with pytest.raises(InvalidParam, match="--runner pooling"):
        llm.engine.add_request("gen", [5, 6, 7], SamplingParams(max_tokens=5))
    assert not llm.engine.has_unfinished_requests()
