"""--reasoning-parser: the <think> part split into reasoning_content, streamed and not, and structured
outputs that wait for it to end; on a tiny random Llama whose tokenizer has <think> and </think> tokens."""

import copy
import json
import re

import pytest
from starlette.testclient import TestClient

from jaxserve.api.app import create_app
from jaxserve.api.reasoning import (
    REASONING_PARSERS,
    Phase,
    ReasoningMarkers,
    ReasoningStream,
    reasoning_stream,
    split_reasoning,
)
from jaxserve.config import REASONING_PARSER_NAMES, ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from tests.engine.helpers import make_engine

DEEPSEEK, QWEN3, GLM45 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"], REASONING_PARSERS["glm45"]


def test_the_config_names_every_parser():
    assert tuple(sorted(REASONING_PARSERS)) == REASONING_PARSER_NAMES
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="o1")


@pytest.mark.parametrize(("parser", "phase", "text", "expected"), [
    (DEEPSEEK, Phase.OPENING, "<think>plan\n</think>\n\nanswer", ("plan\n", "\n\nanswer")),
    (DEEPSEEK, Phase.OPENING, "plan</think>answer", ("plan", "answer")),  # R1's template opened it
    (DEEPSEEK, Phase.OPENING, "still thinking <thi", ("still thinking <thi", None)),  # cut off: all reasoning
    (DEEPSEEK, Phase.REASONING, "a</think>", ("a", None)),
    (DEEPSEEK, Phase.CONTENT, "x</think>y", (None, "x</think>y")),  # the prompt ended reasoning
    (QWEN3, Phase.OPENING, "<think>\nhm\n</think>\n\nhi", ("\nhm\n", "\n\nhi")),
    (QWEN3, Phase.OPENING, "no thinking here", (None, "no thinking here")),
    (QWEN3, Phase.OPENING, "<think>cut off", ("cut off", None)),
    (QWEN3, Phase.OPENING, "<thinking>", (None, "<thinking>")),
    (QWEN3, Phase.OPENING, "<thi", (None, "<thi")),
    (QWEN3, Phase.REASONING, "a</think>b</think>c", ("a", "b</think>c")),
    (GLM45, Phase.OPENING, "\n<think>plan</think>\nanswer", ("plan", "\nanswer")),  # GLM-4.5 opens on a new line
    (GLM45, Phase.OPENING, "\nno thinking", (None, "\nno thinking")),
    (QWEN3, Phase.OPENING, "\n<think>plan</think>", (None, "\n<think>plan</think>")),  # Qwen3's must open it
])
def test_whole_outputs_split(parser, phase, text, expected):
    assert split_reasoning(parser, phase, text) == expected


@pytest.mark.parametrize("parser", [DEEPSEEK, QWEN3, GLM45])
@pytest.mark.parametrize("text", ["<think>ab</think>cd", "<think></think>", "x</think", "<th", "a</think></think>b",
                                  "<think><think>a</thin</think>k>", "\n <think>a</think>b", " \n", "\n<th"])
def test_a_stream_cut_anywhere_splits_as_the_whole_text(parser, text):
    whole = split_reasoning(parser, Phase.OPENING, text)
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1):
            stream = ReasoningStream(parser, Phase.OPENING)
            parts = [stream.feed(text[:cut]), stream.feed(text[cut:second]), stream.feed(text[second:], final=True)]
            reasoning, content = ("".join(p[i] for p in parts) for i in (0, 1))
            assert (reasoning or None, content or None) == whole, (cut, second)


class _Ids:
    """A tokenizer stand-in: each marker is two ids."""

    def encode(self, text, add_special_tokens=False):
        return {"<think>": [7, 8], "</think>": [9, 8]}[text]


@pytest.mark.parametrize(("prompt", "phase"), [
    ([1, 2, 3], Phase.OPENING),
    ([1, 7, 8, 5], Phase.REASONING),
    ([7, 8, 5, 9, 8, 6], Phase.CONTENT),  # Qwen3 with enable_thinking=False
    ([7, 8, 9, 8, 7, 8], Phase.REASONING),  # an earlier turn's thinking ended; this one's opened
    ([9, 7, 8], Phase.REASONING),
])
def test_the_prompt_decides_where_an_output_starts(prompt, phase):
    markers = ReasoningMarkers.of(QWEN3, _Ids())
    assert markers.first_phase(prompt) is phase
    assert markers.grammar_waits(phase) == ((9, 8) if phase is not Phase.CONTENT else ())


@pytest.mark.parametrize(("prompt", "phase"), [
    ([1, 2, 3], Phase.OPENING),
    ([7, 8, 9, 8, 1, 5, 1, 2], Phase.OPENING),  # an earlier turn's closed thinking, then this turn's prompt
    ([1, 2, 7, 8, 9, 8], Phase.CONTENT),  # GLM-4.5 with enable_thinking=False: the prompt ends closed
    ([1, 2, 7, 8], Phase.REASONING),
])
def test_glm45_s_prompt_decides_by_its_end_alone(prompt, phase):
    """GLM-4.5's template writes `<think></think>` into every earlier assistant turn: only the prompt's end says
    where this output starts."""
    assert ReasoningMarkers.of(GLM45, _Ids()).first_phase(prompt) is phase


