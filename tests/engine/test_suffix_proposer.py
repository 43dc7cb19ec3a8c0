"""Suffix decoding (vLLM's "suffix" method): the proposer's walk is a suffix tree's, checked against a
brute-force search of random corpora; the output cache evicts by requests and by tokens and keeps its index
no larger than what it holds; the longer-expected of the two corpora's paths wins; a salted request shares
nothing; vLLM's config keys and refusals; and in the engine, outputs are plain decoding's while a request
asked again drafts its whole answer from the cache."""

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from jaxserve.engine.suffix_proposer import OutputCache, SuffixProposer, follow_longest_match, pair_key
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import assert_same, make_engine, make_prompts, run, workload


def walk_oracle(corpus: list[int | None], ends: list[int], pattern: list[int], factor: float, min_prob: float,
                max_drafts: int) -> tuple[list[int], float]:
    """A suffix tree's walk by brute force: the occurrences (ending at `ends`) of the longest suffix of
    `pattern` in `corpus` (None: the end of an output), then, while the path's probability holds, the most
    frequent next token among the occurrences still agreeing (those that end count against it)."""
    occurrences, longest = [], 0
    for length in range(1, len(pattern) + 1):
        found = [end for end in ends if end - length + 1 >= 0
                 and corpus[end - length + 1 : end + 1] == pattern[-length:]]
        if not found:
            break
        occurrences, longest = found, length
    nexts = [end + 1 for end in occurrences]
    drafts, probability, expected = [], 1.0, 0.0
    while nexts and len(drafts) < min(max_drafts, int(factor * longest)):
        tokens = [corpus[n] if n < len(corpus) else None for n in nexts]
        counts = Counter(token for token in tokens if token is not None)
        if not counts:
            break
        best = min(counts, key=lambda token: (-counts[token], token))
        probability *= counts[best] / len(nexts)
        if probability < min_prob:
            break
        drafts.append(best)
        expected += probability
        nexts = [n + 1 for n, token in zip(nexts, tokens, strict=True) if token == best]
    return drafts, expected


@pytest.mark.parametrize("seed", range(40))
def test_the_walk_is_a_suffix_tree_s(seed):
    """Random corpora over 2-5 token ids (many repeats, ties, occurrences ending at the corpus's end), random
    patterns, factors, thresholds and limits: the drafts and their expected count are the brute force's."""
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 6))
    corpus = rng.integers(0, vocab, size=int(rng.integers(2, 300))).tolist()
    pattern = corpus[-int(rng.integers(1, 25)) :] if seed % 2 else rng.integers(0, vocab, size=8).tolist()
    ends = [end for end in range(len(corpus) - 1) if corpus[end] == pattern[-1]]
    factor, min_prob = float(rng.choice([0.5, 1.0, 2.0, 8.0])), float(rng.choice([0.0, 0.1, 0.3, 0.6]))
    max_drafts = int(rng.integers(1, 17))
    got = follow_longest_match(corpus, ends, pattern, factor, min_prob, max_drafts)
    want = walk_oracle(corpus, ends, pattern, factor, min_prob, max_drafts)
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1])


def test_a_context_drafts_what_followed_its_suffix_most_often():
    corpus = [7, 1, 2, 3, 9, 1, 2, 3, 9, 5, 1, 2, 3, 4, 6, 1, 2, 3]
    ends = [3, 7, 12]  # the earlier 3s
    drafts, expected = follow_longest_match(corpus, ends, corpus[-4:], 1.0, 0.1, 8)
    # "1 2 3" matches (3 tokens: "6 1 2 3" does not occur before); its 3 occurrences go on with 9, 9 and 4
    # (9: 2/3), then those 2 with 1 and 5 (1: 2/3 * 1/2), then the one left with 2 (1/3): 3 drafts, factor 1
    assert drafts == [9, 1, 2] and expected == pytest.approx(2 / 3 + 1 / 3 + 1 / 3)
    assert follow_longest_match(corpus, ends, corpus[-4:], 1.0, 0.7, 8) == ([], 0.0)
    assert follow_longest_match(corpus, ends, corpus[-4:], 0.5, 0.1, 8)[0] == [9]


def cache_oracle(outputs: list[list[int]], pattern: list[int], factor: float, min_prob: float,
                 max_drafts: int) -> tuple[list[int], float]:
    """The walk over the outputs joined with an end after each, from every occurrence of the pattern's last
    two tokens (the cache looks occurrences up by their last pair)."""
    corpus: list[int | None] = [token for output in outputs for token in [*output, None]]
    ends = [i for i in range(1, len(corpus)) if corpus[i - 1 : i + 1] == pattern[-2:]]
    return walk_oracle(corpus, ends, pattern, factor, min_prob, max_drafts)


def test_the_output_cache_keeps_the_latest_requests_within_its_tokens():
    rng = np.random.default_rng(5)
    cache = OutputCache(max_requests=6, max_tokens=300)
    outputs = []
    for step in range(60):
        output = rng.integers(0, 4, size=int(rng.integers(1, 70))).tolist()
        cache.add(output)
        outputs.append(output)
        live, held = [], 0  # the latest outputs, at most 6, whose tokens and ends fit 300 (an output's end included)
        for kept in reversed(outputs):
            if len(live) == 6 or held + len(kept) + 1 > 300:
                break
            live.insert(0, kept)
            held += len(kept) + 1
        assert cache.num_requests == len(live), step
        pattern = rng.integers(0, 4, size=int(rng.integers(2, 12))).tolist()
        got = cache.propose(pair_key(*pattern[-2:]), pattern, 2.0, 0.05, 16)
        want = cache_oracle(live, pattern, 2.0, 0.05, 16)
        assert got[0] == want[0], step
        assert got[1] == pytest.approx(want[1])
    assert OutputCache(max_requests=0).num_requests == 0


