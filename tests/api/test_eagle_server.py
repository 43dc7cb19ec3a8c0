"""`jaxserve serve --speculative-config '{"method": "eagle", "model": ...}'` through the openai SDK: the server
loads the EAGLE drafter beside the bundled model (its embeddings and LM head the target's), answers greedy and
streamed requests as without it, and reports the drafts on /metrics. (The
engine tests hold the drafts to transformers' float64 reference and the outputs to plain decoding's:
tests/engine/test_eagle.py.)"""

import json

import openai
import pytest

from jaxserve.models.gguf_cache import converted_dir
from tests.api.helpers import MODEL, metric, start_server, stop_server, wait_idle
from tests.eagle import write_eagle

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_an_eagle_drafter_serves_through_the_openai_sdk(tmp_path, compile_cache, smollm2_gguf):
    target_config = json.loads((converted_dir(smollm2_gguf) / "config.json").read_text())
    drafter = tmp_path / "eagle-smollm2"
    write_eagle(drafter, target_config, scale=0.05)
    spec = json.dumps({"method": "eagle", "model": str(drafter), "num_speculative_tokens": 3})
    server = start_server(tmp_path, compile_cache, "--speculative-config", spec)
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=40)
        text = reply.choices[0].message.content
        assert "Paris" in text and reply.usage.completion_tokens > 5
        stream = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=40,
                                                stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text
        seeded = [client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0.8, seed=4,
                                            max_tokens=30).choices[0].text for _ in range(2)]
        assert seeded[0] == seeded[1]
        wait_idle(server)
        drafted = metric(server, "jaxserve:spec_decode_num_draft_tokens_total")
        assert drafted > 0
        assert 0 <= metric(server, "jaxserve:spec_decode_num_accepted_tokens_total") <= drafted
        assert "loading the EAGLE drafter" in server.log()
    finally:
        stop_server(server)
    assert server.process.returncode == 0
    assert "Traceback" not in server.log()
