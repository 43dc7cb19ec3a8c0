"""Speculative decoding from a draft model (`--speculative-config '{"model": ...}'`): outputs are token
for token those of plain decoding whatever the draft proposes; a draft that is the target itself has every
draft accepted (its KV cache, kept apart from the target's, holds what the target's does); prompts longer
than the largest bucket catch up in chunks; preemption, aborts and finished requests leave no draft page
behind; the draft's cache shares prefixes as the target's does; the two caches share the KV budget; nothing
compiles after warm-up."""

import contextlib
import functools
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.engine import draft_model_proposer
from jaxserve.engine.draft_model_proposer import (
    DraftModelProposer,
    _DraftState,
    _same_tokens,
    _valid_prefix,
    draft_share,
)
from jaxserve.engine.kv_cache_manager import extend_page_keys
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.request import Request
from jaxserve.runner.model_runner import kv_page_bytes
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import (
    LADDER,
    assert_same,
    drafting_workload,
    make_engine,
    make_prompts,
    run,
    run_alone,
)
from tests.helpers import count_compilations


@pytest.fixture(scope="module")
def draft_dirs(tiny_model_dir) -> dict[str, str]:
    # the target itself (every draft right), and another random model of the same vocabulary (most wrong)
    return {"self": str(tiny_model_dir("llama")), "other": str(tiny_model_dir("qwen3"))}


@pytest.fixture(scope="module")
def engines(llama_dir, draft_dirs) -> dict[str, LLMEngine]:
    itself = {"model": draft_dirs["self"], "num_speculative_tokens": 3}
    with pytest.MonkeyPatch.context() as patch:  # a round's decode steps in one call, as on a GPU
        patch.setattr(draft_model_proposer, "one_call_decodes", lambda platform: True)
        one_call = make_engine(llama_dir, speculative_config=itself)
    assert proposer_of(one_call).runner.num_decode_steps == 2
    return {
        "plain": make_engine(llama_dir),
        "self": make_engine(llama_dir, speculative_config=itself),
        "self-one-call": one_call,
        "other": make_engine(llama_dir, speculative_config={"model": draft_dirs["other"], "num_speculative_tokens": 4},
                             enable_prefix_caching=True),
    }


@contextlib.contextmanager
def every_draft_runs(engine: LLMEngine):
    """Steps cost alike and proposals nothing: the draft policy runs every draft that fits its buckets."""
    policy = engine.scheduler.draft_policy
    costs = policy.costs
    policy.costs = dict.fromkeys(policy.row_buckets, 1.0)
    policy.observe_step = lambda *timed: None
    policy.observe_proposal = lambda num_requests, seconds: None
    try:
        yield
    finally:
        policy.costs = costs
        del policy.observe_step, policy.observe_proposal


def fake_request(request_id: str, tokens: list[int], page_keys: list | None = None) -> SimpleNamespace:
    """What a draft proposer reads of a request whose tokens are all its prompt, with `Request`'s page keys."""
    request = SimpleNamespace(request_id=request_id, num_tokens=len(tokens), num_prompt_tokens=len(tokens),
                              token_ids=lambda start, end: tokens[start:end], page_keys=page_keys or [],
                              prefix_cache_salt=None)
    request.full_page_keys = functools.partial(Request.full_page_keys, request)
    return request


def proposer_of(engine: LLMEngine) -> DraftModelProposer:
    proposer = engine.scheduler.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer


def run_drafting(engine: LLMEngine, requests: dict, arrivals: dict,
                 aborts: dict | None = None) -> tuple[dict, int, int]:
    """`requests` with every draft run; returns the outputs, the draft tokens verified and the accepted ones,
    and checks that nothing compiled and that the draft's cache ends empty."""
    counts, proposer = engine.scheduler.speculation, proposer_of(engine)
    before = counts.num_draft_tokens, counts.num_accepted_tokens
    with every_draft_runs(engine), count_compilations() as compiled:
        outputs = run(engine, requests, arrivals, aborts)
    assert compiled == [], f"compiled after warm-up: {compiled}"
    assert proposer.pages.num_free_pages == proposer.pages.num_usable_pages, "draft pages leaked"
    assert not proposer._states
    return outputs, counts.num_draft_tokens - before[0], counts.num_accepted_tokens - before[1]


