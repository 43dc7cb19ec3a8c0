"""Engine fixtures: a tiny random Llama and an engine on it (one per test module)."""

import pytest

from tests.engine.test_llm_engine import make_engine


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def engine(llama_dir):
    return make_engine(llama_dir)
