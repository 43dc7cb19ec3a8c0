"""A server process keeps PyTorch out (jaxserve/torch_free.py): the same configs, tokenizers and chat
templates through transformers' torch-free paths, and torch kept where a GGUF still needs converting."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.models.gguf_cache import converted_dir
from jaxserve.models.loader import bundled_model_path
from jaxserve.models.tokenizer import load_tokenizer

pytest.importorskip("torch", reason="the point is a process where torch is installed")

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]

READ_WITHOUT_TORCH = '''
import json, sys
from jaxserve.torch_free import keep_torch_out
kept_out = keep_torch_out(None)
from transformers import AutoConfig
from transformers.utils import is_torch_available
from jaxserve.models.gguf_cache import converted_dir
from jaxserve.models.loader import bundled_model_path
from jaxserve.models.tokenizer import load_tokenizer
directory = converted_dir(bundled_model_path())
tokenizer = load_tokenizer(directory)
config = AutoConfig.from_pretrained(directory)
print(json.dumps({
    "kept_out": kept_out, "torch_available": is_torch_available(), "torch_module": repr(sys.modules.get("torch")),
    "prompt": (prompt := tokenizer.apply_chat_template(json.loads(sys.argv[1]), add_generation_prompt=True,
                                                     tokenize=False)),
    "ids": tokenizer.encode(prompt, add_special_tokens=False), "config": config.to_dict()}, default=str))
'''


def run_python(code: str, *args: str, env: dict | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PyTorch was not found" not in done.stderr  # transformers' advice, at every start: kept quiet
    return done.stdout.strip().splitlines()[-1]


def test_configs_tokenizers_and_chat_templates_read_alike_without_torch():
    without = json.loads(run_python(READ_WITHOUT_TORCH, json.dumps(MESSAGES)))
    assert without["kept_out"] and not without["torch_available"] and without["torch_module"] == "None"
    directory = converted_dir(bundled_model_path())
    import transformers

    tokenizer = load_tokenizer(directory)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert "Why is the sky blue?" in prompt
    assert (without["prompt"], without["ids"]) == (prompt, tokenizer.encode(prompt, add_special_tokens=False))
    with_torch = json.loads(json.dumps(transformers.AutoConfig.from_pretrained(directory).to_dict(), default=str))
    assert {k: v for k, v in without["config"].items() if k != "dtype"} == \
        {k: v for k, v in with_torch.items() if k != "dtype"}  # dtype: a string without torch, a torch.dtype with


def test_a_gguf_still_to_convert_keeps_torch(tmp_path: Path):
    unconverted = tmp_path / "model.gguf"
    unconverted.write_bytes(os.urandom(4096))
    check = "import sys; from jaxserve.torch_free import keep_torch_out; print(keep_torch_out(sys.argv[1]))"
    env = {"JAXSERVE_CACHE_DIR": str(tmp_path / "cache")}
    assert run_python(check, str(unconverted), env=env) == "False"  # transformers' GGUF reader imports torch
    assert run_python(check, str(bundled_model_path()), env=env) == "True"  # its conversion ships with jaxserve
