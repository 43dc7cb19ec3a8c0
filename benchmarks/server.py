"""A `jaxserve serve` subprocess for the benchmark scripts: start it, wait for /health, stop it."""

import os
import re
import signal
import subprocess
import sys
import time

import httpx


def start_server(config: str | None, port: int, dtype: str | None = "auto", *extra: str) -> subprocess.Popen:
    """`extra`: more `jaxserve serve` flags; NAME=value words among them set its environment instead
    (e.g. JAXSERVE_ALLOCATOR=glibc). `config` or `dtype` None: not given (the server's defaults).

    Served with `--warmup full` (`extra` may say otherwise): /health answers 200 once every bucket is
    compiled, so no measurement shares the cores with a background warm-up's compiles."""
    settings = [word for word in extra if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word)]
    env = {**os.environ, **dict(word.split("=", 1) for word in settings)}
    extra = tuple(word for word in extra if word not in settings)
    chosen = [*(["--config", config] if config else []), *(["--dtype", dtype] if dtype else [])]
    command = [sys.executable, "-m", "jaxserve", "serve", *chosen, "--host", "127.0.0.1", "--port", str(port),
               "--disable-log-stats", "--log-level", "warning", "--warmup", "full", *extra]
    return wait_until_healthy(subprocess.Popen(command, env=env), port, timeout_s=900)


def wait_until_healthy(process: subprocess.Popen, port: int, timeout_s: float) -> subprocess.Popen:
    """Polls the server's /health until it answers 200; kills it if it does not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"the server exited (code {process.returncode})")
        time.sleep(0.2)
    process.kill()
    raise TimeoutError("the server did not become ready")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(120)
