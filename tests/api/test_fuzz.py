"""A bounded fuzz run against a real `jaxserve serve`, driven by its OpenAPI document.

Two sources of requests, both generated deterministically (fixed seeds) and bounded in examples and in
wall time (on a slow machine the tail of a phase is skipped, so fewer cases are sent, never others):
- schemathesis over every documented operation: its coverage (boundary values, wrong types, missing
  fields, unexpected methods) and fuzzing phases, positive and negative data;
- hostile raw JSON that schemathesis does not produce (it emits valid UTF-8 JSON from the schemas): NaN
  and Infinity tokens, 1e999, integers past 2**63, lone surrogates, 1,000-deep nesting, template bombs,
  put in every field, and whole bodies that are not JSON (invalid UTF-8, truncated, 17 MiB).

Properties: no 5xx (nor a 5xx error event inside a 200 event stream), every answer within 30 s, no
traceback in the server log, and afterwards a normal request still answers and nothing is left running.

Findings are collected, not raised: an exception inside a hypothesis run would stop that operation at its
first failure and spend the budget shrinking it, while a list of every failing request, each with its
status and the server's log lines, is what a fix needs. `test_the_fuzz_run_found_no_failures` fails with it.

Cost: with no limit a positive example such as `n: 100, max_tokens: 200` is minutes of decoding on two
CPU cores, so generation requests are capped (max_tokens, n; an unset max_tokens is set) when their values
are ones the server must accept; values it must refuse (too large, negative, not a number) are sent as
generated. Each (operation, phase) also has a wall-time budget; the cases past it are counted, not sent.

Safety: one bad request can make the server allocate without bound (`"n": 2**31` took 24 GB and the OOM
killer before n was bounded), so a guard thread kills the server past MEMORY_LIMIT_GIB of resident memory
and records the request in flight; once the server is gone, the remaining cases are counted, not sent.
"""

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.core import NotSet

from jaxserve.api.openapi import openapi_document
from jaxserve.config import ServerConfig
from tests.api.helpers import Server, start_server, stop_server

pytestmark = pytest.mark.slow

SEED = 20240917
MAX_MODEL_LEN = 256
SLOW_S = 30.0  # the property: every answer within this
TRANSPORT_TIMEOUT_S = SLOW_S + 5  # then give up on the request and record it
# Wall time per (operation, phase), from its first case; later cases are skipped. Generation is the cost.
PHASE_BUDGET_S = {("POST /v1/completions", "coverage"): 30.0, ("POST /v1/completions", "fuzzing"): 20.0,
                  ("POST /v1/chat/completions", "coverage"): 30.0, ("POST /v1/chat/completions", "fuzzing"): 20.0}
DEFAULT_PHASE_BUDGET_S = 10.0
HOSTILE_BUDGET_S = 60.0
MAX_EXAMPLES = 20  # per operation, fuzzing phase
CAP_MAX_TOKENS = 4  # accepted max_tokens are lowered to this
CAP_N = 2  # and accepted n (1..128, OpenAI's range) to this
MEMORY_LIMIT_GIB = 8.0  # the server needs about 3 GiB (weights, 1 GiB of KV cache, XLA)

CONFIG = schemathesis.Config.from_dict({
    "seed": SEED,
    "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "database": "none"},
    "phases": {"stateful": {"enabled": False}},
})


