"""The server's sockets and TLS files, taken before the model is looked for: a start that cannot serve
ends at once, in one line; one that can serves plain HTTP or HTTPS on the sockets it bound."""

import asyncio
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypercorn.asyncio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from jaxserve.api.server import bind
from jaxserve.config import ServerConfig
from tests.api.helpers import free_port


def _hello_app() -> Starlette:
    async def hello(request):
        return PlainTextResponse(f"hello over {request.url.scheme}")

    return Starlette(routes=[Route("/", hello)])


def _get_while_serving(config: ServerConfig, scheme: str) -> httpx.Response:
    """Serves the hello app on `bind(config)`'s sockets and GETs its root from a thread."""
    hypercorn, port = bind(config)
    assert port == config.port or (config.port == 0 and port > 0)
    url = f"{scheme}://127.0.0.1:{port}/"

    async def main() -> httpx.Response:
        stop = asyncio.Event()
        server = asyncio.create_task(hypercorn_serve(_hello_app(), hypercorn, shutdown_trigger=stop.wait))
        try:
            for _ in range(100):
                try:
                    return await asyncio.to_thread(httpx.get, url, verify=False, timeout=5)
                except httpx.ConnectError:
                    await asyncio.sleep(0.05)
            raise TimeoutError(url)
        finally:
            stop.set()
            await server

    return asyncio.run(main())


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command, which makes this test's certificate, is not on this machine")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


@pytest.mark.parametrize("port", [free_port(), 0], ids=["given", "the-system-s-choice"])
def test_plain_http_is_served_on_the_bound_socket(port):
    response = _get_while_serving(ServerConfig(host="127.0.0.1", port=port), "http")
    assert response.status_code == 200 and response.text == "hello over http"


def test_https_is_served_with_the_certificate_read_at_bind(tmp_path):
    cert, key = _self_signed(tmp_path)
    port = free_port()
    config = ServerConfig(host="127.0.0.1", port=port, ssl_certfile=str(cert), ssl_keyfile=str(key))
    response = _get_while_serving(config, "https")
    assert response.status_code == 200 and response.text == "hello over https"


def test_a_port_in_use_fails_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"^cannot listen on 127\.0\.0\.1:{port}: it is in use"):
            bind(ServerConfig(host="127.0.0.1", port=port))


@pytest.mark.parametrize("which", ["cert", "key"])
def test_unreadable_tls_files_fail_in_one_line(tmp_path, which):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    for path in (cert, key):
        path.write_text("not a PEM file")
    (cert if which == "cert" else key).unlink()
    config = ServerConfig(host="127.0.0.1", port=0, ssl_certfile=str(cert), ssl_keyfile=str(key))
    with pytest.raises(FileNotFoundError, match=f"^--ssl-{which}file '.*' is not a file$"):
        bind(config)


def test_a_bad_certificate_fails_in_one_line(tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a PEM file")
    config = ServerConfig(host="127.0.0.1", port=0, ssl_certfile=str(junk), ssl_keyfile=str(junk))
    with pytest.raises(ValueError, match=r"^--ssl-certfile/--ssl-keyfile cannot be used: "):
        bind(config)


def test_serve_on_a_busy_port_ends_before_looking_for_the_model():
    """The model named does not exist: the port's error, not the model's, says the port came first."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "jaxserve", "serve", "no-such-org/no-such-model", "--host", "127.0.0.1",
             "--port", str(port)], capture_output=True, text=True, timeout=120,
            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"jaxserve: error: cannot listen on 127.0.0.1:{port}: it is in use (another server?)")