def greedy_requests(num: int, max_tokens: int) -> tuple[dict, dict]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = make_prompts(num)
    return ({f"r{i}": (prompts[i], params) for i in range(num)}, {f"r{i}": i % 3 for i in range(num)})


@pytest.mark.parametrize("name", ["self", "self-one-call"])
def test_a_draft_that_is_the_target_has_every_draft_accepted(engines, name):
    """The draft's cache is the target's, computed apart: after rejections and partial acceptances (the
    policy keeps fewer drafts where rows run out), each round's drafts are the target's own next tokens."""
    requests, arrivals = greedy_requests(6, 30)
    plain = run(engines["plain"], requests, arrivals)
    outputs, drafted, accepted = run_drafting(engines[name], requests, arrivals)
    assert_same(plain, outputs)
    assert drafted > 50
    assert accepted == drafted


@pytest.mark.parametrize("name", ["self", "self-one-call"])
def test_each_round_drafts_the_greedy_continuation_of_the_tokens_then(engines, name):
    """Sampled requests reject most of a greedy draft's tokens, so rounds start after rejections, partial
    acceptances, corrections and plain steps: each round's drafts are still the draft model's greedy continuation of
    the request's tokens, as a fresh run of it gives (the draft here is the target: the plain engine)."""
    prompts = make_prompts(6)
    requests = {f"s{i}": (prompts[i], SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True))
                for i in range(6)}
    proposer = proposer_of(engines[name])
    propose_batch, rounds = proposer.propose_batch, []

    def recording_propose_batch(running, max_drafts):
        proposals = propose_batch(running, max_drafts)
        rounds.extend((request.token_ids(0, request.num_tokens), drafts)
                      for request, drafts in zip(running, proposals, strict=True) if drafts)
        return proposals

    proposer.propose_batch = recording_propose_batch
    try:
        # staggered: the steps that start a request run no drafts, so some rounds follow two or more tokens
        _, drafted, accepted = run_drafting(engines[name], requests, {f"s{i}": 4 * i for i in range(6)})
    finally:
        del proposer.propose_batch
    assert 0 < accepted < drafted / 2
    assert len(rounds) > 40
    for tokens, drafts in rounds[::2]:
        assert drafts == run_alone(engines["plain"], tokens, len(drafts)), f"after {len(tokens)} tokens"


def test_any_draft_gives_the_plain_outputs(engines):
    """Penalties, logprobs, grammars, bans, seeded sampling, n > 1, prefix-cache hits and stops, with a draft
    model that is mostly wrong: every output is the plain engine's, and some drafts are accepted."""
    requests, arrivals = drafting_workload(engines["plain"])
    plain = run(engines["plain"], requests, arrivals)
    outputs, drafted, accepted = run_drafting(engines["other"], requests, arrivals)
    assert_same(plain, outputs)
    assert drafted > 0 and 0 <= accepted < drafted


