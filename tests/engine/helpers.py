"""Engine test helpers: an engine on a model directory, prompts, and drivers that run requests to the end."""

import glob
import gzip
import json
import time
from collections import Counter

import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.sampling_params import StructuredOutputsParams as Structure

LADDER = dict(token_buckets=(16, 64), request_buckets=(1, 2, 4, 8), max_num_seqs=8, max_num_batched_tokens=64)


def make_engine(model_dir, warmup: bool = True, model=None, **overrides) -> LLMEngine:
    """An engine on `model_dir` (or on `model`, a LoadedModel of it, where given) with the test ladder.
    `warmup=False`: each step compiles when first run, for tests of outputs whose engine differs from the
    shared ones (a small KV cache, another vocabulary), where a warm-up compiles buckets they never run."""
    # Ready once every bucket is compiled: `auto` would warm up in the background wherever the persistent
    # cache (the default one: None leaves it) already holds the largest bucket, as earlier tests fill it.
    options = {"dtype": "float32", **LADDER, "page_size": 4, "num_kv_pages": 256, "max_model_len": 256,
               "compilation_cache_dir": None, "warmup_mode": "full", **overrides}
    config = EngineConfig.from_preset(None, model=str(model_dir), **options)
    return LLMEngine(config, model=model, warmup=warmup)


