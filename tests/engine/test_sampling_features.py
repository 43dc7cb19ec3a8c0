"""Penalties, logit_bias, min_tokens and logprobs through the real engine, against transformers."""

import numpy as np
import pytest
import torch
import transformers

from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import make_engine, make_prompts, run_staggered


@pytest.fixture(scope="module")
def hf_llama(tiny_hf_model):
    model = tiny_hf_model("llama")
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos
    return model


class VllmPenalties(transformers.LogitsProcessor):
    """vLLM's repetition / frequency / presence penalties, written independently in PyTorch."""

    def __init__(self, prompt_len: int, repetition: float, frequency: float, presence: float) -> None:
        self.prompt_len, self.rep, self.freq, self.pres = prompt_len, repetition, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        in_prompt = torch.zeros(scores.shape, dtype=torch.bool).scatter_(1, input_ids[:, : self.prompt_len], True)
        seen = (counts > 0) | in_prompt
        scores = torch.where(seen, torch.where(scores > 0, scores / self.rep, scores * self.rep), scores)
        return scores - self.freq * counts - self.pres * (counts > 0)


def run_one(engine, prompt: list[int], params: SamplingParams):
    engine.add_request("one", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                return output.outputs[0]


def hf_greedy(model, prompt: list[int], max_tokens: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, **kwargs)
    return out[0, len(prompt) :].tolist()


# Prompt 7's greedy continuation repeats a token, so positive penalties change it; negative ones make
# prompt 3's (repetition-free) continuation start repeating.
@pytest.mark.slow  # transformers reference
@pytest.mark.parametrize(
    "prompt_index,rep,freq,pres", [(7, 1.5, 0.0, 0.0), (7, 1.2, 0.8, 0.5), (7, 1.0, 0.0, 1.5), (3, 0.8, -0.5, 0.0)]
)
def test_penalties_match_transformers_greedy(engine, hf_llama, prompt_index, rep, freq, pres):
    prompt = make_prompts()[prompt_index]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=rep,
                            frequency_penalty=freq, presence_penalty=pres)
    got = run_one(engine, prompt, params).token_ids
    expected = hf_greedy(hf_llama, prompt, 24, logits_processor=[VllmPenalties(len(prompt), rep, freq, pres)])
    assert got == expected
    plain = hf_greedy(hf_llama, prompt, 24)
    assert got != plain, "the penalty should change this greedy continuation"
    if freq == pres == 0.0:  # transformers' own repetition penalty has the same semantics
        assert got == hf_greedy(hf_llama, prompt, 24, repetition_penalty=rep)


def test_penalties_survive_batching_and_preemption(llama_dir, engine):
    prompts = make_prompts()
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.7, presence_penalty=0.4)
    solo = [run_one(engine, p, params).token_ids for p in prompts]
    small = make_engine(llama_dir, warmup=False, num_kv_pages=25)  # forces preemption and recompute
    preemptions = []
    original = small.scheduler._preempt
    small.scheduler._preempt = lambda r: (preemptions.append(r.request_id), original(r))[1]
    got = run_staggered(small, prompts, [14] * 8, arrivals=[0, 0, 0, 1, 1, 1, 2, 2], params=params)
    assert preemptions
    assert [got[i] for i in range(8)] == solo
    small.step()  # the next schedule reports the finished requests; the runner frees their rows
    assert small.runner.rows.num_used == 0


def test_logit_bias_and_min_tokens(engine):
    prompt = make_prompts()[1]
    eos = engine.model.eos_token_ids[0]
    favourite = 1234
    forced = run_one(engine, prompt, SamplingParams(temperature=0.9, max_tokens=6, logit_bias={favourite: 100}))
    assert forced.token_ids == [favourite] * 6
    # EOS is pushed to the top, but banned until min_tokens tokens are out.
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=5, logit_bias={eos: 100})
    completion = run_one(engine, prompt, params)
    assert len(completion.token_ids) == 6 and completion.token_ids[-1] == eos
    assert eos not in completion.token_ids[:5]
    assert completion.finish_reason == "stop"
    # Stop ids are banned the same way.
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=3, stop_token_ids=[favourite],
                            logit_bias={favourite: 100})
    completion = run_one(engine, prompt, params)
    assert completion.token_ids[:3] != [favourite] * 3 and completion.token_ids[3] == favourite


def _contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_are_never_completed(engine):
    from jaxserve.engine.llm_engine import bad_words_token_ids

    prompt = make_prompts()[2]
    greedy = run_one(engine, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).token_ids
    tokenizer = engine.tokenizer
    for start, length in ((0, 1), (2, 3)):  # a one-token word from the start, a three-token one later
        word = tokenizer.decode(greedy[start : start + length])
        sequences = bad_words_token_ids(tokenizer, [word])
        assert tuple(greedy[start : start + length]) in sequences, "the greedy output writes the word so"
        banned = run_one(engine, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                        bad_words=[word])).token_ids
        assert banned[: start + length - 1] == greedy[: start + length - 1], "only the word's last token is banned"
        assert banned[start + length - 1] != greedy[start + length - 1]
        assert not any(_contains(banned, s) for s in sequences)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])