def test_prompts_past_the_largest_bucket_catch_up_in_chunks(engines):
    """Prompts of 150-200 tokens (the largest bucket holds 64) and aborts mid-way: the draft computes each
    prompt over several calls, and the drafts still match the target's tokens."""
    rng = np.random.default_rng(1)
    long_prompts = [rng.integers(3, 40000, size=150 + 25 * i).tolist() for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = {f"long{i}": (prompt, params) for i, prompt in enumerate(long_prompts)}
    requests["aborted"] = (long_prompts[0][:40], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    arrivals = {"long0": 0, "long1": 0, "long2": 2, "aborted": 0}
    assert all(len(prompt) > LADDER["max_num_batched_tokens"] * 2 for prompt in long_prompts)
    plain = run(engines["plain"], requests, arrivals, {"aborted": 12})
    runner = proposer_of(engines["self"]).runner
    launch, chunks = runner.launch, []

    def recording_launch(plan):
        chunks.extend(n for n, keeps in zip(plan.num_new_tokens, plan.keeps_sample, strict=True) if not keeps)
        return launch(plan)

    runner.launch = recording_launch
    try:
        outputs, drafted, accepted = run_drafting(engines["self"], requests, arrivals, {"aborted": 12})
    finally:
        del runner.launch
    assert_same(plain, outputs)
    assert drafted > 0 and accepted == drafted
    assert len(chunks) >= 3 and sum(chunks) >= 3 * 64  # prompts' leading chunks, a full bucket's tokens or less


def test_preemption_leaves_the_outputs_and_the_draft_cache_right(llama_dir, draft_dirs):
    """A target cache too small for every request: requests are preempted and resumed (their draft state
    dropped and computed again), outputs stay the plain ones and all drafts are accepted."""
    small = dict(num_kv_pages=24, warmup=False)
    requests, arrivals = greedy_requests(5, 24)
    plain = run(make_engine(llama_dir, **small), requests, arrivals)
    engine = make_engine(llama_dir, speculative_config={"model": draft_dirs["self"], "num_speculative_tokens": 2},
                         **small)
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda *args: preempted.append(args) or preempt(*args)
    counts = engine.scheduler.speculation
    with every_draft_runs(engine):
        outputs = run(engine, requests, arrivals)
    assert_same(plain, outputs)
    assert preempted, "nothing was preempted: the test no longer tests preemption"
    assert counts.num_draft_tokens > 0 and counts.num_accepted_tokens == counts.num_draft_tokens


def test_requests_on_one_prefix_hold_its_draft_pages_once(llama_dir, draft_dirs):
    """Four requests on one 64-token prefix, arriving at once, in a cache that holds the prefix once beside
    their own tokens: the draft's cache shares the prefix's pages as the target's does (the first round
    computes it for one request, holding the others back from the pages it fills, as the target's scheduler
    does), so rounds draft for all four at once, every draft accepted, and the draft never holds more than the
    prefix once and each request's own pages. Without the draft's prefix cache, its 39 pages hold the prefix
    (16 pages) and a request's own for two requests at most."""
    small = dict(num_kv_pages=40, warmup=False)
    rng = np.random.default_rng(2)
    prefix = rng.integers(3, 40000, size=64).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = {f"p{i}": (prefix + rng.integers(3, 40000, size=3).tolist(), params) for i in range(4)}
    arrivals = dict.fromkeys(requests, 0)
    plain = run(make_engine(llama_dir, **small), requests, arrivals)
    engine = make_engine(llama_dir, speculative_config={"model": draft_dirs["self"], "num_speculative_tokens": 2},
                         **small)
    proposer, counts = proposer_of(engine), engine.scheduler.speculation
    propose_batch, drafted_together, held = proposer.propose_batch, [], []

    def recording_propose_batch(running, max_drafts):
        proposals = propose_batch(running, max_drafts)
        drafted_together.append(sum(bool(drafts) for drafts in proposals))
        held.append(proposer.pages.num_usable_pages - proposer.pages.num_free_pages)
        return proposals

    proposer.propose_batch = recording_propose_batch
    widest = {}
    for shared in (True, False):
        proposer.pages.enable_prefix_caching = shared
        drafted_together.clear()
        held.clear()
        hits, before = proposer.num_hit_tokens, counts.num_draft_tokens
        with every_draft_runs(engine):
            outputs = run(engine, {f"{key}-{shared}": value for key, value in requests.items()},
                          {f"{key}-{shared}": value for key, value in arrivals.items()})
        assert_same({f"{key}-{shared}": value for key, value in plain.items()}, outputs)
        assert counts.num_draft_tokens > before and counts.num_accepted_tokens == counts.num_draft_tokens
        assert proposer.pages.num_free_pages == proposer.pages.num_usable_pages and not proposer._states
        widest[shared] = max(drafted_together)
        if shared:
            assert proposer.num_hit_tokens - hits >= 3 * 64  # the three later requests' prefix, not computed
            assert max(held) <= 16 + 4 * 5  # the prefix once; each request's 3 + 12 tokens and a draft: 5 pages
    assert widest[True] == 4 and widest[False] <= 2


def test_the_draft_shares_a_prefix_only_where_the_target_would(engines):
    """A request's draft pages are keyed as its target pages are, by its tokens and cache salt: a request on
    another's prompt finds that prompt's full pages in the draft's cache under the same salt, none under another."""
    engine, proposer = engines["self"], proposer_of(engines["self"])
    prompt = np.random.default_rng(3).integers(3, 40000, size=40).tolist()  # 10 full pages, 9 before its end

    def draft_hits(request_id: str, salt: str | None) -> int:
        before = proposer.num_hit_tokens
        engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                           cache_salt=salt)
        with every_draft_runs(engine):
            while engine.has_unfinished_requests():
                engine.step()
        return proposer.num_hit_tokens - before

    assert draft_hits("first", "tenant-a") == 0
    assert draft_hits("same-salt", "tenant-a") >= 36
    assert draft_hits("other-salt", "tenant-b") == 0
    assert draft_hits("no-salt", None) == 0
    assert proposer.pages.num_free_pages == proposer.pages.num_usable_pages and not proposer._states


def test_a_request_held_back_finds_the_pages_of_one_that_finished(engines):
    """Two requests on one prompt in the same first round: the second waits for the pages the first fills,
    and finds them in the next round though the first has finished by then (its pages are keyed as its round
    ends, not at a next round it never has)."""
    engine, proposer = engines["self"], proposer_of(engines["self"])
    prompt = np.random.default_rng(4).integers(3, 40000, size=40).tolist()
    greedy_params = dict(temperature=0.0, ignore_eos=True)
    before = proposer.num_hit_tokens
    engine.add_request("short", prompt, SamplingParams(max_tokens=5, **greedy_params))
    engine.add_request("long", prompt, SamplingParams(max_tokens=20, **greedy_params))
    with every_draft_runs(engine):
        while engine.has_unfinished_requests():
            engine.step()
    assert proposer.num_hit_tokens - before >= 36  # the prompt's full pages, computed once


def test_a_hit_stops_short_of_the_page_of_the_last_token(engines):
    """A request whose page keys reach its last token's page (the target planned a step that never ran) finds
    at most the pages before that token, so its catch-up writes no page that another holds keyed."""
    proposer = proposer_of(engines["self"])
    tokens = np.random.default_rng(5).integers(3, 40000, size=44).tolist()

    def sequence(request_id: str, num_tokens: int, page_keys: list) -> SimpleNamespace:
        return fake_request(request_id, tokens[:num_tokens], page_keys)

    before = proposer.num_hit_tokens
    try:
        proposer.propose_batch([sequence("keyed", 44, [])], [3])  # keys its 10 pages before its last token
        assert proposer.num_hit_tokens == before
        keys = extend_page_keys([], 10, 4, lambda start, end: tokens[start:end])  # all 40 tokens' pages
        proposer.propose_batch([sequence("keyed", 44, []), sequence("hitting", 40, keys)], [3, 3])
        assert proposer.num_hit_tokens - before == 36  # 9 pages: the 10th holds its last token
    finally:
        for request_id in ("keyed", "hitting"):
            proposer.forget(request_id)


def test_the_target_sizes_its_cache_for_both_models(llama_dir, draft_dirs):
    """Under a KV budget (no --num-kv-pages), the target's page count is what the budget holds of a page of
    each model's, and the draft has as many pages."""
    budget = dict(num_kv_pages=None, kv_cache_memory_gib=0.01, warmup=False)
    alone = make_engine(llama_dir, **budget)
    both = make_engine(llama_dir, speculative_config={"model": draft_dirs["other"], "num_speculative_tokens": 2},
                       **budget)
    draft_runner, budget_bytes = proposer_of(both).runner, int(0.01 * 2**30)
    target_page = kv_page_bytes(alone.core.runner.model, alone.core.config.cache)
    assert alone.core.runner.num_pages == budget_bytes // target_page
    share = draft_share(draft_runner.model, both.core.runner.model, both.core.config.cache, LADDER["max_num_seqs"])
    assert share.page_bytes == kv_page_bytes(draft_runner.model, both.core.config.cache)
    assert both.core.runner.num_pages == budget_bytes // (target_page + share.page_bytes)
    assert draft_runner.num_pages == both.core.runner.num_pages


def test_the_draft_state_keeps_what_the_request_holds():
    """The positions whose draft K/V is the request's own: the last drafting's base, then the drafts the
    request now holds, at most all but its last token."""

    def request(tokens: list[int]):
        return SimpleNamespace(num_tokens=len(tokens), token_ids=lambda start, end: tokens[start:end])

    known = [5, 6, 7, 8]
    state = _DraftState(num_computed=0)
    assert _valid_prefix(request(known), state) == 0  # nothing computed
    state = _DraftState(num_computed=4 + 2, base=4, drafts=[9, 10])  # drafts 9, 10 written at positions 4, 5
    assert _valid_prefix(request([*known, 9, 10, 11]), state) == 6  # both accepted, then a correction
    assert _valid_prefix(request([*known, 9, 3]), state) == 5  # the second rejected
    assert _valid_prefix(request([*known, 2]), state) == 4  # the first rejected
    assert _valid_prefix(request([*known, 9]), state) == 4  # a plain step sampled draft 1: its logits needed
    state = _DraftState(num_computed=4, base=4)  # one draft a round: nothing written past the base
    assert _valid_prefix(request([*known, 1, 2]), state) == 4


def test_the_speculative_config_takes_a_draft_model():
    assert SpeculativeConfig.of({"model": "some/draft", "num_speculative_tokens": 5}) == SpeculativeConfig(
        method="draft_model", num_speculative_tokens=5, model="some/draft")
    assert SpeculativeConfig.of({"model": "ngram", "num_speculative_tokens": 2}).method == "ngram"
    for bad in ({"method": "draft_model", "num_speculative_tokens": 2},
                {"method": "ngram", "model": "x", "num_speculative_tokens": 2},
                {"model": "", "num_speculative_tokens": 2},
                {"model": "x", "num_speculative_tokens": 0}):
        with pytest.raises(ValueError):
            SpeculativeConfig.of(bad)
    draft = {"model": "d", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="one host"):
        EngineConfig.from_preset(None, model="m", tensor_parallel_size=2, num_processes=2,
                                 coordinator_address="127.0.0.1:1", speculative_config=draft)
    for parallel in ({"tensor_parallel_size": 2}, {"data_parallel_size": 2}):  # split as the target, or per rank
        assert EngineConfig.from_preset(None, model="m", speculative_config=draft, **parallel).scheduler.max_drafts


def test_vllm_s_other_speculative_keys_are_taken_and_checked():
    draft = {"model": "d", "num_speculative_tokens": 2}
    config = SpeculativeConfig.of({**draft, "revision": "main", "quantization": "fp8", "max_model_len": 64,
                                   "draft_tensor_parallel_size": 2, "disable_by_batch_size": 8})
    assert (config.revision, config.quantization, config.max_model_len) == ("main", "fp8", 64)
    assert (config.draft_tensor_parallel_size, config.disable_by_batch_size) == (2, 8)
    assert SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2,
                                 "disable_by_batch_size": 4}).disable_by_batch_size == 4
    for bad, reason in (({"method": "ngram", "num_speculative_tokens": 2, "revision": "main"}, "no \"model\""),
                        ({**draft, "quantization": "int3"}, "quantization must be one of"),
                        ({**draft, "max_model_len": 0}, "max_model_len must be a positive integer"),
                        ({**draft, "disable_by_batch_size": True}, "disable_by_batch_size must be"),
                        ({**draft, "draft_model_tp": 1}, "unknown speculative config keys")):
        with pytest.raises(ValueError, match=reason):
            SpeculativeConfig.of(bad)
    assert EngineConfig.from_preset(None, model="m", tensor_parallel_size=2, speculative_config={
        **draft, "draft_tensor_parallel_size": 2}).scheduler.speculative_config.draft_tensor_parallel_size == 2
    with pytest.raises(ValueError, match="split over the target's devices"):
        EngineConfig.from_preset(None, model="m", tensor_parallel_size=2,
                                 speculative_config={**draft, "draft_tensor_parallel_size": 1})


