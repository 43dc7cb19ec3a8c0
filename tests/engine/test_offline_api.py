"""`LLM.chat`, `LLM.generate` and `LLM.beam_search` as vLLM's offline API has them: a conversation rendered as
the chat API renders a request (OpenAI's text parts, tools, chat_template_kwargs, continue_final_message),
logprobs per token as {token id: Logprob} with the completion's cumulative logprob, and beam search's records."""

import math

import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.outputs import Logprob
from jaxserve.sampling_params import BeamSearchParams, SamplingParams
from tests.engine.beam_cases import oracle
from tests.engine.helpers import LADDER, make_prompts, traced_jit_calls

# Shows what reaches the template: the tools' names, a keyword argument, each message's content as given
TEMPLATE = ("{% for t in tools or [] %}[tool {{ t['function']['name'] }}]{% endfor %}"
            "{% if greeting is defined %}[{{ greeting }}]{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
PARTS_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}({{ p['text'] }}){% endfor %}"
                  "{% endfor %}")
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir("llama")), dtype="float32", max_model_len=256, num_kv_pages=256,
               page_size=4, **LADDER)


def _prompt(llm: LLM, messages, **kwargs) -> str:
    [output] = llm.chat(messages, ONE_TOKEN, use_tqdm=False, **kwargs)
    return llm.get_tokenizer().decode(output.prompt_token_ids)


def test_chat_renders_a_conversation_as_the_chat_api_renders_a_request(llm):
    user = {"role": "user", "content": "hi there"}
    assert _prompt(llm, [user], chat_template=TEMPLATE) == "<user>hi there</user><assistant>"
    parts = {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}
    assert _prompt(llm, [parts], chat_template=TEMPLATE) == "<user>hi\nthere</user><assistant>", \
        "a string template reads the text parts joined by newlines"
    assert _prompt(llm, [user], chat_template=PARTS_TEMPLATE) == "<user>(hi there)", \
        "a template that loops over the parts gets a text as one part (auto)"
    assert _prompt(llm, [parts], chat_template=PARTS_TEMPLATE) == "<user>(hi)(there)"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    assert _prompt(llm, [user], chat_template=TEMPLATE, tools=[tool], chat_template_kwargs={"greeting": "hello"}) \
        == "[tool get_weather][hello]<user>hi there</user><assistant>"
    partial = [user, {"role": "assistant", "content": "The answer is"}]
    assert _prompt(llm, partial, chat_template=TEMPLATE, add_generation_prompt=False,
                   continue_final_message=True) == "<user>hi there</user><assistant>The answer is"


@pytest.mark.parametrize(("messages", "kwargs", "message"), [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     r"messages\[0\]: content part of type 'image_url' is not supported; only text"),
    ([{"role": "user", "content": "hi"}], {"continue_final_message": True},
     "continue_final_message and add_generation_prompt cannot both be true"),
    ([{"role": "user", "content": "hi"}], {"chat_template_content_format": "parts"},
     "chat_template_content_format must be one of auto, string, openai"),
])
def test_chat_refuses_what_it_cannot_render(llm, messages, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, ONE_TOKEN, use_tqdm=False, **kwargs)


def test_logprobs_come_per_token_as_vllm_s_with_the_cumulative_logprob(llm):
    prompts = make_prompts(2)
    tokenizer = llm.get_tokenizer()
    asked = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, prompt_logprobs=1),
                         use_tqdm=False)
    for output in asked:
        completion = output.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == 5
        for token_id, logprob, entry in zip(completion.token_ids, completion.token_logprobs, completion.logprobs,
                                            strict=True):
            assert len(entry) == 3 and [e.rank for e in entry.values()] == [1, 2, 3]
            assert entry[token_id] == Logprob(pytest.approx(logprob, abs=1e-6), 1, tokenizer.decode([token_id])), \
                "greedy: the top token"
            assert all(isinstance(e, Logprob) and e.decoded_token == tokenizer.decode([t]) for t, e in entry.items())
            values = [e.logprob for e in entry.values()]
            assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert completion.cumulative_logprob == pytest.approx(math.fsum(completion.token_logprobs), abs=1e-6)
        assert completion.cumulative_logprob < 0
        assert output.prompt_logprobs[0] is None and all(
            e.decoded_token == tokenizer.decode([t]) for entry in output.prompt_logprobs[1:] for t, e in entry.items())
    sampled = llm.generate(prompts, SamplingParams(temperature=1.5, max_tokens=8, logprobs=0, seed=3), use_tqdm=False)
    for output in sampled:  # no alternatives asked: each entry is the token's own, with its rank
        completion = output.outputs[0]
        assert [list(e) for e in completion.logprobs] == [[t] for t in completion.token_ids]
        ranks = [e.rank for entry in completion.logprobs for e in entry.values()]
        assert ranks == completion.token_ranks and all(isinstance(rank, int) and rank >= 1 for rank in ranks)
        assert completion.cumulative_logprob == pytest.approx(
            float(np.sum([e.logprob for entry in completion.logprobs for e in entry.values()])), abs=1e-5)
    [plain] = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_vllm_s_allowed_token_ids_and_truncate_prompt_tokens_are_sampling_params(llm):
    allowed = [5, 6, 7]
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=12, allowed_token_ids=allowed)
    assert params.allowed_token_ids == tuple(allowed) and params.structured_outputs is None
    outputs = llm.generate(make_prompts(4), params, use_tqdm=False)  # (the LLM replaces their output kind)
    for output in outputs:  # the allowed tokens alone: no EOS, as vLLM masks it too
        assert output.outputs[0].token_ids and set(output.outputs[0].token_ids) <= set(allowed)
        assert len(output.outputs[0].token_ids) == 12
    from jaxserve.sampling_params import StructuredOutputsParams

    both = SamplingParams(allowed_token_ids=[1], structured_outputs=StructuredOutputsParams(regex="a+"))
    assert both.allowed_token_ids == (1,) and both.structured_outputs.regex == "a+"

    prompt = list(range(10, 40))
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    [cut] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, truncate_prompt_tokens=8),
                         use_tqdm=False)
    [tail] = llm.generate([prompt[-8:]], greedy, use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-8:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    [whole] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, truncate_prompt_tokens=-1),
                           use_tqdm=False)
    assert whole.prompt_token_ids == prompt  # -1: the context length's worth, here all of it
    for bad in (0, -2, 257):
        with pytest.raises(ValueError, match=r"truncate_prompt_tokens must be -1 or in \[1, 256\]"):
            llm.generate([prompt], SamplingParams(max_tokens=1, truncate_prompt_tokens=bad), use_tqdm=False)


