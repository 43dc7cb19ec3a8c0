"""`load_tokenizer` loads a generic tokenizers-backed tokenizer (a converted GGUF's) through its class,
without AutoTokenizer's import: the same tokenizer AutoTokenizer gives, and a model-specific class still
goes through AutoTokenizer."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.models.gguf_cache import converted_dir
from jaxserve.models.tokenizer import load_tokenizer

TEXT = "Hello world, é 日本語 \t  tabs\n\nnew lines <|im_start|> 1234567 🙂"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_gguf: Path) -> Path:
    return converted_dir(smollm2_gguf)


def test_a_generic_tokenizer_is_the_one_autotokenizer_gives(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(tokenizer_dir), AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert json.loads((tokenizer_dir / "tokenizer_config.json").read_text())["tokenizer_class"] in \
        ("TokenizersBackend", "PreTrainedTokenizerFast")
    assert type(ours) is type(auto)
    assert {k: str(v) for k, v in vars(ours).items()} == {k: str(v) for k, v in vars(auto).items()}
    assert ours(TEXT)["input_ids"] == auto(TEXT)["input_ids"]
    assert ours.decode(list(range(0, 49152, 97))) == auto.decode(list(range(0, 49152, 97)))
    assert (ours.all_special_ids, ours.eos_token_id, ours.bos_token_id) == \
        (auto.all_special_ids, auto.eos_token_id, auto.bos_token_id)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == \
        auto.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)


def test_a_generic_tokenizer_loads_without_autotokenizers_import(tokenizer_dir: Path):
    pytest.importorskip("transformers.tokenization_utils_tokenizers",
                        reason="transformers 4 has no TokenizersBackend: its tokenizers load through AutoTokenizer")
    code = ("import sys; from jaxserve.models.tokenizer import load_tokenizer; "
            f"load_tokenizer(__import__('pathlib').Path({str(tokenizer_dir)!r})); "
            "print('transformers.models.auto.tokenization_auto' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_a_model_specific_tokenizer_class_goes_through_autotokenizer(tokenizer_dir: Path, tmp_path: Path):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    tokenizer = load_tokenizer(tmp_path)
    assert type(tokenizer).__name__ == "GPT2Tokenizer"
    assert tokenizer(TEXT)["input_ids"] == load_tokenizer(tokenizer_dir)(TEXT)["input_ids"]
