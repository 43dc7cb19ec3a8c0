"""`jaxserve serve --data-parallel-size 2` end to end: two engine cores behind one server, driven by the openai
SDK. Not marked `gpu`: the prepared GPU check's machine has one GPU."""

import asyncio
import os
from pathlib import Path

import openai
import pytest

from tests.api.helpers import MODEL, metric, start_server, stop_server, wait_for
from tests.engine.helpers import require_ranks

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("server")]

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _core_processes(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task").iterdir()  # the model loads on a thread: its children
    children = [int(child) for task in tasks for child in (task / "children").read_text().split()]
    return [child for child in children if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def test_two_engine_cores_serve_one_api_then_drain(tmp_path, compile_cache):
    require_ranks(2)
    server = start_server(tmp_path, compile_cache, "--data-parallel-size", "2")
    try:
        cores = _core_processes(server.process.pid)
        assert len(cores) == 2, cores
        log = server.log()
        assert "[core 0]" in log and "[core 1]" in log and "data parallel: 2 engine cores" in log
        if len(os.sched_getaffinity(0)) >= 2 and "the ranks share them" not in log:  # pinned: disjoint CPUs
            assert not os.sched_getaffinity(cores[0]) & os.sched_getaffinity(cores[1])

        async def ask_all() -> list:
            client = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)
            asks = [client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=12)
                    for _ in range(12)]
            return await asyncio.gather(*asks)

        replies = asyncio.run(ask_all())
        texts = {reply.choices[0].message.content for reply in replies}
        assert len(texts) == 1 and "Paris" in texts.pop()  # greedy: the same answer from either rank
        prompt_tokens = sum(reply.usage.prompt_tokens for reply in replies)
        assert metric(server, "jaxserve:prompt_tokens_total") == prompt_tokens
        # Each rank is a series of its own, labelled `engine` as vLLM labels its engines: both ran steps, and
        # both hold no request and no page once the answers are in.
        assert all(metric(server, "jaxserve:iteration_tokens_total_count", engine=rank) > 0 for rank in "01")
        gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        wait_for(lambda: not any(metric(server, f"jaxserve:{gauge}", engine=rank) for gauge in gauges for rank in "01"))
    finally:
        stop_server(server)
    assert server.process.returncode == 0
    log = server.log()
    assert "Traceback" not in log and "engine core failed" not in log, log[-3000:]
    assert all(not Path(f"/proc/{pid}").exists() for pid in cores)