def test_the_output_cache_s_index_forgets_pairs_no_longer_cached():
    """Outputs of fresh tokens (every pair new) through a 300-token ring: the index keeps about as many pairs
    as the ring holds, not every pair it ever saw."""
    cache = OutputCache(max_requests=100, max_tokens=300)
    for step in range(200):
        cache.add(list(range(step * 50, step * 50 + 50)))
        assert len(cache._chains.latest) <= 2 * 300, step
    assert cache.num_requests == 5  # 5 outputs and their ends fit the ring (51 positions each)
    # matched 2 long: 2 drafts earned
    assert cache.propose(pair_key(9960, 9961), [9960, 9961], 1.0, 0.1, 4) == ([9962, 9963], 2.0)
    assert cache.propose(pair_key(9001, 9002), [9001, 9002], 8.0, 0.1, 4) == ([], 0.0)  # gone with its output


def request(request_id: str, prompt: list[int], output: list[int], salt: str | None = None) -> SimpleNamespace:
    tokens = prompt + output
    return SimpleNamespace(request_id=request_id, num_tokens=len(tokens), num_prompt_tokens=len(prompt),
                           max_num_tokens=len(tokens) + 32, cache_salt=salt,
                           token_ids=lambda start, end: tokens[start:end])


def test_an_answer_given_before_is_drafted_from_the_cache_unless_salted():
    proposer = SuffixProposer(8, max_tree_depth=24, max_cached_requests=100, max_spec_factor=1.0,
                              min_token_prob=0.1)
    prompt, answer = [5, 6, 7, 8], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    first = request("a", prompt, answer)
    assert proposer.propose(first, 8) == []  # nothing repeats in its own context
    proposer.finish(first)
    assert proposer.outputs.num_requests == 1
    again = request("b", [1, 2], answer[:5])  # the same answer begun again: 5 tokens matched, 5 drafts earned
    assert proposer.propose(again, 8) == answer[5:10]
    assert proposer.propose(again, 3) == answer[5:8]
    salted = request("c", [1, 2], answer[:5], salt="tenant")
    assert proposer.propose(salted, 8) == []
    proposer.finish(salted)
    assert proposer.outputs.num_requests == 1
    # Its own context's path wins where it expects more: there "20 21 22 23 24" went on with 40, 41, ... twice,
    # the second time after 11 tokens that match its end (8 drafts earned, against the cache's 5)
    own = request("d", [1, 2], [20, 21, 22, 23, 24, 40, 41, 42, 43, 44, 20, 21, 22, 23, 24, 40, 41, 42, 43, 44,
                                 20, 21, 22, 23, 24])
    assert proposer.propose(own, 8) == [40, 41, 42, 43, 44, 20, 21, 22]


def test_the_speculative_config_takes_vllm_s_suffix_keys():
    config = SpeculativeConfig.of({"method": "suffix"})
    assert config.num_speculative_tokens == MAX_SPECULATIVE_TOKENS
    assert (config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob) == (24, 10000, 1.0, 0.1)
    config = SpeculativeConfig.of({"method": "suffix", "num_speculative_tokens": 6,
                                   "suffix_decoding_max_tree_depth": 32, "suffix_decoding_max_cached_requests": 0,
                                   "suffix_decoding_max_spec_factor": 2, "suffix_decoding_min_token_prob": 0.5})
    assert config.num_speculative_tokens == 6 and config.suffix_decoding_max_spec_factor == 2
    for bad, reason in (({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8},
                         "settings of the \"suffix\" method only"),
                        ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "max_tree_depth must be"),
                        ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "max_cached_requests"),
                        ({"method": "suffix", "suffix_decoding_max_spec_factor": "2"}, "max_spec_factor"),
                        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "min_token_prob"),
                        ({"method": "suffix", "num_speculative_tokens": 17}, "num_speculative_tokens")):
        with pytest.raises(ValueError, match=reason):
            SpeculativeConfig.of(bad)


@pytest.fixture(scope="module")
def engines(llama_dir):
    return {"plain": make_engine(llama_dir),
            "suffix": make_engine(llama_dir, speculative_config={"method": "suffix", "num_speculative_tokens": 4})}


def test_suffix_drafts_give_the_plain_outputs_and_a_repeated_request_drafts_its_answer(engines):
    """The full workload (penalties, logprobs, grammars, n > 1, stops...): plain decoding's outputs. Then
    greedy requests asked a second time: their first answers, in the cache, draft the second ones, accepted."""
    from tests.engine.test_draft_model import every_draft_runs

    engine = engines["suffix"]
    requests, arrivals = workload(engines["plain"])
    assert_same(run(engines["plain"], requests, arrivals), run(engine, requests, arrivals))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = make_prompts(4)
    counts = engine.scheduler.speculation
    outputs, drafts = [], []
    for round_ in range(2):
        before = counts.num_draft_tokens, counts.num_accepted_tokens
        asked = {f"again{round_}-{i}": (prompt, params) for i, prompt in enumerate(prompts)}
        with every_draft_runs(engine):
            outputs.append(run(engine, asked, dict.fromkeys(asked, 0)))
        drafts.append((counts.num_draft_tokens - before[0], counts.num_accepted_tokens - before[1]))
    (first_drafted, _), (drafted, accepted) = drafts
    for i in range(len(prompts)):
        assert outputs[0][f"again0-{i}"].outputs[0].token_ids == outputs[1][f"again1-{i}"].outputs[0].token_ids
    # The second round drafts all its rows allow (8 rows for 4 requests: 4 drafts a step), every draft right.
    assert drafted >= 60 and accepted == drafted and drafted > 2 * first_drafted
