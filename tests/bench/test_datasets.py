"""`jaxserve bench serve`'s file datasets against vLLM's rules: which ShareGPT conversations are taken, in
which order, for how many tokens; the custom JSONL file's prompts in the chat template; their errors."""

import json
import random
import shutil

import pytest

from jaxserve.bench.datasets import CustomDataset, ShareGPTDataset, random_requests
from jaxserve.config import ServeBenchConfig


def _conversation(prompt: str, reply: str, *more: str, name: str = "") -> dict:
    turns = [prompt, reply, *more]
    return {"id": name or prompt[:20], "conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": text}
                                                for i, text in enumerate(turns)]}


def _sharegpt_file(tmp_path, entries: list) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return str(path)


def _words(n: int, word: str = "apple") -> str:
    return " ".join([word] * n)  # one token a word in SmolLM2's vocabulary, after the first


@pytest.fixture
def sharegpt(tmp_path) -> tuple[str, list[dict]]:
    """A ShareGPT file of 12 conversations that pass vLLM's filter and 6 that each break one of its rules."""
    good = [_conversation(f"Question number {i}: what is {i} plus {i}?", f"The answer to it is {2 * i}, of course.",
                          "thanks", "welcome", name=f"good {i}") for i in range(12)]
    bad = [
        {"id": "one turn", "conversations": [{"from": "human", "value": "A question without its answer"}]},
        {"id": "no turns"},
        _conversation("Hi", "A reply long enough to pass the output rule"),  # prompt under 4 tokens
        _conversation("A prompt long enough to pass", "Ok"),  # reply under 4 tokens
        _conversation(_words(1100), "A reply long enough to pass the output rule"),  # prompt over 1,024
        _conversation(_words(1000), _words(1100, "pear")),  # both over 2,048
    ]
    entries = good[:5] + bad[:3] + good[5:] + bad[3:]
    return _sharegpt_file(tmp_path, entries), good


def test_sharegpt_takes_the_conversations_vllm_takes_in_its_order(sharegpt, smollm2_tokenizer):
    path, good = sharegpt
    dataset = ShareGPTDataset(path, seed=0)
    requests = dataset.sample(smollm2_tokenizer, 12)
    # vLLM's order: the conversations of two turns or more, shuffled by random.seed(seed) then random.shuffle
    random.seed(0)
    with open(path) as file:
        entries = [entry for entry in json.load(file) if len(entry.get("conversations", ())) >= 2]
    random.shuffle(entries)
    kept = [entry["conversations"] for entry in entries if entry["id"] in {g["id"] for g in good}]
    assert [r.prompt for r in requests] == [turns[0]["value"] for turns in kept]
    for request, turns in zip(requests, kept, strict=True):
        assert request.prompt_len == len(smollm2_tokenizer(turns[0]["value"]).input_ids) >= 4
        assert request.output_len == len(smollm2_tokenizer(turns[1]["value"]).input_ids) >= 4
    assert [r.prompt for r in dataset.sample(smollm2_tokenizer, 3)] == [r.prompt for r in requests[:3]]
    other = ShareGPTDataset(path, seed=1).sample(smollm2_tokenizer, 12)
    assert sorted(r.prompt for r in other) == sorted(r.prompt for r in requests)
    assert [r.prompt for r in other] != [r.prompt for r in requests]
    in_file_order = ShareGPTDataset(path, shuffle=False).sample(smollm2_tokenizer, 12)
    assert [r.prompt for r in in_file_order] == [g["conversations"][0]["value"] for g in good]


def test_sharegpt_fills_up_with_repeats_unless_told_not_to(sharegpt, smollm2_tokenizer):
    path, good = sharegpt
    dataset = ShareGPTDataset(path)
    filled, kept = dataset.sample(smollm2_tokenizer, 40), dataset.sample(smollm2_tokenizer, 12)
    rng = random.Random(0)  # vLLM's top-up: random.seed(seed), then random.choice of the kept ones
    assert filled == kept + [rng.choice(kept) for _ in range(28)]
    assert {r.prompt for r in filled} == {g["conversations"][0]["value"] for g in good}
    assert len(dataset.sample(smollm2_tokenizer, 40, oversample=False)) == 12


