"""A GGUF's tokenizer read as llama.cpp reads its keys (`jaxserve.models.gguf_tokenizer`): tiny vocabularies
written as llama.cpp writes them, converted and loaded as `serve` does, tokenize as the models' own tokenizers
do where transformers' GGUF reader alone does not; and, where llama.cpp's vocabulary files are at hand, the
ids of real vocabularies equal those their models' own tokenizers gave."""

import os
from pathlib import Path

import gguf
import pytest

from jaxserve.models.gguf_cache import convert_with_transformers
from jaxserve.models.tokenizer import load_tokenizer

_TYPES = gguf.GGUFValueType


def _write_vocabulary(path: Path, model: str, tokens: list[str], *, pre: str | None = None,
                      merges: list[str] | None = None, scores: list[float] | None = None,
                      token_types: list[int] | None = None, extra: dict | None = None) -> Path:
    """A vocabulary-only GGUF (as llama.cpp's `models/ggml-vocab-*.gguf`) of a tiny Llama."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("attention.head_count", 2), ("attention.head_count_kv", 2)):
        writer.add_key_value(f"llama.{key}", value, _TYPES.UINT32)
    writer.add_key_value("llama.attention.layer_norm_rms_epsilon", 1e-5, _TYPES.FLOAT32)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types or [1] * len(tokens))
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)
    for key, (value, value_type) in (extra or {}).items():
        writer.add_key_value(key, value, value_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _served_tokenizer(gguf_path: Path):
    """The tokenizer `serve` loads for the file: converted, saved, and loaded back from the directory."""
    converted = gguf_path.with_suffix("")
    converted.mkdir()
    convert_with_transformers(gguf_path, converted)
    return load_tokenizer(converted)


_BYTE_ALPHABET_SIZE = 256


def _byte_level_vocabulary(tmp_path: Path, pre: str, special: dict[str, int] | None = None,
                           extra: dict | None = None) -> Path:
    """GPT-2's byte alphabet, then tokens of digits and letters, then `special` (text -> llama.cpp's token type,
    written as text). Merges reach "12345" (1 2, 12 3, 4 5, 123 45) and "ab", but not "abc": a tokenizer that
    takes a piece whole where it is a token finds it anyway."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merged = ["12", "123", "45", "12345", "ab", "abc"]
    merges = ["1 2", "12 3", "4 5", "123 45", "a b"]
    special = special or {}
    tokens = alphabet + merged + list(special)
    return _write_vocabulary(tmp_path / f"{pre}.gguf", "gpt2", tokens, pre=pre, merges=merges,
                             token_types=[1] * (len(alphabet) + len(merged)) + list(special.values()), extra=extra)


@pytest.mark.parametrize("pre, abc, digits, spaces", [
    ("gpt-2", ["ab", "c"], ["12345"], ["a", " ", " 1"]),  # GPT-2's: merges alone, numbers whole
    # Llama 3's: a piece that is a token is taken whole; digits in threes
    ("llama-bpe", ["abc"], ["123", "45"], ["a", " ", " ", "1"]),
    ("tekken", ["abc"], ["1", "2", "3", "4", "5"], ["a", " ", " ", "1"]),  # Mistral's Tekken: digits one by one
    ("deepseek-v3", ["ab", "c"], ["123", "45"], ["a", "  ", "1"]),  # DeepSeek V3's: digits in threes
    ("glm4", ["abc"], ["123", "45"], ["a", " ", " ", "1"]),  # GLM-4's (4.5, 4.6): Llama 3's without the marks
    # GPT-2's after splitting digits apart, which also keeps the spaces before a digit together
    ("starcoder", ["ab", "c"], ["1", "2", "3", "4", "5"], ["a", "  ", "1"]),
    ("smollm", ["ab", "c"], ["1", "2", "3", "4", "5"], ["a", "  ", "1"]),
    ("minerva-7b", ["ab", "c"], ["1", "2", "3", "4", "5"], ["a", "  ", "1"]),
])
def test_a_byte_level_vocabulary_splits_and_merges_as_its_pre_tokenizer_says(pre, abc, digits, spaces, tmp_path):
    tokenizer = _served_tokenizer(_byte_level_vocabulary(tmp_path, pre))
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("abc", add_special_tokens=False)) == abc
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("12345", add_special_tokens=False)) == digits
    pieces = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("a  1")
    assert ["a  1"[start:end] for _, (start, end) in pieces] == spaces
    assert tokenizer.decode(tokenizer.encode("abc 12345", add_special_tokens=False)) == "abc 12345"


