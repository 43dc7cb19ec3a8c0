"""Config presets (bundled and from a file), overrides, the platform's preset, ServerConfig checks."""

import math
from pathlib import Path

import jax
import pytest

import jaxserve
from jaxserve.config import EngineConfig, ServerConfig, load_preset, platform_preset, preset_names

SOURCE_PRESETS = Path(jaxserve.__file__).parent / "configs"


def test_presets_load_and_overrides_win():
    config = EngineConfig.from_preset("cpu", max_num_seqs=4, dtype="float32", max_model_len=None)
    assert config.scheduler.max_num_seqs == 4
    assert config.model.dtype == "float32"
    assert config.buckets.token_buckets == (32, 128, 256)
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig.from_preset(None, no_such_flag=1)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig.from_preset(None, dtype="float8")


def test_limits_above_the_preset_s_ladder_extend_it_by_doubling(caplog):
    """vLLM's `--max-num-seqs 512 --max-num-batched-tokens 5000` on the gpu preset (256 sequences, 2,048
    tokens): each ladder doubles up to the limit, ending at it, instead of refusing to start; a limit within
    the ladder leaves it as it is, and a ladder given beside a limit must hold it."""
    with caplog.at_level("INFO", logger="jaxserve.config"):
        config = EngineConfig.from_preset("gpu", max_num_seqs=512, max_num_batched_tokens=5000)
    assert config.buckets.request_buckets == (1, 16, 64, 256, 512)
    assert config.buckets.token_buckets == (256, 512, 1024, 2048, 4096, 5000)
    assert "max_num_batched_tokens 5000 is above the preset's largest bucket: token_buckets 4096, 5000 added" \
        in caplog.text
    assert EngineConfig.from_preset("cpu", max_num_seqs=8).buckets == EngineConfig.from_preset("cpu").buckets
    # the cpu preset's steps hold 256 tokens, so at most 256 rows: no bucket of rows no step could fill
    assert EngineConfig.from_preset("cpu", max_num_seqs=512).buckets.request_buckets == (1, 4, 16, 64, 128, 256)
    with pytest.raises(ValueError, match=r"the largest request bucket \(4\) must cover max_num_seqs \(8\)"):
        EngineConfig.from_preset("cpu", max_num_seqs=8, request_buckets=(1, 4))


def test_every_bundled_preset_builds_an_engine_config():
    names = preset_names()
    assert names == sorted(p.stem for p in SOURCE_PRESETS.glob("*.yaml"))
    assert {"cpu", "default", "gpu"} <= set(names)
    for name in names:
        EngineConfig.from_preset(name)


def test_a_preset_file_is_read_from_its_path_and_unknown_names_list_the_choices(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("scheduler:\n  max_num_seqs: 2\nbuckets:\n  request_buckets: [1, 2]\n")
    assert EngineConfig.from_preset(str(path)).scheduler.max_num_seqs == 2
    with pytest.raises(FileNotFoundError, match="choose from cpu, default, gpu"):
        load_preset("no-such-preset")
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_preset(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("text,message", [
    ("scheduler: [1, 2\n", r"is not valid YAML at line 2, column 1: expected ',' or '\]'"),
    ("- 1\n- 2\n", "must map section names .* got list"),
    ("weights:\n  dtype: float32\n", "unknown section 'weights'"),
    ("scheduler:\n  - 3\n", r"scheduler must map field names to values, got \[3\]"),
    ("scheduler:\n  max_num_seq: 3\n", "scheduler has no field 'max_num_seq'; its fields: async_scheduling, "),
    ("scheduler:\n  max_num_seqs: many\n", "scheduler.max_num_seqs: Input should be a valid integer.*got 'many'"),
    ("buckets:\n  token_buckets: [16, big]\n", "buckets.token_buckets: Input should be a valid integer"),
    ("cache:\n  enable_prefix_caching: {}\n", "cache.enable_prefix_caching: Input should be a valid boolean"),
    ("lora:\n  lora_modules: [nope]\n", "lora.lora_modules: .*a LoRA module is name=path or a JSON object"),
])
def test_a_malformed_preset_file_is_refused_naming_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_preset(str(path))


def test_the_platform_preset_follows_the_jax_backend(monkeypatch, caplog):
    want = {"cpu": "cpu", "gpu": "gpu"}.get(jax.default_backend(), "default")
    with caplog.at_level("INFO", logger="jaxserve.config"):
        assert platform_preset() == want
    assert f"using preset '{want}': no --config given" in caplog.text
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert platform_preset() == "gpu"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert platform_preset() == "default"
    # Isolated: a subprocess asks its own jax (this process's patched one is not consulted).
    assert platform_preset(isolated=True) == want


def test_server_config_defaults_follow_vllm_and_bad_values_are_refused():
    config = ServerConfig()
    assert (config.access_log, config.server_log_level, config.log_requests) == (True, "info", False)
    assert not config.trust_request_chat_template and config.body_read_timeout == 30.0
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="body_read_timeout"):
            ServerConfig(body_read_timeout=bad)
    with pytest.raises(ValueError, match="server_log_level"):
        ServerConfig(server_log_level="verbose")


@pytest.mark.parametrize("fields,match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (dict(tensor_parallel_size=-4), "tensor_parallel_size must be >= 1"),
    (dict(num_processes=0), "process_id must be in"),
    (dict(num_processes=2, process_id=2, coordinator_address="h:1", tensor_parallel_size=2), "process_id must be in"),
    (dict(num_processes=2, process_id=-1, coordinator_address="h:1", tensor_parallel_size=2), "process_id must be in"),
    (dict(num_processes=2, process_id=1, tensor_parallel_size=2), "needs a coordinator_address"),
    (dict(num_processes=2, coordinator_address="h:1", tensor_parallel_size=3), "multiple of num_processes"),
    *[(dict(num_processes=2, coordinator_address=bad, tensor_parallel_size=2), "coordinator_address must be HOST:PORT")
      for bad in ("h", "h:", ":1234", "h:port", "h:-1", "h:0", "h:65535", "h:99999", "h:1.5")],
])
def test_parallel_settings_out_of_range_are_refused(fields, match):
    from jaxserve.config import ParallelConfig

    with pytest.raises(ValueError, match=match):
        ParallelConfig(**fields)


