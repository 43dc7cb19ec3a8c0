"""Async scheduling (step N + 1 launched before step N is read) gives the synchronous loop's outputs.

Two engines on one tiny random Llama, one per mode, run the same workload with the same arrivals and
aborts: greedy and seeded sampling, n > 1, penalties, min_tokens, logprobs, prompt logprobs, stop ids and
stop strings, a grammar, preemption and prefix-cache hits. Every finished request must match exactly
(tokens, text, finish and stop reasons, logprobs), no page may leak, nothing may compile after warm-up,
and the async engine must really have overlapped steps.
"""

import numpy as np
import pytest

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.scheduler import PENDING_TOKEN
from jaxserve.sampling_params import SamplingParams
from jaxserve.sampling_params import StructuredOutputsParams as Structure
from tests.conftest import count_compilations
from tests.engine.sent_pages import shares
from tests.engine.test_llm_engine import make_engine, make_prompts


@pytest.fixture(scope="module")
def engines(llama_dir) -> dict[bool, LLMEngine]:
    return {mode: make_engine(llama_dir, async_scheduling=mode) for mode in (False, True)}


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], arrivals: dict[str, int],
        aborts: dict[str, int] | None = None) -> dict[str, object]:
    """Adds request r before step arrivals[r], aborts it before step aborts[r]; returns the finished outputs.
    Also checks that every step's outputs belong to live requests and that nothing is reported twice, and,
    when the core runs in this process, that it ends with no page leaked and the async loop overlapped."""
    aborts = aborts or {}
    finished: dict[str, object] = {}
    overlapped = 0
    step = 0
    while step <= max(arrivals.values()) or engine.has_unfinished_requests():
        for request_id, arrival in arrivals.items():
            if arrival == step:
                prompt, params = requests[request_id]
                engine.add_request(request_id, prompt, params)
        for request_id, at in aborts.items():
            if at == step:
                engine.abort_request(request_id)
        for output in engine.step():
            assert output.error is None, output.error
            assert output.request_id not in finished, "reported after it finished"
            assert output.request_id not in aborts or step < aborts[output.request_id], "reported after its abort"
            if output.finished:
                finished[output.request_id] = output
        overlapped += engine.core is not None and engine._in_flight is not None
        step += 1
        assert step < 3000, "no progress"
    if engine.core is None:  # in its own process: nothing to look into here
        return finished
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages, "pages leaked"
    assert not engine.scheduler.requests and not engine.scheduler.waiting and not engine.scheduler.running
    if engine.async_scheduling:
        assert overlapped > 0, "the async engine never had a step in flight while it returned"
    return finished


def summary(output) -> list[tuple]:
    """Everything exact but the logprobs' values: a request's rows share steps with different neighbours in
    the two modes, so its logits may differ in the last bits (its tokens may not)."""
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.top_logprobs and [list(t) for t in c.top_logprobs])
            for c in output.outputs] + [output.prompt_logprobs and [e and list(e) for e in output.prompt_logprobs]]


def logprob_values(output) -> list[float]:
    values = [v for c in output.outputs for v in (c.logprobs or [])]
    values += [v for c in output.outputs for t in (c.top_logprobs or []) for v in t.values()]
    values += [lp.logprob for e in (output.prompt_logprobs or []) if e for lp in e.values()]
    return values


def assert_same(sync: dict, overlapped: dict) -> None:
    assert sorted(sync) == sorted(overlapped)
    for request_id in sync:
        assert summary(overlapped[request_id]) == summary(sync[request_id]), f"{request_id} differs"
        np.testing.assert_allclose(logprob_values(overlapped[request_id]), logprob_values(sync[request_id]),
                                   rtol=0, atol=1e-4, err_msg=request_id)


def workload(engine: LLMEngine) -> tuple[dict[str, tuple[list[int], SamplingParams]], dict[str, int]]:
    prompts = make_prompts(8)
    shared = prompts[3] + prompts[6]  # 66 tokens: later requests with this prefix hit the prefix cache
    greedy = dict(temperature=0.0, ignore_eos=True)
    requests = {
        "greedy": (prompts[0], SamplingParams(max_tokens=20, **greedy)),
        "one-token": (prompts[5], SamplingParams(max_tokens=1, **greedy)),
        "two-tokens": (prompts[2], SamplingParams(max_tokens=2, **greedy)),
        "seeded-n3": (prompts[1], SamplingParams(n=3, temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=14,
                                                 ignore_eos=True)),
        "unseeded-greedy-n2": (prompts[4], SamplingParams(n=2, max_tokens=9, **greedy)),
        "penalties": (prompts[6], SamplingParams(max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5,
                                                 presence_penalty=0.4, **greedy)),
        "sampled-penalties": (prompts[7], SamplingParams(max_tokens=16, temperature=1.0, seed=3,
                                                         frequency_penalty=1.5, ignore_eos=True)),
        "logprobs": (prompts[3], SamplingParams(max_tokens=8, logprobs=3, prompt_logprobs=2, **greedy)),
        "min-tokens": (prompts[0], SamplingParams(max_tokens=12, min_tokens=6, stop_token_ids=[],
                                                  temperature=0.0)),
        "shared-a": (shared, SamplingParams(max_tokens=10, **greedy)),
        "shared-b": (shared + prompts[0][:3], SamplingParams(max_tokens=10, temperature=0.7, seed=11,
                                                             ignore_eos=True)),
        "regex": (prompts[2], SamplingParams(max_tokens=12, temperature=1.0, seed=5,
                                             structured_outputs=Structure(regex=r"[a-c]{2,6}-\d{1,3}"))),
    }
    arrivals = {"greedy": 0, "one-token": 0, "two-tokens": 1, "seeded-n3": 1, "unseeded-greedy-n2": 2,
                "penalties": 3, "sampled-penalties": 3, "logprobs": 4, "min-tokens": 5, "shared-a": 6,
                "shared-b": 7, "regex": 18}
    # Stops found from a first, stop-free synchronous run: a stop id mid-output, a stop string mid-text.
    probe = run(engine, {"probe": (prompts[7], SamplingParams(max_tokens=24, **greedy))}, {"probe": 0})
    probe_output = probe["probe"].outputs[0]
    text = probe_output.text
    requests["stop-id"] = (prompts[7], SamplingParams(max_tokens=24, stop_token_ids=[probe_output.token_ids[9]],
                                                      **greedy))
    requests["stop-string"] = (prompts[7], SamplingParams(max_tokens=24, stop=[text[len(text) // 2:][:3]],
                                                          **greedy))
    arrivals.update({"stop-id": 2, "stop-string": 4})
    return requests, arrivals


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
