"""`jaxserve chat` and `jaxserve complete`: a running server's terminal clients, as `vllm chat` and
`vllm complete` are vLLM's. Each reads a line ("> "), streams the model's answer to the terminal as it
comes, and goes on until end of input; `--quick` sends one message and exits. The chat keeps the
conversation (and --system-prompt) across turns. Any OpenAI-compatible server will do.
"""

import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import httpx

from jaxserve.config import ClientConfig

_TIMEOUT = httpx.Timeout(30.0, read=None)  # an answer may take long to start; connecting may not


class ServerError(RuntimeError):
    """The server refused a request, or could not be reached: the reason, in one line."""


def _headers(config: ClientConfig) -> dict[str, str]:
    key = config.api_key or os.environ.get("OPENAI_API_KEY")  # the openai SDK's variable, as vLLM's client reads
    return {"Authorization": f"Bearer {key}"} if key else {}


def served_model(http: httpx.Client, config: ClientConfig) -> str:
    """--model-name, else the first model /v1/models lists (vLLM's choice)."""
    if config.model_name:
        return config.model_name
    body = _get_json(http, f"{config.url}/models", config)
    try:
        return body["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise ServerError(f"{config.url}/models lists no model") from None


def _get_json(http: httpx.Client, url: str, config: ClientConfig) -> Any:
    try:
        response = http.get(url, headers=_headers(config))
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach {url}: {e}") from None
    if response.status_code != 200:
        raise ServerError(f"{url}: HTTP {response.status_code}: {_error_message(response.text)}")
    return response.json()


def _error_message(text: str) -> str:
    """An OpenAI error body's message, else the body's start."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:300]


def stream_text(http: httpx.Client, url: str, body: dict[str, Any], config: ClientConfig,
                text_of: Callable[[dict], str]) -> Iterator[str]:
    """The text of each event a streamed request sends (`text_of` reads it from a chunk's first choice)."""
    try:
        with http.stream("POST", url, json={**body, "stream": True}, headers=_headers(config)) as response:
            if response.status_code != 200:
                body_text = response.read().decode(errors="replace")
                raise ServerError(f"HTTP {response.status_code}: {_error_message(body_text)}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    raise ServerError(f"the server ended the answer: {_error_message(json.dumps(chunk))}")
                if chunk.get("choices"):
                    yield text_of(chunk["choices"][0]) or ""
    except httpx.HTTPError as e:
        raise ServerError(f"the request to {url} failed: {e}") from None


def _chat_text(choice: dict) -> str:
    delta = choice.get("delta") or {}
    return delta.get("content") or ""


def _completion_text(choice: dict) -> str:
    return choice.get("text") or ""


def _answer(parts: Iterator[str], out: TextIO) -> str:
    """Prints the parts as they come and returns them joined."""
    text = []
    for part in parts:
        out.write(part)
        out.flush()
        text.append(part)
    out.write("\n")
    return "".join(text)


def chat(config: ClientConfig, read: Callable[[str], str] = input, out: TextIO | None = None) -> list[dict[str, str]]:
    """The chat loop (printing to `out`, else stdout); returns the conversation (the system prompt, then each
    user and assistant turn)."""
    out = out or sys.stdout
    conversation = [{"role": "system", "content": config.system_prompt}] if config.system_prompt is not None else []
    with httpx.Client(timeout=_TIMEOUT) as http:
        model = served_model(http, config)
        if config.quick is None:
            print(f"Using model: {model}\nPlease enter a message for the chat model:", file=out)
        for message in _messages(config, read):
            conversation.append({"role": "user", "content": message})
            body = {"model": model, "messages": conversation,
                    **({"max_completion_tokens": config.max_tokens} if config.max_tokens else {})}
            reply = _answer(stream_text(http, f"{config.url}/chat/completions", body, config, _chat_text), out)
            conversation.append({"role": "assistant", "content": reply})
    return conversation


def complete(config: ClientConfig, read: Callable[[str], str] = input, out: TextIO | None = None) -> list[str]:
    """The completion loop (printing to `out`, else stdout); returns the completions printed."""
    out = out or sys.stdout
    completions = []
    with httpx.Client(timeout=_TIMEOUT) as http:
        model = served_model(http, config)
        if config.quick is None:
            print(f"Using model: {model}\nPlease enter prompt to complete:", file=out)
        for prompt in _messages(config, read):
            body = {"model": model, "prompt": prompt,
                    **({"max_tokens": config.max_tokens} if config.max_tokens else {})}
            parts = stream_text(http, f"{config.url}/completions", body, config, _completion_text)
            completions.append(_answer(parts, out))
    return completions


def _messages(config: ClientConfig, read: Callable[[str], str]) -> Iterator[str]:
    """--quick's one message, else each line read until end of input (Ctrl-D) or Ctrl-C."""
    if config.quick is not None:
        yield config.quick
        return
    while True:
        try:
            yield read("> ")
        except (EOFError, KeyboardInterrupt):
            return
