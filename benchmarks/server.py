"""A `jaxserve serve` subprocess for the benchmark scripts: start it, wait for /health, stop it."""

import signal
import subprocess
import sys
import time

import httpx


def start_server(config: str, port: int, dtype: str = "auto", *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "jaxserve", "serve", "--config", config, "--dtype", dtype,
               "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats", "--log-level", "warning", *extra]
    process = subprocess.Popen(command)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise RuntimeError("the server exited")
        time.sleep(1)
    process.kill()
    raise TimeoutError("the server did not become ready")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(120)
