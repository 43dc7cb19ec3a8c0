"""Fault isolation: one request's bad data fails that request alone; a runtime fault stops the engine."""

import asyncio

import pytest

from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import greedy, make_engine, make_prompts, run_alone


def poisoned(max_tokens: int = 8) -> SamplingParams:
    """Params that slipped past validation (mutated after it ran): their batch row raises OverflowError."""
    params = SamplingParams(temperature=0.5, top_k=5, max_tokens=max_tokens)
    params.top_k = 2**31
    return params


def run_all(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return finals


def test_a_row_fault_fails_its_request_alone(engine):
    prompts = make_prompts()
    expected = [run_alone(engine, p, 10) for p in prompts[:2]]
    engine.add_request("good-0", prompts[0], greedy(10))
    engine.add_request("bad", prompts[2], poisoned())
    engine.add_request("good-1", prompts[1], greedy(10))
    finals = run_all(engine)
    assert finals["bad"].error and "OverflowError" in finals["bad"].error
    assert [c.finish_reason for c in finals["bad"].outputs] == ["error"]
    assert finals["good-0"].outputs[0].token_ids == expected[0]
    assert finals["good-1"].outputs[0].token_ids == expected[1]
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages, "pages leaked"
    assert run_alone(engine, prompts[0], 10) == expected[0]  # and the next request is served


def test_a_detokenizer_fault_fails_its_request_alone(engine):
    prompts = make_prompts()
    expected = run_alone(engine, prompts[1], 6)
    engine.add_request("bad", prompts[0], SamplingParams(temperature=0, max_tokens=6, n=2, ignore_eos=True))
    engine.add_request("good", prompts[1], greedy(6))

    def explode(token_id):
        raise RuntimeError("decoder fault")

    engine.outputs._requests["bad"].sequences[1].detokenizer.add_token = explode
    finals = run_all(engine)
    assert "RuntimeError" in finals["bad"].error and len(finals["bad"].outputs) == 2
    assert finals["good"].outputs[0].token_ids == expected
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages


@pytest.fixture()
def fresh_engine(tiny_model_dir):
    return make_engine(tiny_model_dir("llama"), warmup=False)


def test_async_engine_reports_the_fault_and_serves_on(fresh_engine):
    async_engine = AsyncEngine(fresh_engine)
    prompt = make_prompts(1)[0]

    async def run(params):
        return [o async for o in async_engine.generate(prompt, params)][-1]

    async def main():
        with pytest.raises(RequestFailedError, match="OverflowError"):
            await run(poisoned())
        return await run(greedy(5))

    try:
        after = asyncio.run(main())
        assert after.finished and len(after.outputs[0].token_ids) == 5
        assert async_engine.is_running
    finally:
        async_engine.shutdown()


def test_a_runtime_fault_kills_the_engine_and_fails_everyone(fresh_engine):
    async_engine = AsyncEngine(fresh_engine)

    def device_lost(scheduler_output):
        raise RuntimeError("device lost")

    fresh_engine.runner.launch = device_lost
    prompt = make_prompts(1)[0]

    async def main():
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in async_engine.generate(prompt, greedy(5)):
                pass
        with pytest.raises(EngineDeadError):
            async for _ in async_engine.generate(prompt, greedy(5)):
                pass

    asyncio.run(main())
    assert not async_engine.is_running
