"""The real SmolLM2-135M-Instruct GGUF: greedy chat generation equals transformers', token for token."""

import pytest
import torch

from jaxserve import LLM, SamplingParams
from tests.helpers import TEST_GPU_MEMORY_UTILIZATION

pytestmark = pytest.mark.slow  # a real model: `make test-fast` skips it

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(
        dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
        token_buckets=(64,), request_buckets=(1, 4), compilation_cache_dir=None,
        gpu_memory_utilization=TEST_GPU_MEMORY_UTILIZATION,
    )


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    import functools
    from unittest import mock

    import gguf
    from transformers import AutoModelForCausalLM

    from jaxserve.models.gguf import shared_gguf_reads

    # One parse of the file for transformers' config and weights, and one map of the architecture's tensor
    # names where transformers builds it again for each of the model's 400 modules (most of its load).
    name_map = functools.lru_cache(gguf.get_tensor_name_map)
    with shared_gguf_reads(), mock.patch.object(gguf, "get_tensor_name_map", name_map):
        return AutoModelForCausalLM.from_pretrained(
            str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
        ).eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_model, smollm2_tokenizer):
    model = hf_model
    results = []
    for prompt in PROMPTS:
        text = smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                 eos_token_id=smollm2_tokenizer.eos_token_id, pad_token_id=2)
        results.append(out[0, len(ids):].tolist())
    return results


@pytest.mark.gpu  # the real model on the device
def test_greedy_chat_matches_transformers(llm, hf_greedy):
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                       SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    for output, expected in zip(outputs, hf_greedy, strict=True):
        assert output.outputs[0].token_ids == expected
    assert "Paris" in outputs[0].outputs[0].text


def test_stop_string_truncates_text(llm):
    [full] = llm.chat([{"role": "user", "content": PROMPTS[0]}], SamplingParams(temperature=0.0, max_tokens=32),
                      use_tqdm=False)
    text = full.outputs[0].text
    assert "Paris" in text
    [stopped] = llm.chat([{"role": "user", "content": PROMPTS[0]}],
                         SamplingParams(temperature=0.0, max_tokens=32, stop=["Paris"]), use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.text == text[: text.index("Paris")]
    assert completion.finish_reason == "stop" and completion.stop_reason == "Paris"


def test_generate_accepts_text_and_token_prompts(llm):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=8)
    by_text, by_ids = llm.generate(["The capital of France is", {"prompt_token_ids":
                                    tokenizer.encode("The capital of France is")}], params, use_tqdm=False)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == tokenizer.decode(by_text.outputs[0].token_ids, skip_special_tokens=True)


def test_prompt_logprobs_match_transformers(llm, hf_model):
    """A 150-token prompt, computed in three 64-token chunks: each prompt token's logprob given the ones
    before, and the top alternatives, equal transformers' log-softmax of the same prompt."""
    prompt = torch.randint(100, 40000, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    [out] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=3),
                         use_tqdm=False)
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    got = out.prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    for i, entry in enumerate(got[1:]):
        token = prompt[i + 1]
        assert entry[token].logprob == pytest.approx(expected[i, token].item(), abs=1e-4)
        top = sorted((lp.logprob for lp in entry.values()), reverse=True)[:3]
        assert top == pytest.approx(expected[i].topk(3).values.tolist(), abs=1e-4)
