"""The n-gram proposer (vLLM's "ngram" method): the longest n-gram in [min_n, max_n] ending the context that
occurs earlier, at its earliest occurrence, checked against a brute-force search; its buffers follow the
context as it grows; and vLLM's config shape with its defaults and refusals."""

from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.config import SpeculativeConfig
from jaxserve.engine.ngram_proposer import NgramProposer, longest_ngram_drafts
from jaxserve.engine.request import Request
from jaxserve.sampling_params import SamplingParams


def brute_force_drafts(context: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Every n from max_n down, every earlier start in order: the first match found."""
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[length - n :]
        for start in range(length - n):  # an occurrence ending before the last token
            if context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []


def test_vllm_s_example():
    """vLLM's docstring: [1, 2, 3, 4, 2, 3], n in [2, 3], k 4: [2, 3] matches; three tokens follow it."""
    context = np.array([1, 2, 3, 4, 2, 3], np.int32)
    assert longest_ngram_drafts(context, 2, 3, 4).tolist() == [4, 2, 3]
    assert longest_ngram_drafts(context, 3, 3, 4).tolist() == []
    assert longest_ngram_drafts(context, 1, 1, 2).tolist() == [4, 2]  # the earliest 3


@pytest.mark.parametrize("seed", range(40))
def test_drafts_match_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    alphabet = int(rng.integers(2, 6))  # few symbols: many overlapping matches of every length
    context = rng.integers(0, alphabet, size=int(rng.integers(1, 60))).tolist()
    min_n = int(rng.integers(1, 4))
    max_n = int(rng.integers(min_n, 7))
    k = int(rng.integers(1, 6))
    got = longest_ngram_drafts(np.array(context, np.int32), min_n, max_n, k).tolist()
    assert got == brute_force_drafts(context, min_n, max_n, k), (context, min_n, max_n, k)


def make_request(prompt: list[int], max_tokens: int = 20) -> Request:
    return Request(request_id="r", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=(0,), max_model_len=128, sampling_seed=0)


def test_the_proposer_follows_a_growing_context_and_its_limits():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
    request = make_request([5, 6, 7, 8, 9, 5, 6])
    assert proposer.propose(request, max_drafts=10) == [7, 8, 9]
    assert proposer.propose(request, max_drafts=2) == [7, 8]
    assert proposer.propose(request, max_drafts=0) == []
    request.append_output_token(7, 0.0)
    request.append_output_token(1, 0.0)  # [..., 5, 6, 7, 1]: no 2-gram "7 1" before
    assert proposer.propose(request, max_drafts=10) == []
    request.append_output_token(5, 0.0)
    request.append_output_token(6, 0.0)  # "5 6" again: its earliest occurrence is the prompt's first
    assert proposer.propose(request, max_drafts=10) == [7, 8, 9]
    proposer.finish(SimpleNamespace(request_id="r"))
    assert proposer._contexts == {}


def test_vllm_s_speculative_config_shape_defaults_and_refusals():
    config = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    config = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    config = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.of(None) is None
    for older in ({"model": "ngram", "num_speculative_tokens": 2}, {"method": "[ngram]", "num_speculative_tokens": 2}):
        assert SpeculativeConfig.of(older).method == "ngram"  # vLLM's other spellings
    for bad, match in (
        ({"method": "medusa", "num_speculative_tokens": 2}, "must be one of ngram"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "take their model as"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"in \[1, 16\]"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": True}, "must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "min <= max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, 'method "ngram" takes no "model"'),
        ([1, 2], "must be a JSON object"),
    ):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.of(bad)
