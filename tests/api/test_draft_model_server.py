"""`jaxserve serve --speculative-config '{"model": ...}'` through the openai SDK: the server loads the draft
beside the model, answers greedy and streamed requests alike, reports vLLM's speculative series on
/metrics, and refuses at start a draft it cannot load, naming it. (The engine tests hold the outputs to plain
decoding's token for token: tests/engine/test_draft_model.py.)"""

import json
import os
import subprocess
import sys

import openai
import pytest

from tests.api.helpers import MODEL, metric, start_server, stop_server, wait_idle

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_a_draft_model_serves_through_the_openai_sdk(tmp_path, compile_cache, smollm2_gguf):
    # the bundled file's 4-bit blocks draft for its dequantized weights: most drafts agree
    draft = json.dumps({"model": str(smollm2_gguf), "num_speculative_tokens": 3})
    server = start_server(tmp_path, compile_cache, "--speculative-config", draft)
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
        assert 0 <= metric(server, "jaxserve:spec_decode_num_accepted_tokens_total") <= drafted
        assert "loading the draft model" in server.log()
    finally:
        stop_server(server)
    assert server.process.returncode == 0
    assert "Traceback" not in server.log()


def test_a_draft_that_cannot_load_stops_the_start_naming_it(tmp_path):
    missing = tmp_path / "no-such-draft"
    result = subprocess.run(
        [sys.executable, "-m", "jaxserve", "serve", "--port", "1", "--speculative-config",
         json.dumps({"model": str(missing), "num_speculative_tokens": 2})],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode != 0
    assert f"the draft model (--speculative-config's \"model\"): model path not found: {missing}" in result.stderr, (
        result.stderr[-2000:])
