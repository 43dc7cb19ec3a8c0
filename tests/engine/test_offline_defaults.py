"""`LLM`'s default sampling parameters, vLLM's: the model's generation_config.json under
`override_generation_config`, used by `generate` and `chat` when given no SamplingParams; and vLLM's
options that change nothing here, taken with a warning."""

import json
import logging
import shutil

import pytest

from jaxserve import LLM
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import LADDER, make_prompts


def test_generate_without_params_samples_with_the_model_s_defaults(tiny_model_dir, tmp_path):
    """The model says top_k 1 (greedy) and 5 new tokens; the override says 3: `generate(prompts)` gives the
    3 greedy tokens that explicit greedy parameters give."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 5,
                                                                  "temperature": 0.7}))
    llm = LLM(model=str(model_dir), dtype="float32", override_generation_config={"max_new_tokens": 3},
              max_model_len=256, num_kv_pages=256, page_size=4, **LADDER)
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.max_tokens, defaults.temperature) == (1, 3, 0.7)
    prompts = make_prompts(3)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, use_tqdm=False)]
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    assert got == [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert [len(tokens) for tokens in got] == [3, 3, 3]
    chat = llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) == 3


def test_a_bad_override_is_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="top_p: top_p must be a finite number"):
        LLM(model="/nonexistent", override_generation_config={"top_p": 0})


def test_llm_takes_vllm_s_options_that_change_nothing_with_a_warning(monkeypatch, caplog):
    """`LLM(trust_remote_code=True, swap_space=4, ...)`, as vLLM's LLM is called: each such option is
    named in a warning and left out of the engine's config, which gets the others; a misspelled option is
    still an error."""
    from jaxserve import llm as llm_module

    class Built(Exception):
        pass

    def engine(config):
        raise Built(config)

    monkeypatch.setattr(llm_module, "LLMEngine", engine)
    with caplog.at_level(logging.WARNING, logger="jaxserve.llm"), pytest.raises(Built) as built:
        LLM(trust_remote_code=True, swap_space=4, enforce_eager=True, max_num_seqs=4, config="cpu")
    config = built.value.args[0]
    assert config.enforce_eager and config.scheduler.max_num_seqs == 4
    assert [record.getMessage().split(" changes nothing")[0] for record in caplog.records
            if record.name == "jaxserve.llm"] == ["trust_remote_code=True", "swap_space=4"]
    with pytest.raises(TypeError, match="unknown engine option 'swap_spce'"):
        LLM(swap_spce=4, config="cpu")
    with pytest.raises(ValueError, match="pipeline_parallel_size: '2': jaxserve runs one pipeline stage"):
        LLM(pipeline_parallel_size=2, config="cpu")


def test_llm_takes_vllm_s_names_of_options_jaxserve_names_otherwise(monkeypatch):
    """`LLM(block_size=32, num_gpu_blocks_override=512, task="embed")`, vLLM's names, set the page size, the
    page count and the pooling runner, as serve's flags of those names do; both names at odds are refused."""
    from jaxserve import llm as llm_module

    class Built(Exception):
        pass

    def engine(config):
        raise Built(config)

    monkeypatch.setattr(llm_module, "LLMEngine", engine)
    with pytest.raises(Built) as built:
        LLM(block_size=32, num_gpu_blocks_override=512, task="embed", config="cpu")
    config = built.value.args[0]
    assert (config.cache.page_size, config.cache.num_kv_pages, config.runner) == (32, 512, "pooling")
    with pytest.raises(Built) as built:
        LLM(block_size=32, page_size=32, config="cpu")
    assert built.value.args[0].cache.page_size == 32
    with pytest.raises(ValueError, match="block_size=32 and page_size=16 set the same option"):
        LLM(block_size=32, page_size=16, config="cpu")
    with pytest.raises(ValueError, match="task: 'draft': say --runner generate or --runner pooling"):
        LLM(task="draft", config="cpu")


def test_llm_starts_from_serve_s_preset_for_the_platform(monkeypatch):
    """`LLM()` with no `config` takes the preset `serve` takes on this backend (vLLM's LLM and serve share
    their defaults): on a CPU the `cpu` ladder, not the forty-odd buckets of the default one, which made every
    `LLM()` warm up for half a minute. Asked in a subprocess where cores run in processes of their own, as
    serve asks; `config` wins where given."""
    import jax

    from jaxserve import config as config_module
    from jaxserve import llm as llm_module
    from jaxserve.config import EngineConfig, load_preset

    class Built(Exception):
        pass

    def engine(config):
        raise Built(config)

    monkeypatch.setattr(llm_module, "LLMEngine", engine)
    expected = {"cpu": "cpu", "gpu": "gpu"}.get(jax.default_backend(), "default")
    with pytest.raises(Built) as built:
        LLM()
    ladder = load_preset(expected).get("buckets", {})
    assert built.value.args[0].buckets.token_buckets == tuple(ladder["token_buckets"])
    assert built.value.args[0].buckets.token_buckets != EngineConfig().buckets.token_buckets
    probes = []
    monkeypatch.setattr(config_module, "platform_preset", lambda isolated: probes.append(isolated) or "cpu")
    for options in ({"data_parallel_size": 2}, {"engine_process": True}, {}):
        with pytest.raises(Built):
            LLM(**options)
    assert probes == [True, True, False]
    with pytest.raises(Built) as built:
        LLM(config="default")
    assert built.value.args[0].buckets.token_buckets == EngineConfig().buckets.token_buckets and len(probes) == 3