def test_sharegpt_output_len_replaces_the_replies_lengths(sharegpt, smollm2_tokenizer):
    """vLLM's --sharegpt-output-len: every request's output length; a short reply no longer disqualifies its
    conversation, the prompt's rules still hold."""
    path, _ = sharegpt
    requests = ShareGPTDataset(path, shuffle=False).sample(smollm2_tokenizer, 40, output_len=3, oversample=False)
    assert {r.output_len for r in requests} == {3}
    kept = {r.prompt: r.prompt_len for r in requests}
    assert len(kept) == 14 and "A prompt long enough to pass" in kept  # its reply was under 4 tokens
    assert kept[_words(1000)] <= 1024  # its reply made it too long
    assert "Hi" not in kept and _words(1100) not in kept  # the prompt's own rules hold


def test_sharegpt_files_that_cannot_serve_are_named(tmp_path, smollm2_tokenizer):
    with pytest.raises(ValueError, match="holds a JSON list of conversations, not a dict"):
        ShareGPTDataset(_sharegpt_file(tmp_path, {"conversations": []}))
    (tmp_path / "broken.json").write_text('[{"conversations": ')
    with pytest.raises(ValueError, match=r"broken\.json: not a JSON file"):
        ShareGPTDataset(str(tmp_path / "broken.json"))
    none_pass = ShareGPTDataset(_sharegpt_file(tmp_path, [_conversation("Hi", "Hello there, my friend")]))
    with pytest.raises(ValueError, match=r"none of its 1 conversations .* has a prompt of 4-1024 tokens"):
        none_pass.sample(smollm2_tokenizer, 4)
    not_a_list = ShareGPTDataset(_sharegpt_file(tmp_path, [{"conversations": {"a": 1, "b": 2}}]))
    with pytest.raises(ValueError, match="none of its 0 conversations"):
        not_a_list.sample(smollm2_tokenizer, 4)
    bad_turn = ShareGPTDataset(_sharegpt_file(tmp_path, [{"conversations": [{"from": "human"}, "text"]}]))
    with pytest.raises(ValueError, match="each turn of a conversation is"):
        bad_turn.sample(smollm2_tokenizer, 4)


def test_custom_prompts_go_in_the_chat_template_for_their_lengths(tmp_path, smollm2_tokenizer):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"Tell me about the number {i}.", "output_tokens": 10 + i} for i in range(6)]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    dataset = CustomDataset(str(path), shuffle=False)
    templated = dataset.sample(smollm2_tokenizer, 6)
    for request, line in zip(templated, lines, strict=True):
        assert request.prompt == smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": line["prompt"]}], add_generation_prompt=True, tokenize=False)
        assert request.prompt.startswith("<|im_start|>") and request.output_len == 256
        assert request.prompt_len == len(smollm2_tokenizer(request.prompt).input_ids)
    plain = dataset.sample(smollm2_tokenizer, 6, output_len=-1, chat_template=False)
    assert [(r.prompt, r.output_len) for r in plain] == [(line["prompt"], line["output_tokens"]) for line in lines]
    assert [r.output_len for r in dataset.sample(smollm2_tokenizer, 2, output_len=7)] == [7, 7]
    shuffled = CustomDataset(str(path), seed=0).sample(smollm2_tokenizer, 6, chat_template=False)
    assert sorted(r.prompt for r in shuffled) == sorted(r.prompt for r in plain)
    assert [r.prompt for r in shuffled] != [r.prompt for r in plain]
    assert len(dataset.sample(smollm2_tokenizer, 9)) == 9 and len(dataset.sample(smollm2_tokenizer, 9,
                                                                                 oversample=False)) == 6


@pytest.mark.parametrize("content, error", [
    ('{"prompt": "a"}\n{"prompt": ', "prompts.jsonl, line 2: not JSON"),
    ('{"text": "a"}', 'line 1: each line needs a "prompt" string'),
    ('{"prompt": 5}', 'line 1: each line needs a "prompt" string'),
    ("\n\n", "has no prompts"),
])
def test_custom_files_that_cannot_serve_are_named(tmp_path, content, error):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=error):
        CustomDataset(str(path))


