"""OpenAI clients of the shared `server` (tests/conftest.py; the server itself is in tests/api/helpers.py), and
a tiny model that speaks harmony's markers."""

import copy

import pytest

from tests.api.helpers import API_KEY


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def async_client(server):
    """One per test: its pooled connections belong to the event loop of the test's own asyncio.run."""
    import openai

    return openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=300)


HARMONY_TOKENS = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>", "<|call|>", "<|constrain|>"]


@pytest.fixture(scope="session")
def harmony_model_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama whose tokenizer has harmony's markers (GPT-OSS's) as special tokens."""
    from tests.conftest import _tiny_hf_model

    directory = tmp_path_factory.mktemp("tiny-harmony")
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    model = _tiny_hf_model("llama").eval()
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
