"""A GGUF's config and tokenizer, converted once into an HF directory, behave as read from the GGUF."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
from transformers import AutoConfig

from jaxserve.models.gguf_cache import converted_dir
from jaxserve.models.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces, tabs\tand\nnewlines  ",
    "naïve café — 東京 🚀 ÷ ∑",
    "<|im_start|>user\nhi<|im_end|>",  # special tokens in text
    "def f(x):\n    return x ** 2  # code",
]


@pytest.mark.slow
def test_the_converted_tokenizer_and_config_match_the_gguf(smollm2_gguf):
    directory = converted_dir(smollm2_gguf)
    tokenizer = load_tokenizer(directory)
    smollm2_tokenizer = load_tokenizer(smollm2_gguf.parent, smollm2_gguf.name)  # through transformers' GGUF
    for text in TEXTS:
        ids = smollm2_tokenizer.encode(text)
        assert tokenizer.encode(text) == ids
        assert tokenizer.decode(ids) == smollm2_tokenizer.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    render = dict(add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(messages, **render) == smollm2_tokenizer.apply_chat_template(
        messages, **render
    )
    assert len(tokenizer) == len(smollm2_tokenizer)
    assert tokenizer.eos_token_id == smollm2_tokenizer.eos_token_id
    assert tokenizer.all_special_ids == smollm2_tokenizer.all_special_ids

    direct = AutoConfig.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name).to_dict()
    cached = AutoConfig.from_pretrained(str(directory)).to_dict()
    assert cached.pop("_name_or_path") != direct.pop("_name_or_path")  # only where it was read from differs
    assert cached == direct


def test_the_conversion_happens_once_per_file_content(smollm2_gguf, tmp_path):
    converted_dir(smollm2_gguf)
    start = time.perf_counter()
    again = converted_dir(smollm2_gguf)
    assert time.perf_counter() - start < 2.0  # a hash and two stats, not a conversion
    assert again == converted_dir(smollm2_gguf)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"not the same bytes")
    from jaxserve.models.gguf_cache import cache_root, file_sha256

    assert file_sha256(other) != file_sha256(smollm2_gguf)
    assert again.parent == cache_root() and again.name.startswith(file_sha256(smollm2_gguf))


def test_a_file_is_hashed_once_until_it_changes(tmp_path, monkeypatch):
    """The content digest that keys the cache is remembered by the file's path, inode, size and mtime: a
    second start reads no byte of the file, a rewritten file is hashed again."""
    from jaxserve.models import gguf_cache

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"first contents")
    first = gguf_cache.content_digest(path)
    assert first == gguf_cache.file_sha256(path)
    hashed = []
    monkeypatch.setattr(gguf_cache, "file_sha256", lambda p: hashed.append(p) or "hashed again")
    assert gguf_cache.content_digest(path) == first and hashed == []
    path.write_bytes(b"other contents")
    os.utime(path, ns=(1, 10**18))  # a modification time unlike the first write's, whatever the clock's step
    assert gguf_cache.content_digest(path) == "hashed again" and hashed == [path]


@pytest.mark.slow
def test_the_cached_tensors_are_the_gguf_tensors(smollm2_gguf):
    import numpy as np

    from jaxserve.models.gguf import iter_gguf_tensors
    from jaxserve.models.gguf_cache import iter_cached_gguf_tensors

    first = dict(iter_cached_gguf_tensors(smollm2_gguf, 9, 3))  # writes the copy if this session has none
    cached = dict(iter_cached_gguf_tensors(smollm2_gguf, 9, 3))  # reads it
    direct = dict(iter_gguf_tensors(str(smollm2_gguf), 9, 3))
    assert cached.keys() == direct.keys() == first.keys()
    for name, array in direct.items():
        assert cached[name].dtype == np.float32 and np.array_equal(cached[name], array), name


def test_the_bundled_model_converts_without_torch(smollm2_gguf, tmp_path):
    """Serving installs no torch, and transformers' GGUF reader imports it: the bundled model's converted
    files ship with the package. In a process where torch cannot be imported, the bundled model's config and
    tokenizer load from a fresh cache, and another GGUF gets an error that says what to install."""
    other = tmp_path / "other.gguf"
    other.write_bytes(smollm2_gguf.read_bytes() + b"\0")  # another file: no shipped conversion
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # `import torch` fails, as where it is not installed
        from pathlib import Path
        from transformers import AutoConfig
        from jaxserve.models.gguf_cache import converted_dir
        from jaxserve.models.tokenizer import load_tokenizer
        directory = converted_dir(Path({str(smollm2_gguf)!r}))
        print("layers", AutoConfig.from_pretrained(str(directory)).num_hidden_layers)
        print("ids", load_tokenizer(directory).encode("Hello, world!"))
        try:
            converted_dir(Path({str(other)!r}))
        except RuntimeError as error:
            print("refused:", error)
    """)
    env = {**os.environ, "JAXSERVE_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    want = load_tokenizer(converted_dir(smollm2_gguf)).encode("Hello, world!")
    assert "layers 30" in result.stdout and f"ids {want}" in result.stdout
    assert "refused:" in result.stdout and "needs torch" in result.stdout