def test_the_draft_s_own_settings_reach_it(llama_dir, draft_dirs, monkeypatch, engines):
    """`quantization`, `max_model_len` and `revision`: an FP8 draft whose context ends at 48 tokens drafts for
    no sequence that would pass it, and frees such a sequence's draft pages; the outputs are plain
    decoding's."""
    from jaxserve.engine import core

    loads = []
    load_model = core.load_model
    monkeypatch.setattr(core, "load_model", lambda *args, **kwargs: loads.append((args, kwargs))
                        or load_model(*args, **kwargs))
    engine = make_engine(llama_dir, warmup=False, speculative_config={
        "model": draft_dirs["self"], "num_speculative_tokens": 2, "quantization": "fp8", "max_model_len": 48,
        "revision": "main"})
    args, kwargs = loads[-1]  # the draft loads after the target
    assert args[0] == draft_dirs["self"] and args[3] == "main"  # the revision: the loader's fourth argument
    assert kwargs["quantization"] == "fp8" and loads[0][1]["quantization"] is None
    proposer = proposer_of(engine)
    assert proposer.runner.max_model_len == 48
    assert any(leaf.dtype == jnp.float8_e4m3fn for leaf in jax.tree.leaves(proposer.runner.model.state))
    propose_batch, lengths, past = proposer.propose_batch, [], []

    def recording_propose_batch(running, max_drafts):
        proposals = propose_batch(running, max_drafts)
        lengths.extend(request.num_tokens for request, drafts in zip(running, proposals, strict=True) if drafts)
        for request in running:  # a sequence that can no longer draft holds no draft pages
            if request.num_tokens + 1 > 48:
                past.append(request.request_id)
                assert request.request_id not in proposer._states
        return proposals

    proposer.propose_batch = recording_propose_batch
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = {f"r{i}": (prompt, params) for i, prompt in enumerate(make_prompts(2)[:2])}  # 3 and 17 tokens
    arrivals = dict.fromkeys(requests, 0)
    with every_draft_runs(engine):
        outputs = run(engine, requests, arrivals)
    assert_same(run(engines["plain"], requests, arrivals), outputs)
    assert lengths and max(lengths) + 1 <= 48  # the drafts' last position (k - 1 past the tokens) in the context
    assert max(len(prompt) for prompt, _ in requests.values()) + 40 > 48 and past


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size(engines):
    engine = engines["self"]
    proposer, scheduler = proposer_of(engine), engine.scheduler
    propose_batch, batches = proposer.propose_batch, []
    proposer.propose_batch = lambda running, max_drafts: batches.append(len(running)) or propose_batch(
        running, max_drafts)
    scheduler.disable_by_batch_size = 2
    prompts = make_prompts(5)
    requests = {f"b{i}": (prompts[i], SamplingParams(temperature=0.0, max_tokens=6 + 8 * i, ignore_eos=True))
                for i in range(5)}
    try:
        outputs, drafted, accepted = run_drafting(engine, requests, dict.fromkeys(requests, 0))
    finally:
        scheduler.disable_by_batch_size = None
        del proposer.propose_batch
    assert_same(run(engines["plain"], requests, dict.fromkeys(requests, 0)), outputs)
    assert batches and max(batches) <= 2 and drafted > 0 and accepted == drafted


