"""A real `jaxserve serve` in a subprocess (Hypercorn, the bundled SmolLM2), on a free port; waits on it."""

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import TEST_GPU_MEMORY_UTILIZATION

API_KEY = "test-key"
MODEL = "smol"
STARTUP_TIMEOUT_S = 600


# Below Linux's ephemeral range (32768-60999): a port the OS hands out for a client's outgoing
# connection (httpx polling /health, gloo) could otherwise take a server's port before it binds.
_SERVER_PORTS = range(20000, 32000)


SERVER_LADDER = Path(__file__).with_name("server_ladder.yaml")  # the cpu preset at 16 sequences


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive free ports outside the ephemeral range (a multi-host
    coordinator on PORT needs PORT + 1 for its work channel)."""
    for _ in range(200):
        first = random.choice(_SERVER_PORTS)
        sockets = [socket.socket() for _ in range(count)]
        try:
            for offset, sock in enumerate(sockets):
                sock.bind(("127.0.0.1", first + offset))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports in {_SERVER_PORTS}")


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log_path: Path
    saw_loading: bool = False  # /health answered 503 before 200

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(tmp_dir: Path, cache_dir: Path, *extra: str, launcher: tuple[str, ...] = ("-m", "jaxserve"),
                 new_session: bool = False) -> Server:
    """`launcher` is what follows the interpreter: the package, or a script that patches it first.
    `new_session`: the server leads its own process group (a test may signal the whole group)."""
    port = free_port()
    log_path = tmp_dir / f"server-{port}.log"
    command = [
        sys.executable, *launcher, "serve", "--host", "127.0.0.1", "--port", str(port),
        "--config", str(SERVER_LADDER), "--dtype", "float32", "--max-model-len", "2048",
        "--served-model-name", MODEL, "--compilation-cache-dir", str(cache_dir),
        "--gpu-memory-utilization", str(TEST_GPU_MEMORY_UTILIZATION),  # on a GPU, which test processes share
        # Dequantized, as before serve kept a GGUF file's blocks by default: these tests compare texts and
        # logprobs across requests, batch shapes and prefix-cache hits, which 8-bit activations do not keep
        # bit-stable (a flipped rounding moves a logprob by up to tenths). `--quantization auto` in `extra`
        # serves the default (test_server.py has one).
        "--quantization", "none",
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the backend tests/conftest.py chose
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=new_session)
    server = Server(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    saw_loading = False
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            status = httpx.get(f"{server.base_url}/health", timeout=2).status_code
        except httpx.TransportError:
            status = None
        if status == 200:
            server.saw_loading = saw_loading
            return server
        saw_loading |= status == 503
        time.sleep(0.5)
    stop_server(server)
    raise TimeoutError(f"server not ready after {STARTUP_TIMEOUT_S}s:\n{server.log()}")


def metric(server: Server, name: str, **labels: str) -> float:
    """The value of one sample on /metrics (by full sample name and a subset of its labels)."""
    for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    raise AssertionError(f"{name} {labels} not in /metrics")


def wait_idle(server: Server, timeout: float = 30.0) -> None:
    """Waits until the engine has nothing running or waiting and holds no KV pages."""
    deadline = time.monotonic() + timeout
    names = ("jaxserve:num_requests_running", "jaxserve:num_requests_waiting", "jaxserve:kv_cache_usage_perc")
    while any(metric(server, name) for name in names):
        assert time.monotonic() < deadline, {name: metric(server, name) for name in names}
        time.sleep(0.1)


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(60)
        except subprocess.TimeoutExpired:
            server.process.kill()


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def check_speculative_serving(server: Server) -> float:
    """What a server with drafts (--speculative-config) must answer as one without: a greedy chat answer naming
    Paris, its stream the same text, a seeded sample repeated; once idle, /metrics' accepted drafts within the
    drafted ones. Returns the draft tokens /metrics counted."""
    import openai

    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    france = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=MODEL, messages=france, temperature=0, max_tokens=40)
    text = reply.choices[0].message.content
    assert "Paris" in text and reply.usage.completion_tokens > 5
    stream = client.chat.completions.create(model=MODEL, messages=france, temperature=0, max_tokens=40, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text
    seeded = [client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0.8, seed=4,
                                        max_tokens=30).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    wait_idle(server)
    drafted = metric(server, "jaxserve:spec_decode_num_draft_tokens_total")
    assert 0 <= metric(server, "jaxserve:spec_decode_num_accepted_tokens_total") <= drafted
    return drafted