@dataclass
class Findings:
    """What the run found, kept across the tests of this module (they run in file order)."""

    failures: list[str] = field(default_factory=list)
    sent: dict[str, int] = field(default_factory=dict)
    skipped: int = 0
    slowest: tuple[float, str] = (0.0, "")
    in_flight: str = ""  # the request being answered, for the memory guard's report
    server_gone: bool = False

    def send(self, server: Server, what: str, repro: str, call: Callable[[], tuple[int, str]]) -> None:
        """Makes one request with `call` (which returns the status and any event-stream text) and records it."""
        if self.server_gone:
            self.skipped += 1
            return
        log_start = len(server.log())
        self.in_flight = repro
        start = time.monotonic()
        try:
            status, text = call()
        except (httpx.HTTPError, requests.RequestException) as e:
            status, text = f"no answer: {type(e).__name__}", ""
        self.record(server, log_start, what, status, time.monotonic() - start, repro, text)
        if isinstance(status, str) and server.process.poll() is not None:
            self.server_gone = True
            self.failures.append(f"the server exited with {server.process.returncode} during the request above")

    def record(self, server: Server, log_start: int, what: str, status: int | str, elapsed: float,
               repro: str, stream_text: str = "") -> None:
        """Keeps the request if it broke a property, with the server's log lines it caused."""
        self.sent[what] = self.sent.get(what, 0) + 1
        if elapsed > self.slowest[0]:
            self.slowest = (elapsed, f"{what}: {repro[:300]}")
        problems = []
        if isinstance(status, str):
            problems.append(status)
        elif status >= 500:
            problems.append(f"HTTP {status}")
        if elapsed > SLOW_S:
            problems.append(f"answered after {elapsed:.1f} s")
        if stream_errors := _server_error_events(stream_text):
            problems.append(f"5xx error event in the stream: {stream_errors[0][:300]}")
        if problems:
            log = server.log()[log_start:]
            tail = log[log.find("Traceback"):][:4000] if "Traceback" in log else log[-1500:]
            self.failures.append(f"[{what}] {'; '.join(problems)}\n  request: {repro[:2000]}\n  server log:\n{tail}")


def guard_memory(server: Server, stop: threading.Event) -> None:
    """Kills the server once its resident memory passes MEMORY_LIMIT_GIB (before the OOM killer picks a
    process, maybe not this one), and records the request that was in flight."""
    status_path = f"/proc/{server.process.pid}/status"
    while not stop.wait(0.1) and server.process.poll() is None:
        try:
            with open(status_path) as f:
                rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError):
            return
        if rss_kib > MEMORY_LIMIT_GIB * 2**20:
            os.kill(server.process.pid, signal.SIGKILL)
            FINDINGS.failures.append(f"the server's memory passed {MEMORY_LIMIT_GIB} GiB; killed it during: "
                                     f"{FINDINGS.in_flight[:2000]}")
            return


def _server_error_events(text: str) -> list[str]:
    """Error events with a 5xx code in a text/event-stream body (a stream's status is already 200)."""
    found = []
    for line in text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            try:
                code = json.loads(line[6:])["error"].get("code")
            except (ValueError, AttributeError, KeyError):
                continue
            if isinstance(code, int) and code >= 500:
                found.append(line)
    return found


FINDINGS = Findings()


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, compile_cache) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("fuzz"), compile_cache, "--max-model-len", str(MAX_MODEL_LEN))
    stop = threading.Event()
    guard = threading.Thread(target=guard_memory, args=(server, stop), daemon=True)
    guard.start()
    yield server
    stop.set()
    guard.join()
    stop_server(server)


def cap_cost(path: str, body: Any) -> Any:
    """The body with accepted-but-expensive generation values lowered (see the module docstring)."""
    if not isinstance(body, dict) or not path.startswith("/v1/"):
        return body
    capped = dict(body)
    if capped.get("max_tokens") is None and capped.get("max_completion_tokens") is None:
        capped["max_tokens"] = CAP_MAX_TOKENS  # unset: up to the context
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = capped.get(name)
        if type(value) is int and CAP_MAX_TOKENS < value <= MAX_MODEL_LEN:
            capped[name] = CAP_MAX_TOKENS
    for name in ("n", "best_of"):
        value = capped.get(name)
        if type(value) is int and CAP_N < value <= 128:
            capped[name] = CAP_N
    return capped


def fill_empty_prompt(path: str, body: Any) -> Any:
    """A valid body whose prompt or messages are empty gets a short one: the schemas allow empty ones, so
    schemathesis' positive coverage cases vary one field over an empty prompt, which the server refuses
    before the engine sees the field. This way those cases reach sampling."""
    if not isinstance(body, dict):
        return body
    if body.get("messages") == []:
        return {**body, "messages": [{"role": "user", "content": "Hi"}]}
    if body.get("prompt") in ("", []) and path != "/detokenize":
        return {**body, "prompt": "Hi"}
    return body


