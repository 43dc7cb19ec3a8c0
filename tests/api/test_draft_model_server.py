"""`jaxserve serve --speculative-config '{"model": ...}'` through the openai SDK: the server loads the draft
beside the model, answers greedy and streamed requests alike, reports vLLM's speculative series on
/metrics, and refuses at start a draft it cannot load, naming it. (The engine tests hold the outputs to plain
decoding's token for token: tests/engine/test_draft_model.py.)"""

import json
import os
import subprocess
import sys

import pytest

from tests.api.helpers import check_speculative_serving, start_server, stop_server


@pytest.mark.slow
def test_a_draft_model_serves_through_the_openai_sdk(tmp_path, compile_cache, smollm2_gguf):
    # the bundled file's 4-bit blocks draft for its dequantized weights: most drafts agree
    draft = json.dumps({"model": str(smollm2_gguf), "num_speculative_tokens": 3})
    server = start_server(tmp_path, compile_cache, "--speculative-config", draft)
    try:
        check_speculative_serving(server)
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