@pytest.mark.parametrize("pre, add_bos, begins_with_bos", [
    ("llama-bpe", None, True),  # Llama 3's files begin a text with BOS where they do not say (llama.cpp's default)
    ("tekken", None, True),
    ("llama-bpe", False, False),  # the file's word is kept
    ("gpt-2", None, False),
    ("gpt-2", True, True),
    ("glm4", True, False),  # llama.cpp begins no GLM-4 text with BOS, whatever the file says: its template does
])
def test_a_byte_level_vocabulary_begins_a_text_with_bos_as_llama_cpp_does(pre, add_bos, begins_with_bos, tmp_path):
    bos = _BYTE_ALPHABET_SIZE + 6
    extra = {"tokenizer.ggml.bos_token_id": (bos, _TYPES.UINT32), "tokenizer.ggml.eos_token_id": (bos, _TYPES.UINT32)}
    if add_bos is not None:
        extra["tokenizer.ggml.add_bos_token"] = (add_bos, _TYPES.BOOL)
    tokenizer = _served_tokenizer(_byte_level_vocabulary(tmp_path, pre, {"<|begin_of_text|>": 3}, extra))
    plain = tokenizer.encode("abc", add_special_tokens=False)
    assert tokenizer.encode("abc") == ([bos] if begins_with_bos else []) + plain


# DeepSeek's control tokens, and user-defined ones, hold characters outside GPT-2's byte alphabet
_DEEPSEEK_SPECIAL = {"<\uff5cbegin\u2581of\u2581sentence\uff5c>": 3, "<\uff5cend\u2581of\u2581sentence\uff5c>": 3,
                     "<\uff5cUser\uff5c>": 3, "<\uff5cAssistant\uff5c>": 3, "<think>": 4, "\u6771\u4eac": 4}


def test_a_byte_level_vocabulary_s_special_tokens_keep_their_ids_and_are_matched_whole(tmp_path):
    """llama.cpp writes a byte-level file's control and user-defined tokens as text. transformers spelled those
    holding other characters in the byte alphabet and added its special tokens again past the vocabulary:
    DeepSeek's BOS was an id the model has no row for, and its chat template's `<｜User｜>` was cut into bytes."""
    first = _BYTE_ALPHABET_SIZE + 6
    ids = dict(zip(_DEEPSEEK_SPECIAL, range(first, first + len(_DEEPSEEK_SPECIAL)), strict=True))
    bos, eos = list(_DEEPSEEK_SPECIAL)[:2]
    extra = {"tokenizer.ggml.bos_token_id": (ids[bos], _TYPES.UINT32),
             "tokenizer.ggml.eos_token_id": (ids[eos], _TYPES.UINT32),
             "tokenizer.ggml.add_bos_token": (True, _TYPES.BOOL)}
    tokenizer = _served_tokenizer(_byte_level_vocabulary(tmp_path, "deepseek-v3", _DEEPSEEK_SPECIAL, extra))
    assert len(tokenizer) == first + len(_DEEPSEEK_SPECIAL)  # no token past the file's
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (ids[bos], ids[eos])
    user, assistant = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"
    got = tokenizer.encode(f"{user}abc{assistant}<think>\u6771\u4eac")
    abc = tokenizer.convert_tokens_to_ids(["ab", "c"])
    assert got == [ids[bos], ids[user], *abc, ids[assistant], ids["<think>"], ids["\u6771\u4eac"]]
    assert tokenizer.decode(got, skip_special_tokens=True) == "abc<think>\u6771\u4eac"


def _sentencepiece_vocabulary(tmp_path: Path, name: str, extra: dict | None = None) -> Path:
    """A sentencepiece vocabulary where "▁Hello" is reached merge by merge; there is no "▁▁"."""
    pieces = ["▁", "H", "e", "l", "o", "▁H", "▁He", "▁Hel", "▁Hell", "▁Hello"]
    tokens = ["<unk>", "<s>", "</s>", *pieces]
    scores = [0.0, 0.0, 0.0, *(-float(i) for i in range(len(pieces)))]
    token_types = [2, 3, 3, *[1] * len(pieces)]  # unknown, control, control, normal
    ids = {f"tokenizer.ggml.{kind}_token_id": (i, _TYPES.UINT32) for i, kind in enumerate(("unknown", "bos", "eos"))}
    return _write_vocabulary(tmp_path / f"{name}.gguf", "llama", tokens, pre="default", scores=scores,
                             token_types=token_types, extra={**ids, **(extra or {})})


