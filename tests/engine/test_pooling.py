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
    # the core's own loop may split the prompts across steps as they arrive: float32's last bits may differ
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_a_pooling_engine_refuses_to_generate(llama_dir):
    llm = _llm(llama_dir, "last")
    with pytest.raises(InvalidParam, match="--runner pooling"):
        llm.engine.add_request("gen", [5, 6, 7], SamplingParams(max_tokens=5))
    assert not llm.engine.has_unfinished_requests()


def test_score_is_the_cosine_of_the_pairs_embeddings(llama_dir, tiny_hf_model):
    """`LLM.score` (vLLM's, for embedding models) against the float64 cosine of transformers' last hidden
    states: one text against several, pairs one to one, truncated texts, and the pairings it refuses."""
    hf_model = tiny_hf_model("llama")
    llm = _llm(llama_dir, "last")
    prompts = make_prompts(5)

    def cosine(a: list[int], b: list[int]) -> float:
        x, y = _reference(hf_model, a)[-1], _reference(hf_model, b)[-1]
        return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))

    one_to_n = llm.score({"prompt_token_ids": prompts[0]}, [{"prompt_token_ids": p} for p in prompts[1:]],
                         use_tqdm=False)
    assert [o.outputs.score for o in one_to_n] == pytest.approx([cosine(prompts[0], p) for p in prompts[1:]],
                                                                abs=1e-5)
    assert [o.prompt_token_ids for o in one_to_n] == [prompts[0] + p for p in prompts[1:]]
    assert len({o.request_id for o in one_to_n}) == 4 and all(o.finished for o in one_to_n)
    pairs = llm.score([prompts[1], prompts[2]], [prompts[3], prompts[4]], use_tqdm=False)
    assert [o.outputs.score for o in pairs] == pytest.approx([cosine(prompts[1], prompts[3]),
                                                              cosine(prompts[2], prompts[4])], abs=1e-5)
    long = [p for p in prompts if len(p) > 6][:2]
    [cut] = llm.score(long[0], long[1], truncate_prompt_tokens=6, use_tqdm=False)
    assert cut.outputs.score == pytest.approx(cosine(long[0][-6:], long[1][-6:]), abs=1e-5)
    with pytest.raises(ValueError, match="must pair 1:1, 1:N or N:N; got 2:3"):
        llm.score([prompts[0], prompts[1]], prompts[2:], use_tqdm=False)
    with pytest.raises(ValueError, match="must not be empty lists"):
        llm.score([], prompts[2:], use_tqdm=False)


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_a_prompt_that_fills_the_context_is_embedded(llama_dir, tiny_hf_model, pooling_type):
    """vLLM embeds prompts of up to max_model_len tokens: a pooled request's one sample is dropped and takes no
    position. One token more is refused with the context's numbers; truncation to the context (-1) fits."""
    options = {**LADDER, "max_num_batched_tokens": 16, "token_buckets": (16,)}
    llm = LLM(model=str(llama_dir), dtype="float32", runner="pooling", pooling_type=pooling_type, page_size=4,
              num_kv_pages=64, max_model_len=48, compilation_cache_dir=None, **options)
    prompt = [int(t) for t in np.random.default_rng(3).integers(5, 200, 48)]
    [output] = llm.embed([prompt], use_tqdm=False)
    hidden = _reference(tiny_hf_model("llama"), prompt)
    expected = hidden[-1] if pooling_type == "last" else hidden.mean(axis=0)
    np.testing.assert_allclose(output.outputs.embedding, expected, rtol=2e-4, atol=2e-4)
    with pytest.raises(InvalidParam, match=r"maximum context length is 48 tokens\. However, you requested 49 tokens"):
        llm.engine.add_request("over", [*prompt, 7], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    [cut] = llm.embed([[7, *prompt]], truncate_prompt_tokens=-1, use_tqdm=False)
    np.testing.assert_allclose(cut.outputs.embedding, output.outputs.embedding, rtol=1e-5, atol=1e-6)
    assert not llm.engine.has_unfinished_requests()