class Tokenizer(dict):
    """A tokenizer's vocabulary, as `draft_share` compares them."""

    def get_vocab(self) -> dict:
        return dict(self)


def test_a_draft_of_another_tokenizer_is_refused():
    def model(vocab: dict):
        return SimpleNamespace(tokenizer=Tokenizer(vocab), cfg=SimpleNamespace(vocab_size=len(vocab)))

    with pytest.raises(ValueError, match="tokenizer is not the target's"):
        draft_share(model({"a": 0, "b": 1}), model({"a": 0, "b": 1, "c": 2}), None, 4)
    with pytest.raises(ValueError, match="tokenizer is not the target's"):
        draft_share(model({"a": 0, "b": 1}), model({"a": 1, "b": 0}), None, 4)
    assert _same_tokens(Tokenizer({"a": 0, "b": 1}), Tokenizer({"b": 1, "a": 0}))


def test_drafts_past_the_target_s_vocabulary_end_the_request_s_drafts(engines):
    """A draft whose vocabulary is padded past the target's may propose a padding id: the drafts end before
    it (here the target's vocabulary is taken to end at 20,000, where the drafts often pass it)."""
    proposer = proposer_of(engines["self"])
    propose_batch, proposed = proposer.propose_batch, []

    def recording_propose_batch(running, max_drafts):
        proposals = propose_batch(running, max_drafts)
        proposed.extend(proposals)
        return proposals

    requests, arrivals = greedy_requests(4, 24)
    plain = run(engines["plain"], requests, arrivals)
    proposer.propose_batch, proposer.vocab_size = recording_propose_batch, 20000
    try:
        outputs, drafted, accepted = run_drafting(engines["self"], requests, arrivals)
    finally:
        del proposer.propose_batch
        proposer.vocab_size = engines["self"].core.model.cfg.vocab_size
    assert_same(plain, outputs)
    assert all(token < 20000 for drafts in proposed for token in drafts)
    assert sum(len(drafts) < 3 for drafts in proposed) > len(proposed) // 4  # cut short, often
    assert accepted == drafted > 0


