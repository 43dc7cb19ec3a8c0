"""Resolving --model: bundled GGUF, local paths, hub ids offline (at a revision, in a download directory)."""

import json
import shutil
from pathlib import Path

import pytest

from jaxserve.models.loader import bundled_model_path, resolve_model


def test_no_model_means_the_bundled_smollm2():
    source = resolve_model(None)
    assert source.gguf_file == bundled_model_path().name
    assert source.name == "SmolLM2-135M-Instruct"


def test_missing_local_paths_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="model path not found"):
        resolve_model("./does/not/exist")


def test_uncached_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        resolve_model("jaxserve-tests/definitely-not-cached")


def test_cached_hub_id_loads_offline(tmp_path, monkeypatch, tiny_model_dir):
    """A hub id resolves through huggingface-hub's cache layout with no network."""
    import huggingface_hub.constants

    from jaxserve.models.loader import load_model

    revision = "0" * 40
    repo = tmp_path / "models--jaxserve-tests--tiny-llama"
    shutil.copytree(tiny_model_dir("llama"), repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    source = resolve_model("jaxserve-tests/tiny-llama")
    assert source.directory == repo / "snapshots" / revision
    loaded = load_model("jaxserve-tests/tiny-llama", dtype="float32")
    assert loaded.name == "jaxserve-tests/tiny-llama" and loaded.cfg.num_kv_heads == 2


def test_all_auto_dtypes_are_16_bit_on_a_cpu_that_multiplies_bfloat16(monkeypatch):
    from jaxserve.models import loader

    for has_bf16 in (True, False):
        monkeypatch.setattr(loader, "cpu_has_bf16_dots", lambda has_bf16=has_bf16: has_bf16)
        fast = ("bfloat16", "bfloat16") if has_bf16 else ("auto", "auto")
        assert loader.fast_cpu_dtypes("auto", "auto", "auto", "auto", "cpu") == fast
        assert loader.fast_cpu_dtypes("auto", "auto", "auto", "cpu-native", "cpu") == fast
        # Any dtype given keeps the rest as it was (--dtype float32: everything float32, as before).
        assert loader.fast_cpu_dtypes("float32", "auto", "auto", "auto", "cpu") == ("auto", "auto")
        assert loader.fast_cpu_dtypes("auto", "float32", "auto", "auto", "cpu") == ("float32", "auto")
        assert loader.fast_cpu_dtypes("auto", "auto", "float16", "auto", "cpu") == ("auto", "float16")
        # Not on GPUs, nor under the Pallas kernel (its cache is the model's dtype).
        assert loader.fast_cpu_dtypes("auto", "auto", "auto", "auto", "gpu") == ("auto", "auto")
        assert loader.fast_cpu_dtypes("auto", "auto", "auto", "interpret", "cpu") == ("auto", "auto")


def _hub_cache(cache: Path, model_dir: Path, refs: dict[str, str]) -> Path:
    """A Hugging Face cache at `cache` holding `model_dir` as the hub repo jaxserve-tests/tiny-llama, one
    snapshot per commit that `refs` (branch or tag -> commit) name."""
    repo = cache / "models--jaxserve-tests--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    for ref, commit in refs.items():
        if not (repo / "snapshots" / commit).exists():
            shutil.copytree(model_dir, repo / "snapshots" / commit)
        (repo / "refs" / ref).write_text(commit)
    return repo


def test_a_revision_in_a_download_dir_resolves_offline(tmp_path, monkeypatch, tiny_model_dir):
    """`--revision` picks the branch or tag's snapshot and `--download-dir` the cache it is in (vLLM's
    flags); the default cache is not looked at."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "default-cache"))
    main, tagged = "1" * 40, "2" * 40
    repo = _hub_cache(tmp_path / "mine", tiny_model_dir("llama"), {"main": main, "v2": tagged})
    downloads = str(tmp_path / "mine")
    assert resolve_model("jaxserve-tests/tiny-llama", download_dir=downloads).directory == repo / "snapshots" / main
    assert resolve_model("jaxserve-tests/tiny-llama", "v2", downloads).directory == repo / "snapshots" / tagged
    with pytest.raises(RuntimeError, match="not in the local Hugging Face cache"):
        resolve_model("jaxserve-tests/tiny-llama", "v3", downloads)
    with pytest.raises(RuntimeError, match="not in the local Hugging Face cache"):
        resolve_model("jaxserve-tests/tiny-llama")  # the default cache does not hold it


def test_an_engine_loads_a_revision_from_a_download_dir(tmp_path, monkeypatch, tiny_model_dir):
    """The engine's own load takes the revision and the directory (the front end's check is test_cli's)."""
    import huggingface_hub.constants

    from tests.engine.helpers import make_engine

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "default-cache"))
    tagged = "2" * 40
    repo = _hub_cache(tmp_path / "mine", tiny_model_dir("llama"), {"main": "1" * 40, "v2": tagged})
    engine = make_engine("jaxserve-tests/tiny-llama", warmup=False, revision="v2", download_dir=str(tmp_path / "mine"))
    assert engine.info.model_dir == str(repo / "snapshots" / tagged)


