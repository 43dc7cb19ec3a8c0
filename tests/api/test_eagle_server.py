"""`jaxserve serve --speculative-config '{"method": "eagle", "model": ...}'` through the openai SDK: the server
loads the EAGLE drafter beside the bundled model (its embeddings and LM head the target's), answers greedy and
streamed requests as without it, and reports the drafts on /metrics. (The
engine tests hold the drafts to transformers' float64 reference and the outputs to plain decoding's:
tests/engine/test_eagle.py.)"""

import json

import pytest

from jaxserve.models.gguf_cache import converted_dir
from tests.api.helpers import check_speculative_serving, start_server, stop_server
from tests.eagle import write_eagle


@pytest.mark.slow
def test_an_eagle_drafter_serves_through_the_openai_sdk(tmp_path, compile_cache, smollm2_gguf):
    target_config = json.loads((converted_dir(smollm2_gguf) / "config.json").read_text())
    drafter = tmp_path / "eagle-smollm2"
    write_eagle(drafter, target_config, scale=0.05)
    spec = json.dumps({"method": "eagle", "model": str(drafter), "num_speculative_tokens": 3})
    server = start_server(tmp_path, compile_cache, "--speculative-config", spec)
    try:
        assert check_speculative_serving(server) > 0
        assert "loading the EAGLE drafter" in server.log()
    finally:
        stop_server(server)
    assert server.process.returncode == 0
    assert "Traceback" not in server.log()