class OnlyAllowed(transformers.LogitsProcessor):
    """vLLM's allowed_token_ids: every other token's score at -inf."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = torch.tensor(allowed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        mask = torch.full_like(scores, -torch.inf)
        mask[:, self.allowed] = 0.0
        return scores + mask


@pytest.mark.slow  # transformers reference
def test_allowed_token_ids_match_transformers_greedy(engine, hf_llama):
    prompt = make_prompts()[3]
    plain = hf_greedy(hf_llama, prompt, 12)
    allowed = [t for t in range(1000, 1100) if t not in plain] + plain[5:7]  # the plain output's 6th and 7th
    got = run_one(engine, prompt, SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=allowed))
    assert got.token_ids == hf_greedy(hf_llama, prompt, 12, logits_processor=[OnlyAllowed(allowed)])
    assert got.token_ids != plain and set(got.token_ids) <= set(allowed)


def test_allowed_token_ids_hold_the_output_to_them_and_end_on_eos_only_if_listed(engine):
    prompt, eos = make_prompts()[0], engine.model.eos_token_ids[0]
    allowed = (1234, 1235, 1236, 40000)
    held = run_one(engine, prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=16, allowed_token_ids=allowed))
    assert len(held.token_ids) == 16 and set(held.token_ids) <= set(allowed), "no EOS unless it is listed"
    assert held.finish_reason == "length"
    ends = run_one(engine, prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=8, allowed_token_ids=[eos]))
    assert (ends.token_ids, ends.finish_reason) == ([eos], "stop")
    past = run_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[eos],
                                                  ignore_eos=True))
    assert (past.token_ids, past.finish_reason) == ([eos] * 4, "length")
    stopped = run_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[1235],
                                                     stop_token_ids=[1235]))
    assert (stopped.token_ids, stopped.finish_reason, stopped.stop_reason) == ([1235], "stop", 1235)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        engine.add_request("x", [5, 6], SamplingParams(allowed_token_ids=[10**6]))
    for bad in ([], [-1], [1.0], "5", [True]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    assert not engine.has_unfinished_requests()


@pytest.mark.slow  # transformers reference
def test_logprobs_match_transformers(engine, hf_llama):
    prompt = make_prompts()[0]
    completion = run_one(engine, prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3))
    with torch.no_grad():
        out = hf_llama.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                                output_logits=True, return_dict_in_generate=True)
    assert completion.token_ids == out.sequences[0, len(prompt) :].tolist()
    for i, logits in enumerate(out.logits):
        reference = torch.log_softmax(logits[0].double(), -1).numpy()
        top = np.argsort(-reference)[:3]
        assert list(completion.top_logprobs[i]) == top.tolist()
        np.testing.assert_allclose(list(completion.top_logprobs[i].values()), reference[top], atol=1e-4)
        np.testing.assert_allclose(completion.token_logprobs[i], reference[completion.token_ids[i]], atol=1e-4)


@pytest.mark.slow  # transformers reference
@pytest.mark.parametrize("num_scheduler_steps,temperature,logprobs", [
    (1, 1.5, 0), (4, 1.5, 0),  # no alternatives: the rank is counted over the vocabulary
    (1, 1.5, 2),  # tokens outside the top 2: counted over the vocabulary
    (1, 0.0, 2),  # each token among the top 2: its rank read there, no pass over the vocabulary
])
def test_a_sampled_token_s_rank_matches_transformers(tiny_model_dir, hf_llama, num_scheduler_steps, temperature,
                                                     logprobs):
    """Each sampled token's logprob and rank (vLLM's Logprob.rank, 1 = the most likely) against the float64
    distribution transformers gives at its position, in single and multi-step decodes (a logprobs=0
    request is a plain decode, so k steps run in one call)."""
    engine = make_engine(tiny_model_dir("llama"), warmup=False, num_scheduler_steps=num_scheduler_steps)
    prompt = make_prompts()[1]
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=12, ignore_eos=True, logprobs=logprobs)
    completion = run_one(engine, prompt, params)
    with torch.no_grad():
        logits = hf_llama(torch.tensor([prompt + completion.token_ids])).logits[0].double()
    reference = torch.log_softmax(logits, -1).numpy()[len(prompt) - 1 : -1]  # [12, V]: each output token's
    assert len(completion.logprobs) == len(completion.token_ranks) == 12
    for row, token, rank, entry in zip(reference, completion.token_ids, completion.token_ranks, completion.logprobs,
                                       strict=True):
        assert token in entry and len(entry) in (logprobs, logprobs + 1)
        assert entry[token].logprob == pytest.approx(row[token], abs=1e-4)
        tol = 1e-4  # the rank counts tokens above; those within tolerance may fall either side
        assert 1 + np.sum(row > row[token] + tol) <= rank <= 1 + np.sum(row > row[token] - tol)
        assert entry[token].rank == rank
    ranks = completion.token_ranks
    if temperature:
        assert max(ranks) > max(logprobs, 1), "at temperature 1.5 some token is outside the top alternatives"
    else:
        assert ranks == [1] * 12, "greedy: the most likely token each time"


@pytest.mark.parametrize(
    "params,match",
    [
        (dict(logprobs=21), "at most 20"),
        (dict(logit_bias={10**6: 1.0}), "outside the vocabulary"),
        (dict(logit_bias={i: 1.0 for i in range(200)}), "at most 128"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
    ],
)
def test_bad_sampling_features_are_rejected(engine, params, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", [5, 6, 7], SamplingParams(**params))
    assert not engine.has_unfinished_requests()