def budget_left(key: str, seconds: float) -> bool:
    """False once `key` (an operation and a phase) has had `seconds` of wall time since its first case."""
    ends = BUDGET_ENDS.setdefault(key, time.monotonic() + seconds)
    if time.monotonic() < ends:
        return True
    FINDINGS.skipped += 1
    return False


BUDGET_ENDS: dict[str, float] = {}

# The document is built in process, not fetched: schemathesis' fixture-based loader does not run on
# pytest 9.2 (it sets the private `Function._nodeid`), and a module-level schema must exist at collection,
# before the server does. test_the_server_serves_the_fuzzed_document checks that the two are the same.
DOCUMENT = {**openapi_document(ServerConfig()), "servers": [{"url": "/"}]}
schema = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)


def test_the_server_serves_the_fuzzed_document(fuzz_server):
    assert httpx.get(f"{fuzz_server.base_url}/openapi.json", timeout=10).json() == DOCUMENT


@schema.parametrize()
@settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=False)
def test_schemathesis_fuzz(case, fuzz_server):
    what = f"{case.operation.method.upper()} {case.operation.path}"
    phase = str(case.meta.phase.name) if case.meta is not None else "other"
    if not budget_left(f"{what} {phase}", PHASE_BUDGET_S.get((what, phase), DEFAULT_PHASE_BUDGET_S)):
        return
    if not isinstance(case.body, NotSet):
        if case.meta is not None and case.meta.generation.mode == GenerationMode.POSITIVE:
            case.body = fill_empty_prompt(case.path, case.body)
        case.body = cap_cost(case.path, case.body)

    def call() -> tuple[int, str]:
        response = case.call(base_url=fuzz_server.base_url, timeout=TRANSPORT_TIMEOUT_S)
        content_type = next((v[0] for k, v in response.headers.items() if k.lower() == "content-type" and v), "")
        return response.status_code, response.text_lossy() if content_type.startswith("text/event-stream") else ""

    FINDINGS.send(fuzz_server, f"{case.method} {case.path}", case.as_curl_command(base_url=fuzz_server.base_url),
                  call)


# Raw JSON tokens, spliced in where a value goes; json.dumps cannot write most of them. Numbers go into
# every numeric field, strings into every string field, and the structural ones in turn into every field.
DEPTH = 1000
HOSTILE_NUMBERS = {
    "NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity", "1e999": "1e999", "-1e999": "-1e999",
    "1e308": "1e308", "denormal": "4.9e-324", "-0.0": "-0.0", "1.5": "1.5", "-1": "-1", "2**31": str(2**31),
    "2**63": str(2**63), "2**64": str(2**64), "-2**63-1": str(-(2**63) - 1), "10**400": "1" + "0" * 400,
}
HOSTILE_STRINGS = {
    "lone high surrogate": r'"\ud800"', "lone low surrogate": r'"a\udfffb"', "NUL": r'"\u0000"',
    "40 KB string": json.dumps("word " * 8000),
    # harmless as a prompt; as a request chat_template, hours of rendering or a 2 MB prompt from 80 bytes
    "template loops": json.dumps("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"),
    "template blow-up": json.dumps("{{ 'a ' * 2000000 }}"),
}
HOSTILE_SHAPES = {
    "deep list": "[" * DEPTH + "]" * DEPTH,
    "deep object": '{"a":' * DEPTH + "1" + "}" * DEPTH,
    "deep list of strings": "[" * DEPTH + '"a"' + "]" * DEPTH,
    "list of surrogates": r'["\ud800", "\udc00"]',
    "list of huge ints": f"[{2**64}, {-(2**63) - 1}]",
    "object of surrogates": r'{"\ud800": "\udfff"}',
    "null": "null",
    "true": "true",
    "empty object": "{}",
    "empty list": "[]",
}
SHAPES_PER_FIELD = 3
RAW_BODIES = {  # whole bodies that are not (UTF-8) JSON at all, or barely
    "empty": b"",
    "invalid UTF-8": b'{"prompt": "\xff\xfe"}',
    "UTF-8 BOM": b'\xef\xbb\xbf{"prompt": "Hi", "max_tokens": 2}',
    "UTF-16": '{"prompt": "Hi", "max_tokens": 2}'.encode("utf-16"),
    "unterminated": b'{"prompt": "Hi", "max_tokens": 2',
    "two documents": b'{"prompt": "Hi"} {"prompt": "Hi"}',
    "duplicate keys": b'{"prompt": "Hi", "max_tokens": 2, "max_tokens": -1}',
    "17 MiB": b'{"prompt": "' + b"a" * (17 * 2**20) + b'"}',
}

