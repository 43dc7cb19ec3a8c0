"""The engine core in its own process (`engine_process`) gives the in-process engine's outputs.

The same workload as the async-scheduling tests (greedy and seeded sampling, n > 1, penalties, min_tokens,
logprobs, prompt logprobs, stop ids and stop strings, a grammar compiled in the core process, prefix-cache
hits, aborts) runs on an in-process engine and on one whose core is a child process; every finished
request must match exactly. A core process that dies fails every live request and the engine with it.
"""

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError
from jaxserve.engine.core_process import CoreProcessDied
from jaxserve.engine.llm_engine import LLMEngine, ProfilerState
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import (
    assert_aborts_leave_the_others_unchanged,
    assert_same,
    greedy,
    make_engine,
    make_prompts,
    run,
    run_short_requests,
    traced_jit_calls,
    workload,
)


@pytest.fixture(scope="module")
def in_process(llama_dir) -> LLMEngine:
    return make_engine(llama_dir)


@pytest.fixture(scope="module")
def core_process(llama_dir):
    engine = make_engine(llama_dir, engine_process=True, async_scheduling=True)
    yield engine
    engine.shutdown()


def test_core_process_outputs_equal_in_process(in_process, core_process):
    assert core_process.core is None and core_process._core._process.pid != os.getpid()
    requests, arrivals = workload(in_process)
    expected = run(in_process, requests, arrivals)
    got = run(core_process, requests, arrivals)
    assert_same(expected, got)
    assert got["shared-b"].num_cached_tokens == expected["shared-b"].num_cached_tokens > 0
    assert got["stop-string"].outputs[0].finish_reason == "stop"
    assert isinstance(got["stop-string"].outputs[0].stop_reason, str)
    metrics = got["seeded-n3"].metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time <= metrics.last_token_time


def test_core_process_aborts_leave_the_others_unchanged(in_process, core_process):
    assert_aborts_leave_the_others_unchanged(in_process, core_process)
    # Everything aborted or finished: the core's pages are all free again once it has heard.
    run_short_requests(core_process, 1)
    stats = core_process.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


def test_bad_input_is_refused_in_the_frontend(core_process):
    with pytest.raises(ValueError, match="max_tokens"):
        core_process.add_request("too-long", [5] * 10, SamplingParams(max_tokens=10_000))
    assert not core_process.has_unfinished_requests()