@pytest.mark.parametrize("text, pieces", [
    ("Hello", ["▁Hello"]),
    (" Hello", ["▁", "▁Hello"]),  # the prefix space comes before text that starts with one (Llama 2's, llama.cpp's)
    ("  Hello", ["▁", "▁", "▁Hello"]),
])
def test_a_sentencepiece_vocabulary_puts_its_prefix_space_before_any_text(text, pieces, tmp_path):
    tokenizer = _served_tokenizer(_sentencepiece_vocabulary(tmp_path, "spm"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == pieces
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text)[0] == tokenizer.convert_tokens_to_ids("<s>")  # BOS, as llama.cpp adds it


@pytest.mark.parametrize("text, pieces", [("Hello", ["H", "e", "l", "l", "o"]), (" Hello", ["▁Hello"])])
def test_a_sentencepiece_vocabulary_without_a_prefix_space_gets_none(text, pieces, tmp_path):
    """`tokenizer.ggml.add_space_prefix` false: no space before the text, and none taken off in decoding."""
    extra = {"tokenizer.ggml.add_space_prefix": (False, _TYPES.BOOL)}
    tokenizer = _served_tokenizer(_sentencepiece_vocabulary(tmp_path, "no-prefix", extra))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == pieces
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("special, keys, ends", [
    # Phi-3's: its EOS is <|endoftext|>, its turns end at <|end|>
    ({"<|endoftext|>": 3, "<|end|>": 3}, {"eos": 0}, [0, 1]),
    # Llama 3.1's: EOS and EOT keyed, <|eom_id|> (a tool call's end) by its text
    ({"<|end_of_text|>": 3, "<|eot_id|>": 3, "<|eom_id|>": 3, "<|start_header_id|>": 3}, {"eos": 1, "eot": 1},
     [1, 0, 2]),
    # Harmony's (GPT-OSS's): <|end|> ends a message, not the answer
    ({"<|return|>": 3, "<|call|>": 3, "<|end|>": 3, "<|start|>": 3}, {"eos": 0}, [0, 1]),
    ({"<eos>": 3, "<end_of_turn>": 3}, {"eos": 0}, [0, 1]),  # Gemma's: its turns end at <end_of_turn>
    ({"<s>": 3, "</s>": 3}, {"eos": 1}, [1]),  # one end: the config's EOS stays a number
])
def test_generation_ends_where_llama_cpp_ends_it(special, keys, ends, tmp_path):
    """A GGUF has no generation_config.json: its config lists every token llama.cpp ends generation at (the
    file's EOS first), as HF configs that name several EOS tokens do; ids relative to the first special token."""
    import json

    first = _BYTE_ALPHABET_SIZE + 6
    extra = {f"tokenizer.ggml.{kind}_token_id": (first + i, _TYPES.UINT32) for kind, i in keys.items()}
    path = _byte_level_vocabulary(tmp_path, "gpt-2", special, extra)
    converted = tmp_path / "converted"
    converted.mkdir()
    convert_with_transformers(path, converted)
    eos = json.loads((converted / "config.json").read_text())["eos_token_id"]
    assert eos == ([first + i for i in ends] if len(ends) > 1 else first + ends[0])


# llama.cpp's vocabulary files of the families jaxserve serves, each beside the ids its model's own tokenizer
# gave for llama.cpp's test texts (`<file>.inp`, `<file>.out`)
_LLAMA_CPP_VOCABULARIES = ("llama-bpe", "llama-spm", "deepseek-llm", "deepseek-coder", "qwen2", "phi-3", "gpt-2",
                           "starcoder")


@pytest.mark.slow
@pytest.mark.parametrize("name", _LLAMA_CPP_VOCABULARIES)
def test_a_real_vocabulary_gives_its_model_tokenizer_ids(name, tmp_path):
    models = os.environ.get("JAXSERVE_LLAMA_CPP_MODELS")
    if not models:
        pytest.skip("set JAXSERVE_LLAMA_CPP_MODELS to llama.cpp's models/ directory (its ggml-vocab-*.gguf files "
                    "and their test texts) to check real vocabularies")
    from benchmarks.tokenizers_vs_llama_cpp import check

    report = check(Path(models) / f"ggml-vocab-{name}.gguf", None, tmp_path)
    assert report["differ"] == [], report