BASE_BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [5, 6]},
}
CHAT_TOKENIZE_BODY = {"messages": [{"role": "user", "content": "Hi"}]}  # /tokenize's other shape
# Fields below the top level, with the JSON types they hold.
NESTED_FIELDS: dict[str, dict[tuple[str | int, ...], set[str]]] = {
    "/v1/completions": {("prompt", 0): {"string", "integer"}, ("prompt", 0, 0): {"integer"},
                        ("stream_options", "include_usage"): {"boolean"}, ("logit_bias", "5"): {"number"},
                        ("stop", 0): {"string"}, ("stop_token_ids", 0): {"integer"}},
    "/v1/chat/completions": {("messages", 0, "content"): {"string"}, ("messages", 0, "role"): {"string"},
                             ("messages", 0): {"object"}, ("messages", 0, "name"): {"string"},
                             ("messages", 0, "content", 0, "text"): {"string"},
                             ("chat_template_kwargs", "x"): {"string"}, ("logit_bias", "5"): {"number"}},
    "/tokenize": {("messages", 0, "content"): {"string"}},
    "/detokenize": {("tokens", 0): {"integer"}},
}
# null there means "up to the context": a legitimate request that decodes for minutes on two cores.
COSTLY = {("max_tokens", "null"), ("max_completion_tokens", "null")}
MARK = "__hostile_value__"


def hostile_body(path: str, field_path: tuple[str | int, ...], token: str, stream: bool) -> bytes:
    """The base body of `path` with the value at `field_path` replaced by the raw JSON `token`."""
    if not field_path:
        return token.encode()
    chat_tokenize = path == "/tokenize" and field_path[0] in ("messages", "add_generation_prompt")
    body: Any = json.loads(json.dumps(CHAT_TOKENIZE_BODY if chat_tokenize else BASE_BODIES[path]))
    if stream and path.startswith("/v1/"):
        body["stream"] = True
    node = body
    for key, next_key in zip(field_path, [*field_path[1:], None], strict=True):
        if isinstance(key, int):  # an index: pad the list
            node.extend(None for _ in range(key + 1 - len(node)))
        if next_key is None:
            node[key] = MARK
            break
        container = list if isinstance(next_key, int) else dict
        current = node[key] if isinstance(key, int) else node.get(key)
        if not isinstance(current, container):  # keep what the base body has there when it fits
            node[key] = container()
        node = node[key]
    return json.dumps(body).replace(json.dumps(MARK), token, 1).encode()


def _json_types(schema: dict[str, Any]) -> set[str]:
    """The JSON types a property schema admits (through anyOf; a $ref is an object)."""
    if "$ref" in schema:
        return {"object"}
    types = {schema["type"]} if isinstance(schema.get("type"), str) else set(schema.get("type", []))
    for option in schema.get("anyOf", []):
        types |= _json_types(option)
    return types or {"any"}