def make_prompts(n: int = 8) -> list[list[int]]:
    rng = np.random.default_rng(0)
    lengths = [3, 17, 5, 40, 9, 1, 26, 12][:n]
    return [rng.integers(3, 40000, size=length).tolist() for length in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_alone(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request("alone", prompt, greedy(max_tokens))
    result = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                result = output.outputs[0].token_ids
    return result


def run_staggered(
    engine: LLMEngine, prompts, max_tokens: list[int], arrivals: list[int], params: SamplingParams | None = None
) -> dict[int, list[int]]:
    """Request i joins before step arrivals[i]; returns its generated tokens."""
    results: dict[int, list[int]] = {}
    step = 0
    while len(results) < len(prompts):
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                engine.add_request(f"r{i}", prompts[i], params or greedy(max_tokens[i]))
        for output in engine.step():
            if output.finished:
                results[int(output.request_id[1:])] = output.outputs[0].token_ids
        step += 1
        assert step < 2000, "engine made no progress"
    return results


# The async-scheduling workload (tests/engine/test_async_scheduling.py, test_core_process.py).


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
    values = [v for c in output.outputs for v in (c.token_logprobs or [])]
    values += [v for c in output.outputs for t in (c.top_logprobs or []) for v in t.values()]
    values += [lp.logprob for e in (output.prompt_logprobs or []) if e for lp in e.values()]
    return values


def assert_same(sync: dict, overlapped: dict) -> None:
    assert sorted(sync) == sorted(overlapped)
    for request_id in sync:
        assert summary(overlapped[request_id]) == summary(sync[request_id]), f"{request_id} differs"
        np.testing.assert_allclose(logprob_values(overlapped[request_id]), logprob_values(sync[request_id]),
                                   rtol=0, atol=1e-4, err_msg=request_id)
        ranks, sync_ranks = token_ranks(overlapped[request_id]), token_ranks(sync[request_id])
        assert [r is None for r in ranks] == [r is None for r in sync_ranks], f"{request_id}: ranks"
        # within one: the logits' last bits may flip a near-tie
        np.testing.assert_allclose([r or 0 for r in ranks], [r or 0 for r in sync_ranks], rtol=0, atol=1,
                                   err_msg=request_id)


def token_ranks(output) -> list[int | None]:
    """Each sampled token's rank, where the request asked for logprobs (None per completion that did not)."""
    return [r for c in output.outputs for r in (c.token_ranks if c.token_ranks is not None else [None])]


def stop_requests(engine: LLMEngine, prompt: list[int]) -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy requests that stop mid-output, found from a first, stop-free run of `prompt`: "stop-id" on
    its 10th token's id, "stop-string" on three characters from the middle of its text."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    probe = run(engine, {"probe": (prompt, SamplingParams(max_tokens=24, **greedy))}, {"probe": 0})
    probe_output = probe["probe"].outputs[0]
    text = probe_output.text
    return {
        "stop-id": (prompt, SamplingParams(max_tokens=24, stop_token_ids=[probe_output.token_ids[9]], **greedy)),
        "stop-string": (prompt, SamplingParams(max_tokens=24, stop=[text[len(text) // 2:][:3]], **greedy)),
    }


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
        "allowed": (prompts[5], SamplingParams(max_tokens=10, temperature=1.0, seed=9,
                                               allowed_token_ids=[11, 12, 13, 1000, 20000])),
    }
    arrivals = {"greedy": 0, "one-token": 0, "two-tokens": 1, "seeded-n3": 1, "unseeded-greedy-n2": 2,
                "penalties": 3, "sampled-penalties": 3, "logprobs": 4, "min-tokens": 5, "shared-a": 6,
                "shared-b": 7, "regex": 18, "allowed": 3}
    requests.update(stop_requests(engine, prompts[7]))
    arrivals.update({"stop-id": 2, "stop-string": 4})
    return requests, arrivals


ABORTS = {"greedy": 6, "seeded-n3": 3, "penalties": 9, "shared-a": 8}  # `workload` request -> its abort step


def drafting_workload(engine: LLMEngine) -> tuple[dict[str, tuple[list[int], SamplingParams]], dict[str, int]]:
    """`workload`, and a greedy request that outlasts the others: it decodes alone at the end, where drafts run
    (the speculative engines' tests)."""
    requests, arrivals = workload(engine)
    requests["outlasting"] = (make_prompts(3)[2], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    arrivals["outlasting"] = 0
    return requests, arrivals


def assert_aborts_leave_the_others_unchanged(reference: LLMEngine, engine: LLMEngine) -> None:
    """`workload` with ABORTS on both engines: the aborted are gone, every other output equals the reference's."""
    requests, arrivals = workload(reference)
    expected = run(reference, requests, arrivals, ABORTS)
    got = run(engine, requests, arrivals, ABORTS)
    assert not set(ABORTS) & set(got)
    assert_same(expected, got)


def run_short_requests(engine: LLMEngine, count: int) -> None:
    """`count` two-token greedy requests, run to the end."""
    for index in range(count):
        engine.add_request(f"last-{index}", make_prompts(1)[0], SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()


def require_ranks(num_ranks: int) -> None:
    """Skips a test whose data-parallel ranks this machine cannot place (a GPU machine with fewer GPUs)."""
    from jaxserve.engine.placement import placements

    try:
        placements(num_ranks, 1)
    except ValueError as e:
        pytest.skip(f"{num_ranks} data-parallel ranks cannot be placed here: {e}")


def traced_jit_calls(log_dir: str, timeout: float = 60.0) -> Counter:
    """The jitted functions a `jax.profiler` trace under `log_dir` recorded (`step`), with their call counts;
    waits up to `timeout` s for a whole trace (a core process writes it when it hears the stop)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            [path] = glob.glob(f"{log_dir}/**/perfetto_trace.json.gz", recursive=True)
            with gzip.open(path) as f:
                trace = json.load(f)
            break
        except (ValueError, EOFError, OSError):  # not there yet, or still being written
            if time.monotonic() > deadline:
                raise AssertionError(f"no whole trace under {log_dir} after {timeout:g} s") from None
            time.sleep(0.1)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = [e["name"].removeprefix("PjitFunction(").removesuffix(")") for e in events
             if e.get("ph") == "X" and e.get("name", "").startswith("PjitFunction(")]
    return Counter(name.removeprefix("jit(").removesuffix(")") for name in names)  # `jit(step)` or `step`