def test_beam_search_is_vllm_s_algorithm_on_the_pytorch_model(llm, tiny_hf_model):
    """`LLM.beam_search` against vLLM's algorithm run on the PyTorch model's float64 logprobs: the beams, best
    first, as vLLM's records (prompt and beam tokens, all decoded; each token's ranked alternatives)."""
    import torch

    model = tiny_hf_model("llama").double()

    def logprobs(ids: tuple[int, ...]) -> np.ndarray:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([list(ids)])).logits[0, -1], -1).numpy()

    prompts = [[5, 6, 7, 8, 9], {"prompt_token_ids": [300, 2000, 17]}, [40, 41]]
    width, max_tokens = 3, 5
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.beam_search(prompts, params, concurrency_limit=2)
    assert len(outputs) == len(prompts)
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip([[5, 6, 7, 8, 9], [300, 2000, 17], [40, 41]], outputs, strict=True):
        expected = oracle(lambda t, prompt=prompt: logprobs((*prompt, *t)), len(prompt), width, max_tokens, set(), 1.0)
        assert [tuple(seq.tokens[len(prompt):]) for seq in output.sequences] == [t for t, _, _ in expected]
        for seq, (_, total, _) in zip(output.sequences, expected, strict=True):
            assert seq.tokens[:len(prompt)] == prompt and seq.text == tokenizer.decode(seq.tokens)
            assert seq.cum_logprob == pytest.approx(total, abs=1e-3)
            assert (seq.finish_reason, seq.stop_reason, seq.lora_request) == ("length", None, None)
            assert len(seq.logprobs) == max_tokens
            chosen = [entry[token] for entry, token in zip(seq.logprobs, seq.tokens[len(prompt):], strict=True)]
            assert seq.cum_logprob == pytest.approx(math.fsum(c.logprob for c in chosen), abs=1e-9)
            assert all([e.rank for e in entry.values()] == list(range(1, 2 * width + 1)) for entry in seq.logprobs)
            assert all(e.decoded_token == tokenizer.decode([t]) for entry in seq.logprobs for t, e in entry.items())
    [alone] = llm.beam_search([[5, 6, 7, 8, 9]], params)
    assert [(s.tokens, s.text) for s in alone.sequences] == [(s.tokens, s.text) for s in outputs[0].sequences], \
        "a prompt's beams do not depend on the others searched with it"
    assert [s.cum_logprob for s in alone.sequences] == pytest.approx([s.cum_logprob for s in outputs[0].sequences],
                                                                     abs=1e-4)


def test_beam_search_refuses_what_it_cannot_search(llm):
    with pytest.raises(ValueError, match=r"beam_width must be an integer in \[1,"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="length_penalty must be a finite number"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=math.nan)
    with pytest.raises(ValueError, match=r"beam_width is at most 10 on this engine"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="a prompt of 5 tokens and max_tokens 252 exceed the model's context of 256"):
        llm.beam_search([[1, 2, 3, 4, 5]], BeamSearchParams(beam_width=2, max_tokens=252))
    for limit in (0, 2.5, True):
        with pytest.raises(ValueError, match="concurrency_limit must be a positive integer"):
            llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=limit)
    [one] = llm.beam_search("hi there", BeamSearchParams(beam_width=2, max_tokens=2))  # a text is one prompt
    assert len(one.sequences) == 2
    with pytest.raises(ValueError, match=r"length_penalty must be in \[-126, 126\] on this engine"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=500.0))


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    prompts = make_prompts(2)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    texts = llm.generate(prompts, greedy, use_tqdm=False)
    ids_only = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False,
                                                    spaces_between_special_tokens=False, extra_args={"tag": 1},
                                                    logprobs=2), use_tqdm=False)
    for text, ids in zip(texts, ids_only, strict=True):
        assert ids.outputs[0].token_ids == text.outputs[0].token_ids and len(ids.outputs[0].token_ids) == 6
        assert ids.outputs[0].text == "" and text.outputs[0].text
        assert all(e.decoded_token is None for entry in ids.outputs[0].logprobs for e in entry.values())
    with pytest.raises(ValueError, match="stop strings are found in the text: they need detokenize=True"):
        SamplingParams(stop=["\n"], detokenize=False)
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=[1])


def test_start_profile_and_stop_profile_trace_the_steps_between_them(llm, tmp_path, monkeypatch):
    monkeypatch.delenv("JAXSERVE_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(ValueError, match="start_profile needs a folder"):
        llm.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "trace"))
    llm.start_profile()
    llm.generate(make_prompts(2), ONE_TOKEN, use_tqdm=False)
    assert llm.stop_profile() == str(tmp_path / "trace")
    assert traced_jit_calls(str(tmp_path / "trace"))["step"] >= 1
