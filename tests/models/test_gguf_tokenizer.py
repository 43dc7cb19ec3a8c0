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


def _byte_level_vocabulary(tmp_path: Path, pre: str) -> Path:
    """GPT-2's byte alphabet, then tokens of digits and letters. Merges reach "12345" (1 2, 12 3, 4 5, 123 45)
    and "ab", but not "abc": a tokenizer that takes a piece whole where it is a token finds it anyway."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merged = ["12", "123", "45", "12345", "ab", "abc"]
    merges = ["1 2", "12 3", "4 5", "123 45", "a b"]
    return _write_vocabulary(tmp_path / f"{pre}.gguf", "gpt2", alphabet + merged, pre=pre, merges=merges)


@pytest.mark.parametrize("pre, abc, digits", [
    ("gpt-2", ["ab", "c"], ["12345"]),  # GPT-2's: merges alone, numbers whole
    ("llama-bpe", ["abc"], ["123", "45"]),  # Llama 3's: a piece that is a token is taken whole; digits in threes
    ("tekken", ["abc"], ["1", "2", "3", "4", "5"]),  # Mistral's Tekken: whole pieces too; digits one by one
    ("deepseek-v3", ["ab", "c"], ["123", "45"]),  # DeepSeek V3's: digits in threes, merges alone
    ("starcoder", ["ab", "c"], ["1", "2", "3", "4", "5"]),  # GPT-2's after splitting digits apart
])
def test_a_byte_level_vocabulary_splits_and_merges_as_its_pre_tokenizer_says(pre, abc, digits, tmp_path):
    tokenizer = _served_tokenizer(_byte_level_vocabulary(tmp_path, pre))
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("abc", add_special_tokens=False)) == abc
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("12345", add_special_tokens=False)) == digits
    assert tokenizer.decode(tokenizer.encode("abc 12345", add_special_tokens=False)) == "abc 12345"


def _sentencepiece_vocabulary(tmp_path: Path, name: str, extra: dict | None = None) -> Path:
    """A sentencepiece vocabulary where "▁Hello" is reached merge by merge; there is no "▁▁"."""
    pieces = ["▁", "H", "e", "l", "o", "▁H", "▁He", "▁Hel", "▁Hell", "▁Hello"]
    tokens = ["<unk>", "<s>", "</s>", *pieces]
    scores = [0.0, 0.0, 0.0, *(-float(i) for i in range(len(pieces)))]
    token_types = [2, 3, 3, *[1] * len(pieces)]  # unknown, control, control, normal
    ids = {f"tokenizer.ggml.{name}_token_id": (i, _TYPES.UINT32) for i, name in enumerate(("unknown", "bos", "eos"))}
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


def test_a_sentencepiece_vocabulary_without_a_prefix_space_gets_none(tmp_path):
    extra = {"tokenizer.ggml.add_space_prefix": (False, _TYPES.BOOL)}
    tokenizer = _served_tokenizer(_sentencepiece_vocabulary(tmp_path, "no-prefix", extra))
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" Hello", add_special_tokens=False)) == ["▁Hello"]


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
