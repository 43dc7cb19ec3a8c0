"""`jaxserve bench serve`'s requests, from vLLM's datasets: `random` (token ids of given lengths), `sharegpt`
(a ShareGPT JSON file's first turns) and `custom` (a JSONL file of prompts).

A file's datasets pick what vLLM's `bench serve` picks from the same file, tokenizer and seed: the same
entries, shuffled alike, filtered by the same length rules, topped up to --num-prompts alike.
"""

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Random prompt ids come from this range: past the special tokens of common vocabularies (GPT-2's
# 50257, SmolLM2's 49152, Llama 3's 128256).
_TOKEN_RANGE = (1000, 30000)

# vLLM's filter for ShareGPT conversations (`is_valid_sequence`): prompts and completions of at least 4
# tokens, prompts of at most 1,024, the two together at most 2,048.
_MIN_LEN, _MAX_PROMPT_LEN, _MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str  # token ids (random) or text, sent as /v1/completions' prompt
    prompt_len: int  # its tokens, as the bench's tokenizer counts them (exact for token ids)
    output_len: int  # max_tokens; EOS is ignored, so the tokens it generates


def random_requests(num_prompts: int, input_len: int, output_len: int, prefix_len: int = 0,
                    range_ratio: float = 0.0, seed: int = 0) -> list[BenchRequest]:
    """vLLM's random dataset: `prefix_len` shared token ids, then `input_len` random ones per request (with
    `range_ratio`, drawn uniformly within that fraction either side, as the output lengths are)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(*_TOKEN_RANGE) for _ in range(prefix_len)]
    input_lens = [drawn_length(rng, input_len, range_ratio) for _ in range(num_prompts)]
    requests = []
    for length in input_lens:
        prompt = prefix + [rng.randrange(*_TOKEN_RANGE) for _ in range(length)]
        requests.append(BenchRequest(prompt, len(prompt), drawn_length(rng, output_len, range_ratio, least=1)))
    return requests


def as_text(requests: list[BenchRequest], tokenizer: Any) -> list[BenchRequest]:
    """Token-id prompts as text, for an API that takes text (the chat API): each decoded, its length
    counted again (a decoded text need not encode back to the same ids)."""
    decoded = [tokenizer.decode(r.prompt) if isinstance(r.prompt, list) else r.prompt for r in requests]
    return [BenchRequest(text, len(tokenizer(text).input_ids), r.output_len)
            for text, r in zip(decoded, requests, strict=True)]


def drawn_length(rng: random.Random, length: int, range_ratio: float, least: int = 0) -> int:
    """A length drawn uniformly from [length (1 - r), length (1 + r)], at least `least` (vLLM's random
    dataset); `length` itself, drawing nothing, where r is 0."""
    if range_ratio == 0:
        return length
    low, high = math.floor(length * (1 - range_ratio)), math.ceil(length * (1 + range_ratio))
    return rng.randint(max(least, low), max(least, high))


class ShareGPTDataset:
    """A ShareGPT file (a JSON list of {"conversations": [{"from": ..., "value": ...}, ...]}): each
    conversation of two turns or more, in an order shuffled by the seed. A request is a conversation's first
    turn, sent as it is (no chat template), for as many tokens as its second turn has (or `output_len`)."""

    def __init__(self, path: str, seed: int = 0, shuffle: bool = True) -> None:
        entries = _read_json(path)
        if not isinstance(entries, list):
            raise ValueError(f"{path}: a ShareGPT file holds a JSON list of conversations, not a "
                             f"{type(entries).__name__}")
        self.path = path
        self.seed = seed
        self.conversations = [entry["conversations"] for entry in entries if isinstance(entry, dict)
                              and isinstance(entry.get("conversations"), list) and len(entry["conversations"]) >= 2]
        if shuffle:
            random.Random(seed).shuffle(self.conversations)

    def sample(self, tokenizer: Any, num_prompts: int, output_len: int | None = None,
               oversample: bool = True) -> list[BenchRequest]:
        """The first `num_prompts` conversations whose lengths pass vLLM's filter (prompt and completion of
        4 tokens or more, prompt at most 1,024, both at most 2,048; with `output_len`, that length in place
        of the completion's, which may then be under 4); topped up with random repeats where too few pass."""
        requests = []
        for turns in self.conversations:
            if len(requests) == num_prompts:
                break
            prompt, completion = _text(turns[0], self.path), _text(turns[1], self.path)
            prompt_len = len(tokenizer(prompt).input_ids)
            new_output_len = len(tokenizer(completion).input_ids) if output_len is None else output_len
            if (prompt_len < _MIN_LEN or (output_len is None and new_output_len < _MIN_LEN)
                    or prompt_len > _MAX_PROMPT_LEN or prompt_len + new_output_len > _MAX_TOTAL_LEN):
                continue
            requests.append(BenchRequest(prompt, prompt_len, new_output_len))
        if not requests:
            raise ValueError(f"{self.path}: none of its {len(self.conversations)} conversations of two turns or "
                             f"more has a prompt of {_MIN_LEN}-{_MAX_PROMPT_LEN} tokens and a reply that keeps "
                             f"both within {_MAX_TOTAL_LEN} (vLLM's filter)")
        return _topped_up(requests, num_prompts, self.seed) if oversample else requests


class CustomDataset:
    """A JSONL file of {"prompt": "...", "output_tokens": N} lines (output_tokens optional), in an order
    shuffled by the seed. Each prompt is sent in the tokenizer's chat template as one user turn (unless
    `chat_template` is off), for `output_len` tokens (-1 or None: the line's output_tokens)."""

    def __init__(self, path: str, seed: int = 0, shuffle: bool = True) -> None:
        if not path.endswith(".jsonl"):
            raise ValueError(f"{path}: a custom dataset is a .jsonl file, one JSON object per line")
        self.path = path
        self.seed = seed
        self.items: list[dict[str, Any]] = []
        for number, line in enumerate(_read_lines(path), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: not JSON ({error})") from None
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise ValueError(f"{path}, line {number}: each line needs a \"prompt\" string")
            self.items.append(item)
        if not self.items:
            raise ValueError(f"{path} has no prompts")
        if shuffle:
            random.Random(seed).shuffle(self.items)

    def sample(self, tokenizer: Any, num_prompts: int, output_len: int | None = 256, chat_template: bool = True,
               oversample: bool = True) -> list[BenchRequest]:
        requests = []
        for item in self.items[:num_prompts]:
            prompt = item["prompt"]
            length = output_len if output_len not in (None, -1) else _output_tokens(item, self.path)
            if chat_template:
                prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                       add_generation_prompt=True, tokenize=False)
            requests.append(BenchRequest(prompt, len(tokenizer(prompt).input_ids), length))
        return _topped_up(requests, num_prompts, self.seed) if oversample else requests


def _topped_up(requests: list[BenchRequest], num_prompts: int, seed: int) -> list[BenchRequest]:
    """`requests` and random repeats of them up to `num_prompts`, as vLLM oversamples a small dataset."""
    rng = random.Random(seed)
    return requests + [rng.choice(requests) for _ in range(num_prompts - len(requests))]


def _output_tokens(item: dict[str, Any], path: str) -> int:
    value = item.get("output_tokens")
    if isinstance(value, float) and value.is_integer():  # 10.0, as pandas writes a column with a gap
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path}: without --custom-output-len, each line needs \"output_tokens\", a whole "
                         f"number of tokens >= 1; got {value!r} for {item['prompt'][:40]!r}")
    return value


def _text(turn: Any, path: str) -> str:
    if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
        raise ValueError(f"{path}: each turn of a conversation is {{\"from\": ..., \"value\": \"text\"}}, got "
                         f"{str(turn)[:80]}")
    return turn["value"]


def _read_json(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not a JSON file ({error})") from None


def _read_lines(path: str) -> list[str]:
    return Path(path).read_text(encoding="utf-8").split("\n")  # only there: JSON strings may hold U+2028
