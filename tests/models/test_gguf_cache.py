"""A GGUF's config and tokenizer, converted once into an HF directory, behave as read from the GGUF."""

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
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
    assert cached.pop("_name_or_path") != direct.pop("_name_or_path")  # where it was read from differs
    # and the ends of generation: llama.cpp's, <|endoftext|> beside the file's EOS <|im_end|> (gguf_tokenizer)
    assert (cached.pop("eos_token_id"), direct.pop("eos_token_id")) == ([2, 0], 2)
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


def test_the_plain_view_reader_reads_what_gguf_reads(smollm2_gguf):
    """The reader that slices a plain view of the mapping (jaxserve/models/gguf.py) overrides a method of
    gguf's reader: it must still read every field and tensor as gguf's own does."""
    import gguf
    import numpy as np

    from jaxserve.models.gguf import _PlainViewReader

    theirs, ours = gguf.GGUFReader(smollm2_gguf), _PlainViewReader(smollm2_gguf)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].contents() == field.contents(), name
        assert ours.fields[name].types == field.types
    assert ours.data_offset == theirs.data_offset and len(ours.tensors) == len(theirs.tensors) == 272
    for mine, want in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.shape.tolist()) == (want.name, want.tensor_type, want.shape.tolist())
        np.testing.assert_array_equal(mine.data, want.data)


def _tiny_gguf(path, context_length: int) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_context_length(context_length)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_file_is_parsed_once_until_it_changes(tmp_path):
    from jaxserve.models.gguf import read_gguf

    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path, 128)
    first = read_gguf(path)
    assert read_gguf(str(path)) is first and first.fields["llama.context_length"].contents() == 128
    _tiny_gguf(path, 256)  # rewritten: another size or modification time
    assert read_gguf(path).fields["llama.context_length"].contents() == 256


def test_a_conversion_through_transformers_parses_the_file_once(smollm2_gguf, tmp_path, monkeypatch):
    """transformers parses a GGUF for its config and again for its tokenizer, and jaxserve for the head size
    and then the weights: within a conversion, all of them share one parse."""
    import gguf

    from jaxserve.models import gguf as jaxserve_gguf
    from jaxserve.models.gguf_cache import convert_with_transformers

    parses, parse = [], gguf.GGUFReader.__init__

    def counted(self, path, *args, **kwargs) -> None:  # every parse, by gguf's reader or jaxserve's
        parses.append(path)
        parse(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted)
    jaxserve_gguf._parsed.cache_clear()
    convert_with_transformers(smollm2_gguf, tmp_path)
    assert len(parses) == 1
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader  # transformers' reader given back
    assert (tmp_path / "config.json").is_file() and (tmp_path / "tokenizer.json").is_file()
    list(jaxserve_gguf.iter_gguf_tensors(str(smollm2_gguf), 9, 3))
    assert len(parses) == 1  # the weights too


def test_a_file_past_the_cache_s_limit_is_read_from_the_file(smollm2_gguf, tmp_path, monkeypatch):
    """No float32 copy for a large file: its tensors come straight from the GGUF, and nothing is written (the
    copy takes float32's 4 bytes a weight, on disk and in memory while the first start writes it)."""
    import numpy as np

    from jaxserve.models import gguf_cache
    from jaxserve.models.gguf import iter_gguf_tensors

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    size = gguf_cache.copy_bytes(smollm2_gguf, keep_blocks=False)
    assert size > 4 * 134_000_000  # SmolLM2-135M's weights in float32
    assert gguf_cache.copy_bytes(smollm2_gguf, keep_blocks=True) < size / 4  # its Q4_1 blocks as stored
    monkeypatch.setattr(gguf_cache, "MAX_COPY_BYTES", size - 1)
    streamed = dict(gguf_cache.iter_cached_gguf_tensors(smollm2_gguf, 9, 3))
    assert not list(tmp_path.rglob("tensors*.safetensors"))
    direct = dict(iter_gguf_tensors(str(smollm2_gguf), 9, 3))
    assert streamed.keys() == direct.keys()
    assert all(np.array_equal(streamed[name], array) for name, array in direct.items())


def test_a_blocks_copy_is_named_by_the_kept_formats_and_older_copies_go(smollm2_gguf, tmp_path, monkeypatch):
    """The copy with kept blocks names the formats kept, so that a copy written when fewer were kept (holding
    some of them dequantized) is never read; once the new copy is written the older ones are removed, and the
    float32 copy and one keeping more formats (a newer jaxserve's, sharing the cache) stay."""
    from jaxserve.models import gguf_cache
    from jaxserve.models.gguf_weights import KEPT_KINDS, GgufTensor

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    directory = converted_dir(smollm2_gguf)
    kinds = "-".join(sorted(kind.lower() for kind in KEPT_KINDS))
    unsorted = "-".join(kind.lower() for kind in reversed(sorted(KEPT_KINDS)))  # the same formats, another order
    for name in ("tensors-blocks-2", "tensors-blocks-2-q4_0-q8_0", f"tensors-blocks-2-{unsorted}",
                 f"tensors-blocks-2-{kinds}-iq3_s", "tensors"):
        (directory / f"{name}.safetensors").write_bytes(b"another copy")
    first = dict(gguf_cache.iter_cached_gguf_tensors(smollm2_gguf, 9, 3, keep_blocks=True))
    copies = sorted(path.name for path in directory.glob("tensors*.safetensors"))
    assert copies == [f"tensors-blocks-2-{kinds}-iq3_s.safetensors", f"tensors-blocks-2-{kinds}.safetensors",
                      "tensors.safetensors"]
    again = dict(gguf_cache.iter_cached_gguf_tensors(smollm2_gguf, 9, 3, keep_blocks=True))
    assert again.keys() == first.keys()
    assert all(isinstance(again[name], GgufTensor) == isinstance(array, GgufTensor) for name, array in first.items())


def test_the_shipped_conversion_is_a_fresh_one(smollm2_gguf, tmp_path):
    """The bundled model's converted files ship with the package (serving needs no torch): they are what a
    conversion writes now (else `scripts/refresh_bundled_conversion.py` rewrites them)."""
    import gzip
    import json
    from importlib import resources

    from jaxserve.models.gguf_cache import _SHIPPED_FILES, convert_with_transformers

    convert_with_transformers(smollm2_gguf, tmp_path)
    shipped = resources.files("jaxserve.models").joinpath("bundled")
    for name in _SHIPPED_FILES:
        data = shipped.joinpath(name).read_bytes()
        fresh = (tmp_path / name.removesuffix(".gz")).read_bytes()
        if name.endswith(".gz"):
            data = gzip.decompress(data)
        if name.endswith(".jinja"):
            assert data == fresh, name
            continue
        data, fresh = json.loads(data), json.loads(fresh)
        for key in ("transformers_version", "local_files_only"):  # the writer's, not the tokenizer's
            data.pop(key, None), fresh.pop(key, None)
        assert data == fresh, f"{name} differs from a fresh conversion: run scripts/refresh_bundled_conversion.py"
