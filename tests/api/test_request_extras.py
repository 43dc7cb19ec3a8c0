"""vLLM's request extras through the openai SDK on the shared server: priority (refused: the server
schedules fcfs), truncate_prompt_tokens, chat echo, roles, tool calls cut by max_tokens, allowed_token_ids
and bad_words, return_token_ids and return_tokens_as_token_ids, continuous_usage_stats."""

import re

import httpx
import openai
import pytest

from tests.api.helpers import API_KEY, MODEL
from tests.api.test_structured_api import TOOLS, WEATHER, check_call

HELLO = [{"role": "user", "content": "Say hello."}]


def test_a_priority_on_an_fcfs_server_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": 3})
    assert e.value.body["param"] == "priority" and "--scheduling-policy priority" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, extra_body={"priority": "urgent"})
    assert e.value.status_code == 400
    zero = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": 0})
    assert zero.choices[0].text is not None


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, client):
    words = " ".join(f"w{i}" for i in range(300))
    tail = client.completions.create(model=MODEL, prompt=words, max_tokens=1, extra_body={
        "truncate_prompt_tokens": 7, "echo": True})
    assert tail.usage.prompt_tokens == 7
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": words}, headers=headers).json()["tokens"]
    last = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens[-7:]}, headers=headers).json()
    assert tail.choices[0].text.startswith(last["prompt"])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words}], max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    whole = client.completions.create(model=MODEL, prompt=words, max_tokens=1, extra_body={
        "truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(tokens), "-1: up to the context length, which this prompt fits"
    for bad in (0, -2, 2049):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": bad})
        assert e.value.body["param"] == "truncate_prompt_tokens"


def test_truncation_lets_a_prompt_longer_than_the_context_through(client):
    words = " ".join(f"w{i}" for i in range(3000))  # more tokens than the 2,048-token context
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=words, max_tokens=1)
    cut = client.completions.create(model=MODEL, prompt=words, max_tokens=4, extra_body={"truncate_prompt_tokens": 100})
    assert cut.usage.prompt_tokens == 100


def test_chat_echo_repeats_the_assistant_message_it_continues(client):
    messages = [*HELLO, {"role": "assistant", "content": "Hello! I am"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    echoed = client.chat.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"], "echo": True}})
    assert echoed.choices[0].message.content == "Hello! I am" + plain
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        **{**kwargs, "extra_body": {**kwargs["extra_body"], "echo": True}}, stream=True) if c.choices)
    assert streamed == "Hello! I am" + plain
    user_last = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0,
                                               extra_body={"echo": True})
    assert not user_last.choices[0].message.content.startswith("Say hello."), "only the assistant's own message"


def test_a_role_the_template_does_not_know_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "narrator", "content": "x"}, *HELLO],
                                       max_tokens=2)
    assert e.value.body["param"] == "messages.0.role" and "narrator" in e.value.body["message"]
    for role in ("developer", "system"):
        assert client.chat.completions.create(model=MODEL, messages=[{"role": role, "content": "Be brief."}, *HELLO],
                                              max_tokens=2).choices


def test_tool_calls_cut_by_max_tokens_keep_the_complete_ones(client):
    kwargs = dict(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice="required", temperature=0)
    whole = client.chat.completions.create(**kwargs, max_tokens=160)
    calls = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert calls and whole.choices[0].finish_reason == "tool_calls"
    kept = []
    for max_tokens in range(whole.usage.completion_tokens - 1, 0, -1):
        cut = client.chat.completions.create(**kwargs, max_tokens=max_tokens).choices[0]
        assert cut.finish_reason == "length"
        got = [(c.function.name, c.function.arguments) for c in cut.message.tool_calls]
        assert got == calls[: len(got)], "the calls kept are the complete ones, unchanged"
        for call in cut.message.tool_calls:
            check_call(call)
        if got:
            assert cut.message.content is None
        kept.append(len(got))
        if len(kept) == 6:
            break
    assert max(kept) >= 1


def _token_ids(server, text: str) -> list[int]:
    return httpx.post(f"{server.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                      headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"]