def request_fields(path: str) -> dict[tuple[str | int, ...], set[str]]:
    """Every field of the body of `path` (the document's properties, then NESTED_FIELDS) -> its types; the
    empty path is the whole body."""
    schemas = DOCUMENT["components"]["schemas"]
    body_schema = DOCUMENT["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    fields: dict[tuple[str | int, ...], set[str]] = {(): {"object"}}
    for ref in (s["$ref"] for s in body_schema.get("anyOf", [body_schema])):
        for name, prop in schemas[ref.rsplit("/", 1)[1]]["properties"].items():
            fields.setdefault((name,), set()).update(_json_types(prop))
    return {**fields, **NESTED_FIELDS[path]}


def hostile_cases() -> Iterator[tuple[str, tuple[str | int, ...], str]]:
    """(path, field, hostile value name): every number into every numeric field, every string into every
    string field, and SHAPES_PER_FIELD structural values per field in turn."""
    shapes = sorted(HOSTILE_SHAPES)
    turn = 0
    for path in BASE_BODIES:
        for field_path, types in request_fields(path).items():
            names = []
            if types & {"number", "integer", "any"}:
                names += list(HOSTILE_NUMBERS)
            if types & {"string", "any"}:
                names += list(HOSTILE_STRINGS)
            for _ in range(SHAPES_PER_FIELD):
                names.append(shapes[turn % len(shapes)])
                turn += 1
            for name in names:
                if (".".join(map(str, field_path)), name) not in COSTLY:
                    yield path, field_path, name


HOSTILE = {**HOSTILE_NUMBERS, **HOSTILE_STRINGS, **HOSTILE_SHAPES}


def all_hostile_bodies() -> Iterator[tuple[str, str, bytes]]:
    """(path, description, body) of every hostile request: the raw bodies, then the spliced values."""
    for path in BASE_BODIES:
        for name, body in RAW_BODIES.items():
            yield path, f"body = {name}", body
    for i, (path, field_path, name) in enumerate(hostile_cases()):
        body = hostile_body(path, field_path, HOSTILE[name], stream=i % 2 == 0)
        yield path, f"{'.'.join(map(str, field_path)) or 'body'} = {name}", body


def test_hostile_json_values(fuzz_server):
    ends = time.monotonic() + HOSTILE_BUDGET_S
    for path, description, body in all_hostile_bodies():
        if time.monotonic() > ends:
            FINDINGS.skipped += 1
            continue
        shown = body[:400].decode(errors="backslashreplace")
        repro = f"POST {path} [{description}] -d '{shown}'" + (f" ({len(body)} bytes)" if len(body) > 400 else "")

        def call(path: str = path, body: bytes = body) -> tuple[int, str]:
            response = httpx.post(f"{fuzz_server.base_url}{path}", content=body, timeout=TRANSPORT_TIMEOUT_S,
                                  headers={"Content-Type": "application/json"})
            stream = "event-stream" in response.headers.get("content-type", "")
            return response.status_code, response.text if stream else ""

        FINDINGS.send(fuzz_server, f"hostile POST {path}", repro, call)


def test_the_fuzz_run_found_no_failures():
    summary = (f"sent {sum(FINDINGS.sent.values())} requests {FINDINGS.sent}, skipped {FINDINGS.skipped} over "
               f"budget; slowest {FINDINGS.slowest[0]:.1f} s ({FINDINGS.slowest[1]})")
    print(summary)
    assert FINDINGS.sent, "the fuzz run sent nothing"
    assert not FINDINGS.failures, f"{len(FINDINGS.failures)} failing requests ({summary}):\n\n" + "\n\n".join(
        FINDINGS.failures)


def test_the_server_is_unhurt_after_the_fuzz_run(fuzz_server):
    log = fuzz_server.log()
    tracebacks = [m.start() for m in re.finditer("Traceback", log)]
    assert not tracebacks, f"{len(tracebacks)} tracebacks in the server log; the first:\n" + log[
        tracebacks[0]:tracebacks[0] + 3000]
    assert httpx.get(f"{fuzz_server.base_url}/health", timeout=10).status_code == 200
    reply = httpx.post(f"{fuzz_server.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
        "max_tokens": 8})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]

    def gauges() -> list[float]:
        metrics = httpx.get(f"{fuzz_server.base_url}/metrics", timeout=10).text
        return [float(v) for gauge in ("jaxserve:num_requests_running", "jaxserve:num_requests_waiting")
                for v in re.findall(rf"^{gauge}\{{[^}}]*\}} (\S+)$", metrics, re.MULTILINE)]

    deadline = time.monotonic() + 10  # the engine thread updates the gauges after its step
    while any(gauges()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(gauges()) == 2 and not any(gauges()), gauges()
