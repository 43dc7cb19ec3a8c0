"""GPT-OSS's tool calls through the chat endpoint, served as vLLM serves GPT-OSS (`--reasoning-parser
openai_gptoss --tool-call-parser openai`), on a tiny random Llama whose tokenizer has harmony's markers:
a Lark grammar forces harmony text (an analysis, then a call as GPT-OSS writes one), and the answer must
carry the call, its reasoning apart, streamed and not."""

import json

import pytest
from starlette.testclient import TestClient

from jaxserve.api.app import create_app
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.models.loader import _eos_token_ids
from jaxserve.models.source import ModelSource
from tests.engine.helpers import make_engine

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}}]
ARGUMENTS = '{"city": "Paris"}'
# Harmony's markers are special tokens: the grammar names them as tokens, its strings are text.
GRAMMAR = ('start: <|channel|> "analysis" <|message|> "Weather, so call." <|end|> <|start|> "assistant" <|channel|> '
           '"commentary to=functions.get_weather " <|constrain|> "json" <|message|> ' + json.dumps(ARGUMENTS)
           + " <|call|>")


@pytest.fixture(scope="module")
def engine(harmony_model_dir):
    return AsyncEngine(make_engine(harmony_model_dir, warmup=False, max_model_len=512, num_kv_pages=512))


@pytest.fixture(scope="module")
def client(engine):
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="openai", reasoning_parser="openai_gptoss")
    with TestClient(create_app(config, engine)) as client:
        yield client


def _body(**fields) -> dict:
    # Without the reasoning (include_reasoning false) the grammar applies from the first token, so it can
    # force the analysis too.
    return {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "max_tokens": 100,
            "temperature": 0, "structured_outputs": {"grammar": GRAMMAR}, "include_reasoning": False, **fields}


def test_a_harmony_call_comes_back_as_a_tool_call(client):
    response = client.post("/v1/chat/completions", json=_body())
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["reasoning_content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS}


def test_a_streamed_harmony_call_sends_no_markup(client):
    response = client.post("/v1/chat/completions", json=_body(stream=True))
    chunks = [json.loads(line.removeprefix("data: ")) for line in response.text.split("\n\n")
              if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any(d.get("content") or d.get("reasoning_content") for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"].get("arguments") or "" for c in calls) == ARGUMENTS
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_tool_parser_alone_reads_the_raw_harmony_text(engine):
    """Without the reasoning parser the call is read from the raw text, and the analysis is no content."""
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="openai")
    with TestClient(create_app(config, engine)) as client:
        message = client.post("/v1/chat/completions", json=_body()).json()["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == ARGUMENTS


def test_gpt_oss_stops_at_a_call_and_at_its_answer_s_end(harmony_model_dir, engine):
    """A GPT-OSS GGUF file names one end token; harmony's turn ends at `<|return|>` and at `<|call|>` both."""
    class Config:
        model_type, eos_token_id = "gpt_oss", 2

    tokenizer = engine.tokenizer
    eos = _eos_token_ids(ModelSource(harmony_model_dir, "model.gguf", "m"), Config(), tokenizer)
    assert eos == (2, *tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"]))
    Config.model_type = "llama"
    assert _eos_token_ids(ModelSource(harmony_model_dir, "model.gguf", "m"), Config(), tokenizer) == (2,)


def test_an_earlier_turn_s_reasoning_reaches_the_template_as_gpt_oss_reads_it():
    """GPT-OSS's template renders an earlier call's analysis from `thinking`; clients send back the
    reasoning_content (or reasoning) they were given. A call with content too keeps only the content, which
    that template requires."""
    from jaxserve.api.chat import _message_dicts
    from jaxserve.api.protocol import ChatMessage

    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
    messages = [ChatMessage(role="user", content="Weather in Paris?", reasoning="not an assistant's"),
                ChatMessage(role="assistant", content=None, reasoning_content="Weather, so call.", tool_calls=[call]),
                ChatMessage(role="assistant", content="Checking.", reasoning="Hm.", tool_calls=[call]),
                ChatMessage(role="assistant", content="Sunny.", reasoning="Done.", thinking="Own."),
                ChatMessage(role="assistant", content="Hi.", reasoning_content={"not": "text"})]
    user, only_call, with_content, own, not_text = _message_dicts(messages, "string")
    assert "thinking" not in user and "thinking" not in with_content and own["thinking"] == "Own."
    assert "thinking" not in not_text  # only text is a template's thinking
    assert only_call["thinking"] == "Weather, so call." and only_call["tool_calls"][0]["function"]["arguments"] == \
        json.loads(ARGUMENTS)