def test_allowed_token_ids_and_bad_words(server, client):
    (a,), (b,) = _token_ids(server, "a"), _token_ids(server, "b")
    held = client.completions.create(model=MODEL, prompt="Spell:", max_tokens=8, temperature=1.0, seed=1,
                                     extra_body={"allowed_token_ids": [a, b]})
    assert set(held.choices[0].text) <= {"a", "b"} and held.choices[0].finish_reason == "length", "no EOS unlisted"
    both = client.completions.create(model=MODEL, prompt="Spell:", max_tokens=6, temperature=1.0, seed=1,
                                     extra_body={"allowed_token_ids": [a, b], "structured_outputs": {"regex": "a+"}})
    assert both.choices[0].text == "a" * 6, "each token is both allowed and in the grammar"
    greedy = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                       temperature=0).choices[0].text
    first_word = greedy.split()[0]
    banned = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                       extra_body={"bad_words": [first_word]}).choices[0].text
    assert banned != greedy and banned.split()[0:1] != [first_word]
    for extra, param in (({"allowed_token_ids": [10**8]}, "allowed_token_ids"),
                         ({"allowed_token_ids": []}, "allowed_token_ids"),
                         ({"allowed_token_ids": [a], "use_beam_search": True, "n": 2}, "allowed_token_ids"),
                         ({"bad_words": [""]}, "bad_words"),
                         ({"bad_words": ["w"] * 33}, "bad_words")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)


def _detokenize(server, token_ids: list[int]) -> str:
    return httpx.post(f"{server.base_url}/detokenize", json={"tokens": token_ids},
                      headers={"Authorization": f"Bearer {API_KEY}"}).json()["prompt"]


def test_return_token_ids_in_completions(server, client):
    """vLLM's `return_token_ids`: the prompt's ids and each choice's, which decode to its text; streamed, the
    prompt's ids lead each choice's first chunk and every chunk carries its new ids."""
    prompt_ids = _token_ids(server, "Hello there")
    body = dict(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**body)
    (choice,) = whole.choices
    assert choice.model_extra["prompt_token_ids"] == prompt_ids
    token_ids = choice.model_extra["token_ids"]
    assert len(token_ids) == whole.usage.completion_tokens == 6 and _detokenize(server, token_ids) == choice.text

    sampled = client.completions.create(model=MODEL, prompt=[prompt_ids, prompt_ids[:2]], max_tokens=5, n=2,
                                        temperature=1.0, seed=3, extra_body={"return_token_ids": True,
                                                                             "ignore_eos": True})
    for c in sampled.choices:
        assert c.model_extra["prompt_token_ids"] == (prompt_ids if c.index < 2 else prompt_ids[:2])
        assert _detokenize(server, c.model_extra["token_ids"]) == c.text

    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    assert [c.model_extra["prompt_token_ids"] for c in chunks] == [prompt_ids] + [None] * (len(chunks) - 1)
    assert [t for c in chunks for t in c.model_extra["token_ids"]] == token_ids

    # Two prompts, two greedy choices each, echoed: each choice's first chunk brings its prompt's ids.
    other_ids = _token_ids(server, "Good morning")
    streamed = [c.choices[0] for c in client.completions.create(
        **{**body, "prompt": ["Hello there", "Good morning"]}, n=2, echo=True, stream=True) if c.choices]
    for index, want_prompt in enumerate([prompt_ids, prompt_ids, other_ids, other_ids]):
        mine = [c for c in streamed if c.index == index]
        assert [c.model_extra["prompt_token_ids"] for c in mine] == [want_prompt] + [None] * (len(mine) - 1)
        assert len([t for c in mine for t in c.model_extra["token_ids"]]) == 6
    assert [t for c in streamed if c.index == 1 for t in c.model_extra["token_ids"]] == token_ids

    scored = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, echo=True,
                                       extra_body={"return_token_ids": True}).choices[0]
    assert scored.model_extra["token_ids"] == [] and scored.model_extra["prompt_token_ids"] == prompt_ids

    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2).choices[0]
    assert plain.model_extra["token_ids"] is None and plain.model_extra["prompt_token_ids"] is None