def test_a_multihost_engine_refuses_background_warmup():
    from jaxserve.config import EngineConfig

    with pytest.raises(ValueError, match="warms up fully"):
        EngineConfig.from_preset("cpu", num_processes=2, coordinator_address="127.0.0.1:1", tensor_parallel_size=2,
                                 warmup_mode="background")
    channel = EngineConfig.from_preset("cpu", num_processes=2, coordinator_address="10.0.0.1:1234",
                                       tensor_parallel_size=2).parallel.channel_address
    assert channel == ("10.0.0.1", 1235)


def test_the_kv_cache_dtype_is_one_of_the_listed_and_the_cli_takes_it():
    from jaxserve.cli import _engine_config, build_parser

    assert EngineConfig.from_preset(None, kv_cache_dtype="float16").cache.kv_cache_dtype == "float16"
    assert EngineConfig.from_preset(None, kv_cache_dtype="fp8").cache.kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16, fp8"):
        EngineConfig.from_preset(None, kv_cache_dtype="int8")
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "bfloat16", "--config", "cpu"])
    assert _engine_config(args).cache.kv_cache_dtype == "bfloat16"
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8", "--config", "cpu"])
    assert _engine_config(args).cache.kv_cache_dtype == "fp8"


def test_the_weight_dtype_is_one_of_the_listed_and_the_cli_takes_it():
    from jaxserve.cli import _engine_config, build_parser

    assert EngineConfig.from_preset(None).model.weight_dtype == "auto"
    assert EngineConfig.from_preset(None, weight_dtype="bfloat16").model.weight_dtype == "bfloat16"
    for bad in ("float16", "int8", "", None.__class__.__name__):
        with pytest.raises(ValueError, match="weight_dtype must be one of auto, float32, bfloat16"):
            EngineConfig.from_preset(None, weight_dtype=bad)
    args = build_parser().parse_args(["serve", "--weight-dtype", "bfloat16", "--dtype", "float32", "--config", "cpu"])
    config = _engine_config(args)
    assert (config.model.dtype, config.model.weight_dtype) == ("float32", "bfloat16")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--weight-dtype", "int4"])


def test_field_default_reads_a_default_or_calls_its_factory():
    import os

    from jaxserve.config import CompileConfig, field_default

    assert field_default(ServerConfig, "port") == 8000
    assert field_default(CompileConfig, "jobs") == (os.cpu_count() or 1)
    with pytest.raises(TypeError, match="no field 'nope'"):
        field_default(ServerConfig, "nope")


@pytest.mark.parametrize("owner,fields,message", [
    ("ModelConfig", dict(seed=-1), "seed must be >= 0"),
    ("ModelConfig", dict(max_logprobs=-1), "max_logprobs must be >= 0"),
    ("CacheConfig", dict(kv_cache_memory_gib=0.0), "kv_cache_memory_gib"),
    ("CacheConfig", dict(kv_cache_memory_gib=math.inf), "kv_cache_memory_gib"),
    ("CacheConfig", dict(kv_cache_memory_gib=math.nan), "kv_cache_memory_gib"),
    ("ServerConfig", dict(shutdown_timeout=math.nan), "shutdown_timeout must be >= 0"),
    ("ServerConfig", dict(shutdown_timeout=-1.0), "shutdown_timeout must be >= 0"),
    ("BucketBenchConfig", dict(rate=0.0), "rate must be a finite number"),
    ("BucketBenchConfig", dict(rate=math.inf), "rate must be a finite number"),
    ("BucketBenchConfig", dict(concurrency=0), "concurrency must be >= 1"),
    ("BucketBenchConfig", dict(num_requests=0), "num_requests must be >= 1"),
    ("BucketBenchConfig", dict(max_buckets=0), "max_buckets must be >= 1"),
    ("OfflineBenchConfig", dict(concurrency=(1, 0)), "concurrency levels must be >= 1"),
    ("OfflineBenchConfig", dict(concurrency=()), "concurrency levels must be >= 1"),
    ("OfflineBenchConfig", dict(output_len=0), "output_len must be >= 1"),
    ("CompileConfig", dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    ("CompileConfig", dict(jobs=0), "jobs must be >= 1"),
    ("CompileConfig", dict(max_loras=-1), "max_loras must be >= 0"),
    ("CompileConfig", dict(num_kv_pages=1), "num_kv_pages must be >= 2"),
    ("CompileConfig", dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in"),
])
def test_settings_out_of_range_are_refused_before_anything_runs(owner, fields, message):
    import jaxserve.config

    with pytest.raises(ValueError, match=message):
        getattr(jaxserve.config, owner)(**fields)
    assert getattr(jaxserve.config, owner)()  # the defaults pass
