"""Multi-host: two `jaxserve serve` processes on 127.0.0.1 (jax.distributed, CPU collectives over gloo) serve
one tiny Llama split over their two CPU devices; process 0 answers HTTP with the greedy tokens of a single
process, and the pair stops cleanly when either process stops."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.api.helpers import MODEL, SERVER_LADDER, Server, free_port, start_server, stop_server

pytestmark = [pytest.mark.slow,
              pytest.mark.cpu_only("two processes split a model over CPU devices with gloo collectives")]

PROMPTS = ["Hello there", "The weather today is"]


def _start_pair(model_dir: Path, tmp_path: Path, cache_dir: Path) -> tuple[Server, subprocess.Popen, Path]:
    coordinator = f"127.0.0.1:{free_port(count=2)}"
    hosts = ["--model", str(model_dir), "--num-kv-pages", "64", "--tensor-parallel-size", "2",
             "--num-processes", "2", "--coordinator-address", coordinator]
    follower_log = tmp_path / f"follower-{coordinator.rsplit(':', 1)[1]}.log"
    with follower_log.open("w") as log:
        follower = subprocess.Popen(
            # The leader's ladder (start_server's): both processes must trace the same steps.
            [sys.executable, "-m", "jaxserve", "serve", "--config", str(SERVER_LADDER), "--dtype", "float32",
             "--max-model-len", "2048", "--compilation-cache-dir", str(cache_dir), *hosts, "--process-id", "1"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        leader = start_server(tmp_path, cache_dir, *hosts, "--process-id", "0")
    except BaseException:
        follower.kill()
        raise
    return leader, follower, follower_log


def _greedy(base_url: str, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _wait_exit(process: subprocess.Popen, timeout: float) -> int:
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"process {process.pid} still running {timeout}s after its peer stopped") from None


def test_two_processes_serve_one_process_tokens_and_stop_together(tiny_model_dir, tmp_path, compile_cache):
    from jaxserve import LLM, SamplingParams

    model_dir = tiny_model_dir("llama")
    single = LLM(model=str(model_dir), dtype="float32", config=str(SERVER_LADDER), num_kv_pages=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [out.outputs[0].text for out in single.generate(PROMPTS, params, use_tqdm=False)]

    # The leader stops (SIGTERM): the follower stops too, cleanly.
    leader, follower, follower_log = _start_pair(model_dir, tmp_path, compile_cache)
    try:
        assert [_greedy(leader.base_url, p) for p in PROMPTS] == want
        assert "process 1: following the leader" in follower_log.read_text()
    finally:
        stop_server(leader)
    assert leader.process.returncode == 0, leader.log()[-3000:]
    assert _wait_exit(follower, 60) == 0, follower_log.read_text()[-3000:]
    assert "the leader stopped; this follower stops too" in follower_log.read_text()

    # A follower dies: the leader, whose next step could never complete, stops within seconds.
    leader, follower, follower_log = _start_pair(model_dir, tmp_path, compile_cache)
    try:
        assert _greedy(leader.base_url, PROMPTS[0]) == want[0]
        follower.send_signal(signal.SIGKILL)
        follower.wait(30)
        started = time.monotonic()
        code = _wait_exit(leader.process, 60)
    finally:
        stop_server(leader)
    assert code != 0 and time.monotonic() - started < 30
    assert "a follower process stopped; this server stops too" in leader.log()
