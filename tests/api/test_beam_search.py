"""Beam search (`use_beam_search`): the search against exhaustive enumeration where it prunes nothing, and
against a float64 oracle of vLLM's algorithm where it does; served, against the same oracle run on the
PyTorch model's float64 logits; and what it refuses."""

import asyncio
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from jaxserve.api.app import create_app
from jaxserve.api.beam_search import ServedBeamSearch, beam_search, side_by_side
from jaxserve.api.errors import APIError
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.outputs import CompletionOutput, RequestOutput
from tests.engine.beam_cases import oracle, run_search, toy_model
from tests.engine.helpers import make_engine

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.5])
def test_a_search_that_prunes_nothing_finds_the_best_sequences_of_all(length_penalty):
    """Width 64 over 4 tokens (8 alternatives per beam: all of them) for 3 rounds keeps every sequence, so the
    result is the best of all 4 + 4^2 + 4^3 candidates (those ended by EOS at each length, the rest at 3)."""
    vocab, eos, width, num_prompt = 4, 3, 64, 5
    model = toy_model(vocab, seed=1)
    candidates = []
    for length in (1, 2, 3):
        for tokens in itertools.product(range(vocab), repeat=length):
            if eos in tokens[:-1] or (length < 3 and tokens[-1] != eos):
                continue  # a sequence ends at its first EOS, and only the longest may end without one
            total = sum(model(tokens[:i])[t] for i, t in enumerate(tokens))
            ended = tokens[-1] == eos
            candidates.append((tokens, total / (num_prompt + length - ended) ** length_penalty))
    best = sorted(candidates, key=lambda c: -c[1])[:width]
    beams = run_search(model, num_prompt, width, 3, frozenset({eos}), length_penalty)
    assert [b.token_ids for b in beams] == [tokens for tokens, _ in best]
    assert all(b.finished == (b.token_ids[-1] == eos) for b in beams)


@pytest.mark.parametrize("width", [1, 2, 5])
@pytest.mark.parametrize("eos", [frozenset(), frozenset({0, 7})])
def test_a_pruning_search_is_vllms_algorithm(width, eos):
    model = toy_model(40, seed=width)
    beams = run_search(model, 7, width, 9, eos, 1.0)
    expected = oracle(model, 7, width, 9, set(eos), 1.0)
    assert [(b.token_ids, b.finished) for b in beams] == [(tokens, ended) for tokens, _, ended in expected]
    assert np.allclose([b.cumulative_logprob for b in beams], [total for _, total, _ in expected], atol=1e-9)
    if width == 1 and not eos:  # one beam with 2 alternatives is greedy decoding
        tokens = ()
        for _ in range(9):
            tokens = (*tokens, int(np.argmax(model(tokens))))
        assert beams[0].token_ids == tokens


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), warmup=False)
    with TestClient(create_app(ServerConfig(), AsyncEngine(engine))) as client:
        yield client


@pytest.fixture(scope="module")
def torch_logprobs(tiny_hf_model):
    model = tiny_hf_model("llama").double()

    def logprobs(ids: tuple[int, ...]) -> np.ndarray:
        with torch.no_grad():
            logits = model(torch.tensor([list(ids)])).logits[0, -1]
        return torch.log_softmax(logits, -1).numpy()

    return logprobs


def test_served_beams_are_the_oracles_on_the_pytorch_model(client, torch_logprobs):
    prompts = [[5, 6, 7, 8, 9], [300, 2000, 17]]
    width, max_tokens = 3, 6
    response = client.post("/v1/completions", json={
        "prompt": prompts, "n": width, "max_tokens": max_tokens, "use_beam_search": True, "ignore_eos": True,
        "return_token_ids": True, "request_id": "beams"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == "cmpl-beams" and len(body["choices"]) == 2 * width
    for p, prompt in enumerate(prompts):
        expected = oracle(lambda t, prompt=prompt: torch_logprobs((*prompt, *t)), len(prompt), width, max_tokens,
                           set(), 1.0)
        choices = body["choices"][p * width:(p + 1) * width]
        assert [c["index"] for c in choices] == list(range(p * width, (p + 1) * width))
        assert [tuple(c["token_ids"]) for c in choices] == [tokens for tokens, _, _ in expected]
        assert all(c["finish_reason"] == "length" and c["prompt_token_ids"] == prompt for c in choices)
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 2 * width * max_tokens,
                             "total_tokens": 8 + 2 * width * max_tokens,
                             "prompt_tokens_details": body["usage"]["prompt_tokens_details"]}
    greedy = client.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": max_tokens, "temperature": 0,
                                                  "ignore_eos": True, "return_token_ids": True}).json()
    one_beam = client.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": max_tokens,
                                                    "use_beam_search": True, "ignore_eos": True,
                                                    "return_token_ids": True}).json()
    assert one_beam["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"], "one beam is greedy"