def test_a_warm_up_still_compiling_the_multi_step_call_runs_a_call_a_step(engines):
    """On a GPU a background warm-up compiles the k - 1-step call last: until it has, rounds run their
    decode steps a call each, as `decode_steps_ready` says (a k-step plan in the fallback bucket would fail)."""
    proposer = proposer_of(engines["self-one-call"])
    launch, steps = proposer.runner.launch, []

    def recording_launch(plan):
        steps.append(plan.num_steps)
        return launch(plan)

    requests, arrivals = greedy_requests(3, 20)
    plain = run(engines["plain"], requests, arrivals)
    proposer.runner.launch, proposer.runner.decode_steps_ready = recording_launch, lambda: 1
    try:
        outputs, drafted, accepted = run_drafting(engines["self-one-call"], requests, arrivals)
    finally:
        del proposer.runner.launch, proposer.runner.decode_steps_ready
    assert_same(plain, outputs)
    assert steps and set(steps) == {1}
    assert accepted == drafted > 0


def test_the_draft_model_runs_only_where_its_drafts_can_and_is_timed_on_steady_rounds(llama_dir, draft_dirs):
    """With the draft policy's own measurements: no round before the running requests' bucket has a step
    time (its drafts could not run), the rounds that also computed a prompt are left out of the proposal's
    cost, and the host's turn between steps is timed."""
    engine = make_engine(llama_dir, speculative_config={"model": draft_dirs["self"], "num_speculative_tokens": 3})
    scheduler = engine.scheduler
    proposer, policy = proposer_of(engine), scheduler.draft_policy
    propose_batch, rounds = proposer.propose_batch, []

    def checking_propose_batch(running, max_drafts):
        assert policy.is_timed(len(running)), "a round whose drafts could not run"
        proposals = propose_batch(running, max_drafts)
        rounds.append(proposer.last_round_steady)
        return proposals

    observe_proposal, observed = policy.observe_proposal, []
    policy.observe_proposal = lambda num, seconds: observed.append(seconds) or observe_proposal(num, seconds)
    proposer.propose_batch = checking_propose_batch
    requests, _ = greedy_requests(2, 40)
    try:
        run(engine, requests, dict.fromkeys(requests, 0))
    finally:
        del proposer.propose_batch, policy.observe_proposal
    assert rounds and not rounds[0], "the first round computes the prompts"
    assert len(observed) == sum(rounds) > 0
    assert policy.host_turn > 0  # timed from each drafting step's read to the next launch