@pytest.fixture(scope="module")
def thinking_engine(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama whose tokenizer has <think> and </think> as single tokens."""
    from tests.conftest import _tiny_hf_model

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_tokens(["<think>", "</think>"])
    model = _tiny_hf_model("llama").eval()
    model.resize_token_embeddings(len(tokenizer))
    directory = tmp_path_factory.mktemp("tiny-thinking")
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return AsyncEngine(make_engine(directory, warmup=False))


@pytest.fixture(scope="module")
def apps(thinking_engine):
    clients = {name: TestClient(create_app(ServerConfig(reasoning_parser=name), thinking_engine))
               for name in REASONING_PARSER_NAMES}
    clients[None] = TestClient(create_app(ServerConfig(), thinking_engine))
    for client in clients.values():
        client.__enter__()
    yield clients
    for client in clients.values():
        client.__exit__(None, None, None)


def _ids(engine: AsyncEngine, text: str) -> int:
    (token,) = engine.tokenizer.encode(text, add_special_tokens=False)
    return token


def _chat(client: TestClient, **body) -> dict:
    body = {"messages": [{"role": "user", "content": "What is 12 x 11?"}], "temperature": 0, **body}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _streamed(client: TestClient, **body) -> tuple[str, str, list[dict]]:
    body = {"messages": [{"role": "user", "content": "What is 12 x 11?"}], "temperature": 0, "stream": True, **body}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    return reasoning, "".join(d.get("content") or "" for d in deltas), deltas


def test_an_output_without_an_end_is_reasoning_for_deepseek_and_content_for_qwen3(apps, thinking_engine):
    end = _ids(thinking_engine, "</think>")
    body = {"max_tokens": 8, "logit_bias": {str(end): -100}}
    raw = _chat(apps[None], **body)["choices"][0]["message"]
    assert raw["reasoning_content"] is None and "</think>" not in raw["content"]
    deepseek = _chat(apps["deepseek_r1"], **body)["choices"][0]["message"]
    assert deepseek["reasoning_content"] == raw["content"] and deepseek["content"] is None
    assert deepseek["reasoning"] == deepseek["reasoning_content"], "vLLM's newer name carries the same"
    qwen3 = _chat(apps["qwen3"], **body)["choices"][0]["message"]
    assert qwen3["content"] == raw["content"] and qwen3["reasoning_content"] is None
    for name, expected in (("deepseek_r1", (raw["content"], "")), ("qwen3", ("", raw["content"]))):
        reasoning, content, deltas = _streamed(apps[name], **body)
        assert (reasoning, content) == expected
        assert all(d.get("content") is None for d in deltas if d.get("reasoning_content"))
    assert _chat(apps["deepseek_r1"], include_reasoning=False, **body)["choices"][0]["message"][
        "reasoning_content"] is None


def test_a_structured_output_applies_after_the_reasoning(apps, thinking_engine):
    """</think> is forced by logit_bias: a grammar applied from the start would forbid it; applied after
    the reasoning, it shapes the answer (vLLM's rule)."""
    end = _ids(thinking_engine, "</think>")
    body = {"max_tokens": 10, "logit_bias": {str(end): 100}, "structured_outputs": {"regex": "[0-9]{3}"}}
    message = _chat(apps["deepseek_r1"], **body)["choices"][0]["message"]
    assert message["reasoning_content"] is None and re.fullmatch("[0-9]{3}", message["content"])
    reasoning, content, _ = _streamed(apps["deepseek_r1"], **body)
    assert (reasoning, content) == ("", message["content"])
    without_parser = _chat(apps[None], **body)["choices"][0]["message"]
    assert re.fullmatch("[0-9]{3}", without_parser["content"]), "no parser: the grammar rules from the start"
    left_out = _chat(apps["deepseek_r1"], include_reasoning=False, **body)["choices"][0]["message"]
    assert left_out["reasoning_content"] is None and left_out["content"] == without_parser["content"], \
        "include_reasoning false: the grammar rules from the first token (vLLM's rule)"


def test_a_prompt_that_ended_its_reasoning_gets_the_grammar_from_the_start(apps, thinking_engine):
    end = _ids(thinking_engine, "</think>")
    messages = [{"role": "user", "content": "Answer in digits."},
                {"role": "assistant", "content": "<think>easy</think>"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 10, "logit_bias": {str(end): 100}, "response_format": {
                "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}}
    message = _chat(apps["qwen3"], **body)["choices"][0]["message"]
    assert message["reasoning_content"] is None
    assert isinstance(json.loads(message["content"]), int), "no </think> was let through"


def test_the_responses_api_sends_reasoning_as_a_reasoning_item(apps):
    chat = _chat(apps["deepseek_r1"], max_tokens=8)["choices"][0]["message"]
    assert chat["reasoning_content"] and chat["content"] is None  # no </think> from this random model
    body = {"input": "What is 12 x 11?", "max_output_tokens": 8, "temperature": 0}
    response = apps["deepseek_r1"].post("/v1/responses", json=body).json()
    (item,) = response["output"]
    assert item["type"] == "reasoning" and item["content"] == [{"type": "reasoning_text",
                                                                 "text": chat["reasoning_content"]}]
    with apps["deepseek_r1"].stream("POST", "/v1/responses", json={**body, "stream": True}) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == \
        chat["reasoning_content"]
    assert [e["type"] for e in events][-3:] == ["response.reasoning_text.done", "response.output_item.done",
                                               "response.incomplete"]


HARMONY = REASONING_PARSERS["openai_gptoss"]
ANALYSIS, FINAL = "<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'


@pytest.mark.parametrize(("text", "expected"), [
    (f"{ANALYSIS}Add 12 tens and 12.{FINAL}132<|return|>", ("Add 12 tens and 12.", "132")),
    ("<|channel|>final<|message|>132<|return|>", (None, "132")),  # no reasoning: the final channel's marker goes
    (f"{ANALYSIS}cut off", ("cut off", None)),
    (f"{ANALYSIS}a{FINAL}b<|end|>", ("a", "b")),
    ("no markers", (None, "no markers")),
    ("<|channel|>commentary<|message|>I will look.<|end|>", (None, "I will look.")),  # a preamble is content
    # a call goes to the content whole, for the tool-call parser; the other form has the recipient first
    (f"{ANALYSIS}Look it up.<|end|>{CALL}", ("Look it up.", CALL)),
    (" to=functions.f<|channel|>commentary json<|message|>{}", (None, " to=functions.f<|channel|>commentary json"
                                                                    "<|message|>{}")),
    (f"{ANALYSIS}a<|end|><|start|>assistant<|channel|>analysis<|message|>b{FINAL}c", ("ab", "c")),
    ("<|channel|><|channel|>x<|message|>y", (None, "<|channel|>y")),  # a stray marker is text, the message read
])
def test_harmony_outputs_split(text, expected):
    """GPT-OSS's analysis channel is the reasoning and its final channel the answer, the turn's end dropped."""
    assert split_reasoning(HARMONY, Phase.OPENING, text) == expected


@pytest.mark.parametrize("text", [f"{ANALYSIS}ab{FINAL}cd<|return|>", "<|channel|>final<|message|>x<|return|>",
                                  f"{ANALYSIS}<|end|>x", "<|channel|>fin", f"{ANALYSIS}a<b<|end|>{CALL}",
                                  " to=functions.f<|channel|>commentary json<|message|>{}"])
def test_a_harmony_stream_cut_anywhere_splits_as_the_whole_text(text):
    whole = split_reasoning(HARMONY, Phase.OPENING, text)
    for cut in range(len(text) + 1):
        stream = reasoning_stream(HARMONY, Phase.OPENING)
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:], final=True)]
        assert tuple("".join(p[i] for p in parts) or None for i in (0, 1)) == whole, cut


def test_every_harmony_output_starts_open():
    """A harmony prompt holds earlier turns' final channels (the end marker) and its own open turn: its
    output starts open whatever the prompt's last marker."""
    class Harmony:
        def encode(self, text, add_special_tokens=False):
            return {ANALYSIS: [1, 2, 3], FINAL: [4, 5, 6, 1, 7, 3], "<|channel|>final<|message|>": [1, 7, 3]}[text]

    markers = ReasoningMarkers.of(HARMONY, Harmony())
    assert markers.first_phase([4, 5, 6, 1, 7, 3, 9, 4, 5, 6]) is Phase.OPENING
    # A structured output waits for the answer's own marker, which ends the end marker too: it applies to an
    # answer given with or without an analysis first.
    assert markers.grammar_waits(Phase.OPENING) == (1, 7, 3)


def test_the_harmony_parser_keeps_the_special_tokens_it_reads(harmony_model_dir):
    """Over HTTP, on a tiny model whose tokenizer has harmony's special tokens: forced to write
    `<|channel|>` three times, the answer holds them under `openai_gptoss` (they reach the parser), and
    is empty without it (special tokens are skipped, as vLLM skips them)."""
    engine = AsyncEngine(make_engine(harmony_model_dir, warmup=False))
    channel = _ids(engine, "<|channel|>")
    body = {"max_tokens": 3, "logit_bias": {str(channel): 100}}
    with TestClient(create_app(ServerConfig(reasoning_parser="openai_gptoss"), engine)) as harmony, \
            TestClient(create_app(ServerConfig(), engine)) as plain:
        message = _chat(harmony, **body)["choices"][0]["message"]
        assert message["content"] == "<|channel|>" * 3 and message["reasoning_content"] is None
        assert _chat(plain, **body)["choices"][0]["message"]["content"] == ""