def test_a_tokenizer_from_elsewhere_replaces_the_model_s(tmp_path, monkeypatch, tiny_model_dir):
    """vLLM's --tokenizer: the engine renders and tokenizes with the given directory's tokenizer and chat
    template, and stops at its EOS beside the model's own; a hub id's tokenizer files come from the cache at
    --tokenizer-revision (alone: the model's own tokenizer at that revision); a path that is not there, a
    directory without a tokenizer and a tokenizer larger than the model's vocabulary are one line each."""
    import huggingface_hub.constants

    from jaxserve.models.loader import load_model
    from jaxserve.models.source import resolve_tokenizer
    from jaxserve.models.tokenizer import apply_chat_template
    from tests.engine.helpers import make_engine

    base = tiny_model_dir("llama")
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, tokenizer_dir / name)
    template = "<<{{ messages[0]['content'] }}>>"
    (tokenizer_dir / "chat_template.jinja").write_text(template)
    assert (base / "chat_template.jinja").read_text() != template
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    engine = make_engine(base, warmup=False, tokenizer=str(tokenizer_dir))
    assert engine.tokenizer.chat_template == template
    assert engine.tokenizer.decode(apply_chat_template(engine.tokenizer, [{"role": "user", "content": "Hi"}])) == \
        "<<Hi>>"
    own = load_model(str(base), "float32").eos_token_ids
    assert own == (2,) and engine.info.eos_token_ids == (2, 0)  # <|im_end|> the model's, <|endoftext|> the tokenizer's

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "default-cache"))
    repo = _hub_cache(tmp_path / "mine", tokenizer_dir, {"v2": "2" * 40})
    found = resolve_tokenizer("jaxserve-tests/tiny-llama", "v2", str(tmp_path / "mine"))
    assert found == repo / "snapshots" / ("2" * 40)
    _hub_cache(tmp_path / "model-cache", base, {"main": "1" * 40})
    shutil.copytree(tokenizer_dir, tmp_path / "model-cache" / "models--jaxserve-tests--tiny-llama" / "snapshots" /
                    ("3" * 40))
    (tmp_path / "model-cache" / "models--jaxserve-tests--tiny-llama" / "refs" / "v3").write_text("3" * 40)
    by_revision = make_engine("jaxserve-tests/tiny-llama", warmup=False, download_dir=str(tmp_path / "model-cache"),
                              tokenizer_revision="v3")
    assert by_revision.tokenizer.chat_template == template  # the model's main, its tokenizer's v3
    assert by_revision.info.model_dir.endswith("1" * 40)
    with pytest.raises(FileNotFoundError, match=r"tokenizer not found: \./no-such-tokenizer"):
        resolve_tokenizer("./no-such-tokenizer")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no tokenizer files"):
        resolve_tokenizer(str(tmp_path / "empty"))
    gpt2 = tiny_model_dir("gpt2")  # the same tokenizer files: fits; a vocabulary cut to 100 does not
    small = tmp_path / "small-vocab"
    shutil.copytree(gpt2, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(ValueError, match="tokens, more than the model's vocabulary of 100: it is not this model's"):
        load_model(str(small), "float32", load_format="dummy", tokenizer=str(tokenizer_dir))