def test_a_draft_that_cannot_pay_is_not_run_until_weighed_again(llama_dir, draft_dirs, monkeypatch):
    """Rounds that cost more than drafts could give back even all accepted (a draft as slow as its target,
    here taken to take 10 s a round): once the requests' bucket is timed, no round runs. After REPROBE_PLANS
    plans so, rounds run again until one is steady, and its time replaces the old one (a burst's costly
    rounds do not keep drafting off for good; whether drafts then run is the policy's usual choice)."""
    from jaxserve.engine import scheduler as scheduler_module

    engine = make_engine(llama_dir, speculative_config={"model": draft_dirs["self"], "num_speculative_tokens": 3})
    scheduler = engine.scheduler
    proposer, policy = proposer_of(engine), scheduler.draft_policy
    policy.proposal_costs.update(dict.fromkeys(policy.row_buckets, 10.0))
    policy._num_proposals.update(dict.fromkeys(policy.row_buckets, 2))
    requests, arrivals = greedy_requests(3, 30)
    outputs = run(engine, requests, arrivals)
    assert proposer.num_calls == 0 and scheduler.speculation.num_draft_tokens == 0
    assert len(policy.costs) > 0  # the buckets were timed: rounds were weighed, not skipped for want of times
    assert all(len(output.outputs[0].token_ids) == 30 for output in outputs.values())
    monkeypatch.setattr(scheduler_module, "REPROBE_PLANS", 10)
    run(engine, *greedy_requests(3, 60))
    assert proposer.num_calls > 0 and scheduler._reprobes == 0
    assert policy.proposal_cost(3) < 1.0  # measured again, replacing the old time (not averaged with it)