def test_return_token_ids_in_chat(server, client):
    """The rendered prompt's ids on the response (a stream's first chunk) and each choice's generated ids.
    A streamed tool call holds some chunks back while a call's name arrives; their ids come with the next
    chunk, so a stream's ids add up to the usage's count."""
    rendered = httpx.post(f"{server.base_url}/tokenize", json={"messages": HELLO},
                          headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"]
    body = dict(model=MODEL, messages=HELLO, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**body)
    assert whole.model_extra["prompt_token_ids"] == rendered
    token_ids = whole.choices[0].model_extra["token_ids"]
    assert len(token_ids) == whole.usage.completion_tokens
    assert _detokenize(server, token_ids).startswith(whole.choices[0].message.content)

    chunks = list(client.chat.completions.create(**body, n=2, stream=True))
    firsts = [c for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(c.choices[0].index for c in firsts) == [0, 1]
    assert all(c.model_extra["prompt_token_ids"] == rendered for c in firsts)
    assert all(c.model_extra["prompt_token_ids"] is None for c in chunks if c not in firsts)
    for index in (0, 1):
        assert [t for c in chunks if c.choices and c.choices[0].index == index
                for t in c.choices[0].model_extra["token_ids"] or []] == token_ids

    tool_call = dict(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice="required", temperature=0,
                     max_tokens=160, extra_body={"return_token_ids": True})
    called = client.chat.completions.create(**tool_call).choices[0]
    calls = list(client.chat.completions.create(**tool_call, stream=True))
    ids_per_chunk = [c.choices[0].model_extra["token_ids"] or [] for c in calls if c.choices]
    assert any(c.choices and c.choices[0].delta.tool_calls for c in calls)
    assert [t for ids in ids_per_chunk for t in ids] == called.model_extra["token_ids"]
    assert max(map(len, ids_per_chunk)) > 1, "a chunk brought the ids of deltas the tool parser held back"


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server, client):
    """vLLM's `return_tokens_as_token_ids`: every token in logprobs (the echoed prompt's, the output's, the
    alternatives) is "token_id:{id}", so a token whose bytes are not whole UTF-8 stays identifiable."""
    prompt_ids = _token_ids(server, "Hello there")
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    choice = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0, echo=True,
                                       logprobs=2, extra_body=extra).choices[0]
    ids = prompt_ids + choice.model_extra["token_ids"]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(re.fullmatch(r"token_id:\d+", key) for top in choice.logprobs.top_logprobs if top for key in top)
    streamed = [c.choices[0] for c in client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=5, temperature=0, echo=True, logprobs=2, extra_body=extra,
        stream=True) if c.choices]
    assert [t for c in streamed for t in c.logprobs.tokens] == choice.logprobs.tokens

    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body=extra).choices[0]
    assert [e.token for e in chat.logprobs.content] == [f"token_id:{t}" for t in chat.model_extra["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", top.token) for e in chat.logprobs.content for top in e.top_logprobs)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    """vLLM's `stream_options.continuous_usage_stats` beside `include_usage`: each chunk carries the usage
    so far, completion tokens counting up to the final usage chunk's; without it only that last chunk does."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create, kwargs in ((client.completions.create, {"prompt": "Hello there"}),
                           (client.chat.completions.create, {"messages": HELLO})):
        chunks = list(create(model=MODEL, max_tokens=6, temperature=0, stream=True, stream_options=options,
                             extra_body={"ignore_eos": True}, **kwargs))
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 6 and len(set(counts)) > 2
        assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
        plain = list(create(model=MODEL, max_tokens=6, temperature=0, stream=True,
                            stream_options={"include_usage": True}, **kwargs))
        assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]
        alone = list(create(model=MODEL, max_tokens=2, stream=True, stream_options={"continuous_usage_stats": True},
                            **kwargs))
        assert all(c.usage is None for c in alone), "continuous_usage_stats counts only beside include_usage"


def test_continuous_usage_counts_each_choice_on_its_own(server, client):
    """As vLLM: a chunk's usage is its choice's (its prompt's tokens, its own tokens so far); only the last,
    choice-less chunk sums the request. A prompt-only request's chunks count no completion token."""
    lengths = {0: len(_token_ids(server, "Hello there")), 1: len(_token_ids(server, "Good morning friend"))}
    chunks = list(client.completions.create(
        model=MODEL, prompt=["Hello there", "Good morning friend"], n=2, max_tokens=5, temperature=1.0, seed=7,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "return_token_ids": True}))
    so_far = [0] * 4
    for c in chunks[:-1]:
        (choice,) = c.choices
        so_far[choice.index] += len(choice.model_extra["token_ids"])
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (lengths[choice.index // 2], so_far[choice.index])
    assert so_far == [5] * 4 and chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (sum(lengths.values()), 20)
    scored = list(client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=0, echo=True, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert [c.usage.completion_tokens for c in scored] == [0] * len(scored)


def test_the_token_id_fields_refuse_what_is_not_a_boolean(server):
    """Hostile values of the new fields are 400s naming the field; `max_tokens` below 0 with `echo` still
    is one (only 0 scores the prompt)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for extra, param in (({"return_token_ids": [1]}, "return_token_ids"),
                         ({"return_token_ids": "maybe"}, "return_token_ids"),
                         ({"return_tokens_as_token_ids": {"a": 1}}, "return_tokens_as_token_ids"),
                         ({"return_tokens_as_token_ids": 10**30}, "return_tokens_as_token_ids"),
                         ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "x"}},
                          "stream_options.continuous_usage_stats"),
                         ({"echo": True, "max_tokens": -1}, "max_tokens")):
        for path, body in (("completions", {**base, **extra}),
                           ("chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 2, **extra})):
            if path == "chat/completions" and "echo" in extra:
                continue  # chat's echo is another field's rule
            response = httpx.post(f"{server.base_url}/v1/{path}", json=body, headers=headers)
            assert response.status_code == 400, (path, extra, response.text)
            assert response.json()["error"]["param"] == param, (path, extra, response.text)
