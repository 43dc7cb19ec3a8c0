"""LLMEngine on a tiny random Llama: continuous batching, preemption, chunked prefill, compiles, errors."""

import dataclasses
import logging
import time

import jax
import pytest

from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import greedy, make_engine, make_prompts, run_alone, run_staggered
from tests.helpers import count_compilations


@pytest.fixture(scope="module")
def solo_outputs(engine):
    prompts = make_prompts()
    max_tokens = [12, 7, 20, 9, 15, 11, 6, 18]
    return prompts, max_tokens, [run_alone(engine, p, m) for p, m in zip(prompts, max_tokens, strict=True)]


def check_batched(engine, solo_outputs, arrivals):
    prompts, max_tokens, expected = solo_outputs
    got = run_staggered(engine, prompts, max_tokens, arrivals)
    for i, tokens in enumerate(expected):
        assert got[i] == tokens, f"request {i} differs when batched"
        assert len(tokens) == max_tokens[i]
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages, "pages leaked"


@pytest.mark.gpu  # with the three below, `make test-gpu`'s check of the engine's greedy outputs
def test_continuous_batching_changes_nothing(engine, solo_outputs):
    check_batched(engine, solo_outputs, arrivals=[0, 0, 1, 2, 2, 5, 9, 14])


@pytest.mark.gpu
def test_preemption_changes_nothing(llama_dir, solo_outputs):
    # 24 usable pages of 4 tokens cannot hold all eight requests at once: some are preempted.
    small = make_engine(llama_dir, warmup=False, num_kv_pages=25)
    preemptions = []
    original = small.scheduler._preempt
    small.scheduler._preempt = lambda r: (preemptions.append(r.request_id), original(r))[1]
    check_batched(small, solo_outputs, arrivals=[0, 0, 0, 1, 1, 1, 2, 2])
    assert preemptions, "the page budget was meant to force preemption"


@pytest.mark.gpu
def test_chunked_prefill_changes_nothing(llama_dir, solo_outputs):
    tiny_budget = make_engine(llama_dir, warmup=False, max_num_batched_tokens=8, token_buckets=(8,))
    check_batched(tiny_budget, solo_outputs, arrivals=[0, 0, 1, 2, 2, 5, 9, 14])


def test_max_model_len_auto_serves_what_the_kv_cache_holds(llama_dir, solo_outputs, caplog):
    """vLLM's --max-model-len auto (-1): the model's context (the tiny Llama's 512) where the KV cache holds
    it, else what one request can hold there (16 usable pages of 4 tokens: 64), which the requests' limit
    and the steps' page tables follow, with the same tokens. A length the cache cannot hold, given, is kept,
    with a warning that names auto."""
    prompts, max_tokens, expected = solo_outputs
    fitted = make_engine(llama_dir, warmup=False, max_model_len=-1, num_kv_pages=17)
    assert fitted.max_model_len == 64 and fitted.core.runner.max_pages_per_req == 16
    assert run_alone(fitted, prompts[3], max_tokens[3]) == expected[3]  # 40 prompt tokens
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        fitted.add_request("long", prompts[3] * 2, greedy(1))
    assert make_engine(llama_dir, warmup=False, max_model_len=-1, num_kv_pages=129).max_model_len == 512
    with caplog.at_level(logging.WARNING, "jaxserve.engine.core"):
        fixed = make_engine(llama_dir, warmup=False, max_model_len=256, num_kv_pages=17)
    assert fixed.max_model_len == 256 and fixed.core.runner.max_pages_per_req == 64
    assert ("the KV cache holds 64 tokens, fewer than the 256 of the context served: a longer request is refused; "
            "--max-model-len auto serves what the cache holds") in caplog.text


@pytest.mark.gpu
def test_nothing_compiles_after_warmup(engine, solo_outputs):
    prompts, _, _ = solo_outputs
    with count_compilations() as compiles:
        run_staggered(engine, prompts, [5, 30, 3, 8, 12, 2, 9, 4], arrivals=[0, 1, 1, 3, 4, 4, 6, 7])
        engine.add_request("sampled", prompts[3], SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05,
                                                                 max_tokens=6, seed=1))
        while engine.has_unfinished_requests():
            engine.step()
    assert compiles == []


def test_warmup_waits_for_its_runs(tiny_model_dir):
    """Warm-up runs each bucket once to pay an executable's first-run cost; dispatch is asynchronous, so
    it must wait for those runs, or the first request's step waits behind them (4 s for SmolLM2 on CPU).
    The runs are made slow here (a host callback that sleeps) so an unawaited one is still running."""
    engine = make_engine(tiny_model_dir("llama"), warmup=False)
    runner = engine.runner
    run_step, outputs = runner.run_step, []

    def slow(x):
        time.sleep(0.2)
        return x

    def slow_run_step(batch, bucket, *variant):
        sampled, prompt, pooled = run_step(batch, bucket, *variant)
        tokens = jax.pure_callback(slow, jax.ShapeDtypeStruct(sampled.tokens.shape, sampled.tokens.dtype),
                                   sampled.tokens)
        outputs.append(tokens)
        return dataclasses.replace(sampled, tokens=tokens), prompt, pooled

    runner.run_step = slow_run_step
    runner.warmup(show_progress=False)
    ready = [out.is_ready() for out in outputs]
    jax.block_until_ready(outputs)  # before asserting: pending callbacks at exit would crash the interpreter
    assert ready and all(ready)


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], SamplingParams(), "empty"),
        ("", SamplingParams(), "empty"),
        (list(range(5, 300)), SamplingParams(), "context length"),
        ([10**6], SamplingParams(), "vocabulary"),
    ],
)
def test_bad_input_is_rejected_and_engine_keeps_serving(engine, solo_outputs, prompt, params, match):
    prompts, max_tokens, expected = solo_outputs
    engine.add_request("ok", prompts[0], greedy(max_tokens[0]))
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(outputs) == ["ok"]
    assert outputs["ok"].outputs[0].token_ids == expected[0]


def test_bad_sampling_params_raise():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)


def test_abort_frees_pages(engine, solo_outputs):
    prompts, _, _ = solo_outputs
    engine.add_request("a", prompts[3], greedy(50))
    engine.add_request("b", prompts[1], greedy(50))
    engine.step()
    engine.step()
    assert engine.kv_cache.num_free_pages < engine.kv_cache.num_usable_pages
    engine.abort_request(["a", "b"])
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages


def test_n_completions_and_seed_reproduce(engine, solo_outputs):
    prompts, _, _ = solo_outputs
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=123, ignore_eos=True)

    def run(request_id: str):
        engine.add_request(request_id, prompts[2], params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    return output

    first, second = run("s1"), run("s2")
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1, "n completions should differ"


def test_stop_token_ids_and_max_tokens(engine, solo_outputs):
    prompts, _, expected = solo_outputs
    stop_at = expected[2][4]
    engine.add_request("stop", prompts[2], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
    first = expected[2].index(stop_at)
    assert completion.token_ids == expected[2][: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_at