def test_an_idle_wait_between_requests_is_not_the_host_s_turn(engines):
    """The host's turn is timed from a step read at once to the next launch; a wait for new requests after
    the last one finished is not part of it."""
    engine = engines["self"]
    policy = engine.scheduler.draft_policy
    observe, turns = policy.observe_host_turn, []
    policy.observe_host_turn = lambda seconds: turns.append(seconds) or observe(seconds)
    requests, arrivals = greedy_requests(2, 12)
    try:
        run_drafting(engine, requests, arrivals)
        time.sleep(0.5)
        run_drafting(engine, requests, arrivals)
    finally:
        del policy.observe_host_turn
    assert len(turns) > 4 and max(turns) < 0.45, turns  # 0.5 and more: the idle wait counted


def test_a_failed_round_leaves_no_state_behind(engines):
    """A device call that fails mid-round: the requests' draft states (which would claim K/V never written)
    and their pages are dropped, and the error goes on to the engine."""
    proposer = proposer_of(engines["self"])
    tokens = make_prompts(4)[3]
    request = fake_request("failing", tokens)
    free = proposer.pages.num_free_pages

    def failing_launch(plan):
        raise RuntimeError("the device failed")

    proposer.runner.launch = failing_launch
    try:
        with pytest.raises(RuntimeError, match="the device failed"):
            proposer.propose_batch([request], [3])
    finally:
        del proposer.runner.launch
    assert "failing" not in proposer._states and proposer.pages.num_free_pages == free