def test_chat_beams_come_as_n_messages(client):
    response = client.post("/v1/chat/completions", json={
        "messages": HELLO, "n": 2, "max_tokens": 4, "use_beam_search": True, "length_penalty": 0.5,
        "ignore_eos": True, "return_token_ids": True})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and choices[0]["token_ids"] != choices[1]["token_ids"]
    assert all(len(c["token_ids"]) == 4 and c["message"]["role"] == "assistant" for c in choices)


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 11}, "n"),  # 2 x 11 alternatives exceed --max-logprobs 20
    ({"max_tokens": 0}, "max_tokens"),  # a beam search generates at least one token
    ({"stream": True}, "stream"),
    ({"logprobs": True}, "logprobs"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"response_format": {"type": "json_object"}}, "use_beam_search"),
    ({"length_penalty": "long"}, "length_penalty"),
    ({"length_penalty": 200}, "length_penalty"),  # 2048 ** 200 is no float
    ({"length_penalty": -200}, "length_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_what_beam_search_cannot_answer_is_a_400_naming_it(client, fields, param):
    body = {"messages": HELLO, "max_tokens": 3, "use_beam_search": True, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_completions_refuse_a_prompt_only_beam_search_and_infinite_penalties(client):
    for fields, param in (('"max_tokens": 0, "echo": true', "max_tokens"), ('"logprobs": 2', "logprobs"),
                          ('"length_penalty": 1e999', "length_penalty"), ('"length_penalty": NaN', "length_penalty")):
        body = '{"prompt": [5, 6], "use_beam_search": true, ' + fields + "}"  # 1e999 reads as infinity
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (fields, response.text)
    echoed = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "use_beam_search": True,
                                                  "n": 2, "echo": True}).json()
    assert all(c["text"].startswith("Hello") for c in echoed["choices"])


class _Client:
    """A request whose client never leaves (what `collect` watches)."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()


class _Serving:
    """The engine side of `beam_search` on a toy model whose token 3 is EOS: each request's one token with
    its alternatives, and decoding that records what it was asked."""

    def __init__(self, model, fail_on: int | None = None) -> None:
        self.model, self.fail_on, self.decoded = model, fail_on, []
        self.info = SimpleNamespace(eos_token_ids=(3,))

    def generate(self, ids, params, request_id, cache_salt=None, priority=0, lora_name=None):
        async def outputs():
            await asyncio.sleep(0)
            if self.fail_on is not None and len(ids) >= self.fail_on:
                raise APIError(400, "a fault in this prompt's search", "prompt")
            lp = self.model(tuple(ids[2:]))
            top = {int(t): float(lp[t]) for t in np.argsort(-lp, kind="stable")[: params.logprobs]}
            yield RequestOutput(request_id, None, list(ids), [CompletionOutput(
                0, token_ids=[int(np.argmax(lp))], token_logprobs=[max(top.values())], top_logprobs=[top],
                finish_reason="length")], finished=True)

        return outputs()

    async def decode(self, ids, skip_special_tokens=False):
        self.decoded.append((tuple(ids), skip_special_tokens))
        return "".join(f"<{t}>" for t in ids)


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_beam_that_ends_in_eos_is_stop_without_it_in_its_text(include_stop):
    model = toy_model(6, seed=3)
    serving = _Serving(model)
    params = ServedBeamSearch(beam_width=4, max_tokens=5, length_penalty=1.0, ignore_eos=False,
                              skip_special_tokens=False, include_stop_str_in_output=include_stop)
    output = asyncio.run(beam_search(serving, _Client(), [7, 8], params, "r"))
    expected = oracle(model, 2, 4, 5, {3}, 1.0)
    assert any(ended for _, _, ended in expected), "the case must have a beam that EOS ended"
    for completion, (tokens, _, ended) in zip(output.outputs, expected, strict=True):
        text_ids = tokens[:-1] if ended else tokens
        assert completion.finish_reason == ("stop" if ended else "length")
        assert completion.stop_reason == (3 if ended else None)
        assert completion.text == "".join(f"<{t}>" for t in text_ids), "the EOS is never text"
        assert completion.token_ids == list(tokens if include_stop else text_ids), "vLLM's rule for the EOS id"
    assert {skip for _, skip in serving.decoded} == {False}
    assert output.finished and output.prompt_token_ids == [7, 8]


def test_one_failing_search_stops_the_others_before_the_error_is_answered():
    serving = _Serving(toy_model(6, seed=4), fail_on=5)  # a prompt of 2 fails in its third round
    params = ServedBeamSearch(3, 20, ignore_eos=True)

    async def run():
        searches = [beam_search(serving, _Client(), [1, 2], params, "fails"),
                    beam_search(serving, _Client(), [1, 2, 9, 9, 9, 9, 9, 9], params, "long")]
        with pytest.raises(APIError, match="a fault"):
            await side_by_side(searches)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]

    left = asyncio.run(run())
    assert not left, left


@pytest.fixture(scope="module")
def thinking_client(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), warmup=False)
    with TestClient(create_app(ServerConfig(reasoning_parser="deepseek_r1"), AsyncEngine(engine))) as client:
        yield client


def test_chat_beams_go_through_the_reasoning_parser(thinking_client):
    """DeepSeek-R1's parser reads an output with no </think> as all reasoning: a beam's text too."""
    body = {"messages": HELLO, "max_tokens": 5, "ignore_eos": True}
    beam = thinking_client.post("/v1/chat/completions", json={**body, "use_beam_search": True}).json()
    greedy = thinking_client.post("/v1/chat/completions", json={**body, "temperature": 0}).json()
    message = beam["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"]
    assert message["reasoning_content"] == greedy["choices"][0]["message"]["reasoning_content"], "one beam is greedy"