def test_a_dead_core_process_fails_live_requests_and_the_engine(llama_dir):
    async_engine = AsyncEngine(make_engine(llama_dir, engine_process=True))

    async def scenario() -> None:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        stream = async_engine.generate(make_prompts(1)[0], params, request_id="doomed")
        first = await anext(stream)  # it runs
        assert first.outputs[0].token_ids
        os.kill(async_engine.engine._core._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            async for _ in async_engine.generate([5, 6, 7], params):
                pass

    try:
        asyncio.run(scenario())
        assert not async_engine.is_running
    finally:
        async_engine.shutdown()


def test_a_core_process_that_cannot_start_says_why(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CoreProcessDied, match="did not start"):
        make_engine(tmp_path, engine_process=True)


def test_a_request_id_reused_at_once_gets_only_its_own_tokens(in_process, core_process):
    """A request that a stop string ends here runs a step or more in the core before it hears; the same
    id, added again at once, must not receive those tokens."""
    requests, _ = workload(in_process)
    prompt, stopping = requests["stop-string"]
    expected = run(in_process, {"again": (prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))},
                   {"again": 0})["again"]
    core_process.add_request("again", prompt, stopping)
    while core_process.has_unfinished_requests():
        outputs = core_process.step()
    assert outputs[-1].outputs[0].finish_reason == "stop"
    core_process.add_request("again", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    got = None
    while core_process.has_unfinished_requests():
        for output in core_process.step():
            if output.finished:
                got = output
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids


EXITS_WITHOUT_SHUTDOWN = """
import sys
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine, ProfilerState
from jaxserve.sampling_params import SamplingParams

if __name__ == "__main__":
    config = EngineConfig.from_preset(None, model=sys.argv[1], dtype="float32", compilation_cache_dir=None,
                                      engine_process=True, token_buckets=[16], request_buckets=[2],
                                      max_num_batched_tokens=16, max_num_seqs=2, page_size=4, num_kv_pages=64,
                                      max_model_len=64)
    engine = LLMEngine(config, warmup=False)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    print("done")  # and exits with the core process still running: no shutdown()
"""


def test_a_script_that_never_shuts_the_engine_down_still_exits(llama_dir, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(EXITS_WITHOUT_SHUTDOWN)
    run = subprocess.run([sys.executable, str(script), str(llama_dir)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr[-3000:]


_FRONT_END = """
import sys
import jaxserve.api.server, jaxserve.cli, jaxserve.models.source
from tests.engine.helpers import make_engine
engine = make_engine(sys.argv[1], warmup=False, engine_process=True)
assert engine.core is None and engine.tokenizer is not None
print(sorted({"jax", "jaxlib", "flax", "torch"} & set(sys.modules)))
engine.shutdown()
"""


def test_the_front_end_of_a_core_process_imports_no_jax(llama_dir):
    """With the core in its own process, the front end (the server's process: its CLI, the app, the
    engine's client) holds requests, tokenizers and grammars, never arrays: it imports no jax or flax,
    whose imports would stand before the core's start on every start."""
    result = subprocess.run([sys.executable, "-c", _FRONT_END, str(llama_dir)], capture_output=True, text=True,
                            timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("where", ["in_process", "core_process"])
def test_a_profile_records_the_engine_s_steps_where_they_run(where, request, tmp_path):
    """start_profile / stop_profile trace the process that runs the steps (the core's, with engine_process),
    refusing a second start and a stop without one."""
    engine = request.getfixturevalue(where)
    log_dir = str(tmp_path / "trace")
    engine.start_profile(log_dir)
    with pytest.raises(ProfilerState, match=f"a profile is being recorded already, into {log_dir}"):
        engine.start_profile(str(tmp_path / "other"))
    run_short_requests(engine, 2)
    assert engine.stop_profile() == log_dir
    with pytest.raises(ProfilerState, match="no profile is being recorded"):
        engine.stop_profile()
    calls = traced_jit_calls(log_dir)
    assert calls["step"] >= 2, calls  # the prefill and the decode, at least
    assert not (tmp_path / "other").exists()


def test_a_profiler_command_the_core_refuses_fails_its_caller_and_the_core_serves_on(llama_dir, tmp_path):
    """The core's own refusal (jax runs one trace per process) reaches the frontend as the core raised it,
    with the steps sent before the answer kept; the core then serves and its trace stops."""
    engine = make_engine(llama_dir, engine_process=True)
    try:
        client = engine._core
        client.start_profile(str(tmp_path / "first"))
        engine.add_request("before", [5, 6, 7], greedy(3))
        with pytest.raises(RuntimeError, match=r"(?i)already"):  # past LLMEngine's own check, as a race would be
            client.start_profile(str(tmp_path / "second"))
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert len(finished["before"].outputs[0].token_ids) == 3
        client.stop_profile()
        with pytest.raises(RuntimeError):  # no trace runs now: the core says so
            client.stop_profile()
        assert traced_jit_calls(str(tmp_path / "first"))["step"] >= 1
    finally:
        engine.shutdown()


def test_a_dead_core_s_profile_does_not_stop_the_shutdown(llama_dir, tmp_path):
    engine = make_engine(llama_dir, engine_process=True)
    process = engine._core._process
    engine.start_profile(str(tmp_path / "trace"))
    os.kill(process.pid, signal.SIGKILL)
    process.join(30)
    engine.shutdown()  # the lost profile is logged; the shutdown goes on
    assert engine.profile_dir is None and not process.is_alive() and engine._core._conn.closed


def test_a_profile_still_recorded_at_shutdown_is_written(llama_dir, tmp_path):
    engine = make_engine(llama_dir, engine_process=True)
    engine.start_profile(str(tmp_path / "trace"))
    run_short_requests(engine, 1)
    engine.shutdown()
    assert traced_jit_calls(str(tmp_path / "trace"))["step"] >= 1
