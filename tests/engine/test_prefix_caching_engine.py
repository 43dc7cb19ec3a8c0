"""Prefix caching and prompt logprobs through the real engine on a tiny random Llama.

Caching must change nothing but speed: every scenario runs on an engine with caching and one without,
and the greedy tokens must be identical, while the cached run must actually have hit. Prompt logprobs are
checked against transformers' log-softmax of the same prompt.
"""

import numpy as np
import pytest
import torch

from jaxserve.runner.prompt_logprobs import prompt_logprobs
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import make_engine

SYSTEM = np.random.default_rng(7).integers(3, 40000, size=37).tolist()  # 9 pages of 4, and a partial one


def chat_prompts(n: int = 8) -> list[list[int]]:
    """A shared system prompt with short, different user turns (one of them identical to another)."""
    rng = np.random.default_rng(1)
    turns = [rng.integers(3, 40000, size=length).tolist() for length in [5, 1, 12, 3, 8, 5, 20, 2][:n]]
    turns[5] = turns[0]
    return [SYSTEM + turn for turn in turns]


@pytest.fixture(scope="module")
def engines(llama_dir):
    made = {}

    def get(caching: bool, **overrides):
        key = (caching, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = make_engine(llama_dir, enable_prefix_caching=caching, **overrides)
        return made[key]

    return get


def run(engine, prompts, params, arrivals, salts=None) -> dict[int, object]:
    """Request i joins before step arrivals[i]; returns its finished RequestOutput."""
    results, step = {}, 0
    while len(results) < len(prompts):
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                engine.add_request(f"r{i}", prompts[i], params[i] if isinstance(params, list) else params,
                                   cache_salt=salts[i] if salts else None)
        for output in engine.step():
            if output.finished:
                results[int(output.request_id[1:])] = output
        step += 1
        assert step < 3000, "engine made no progress"
    return results


def tokens(results) -> dict[int, list[list[int]]]:
    return {i: [c.token_ids for c in out.outputs] for i, out in results.items()}


def assert_released(engine) -> None:
    kv = engine.kv_cache
    assert all(kv.ref_count(p) == 0 for p in range(kv.num_pages)), "a page is still referenced"
    assert kv.num_free_pages == kv.num_usable_pages and kv.usage == 0.0


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


SCENARIOS = {
    # name: (engine overrides, sampling params, arrivals)
    "staggered": ({}, greedy(9), [0, 0, 1, 2, 2, 5, 9, 14]),
    "preemption": ({"num_kv_pages": 40}, greedy(24), [0, 0, 0, 1, 1, 1, 2, 2]),
    "tiny-budget": ({"max_num_batched_tokens": 8, "token_buckets": (8,)}, greedy(6), [0, 0, 1, 2, 2, 5, 9, 14]),
    "n-3": ({}, greedy(7, n=3), [0, 0, 0, 3, 3, 6, 6, 6]),
    "penalties": ({"num_kv_pages": 40}, greedy(16, repetition_penalty=1.6, frequency_penalty=0.7,
                                               presence_penalty=0.4), [0, 0, 0, 1, 1, 1, 2, 2]),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_outputs_are_identical_with_caching_on_and_off(engines, scenario):
    overrides, params, arrivals = SCENARIOS[scenario]
    prompts = chat_prompts()
    cached, plain = engines(True, **overrides), engines(False, **overrides)
    hits_before = cached.scheduler.prefix_cache_hits
    expected = run(plain, prompts, params, arrivals)
    got = run(cached, prompts, params, arrivals)
    assert tokens(got) == tokens(expected)
    assert cached.scheduler.prefix_cache_hits > hits_before, "the cached run never hit"
    assert plain.scheduler.prefix_cache_hits == 0 and plain.kv_cache.num_cached_pages == 0
    if scenario in ("preemption", "penalties"):
        assert cached.scheduler.num_preemptions > 0, "the page budget was meant to force preemption"
    if scenario == "n-3":
        assert all(len({tuple(t) for t in ts}) == 1 for ts in tokens(got).values()), "greedy siblings agree"
    assert_released(cached)
    assert cached.kv_cache.num_cached_pages > 0
    # Cached pages are reusable: the same traffic again, now hitting what the first run left.
    again = run(cached, prompts, params, arrivals)
    assert tokens(again) == tokens(expected)
    assert_released(cached)


def test_a_repeated_prompt_reports_its_cached_tokens_and_salts_isolate(engines):
    engine = engines(True)
    prompt = [*SYSTEM, 11, 12, 13]  # 40 tokens: 10 full pages
    first = run(engine, [prompt], greedy(3), [0], salts=["fresh-salt"])[0]
    again = run(engine, [prompt], greedy(3), [0], salts=["fresh-salt"])[0]
    other = run(engine, [prompt], greedy(3), [0], salts=["other-salt"])[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens == 36, "all full pages but the one holding the last token"
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == other.outputs[0].token_ids


def test_penalties_see_the_whole_prompt_on_a_cache_hit(engines):
    """The penalty tables are fed by the step's inputs; a hit skips the cached tokens, so their row is
    loaded from the host. The prompt starts with the token its greedy continuation would begin with, so a
    repetition penalty that sees the prompt changes the output."""
    plain = engines(False)
    base = SYSTEM + SYSTEM[10:20]
    prompt = run(plain, [base], greedy(1), [0])[0].outputs[0].token_ids + base
    params = greedy(12, repetition_penalty=2.0)
    expected = run(plain, [prompt], params, [0])[0].outputs[0].token_ids
    assert expected != run(plain, [prompt], greedy(12), [0])[0].outputs[0].token_ids, "the penalty matters here"
    cached = engines(True)
    run(cached, [prompt], greedy(1), [0])  # caches the prompt
    hit = run(cached, [prompt], params, [0])[0]
    assert hit.num_cached_tokens > 0 and hit.outputs[0].token_ids == expected


def test_a_faulty_neighbour_leaves_a_cache_hit_its_penalties(engines):
    """A request whose parameters fail its batch row is dropped and the step is planned again. A request
    resumed after a cache hit in that step comes back as a running one, and its penalty row must still
    count the cached prompt."""
    plain = engines(False)
    base = SYSTEM + SYSTEM[10:20]
    prompt = run(plain, [base], greedy(1), [0])[0].outputs[0].token_ids + base
    params = greedy(12, repetition_penalty=2.0)
    expected = run(plain, [prompt], params, [0])[0].outputs[0].token_ids
    cached = engines(True)
    run(cached, [prompt], greedy(1), [0])  # caches the prompt
    poisoned = SamplingParams(temperature=0.5, max_tokens=4)
    poisoned.top_k = 2**31  # slipped past validation: its row raises OverflowError
    results = run(cached, [prompt, SYSTEM[:9]], [params, poisoned], [0, 0])
    assert [c.finish_reason for c in results[1].outputs] == ["error"]
    assert results[0].num_cached_tokens > 0 and results[0].outputs[0].token_ids == expected


# Prompt logprobs ----------------------------------------------------------------------------------

def hf_prompt_logprobs(model, prompt: list[int]) -> np.ndarray:  # f32[len(prompt) - 1, V]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].numpy()


def check_prompt_logprobs(got, expected: np.ndarray, prompt: list[int], k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for i, entry in enumerate(got[1:]):
        row, token = expected[i], prompt[i + 1]
        assert next(iter(entry)) == token, "the prompt's own token comes first"
        assert entry[token].logprob == pytest.approx(row[token], abs=1e-4)
        tol = 1e-4  # the rank counts tokens above; those within tolerance may fall either side
        assert 1 + np.sum(row > row[token] + tol) <= entry[token].rank <= 1 + np.sum(row > row[token] - tol)
        assert len(entry) in (max(k, 1), k + 1), "the prompt's token and the top k, once each"
        top = sorted((lp.logprob for lp in entry.values()), reverse=True)[:k]
        assert top == pytest.approx(np.sort(row)[::-1][:k], abs=1e-4)


@pytest.mark.slow  # transformers reference
def test_prompt_logprobs_match_transformers_over_several_chunks(engines, tiny_hf_model):
    """A 150-token prompt through a 64-token step budget: three chunks, batched with other requests,
    one of which shares its prefix (the logprob request must compute it anyway)."""
    model = tiny_hf_model("llama")
    prompt = np.random.default_rng(3).integers(3, 40000, size=150).tolist()
    expected = hf_prompt_logprobs(model, prompt)
    engine = engines(True)
    run(engine, [prompt], greedy(2), [0])  # the prompt's pages are cached now
    params = [greedy(4), greedy(4, prompt_logprobs=5), greedy(4, prompt_logprobs=0)]
    results = run(engine, [prompt[:70], prompt, prompt], params, [0, 0, 1])
    assert results[0].prompt_logprobs is None
    check_prompt_logprobs(results[1].prompt_logprobs, expected, prompt, 5)
    check_prompt_logprobs(results[2].prompt_logprobs, expected, prompt, 0)
    assert results[1].num_cached_tokens == 0, "prompt logprobs are computed, not read from the cache"


def test_prompt_logprobs_survive_preemption(engines):
    engine = engines(True, num_kv_pages=40)
    prompt = chat_prompts()[2]
    alone = run(engine, [prompt], greedy(3, prompt_logprobs=2), [0])[0].prompt_logprobs
    crowd = chat_prompts()
    params = [greedy(24)] * 8
    params[2] = greedy(24, prompt_logprobs=2)
    before = engine.scheduler.num_preemptions
    results = run(engine, crowd, params, [0, 0, 0, 1, 1, 1, 2, 2])
    assert engine.scheduler.num_preemptions > before
    got = results[2].prompt_logprobs
    assert [next(iter(e)) for e in got[1:]] == [next(iter(e)) for e in alone[1:]]
    for a, b in zip(got[1:], alone[1:], strict=True):
        assert {t: lp.logprob for t, lp in a.items()} == pytest.approx({t: lp.logprob for t, lp in b.items()},
                                                                        abs=1e-5)


def test_prompt_logprobs_in_lm_head_chunks_equal_one_pass():
    """The device function scores CHUNK tokens at a time; a small chunk against one full log-softmax."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(20, 8)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32)
    targets = jnp.asarray(np.r_[rng.integers(0, 50, size=13), np.full(7, 50)], jnp.int32)  # 7 positions unscored
    out = jax.jit(lambda h, t: prompt_logprobs(lambda x: x @ head, h, t, 50, 3, chunk=8))(hidden, targets)
    full = jax.nn.log_softmax(hidden @ head, axis=-1)
    np.testing.assert_allclose(out.token_logprobs[:13], full[np.arange(13), targets[:13]], atol=1e-5)
    np.testing.assert_array_equal(out.ranks[:13], 1 + np.sum(full[:13] > full[np.arange(13), targets[:13]][:, None],
                                                                axis=-1))
    np.testing.assert_array_equal(out.top_token_ids, np.argsort(-full, axis=-1)[:, :3])
    skipped = jax.jit(lambda h, t: prompt_logprobs(lambda x: x @ head, h, t, 50, 3, chunk=8))(
        hidden, jnp.full(20, 50, jnp.int32))
    assert not np.any(np.asarray(skipped.top_logprobs)), "no scored position: the work is skipped"


def test_nothing_compiles_for_hits_penalties_or_prompt_logprobs(engines):
    from tests.helpers import count_compilations

    engine = engines(True)
    prompts = chat_prompts()
    run(engine, prompts[:1], greedy(2), [0])  # the system prompt is cached now
    params = [greedy(5), greedy(5, repetition_penalty=1.3, frequency_penalty=0.5), greedy(5, prompt_logprobs=4),
              greedy(5, n=2, presence_penalty=0.3), greedy(5, prompt_logprobs=0, n=2)]
    with count_compilations() as compiles:
        results = run(engine, prompts[1:6], params, [0, 0, 1, 1, 2])
    assert compiles == []
    assert results[1].num_cached_tokens > 0 and results[2].prompt_logprobs is not None