@pytest.mark.parametrize("output_tokens", [None, 0, -3, 2.5, "ten", True])
def test_custom_output_tokens_must_be_whole_counts_where_taken(tmp_path, smollm2_tokenizer, output_tokens):
    path = tmp_path / "prompts.jsonl"
    line = {"prompt": "Say it."} if output_tokens is None else {"prompt": "Say it.", "output_tokens": output_tokens}
    path.write_text(json.dumps(line))
    dataset = CustomDataset(str(path))
    assert dataset.sample(smollm2_tokenizer, 1)[0].output_len == 256  # the file's counts are not read
    with pytest.raises(ValueError, match="each line needs \"output_tokens\", a whole number of tokens >= 1"):
        dataset.sample(smollm2_tokenizer, 1, output_len=-1)


def test_lines_split_at_newlines_only(tmp_path, smollm2_tokenizer):
    """JSON strings may hold U+2028 and U+2029 unescaped (json.dumps(ensure_ascii=False) writes them so):
    a line ends at a newline only, as pandas' reader (vLLM's) splits it."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "one\u2028two\u2029three"}, ensure_ascii=False) + "\n", encoding="utf-8")
    [request] = CustomDataset(str(path)).sample(smollm2_tokenizer, 1, chat_template=False)
    assert request.prompt == "one\u2028two\u2029three"


def test_custom_prompts_need_a_chat_template_or_skip_it(tmp_path, smollm2_gguf):
    """A tokenizer without a chat template: vLLM's bench cannot put a custom prompt in one, and neither does
    this one (jaxserve's fallback template is not the model's); --skip-chat-template sends the prompts as
    written."""
    from jaxserve.bench.serve import _tokenizer
    from jaxserve.models.gguf_cache import converted_dir

    plain = tmp_path / "plain-tokenizer"
    shutil.copytree(converted_dir(smollm2_gguf), plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    settings = dict(dataset_name="custom", dataset_path="prompts.jsonl", tokenizer=str(plain))
    with pytest.raises(ValueError, match="has no chat template for the custom dataset's prompts"):
        _tokenizer(ServeBenchConfig(**settings))
    assert _tokenizer(ServeBenchConfig(**settings, skip_chat_template=True))("a b").input_ids
    assert _tokenizer(ServeBenchConfig(**{**settings, "tokenizer": str(smollm2_gguf)})).chat_template


def test_a_custom_dataset_is_a_jsonl_file(tmp_path):
    with pytest.raises(ValueError, match=r"a custom dataset is a \.jsonl file"):
        CustomDataset(str(tmp_path / "prompts.json"))


def test_random_requests_are_the_seed_s():
    first, again, other = (random_requests(6, 20, 5, prefix_len=3, seed=s) for s in (4, 4, 5))
    assert first == again != other
    assert {r.prompt_len for r in first} == {23} and {r.output_len for r in first} == {5}
    assert len({tuple(r.prompt[:3]) for r in first}) == 1 and len({tuple(r.prompt) for r in first}) == 6


@pytest.mark.parametrize("settings, error", [
    ({"dataset_name": "sharegpt"}, "the sharegpt dataset reads a file: give its dataset path"),
    ({"dataset_name": "custom"}, "the custom dataset reads a file"),
    ({"dataset_path": "x.json"}, "the random dataset takes no dataset path"),
    ({"dataset_name": "sonnet", "dataset_path": "x.txt"}, "dataset_name must be one of random, sharegpt, custom"),
    ({"dataset_name": "sharegpt", "dataset_path": "x.json", "sharegpt_output_len": 0}, "sharegpt_output_len"),
    ({"dataset_name": "custom", "dataset_path": "x.jsonl", "custom_output_len": 0}, "or -1 for each line's"),
])
def test_dataset_settings_that_cannot_run_are_refused(settings, error):
    with pytest.raises(ValueError, match=error):
        ServeBenchConfig(**settings)
