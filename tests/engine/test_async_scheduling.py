"""Async scheduling (step N + 1 launched before step N is read) gives the synchronous loop's outputs.

Two engines on one tiny random Llama, one per mode, run the same workload with the same arrivals and
aborts: greedy and seeded sampling, n > 1, penalties, min_tokens, logprobs, prompt logprobs, stop ids and
stop strings, a grammar, preemption and prefix-cache hits. Every finished request must match exactly
(tokens, text, finish and stop reasons, logprobs), no page may leak, nothing may compile after warm-up,
and the async engine must really have overlapped steps.
"""

import pytest

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.step_io import PENDING_TOKEN
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import assert_same, make_engine, make_prompts, run, workload
from tests.engine.sent_pages import shares
from tests.helpers import count_compilations


@pytest.fixture(scope="module")
def engines(llama_dir) -> dict[bool, LLMEngine]:
    return {mode: make_engine(llama_dir, async_scheduling=mode) for mode in (False, True)}


def test_async_outputs_equal_synchronous(engines):
    requests, arrivals = workload(engines[False])
    sync = run(engines[False], requests, arrivals)
    assert sync["stop-id"].outputs[0].finish_reason == "stop" and sync["stop-id"].outputs[0].stop_reason is not None
    assert sync["stop-string"].outputs[0].finish_reason == "stop"
    assert isinstance(sync["stop-string"].outputs[0].stop_reason, str)
    assert sync["shared-b"].num_cached_tokens > 0, "the workload should hit the prefix cache"
    with count_compilations() as compiled:
        overlapped = run(engines[True], requests, arrivals)
    assert compiled == [], f"compiled after warm-up: {compiled}"
    assert_same(sync, overlapped)
    assert overlapped["shared-b"].num_cached_tokens == sync["shared-b"].num_cached_tokens


def test_async_aborts_leave_the_others_unchanged(engines):
    requests, arrivals = workload(engines[False])
    aborts = {"greedy": 6, "seeded-n3": 3, "penalties": 9, "shared-a": 8}
    sync = run(engines[False], requests, arrivals, aborts)
    overlapped = run(engines[True], requests, arrivals, aborts)
    assert not set(aborts) & set(sync)
    assert_same(sync, overlapped)


def test_async_with_preemption_equals_synchronous(llama_dir):
    # 24 usable pages of 4 tokens cannot hold the eight requests at once: the newest are preempted,
    # some while their sampled token is still in flight.
    prompts = make_prompts(8)
    params = [SamplingParams(max_tokens=m, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True)
              for i, m in enumerate([12, 7, 20, 9, 15, 11, 6, 18])]
    requests = {f"p{i}": (prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))}
    arrivals = {f"p{i}": step for i, step in enumerate([0, 0, 1, 1, 2, 3, 3, 4])}
    results = {}
    for mode in (False, True):
        engine = make_engine(llama_dir, num_kv_pages=25, async_scheduling=mode)
        results[mode] = run(engine, requests, arrivals)
        assert engine.scheduler.num_preemptions > 0
    assert_same(results[False], results[True])


def test_pending_token_feeds_the_next_step_on_device(engines):
    """A decode scheduled while its input token is in flight carries PENDING_TOKEN, and the step reads the
    token the device sampled: the async engine's second decode equals the synchronous one's."""
    engine = engines[True]
    prompt = make_prompts(1)[0]
    engine.add_request("pending", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()  # launches the prefill; nothing read yet
    assert engine._in_flight is not None
    outputs = engine.step()  # launches the first decode (its input in flight), reads the prefill
    assert [tokens for _, _, tokens in shares(engine._in_flight.scheduler_output)] == [(PENDING_TOKEN,)]
    assert [len(output.outputs[0].token_ids) for output in outputs] == [1], "the prefill's token is read"
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens = output.outputs[0].token_ids
    sync = engines[False]
    sync.add_request("pending", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while sync.has_unfinished_requests():
        for output in sync.step():
            if output.finished:
                expected = output.outputs[0].token_ids
    assert tokens == expected
