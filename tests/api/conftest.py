"""OpenAI clients of the shared `server` (tests/conftest.py; the server itself is in tests/api/helpers.py)."""

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
