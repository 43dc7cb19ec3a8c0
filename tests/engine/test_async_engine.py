"""AsyncEngine: streaming from asyncio, concurrent requests, cancellation frees pages, bad input."""

import asyncio

import pytest

from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import greedy, make_engine, make_prompts, run_alone


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"))
    prompts = make_prompts()
    expected = [run_alone(engine, p, 10) for p in prompts]
    async_engine = AsyncEngine(engine)
    yield async_engine, prompts, expected
    async_engine.shutdown()


async def collect(async_engine, prompt, params, request_id=None):
    deltas, last = [], None
    async for output in async_engine.generate(prompt, params, request_id):
        deltas.extend(output.outputs[0].token_ids_delta)
        last = output
    return deltas, last


def test_concurrent_streams_match_solo_runs(engines):
    async_engine, prompts, expected = engines

    async def main():
        return await asyncio.gather(*(collect(async_engine, p, greedy(10)) for p in prompts))

    for (deltas, last), tokens in zip(asyncio.run(main()), expected, strict=True):
        assert deltas == tokens == last.outputs[0].token_ids
        assert last.finished and last.outputs[0].finish_reason == "length"


async def all_pages_free(async_engine, timeout: float = 2.0) -> bool:
    """Whether, within `timeout` seconds, every KV page is free and no request is left in the engine."""
    kv = async_engine.engine.kv_cache
    for _ in range(int(timeout / 0.01)):
        if kv.num_free_pages == kv.num_usable_pages and not async_engine.engine.has_unfinished_requests():
            return True
        await asyncio.sleep(0.01)
    return False


def test_cancelled_stream_aborts_and_frees_pages(engines):
    async_engine, prompts, _ = engines

    async def main():
        stream = async_engine.generate(prompts[3], greedy(200), "cancel-me")
        await anext(stream)  # the request is running and holds pages
        await stream.aclose()  # the client went away
        return await all_pages_free(async_engine)

    assert asyncio.run(main()), "pages were not freed after the stream was closed"


def test_bad_request_fails_alone(engines):
    async_engine, prompts, expected = engines

    async def main():
        good = asyncio.create_task(collect(async_engine, prompts[0], greedy(10)))
        with pytest.raises(ValueError, match="empty"):
            await collect(async_engine, [], SamplingParams())
        return await good

    deltas, _ = asyncio.run(main())
    assert deltas == expected[0]


def test_shutdown_engine_refuses_new_work(tiny_model_dir):
    async_engine = AsyncEngine(make_engine(tiny_model_dir("llama"), warmup=False))
    async_engine.shutdown()

    async def main():
        await collect(async_engine, [5, 6, 7], greedy(2))

    with pytest.raises(EngineDeadError):
        asyncio.run(main())


def test_one_engine_is_driven_by_one_async_engine_at_a_time(tiny_model_dir):
    """A second AsyncEngine on a driven LLMEngine is refused (two threads would step it at once); once the
    first shuts down, the next one drives the same engine and serves."""
    engine = make_engine(tiny_model_dir("llama"), warmup=False)
    expected = run_alone(engine, [5, 6, 7], 3)
    first = AsyncEngine(engine)
    with pytest.raises(RuntimeError, match="driven by another AsyncEngine"):
        AsyncEngine(engine)
    assert first.is_running
    first.shutdown()
    second = AsyncEngine(engine)
    try:
        deltas, last = asyncio.run(asyncio.wait_for(collect(second, [5, 6, 7], greedy(3)), 60))
        assert deltas == expected and last.finished
    finally:
        second.shutdown()


def test_a_shutdown_ends_the_streams_still_running_with_an_error(tiny_model_dir):
    """A stream still generating when the engine shuts down (no drain first: a host other than `jaxserve
    serve`, or the library) ends with EngineDeadError rather than waiting forever."""
    async_engine = AsyncEngine(make_engine(tiny_model_dir("llama"), warmup=False))
    params = SamplingParams(max_tokens=250, ignore_eos=True, temperature=0.0)

    async def main() -> int:
        seen = 0
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in async_engine.generate([5, 6, 7], params):
                seen += 1
                if seen == 2:
                    asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)
        return seen

    assert asyncio.run(asyncio.wait_for(main(), 60)) >= 2


def test_grammar_compiles_off_the_engine_thread_with_a_timeout(engines, monkeypatch):
    """A definition that compiles slowly is an InvalidParam after the timeout, and the engine serves on;
    a compiled grammar travels with the request and constrains it."""
    import threading
    import time

    from jaxserve.sampling_params import InvalidParam, StructuredOutputsParams

    async_engine, prompts, expected = engines
    compiler = async_engine.engine.grammars
    real_compile = compiler.compile
    threads: list[str] = []

    def slow_compile(spec):
        threads.append(threading.current_thread().name)
        if spec.regex == "slow":
            time.sleep(1.0)
        return real_compile(spec)

    monkeypatch.setattr(compiler, "compile", slow_compile)

    async def main():
        with pytest.raises(InvalidParam, match="did not compile within") as info:
            await async_engine.compile_grammar(StructuredOutputsParams(regex="slow"), timeout=0.1)
        assert info.value.param == "structured_outputs"
        spec = StructuredOutputsParams(choice=["red", "green"])
        grammar = await async_engine.compile_grammar(spec, timeout=10)
        params = SamplingParams(temperature=0, max_tokens=10, structured_outputs=spec)
        outputs = []
        async for output in async_engine.generate(prompts[1], params, grammar=grammar):
            outputs.append(output)
        return outputs[-1], await collect(async_engine, prompts[0], greedy(10))

    constrained, (deltas, _) = asyncio.run(main())
    assert constrained.outputs[0].text in ("red", "green")
    assert deltas == expected[0]
    assert threads and all(name.startswith("jaxserve-grammar") for name in threads)


def test_a_duplicate_id_given_up_before_its_refusal_leaves_the_request_of_that_id_alone(engines):
    """A caller's second request under a live request's id is refused; if the caller gives it up before the
    refusal arrives, the abort it sends must not reach the first request."""
    async_engine, prompts, expected = engines

    async def main():
        first = asyncio.create_task(collect(async_engine, prompts[0], greedy(10), "shared-id"))
        await asyncio.sleep(0)  # the first request's add is queued
        duplicate = async_engine.generate(prompts[1], greedy(10), "shared-id")
        waiting = asyncio.create_task(anext(duplicate))
        await asyncio.sleep(0)  # its add is queued behind the first's
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await duplicate.aclose()
        return await asyncio.wait_for(first, 60)  # aborted by the duplicate, the first stream never ended

    deltas, last = asyncio.run(main())
    assert deltas == expected[0] and last.outputs[0].finish_reason == "length"


def test_an_abort_by_id_ends_the_request_s_stream_and_frees_its_pages(engines):
    async_engine, prompts, _ = engines

    async def main():
        stream = async_engine.generate(prompts[3], greedy(200), "aborted-by-id")
        await anext(stream)
        async_engine.abort("aborted-by-id")

        async def read_to_the_end():  # outputs already on their way come first
            async for output in stream:
                assert not output.finished, "the request ran to its end"

        with pytest.raises(RequestFailedError, match="aborted-by-id was aborted"):
            await asyncio.wait_for(read_to_the_end(), 60)
        return await all_pages_free(async_engine)

    assert asyncio.run(main()), "pages were not freed after the abort"
