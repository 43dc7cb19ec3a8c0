"""The CLI: help without jax, every flag described with its default, subcommand usage on a bad flag,
vLLM's server flags and variables, the model check before binding, `bench serve`'s table order, and the
defaults of flags left out, which are the config dataclasses'."""

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from jaxserve.cli import _engine_config, _HelpFormatter, _server_config, build_parser, main
from jaxserve.cli_flags import (
    BUCKET_ARRIVAL_FLAGS,
    BUCKET_FLAGS,
    COMPILE_FLAGS,
    GENERATE_FLAGS,
    OFFLINE_FLAGS,
    SERVE_BENCH_FLAGS,
    SERVER_FLAGS,
    Flag,
    read_flags,
)
from jaxserve.config import (
    BucketBenchConfig,
    CompileConfig,
    EngineConfig,
    GenerateConfig,
    LoraConfig,
    LoraModule,
    OfflineBenchConfig,
    ServeBenchConfig,
    ServerConfig,
    SpeculativeConfig,
    platform_preset,
)

HELP_COMMANDS = [[], ["serve"], ["generate"], ["bench"], ["bench", "offline"], ["bench", "serve"]]


def _run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "jaxserve", *argv], capture_output=True, text=True,
                          timeout=180, env=env)


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_help_does_not_import_jax():
    code = (
        "import contextlib, io, sys\n"
        "from jaxserve.cli import main\n"
        f"for argv in {HELP_COMMANDS!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main([*argv, '--help'])\n"
        "heavy = sorted({'jax', 'jaxlib', 'flax', 'transformers', 'torch'} & set(sys.modules))\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_every_flag_of_every_command_is_described_with_its_default():
    checked = 0
    for parser in _parsers(build_parser()):
        formatter = _HelpFormatter(parser.prog)
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction):
                continue
            text = formatter._get_help_string(action)
            name = f"{parser.prog} {action.option_strings or action.dest}"
            assert action.help, f"{name} has no description"
            assert "default" in text or action.required, f"{name} does not show its default: {text!r}"
            assert "default: None" not in text, f"{name}: say what no value means, not 'None'"
            checked += 1
    assert checked > 60


@pytest.mark.parametrize("command", [
    ["serve"], ["serve", "gpt2"], ["generate", "--prompt", "hi"], ["bench", "offline"], ["bench", "serve"],
])
def test_a_bad_flag_prints_the_subcommand_usage(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--no-such-flag"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    prog = " ".join(["jaxserve", *(word for word in command if word in ("serve", "generate", "bench", "offline"))])
    assert err.startswith(f"usage: {prog} ")
    assert err.rstrip().endswith(f"{prog}: error: unrecognized arguments: --no-such-flag")


def test_vllm_server_flags_reach_the_server_config():
    parser = build_parser()
    defaults = _server_config(parser.parse_args(["serve"]))
    assert defaults.access_log and defaults.server_log_level == "info" and not defaults.log_requests
    assert not defaults.trust_request_chat_template and defaults.body_read_timeout == 30.0
    args = parser.parse_args([
        "serve", "gpt2", "--disable-uvicorn-access-log", "--uvicorn-log-level", "trace", "--enable-log-requests",
        "--trust-request-chat-template", "--body-read-timeout", "2.5", "--trust-remote-code",
    ])
    config = _server_config(args)
    assert not config.access_log and config.server_log_level == "trace" and config.log_requests
    assert config.trust_request_chat_template and config.body_read_timeout == 2.5
    assert not _server_config(parser.parse_args(["serve", "--disable-access-log"])).access_log
    assert not _server_config(parser.parse_args(["serve", "--disable-log-requests"])).log_requests
    with pytest.raises(ValueError, match="body_read_timeout"):
        _server_config(parser.parse_args(["serve", "--body-read-timeout", "0"]))


def test_the_api_key_comes_from_the_flag_then_jaxserve_then_vllm_variables(monkeypatch):
    parser = build_parser()
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert _server_config(parser.parse_args(["serve"])).api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert _server_config(parser.parse_args(["serve"])).api_key == "from-vllm"
    monkeypatch.setenv("JAXSERVE_API_KEY", "from-jaxserve")
    assert _server_config(parser.parse_args(["serve"])).api_key == "from-jaxserve"
    assert _server_config(parser.parse_args(["serve", "--api-key", "flag"])).api_key == "flag"


# Command lines written for `vllm serve` (its docs' and model cards' flags): each runs unchanged, with the
# flags that mean something here mapped, and each one that does not named in a warning with the reason.
VLLM_COMMAND_LINES = {
    "serve gpt2 --tensor-parallel-size 1 --max-model-len 8k --gpu-memory-utilization 0.9 --enable-chunked-prefill "
    "--max-num-batched-tokens 2048 --disable-log-requests --swap-space 16 --trust-remote-code": (
        "--enable-chunked-prefill", "--swap-space 16", "--trust-remote-code"),
    "serve gpt2 --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3 --enforce-eager "
    "--max-num-seqs 64 -pp 1 --distributed-executor-backend mp --enable-prompt-tokens-details "
    "--no-enable-chunked-prefill": (
        "--pipeline-parallel-size 1", "--distributed-executor-backend mp", "--no-enable-chunked-prefill",
        "--enable-prompt-tokens-details"),
    "serve gpt2 -O3 --cuda-graph-sizes 1 2 4 --max-seq-len-to-capture 8192 --disable-custom-all-reduce "
    "--tokenizer-mode auto --guided-decoding-backend xgrammar --use-v2-block-manager --num-gpu-blocks-override "
    "512 --enable-server-load-tracking --max-log-len 100 --api-server-count 1 --disable-frontend-multiprocessing": (
        "--compilation-config 3", "--cuda-graph-sizes 1 2 4", "--max-seq-len-to-capture 8192",
        "--disable-custom-all-reduce", "--tokenizer-mode auto", "--guided-decoding-backend xgrammar",
        "--use-v2-block-manager", "--enable-server-load-tracking", "--max-log-len 100", "--api-server-count 1",
        "--disable-frontend-multiprocessing"),
    "serve gpt2 --dtype auto --enable-reasoning --reasoning-parser deepseek_r1 --task generate "
    "--disable-log-requests --max-model-len 8192 --gpu-memory-utilization 0.8 --enable-chunked-prefill": (
        "--enable-reasoning", "--enable-chunked-prefill"),
    "serve gpt2 --task embed": (),
    "generate --prompt hi --trust-remote-code --cpu-offload-gb 0 --max-num-partial-prefills 2 "
    "--long-prefill-token-threshold 512 --limit-mm-per-prompt image=0 --structured-outputs-config x": (
        "--trust-remote-code", "--cpu-offload-gb 0", "--max-num-partial-prefills 2",
        "--long-prefill-token-threshold 512", "--limit-mm-per-prompt image=0", "--structured-outputs-config x"),
}


@pytest.mark.parametrize("command_line", VLLM_COMMAND_LINES)
def test_vllm_command_lines_run_with_each_flag_mapped_or_named_without_effect(command_line, caplog):
    from jaxserve.cli import _log_inert_flags

    args = build_parser().parse_args(command_line.split())
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        _log_inert_flags(args)
    named = [record.getMessage().split(" changes nothing in jaxserve: ")[0] for record in caplog.records]
    assert sorted(named) == sorted(VLLM_COMMAND_LINES[command_line])
    assert all(record.levelno == logging.WARNING for record in caplog.records)
    engine = _engine_config(args)
    if "--enforce-eager" in command_line:
        assert engine.enforce_eager and engine.cache.num_kv_pages is None
    if "--num-gpu-blocks-override" in command_line:  # vLLM's name for a fixed KV page count
        assert engine.cache.num_kv_pages == 512 and not engine.enforce_eager
    # vLLM's former flag: a task's runner, or auto where none is named
    assert engine.runner == ("pooling" if "--task embed" in command_line else
                             "generate" if "--task generate" in command_line else "auto")


def test_the_command_names_each_flag_without_effect_before_it_runs(monkeypatch, caplog):
    from jaxserve import cli

    ran = []
    monkeypatch.setattr(cli, "_cmd_generate", lambda args: ran.append(args.prompt))
    monkeypatch.setattr(cli.kernel_build, "start_early", lambda: None)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        main(["generate", "--prompt", "hi", "--trust-remote-code", "--swap-space", "4"])
    assert ran == [["hi"]]
    assert "--trust-remote-code changes nothing in jaxserve: jaxserve's models are its own Flax ports" in caplog.text
    assert "--swap-space 4 changes nothing in jaxserve: a preempted request's KV pages are computed" in caplog.text


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "-pp", "2"], "'2': jaxserve runs one pipeline stage; split a model over devices with "
                            "--tensor-parallel-size"),
    (["serve", "--response-role", ""], "response_role must not be empty"),
    (["serve", "--default-chat-template-kwargs", '{"tokenize": true}'],
     "default_chat_template_kwargs may not set tokenize"),
    (["serve", "--chat-template-content-format", "xml"], "invalid choice: 'xml'"),
    (["serve", "--swap-space"], "expected one argument"),
    (["serve", "--task", "transcription"], "'transcription': say --runner generate or --runner pooling"),
    (["serve", "--runner", "embed"], "invalid choice: 'embed'"),
    (["serve", "--tokenizer-mode", "mistral"], "'mistral': tokenizers load through transformers' AutoTokenizer"),
])
def test_vllm_flags_refuse_what_would_mean_something_else(argv, message, capsys):
    with pytest.raises((SystemExit, ValueError)) as error:
        _server_config(build_parser().parse_args(argv))
    assert message in (str(error.value) if error.type is ValueError else capsys.readouterr().err)


def test_vllm_s_chat_and_docs_flags_reach_the_server_config():
    config = _server_config(build_parser().parse_args([
        "serve", "--response-role", "model", "--default-chat-template-kwargs", '{"enable_thinking": false}',
        "--return-tokens-as-token-ids", "--disable-fastapi-docs", "--chat-template-content-format", "openai"]))
    assert (config.response_role, config.default_chat_template_kwargs) == ("model", {"enable_thinking": False})
    assert config.return_tokens_as_token_ids and config.disable_fastapi_docs
    assert config.chat_template_content_format == "openai"
    compiled = CompileConfig(**read_flags(build_parser().parse_args(
        ["compile", "--enforce-eager", "--max-num-seqs", "512", "--max-num-batched-tokens", "8k",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']), COMPILE_FLAGS))
    assert compiled.enforce_eager and (compiled.max_num_seqs, compiled.max_num_batched_tokens) == (512, 8000)
    assert compiled.speculative_config.num_speculative_tokens == 3


def test_without_config_the_preset_follows_the_platform():
    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert _engine_config(args).buckets == EngineConfig.from_preset(platform_preset()).buckets


def _our_lines(stderr: str) -> list[str]:
    """stderr without the C++ log lines that the CUDA compile plugin of the test extra prints when jax
    starts on a machine without a GPU (absl's preamble, `I0000 ... cudart_stub.cc ...`)."""
    return [line for line in stderr.strip().splitlines()
            if not line.startswith("WARNING: All log messages before absl::InitializeLog()")
            and not re.match(r"^[IWE]\d{4} ", line)]


def test_serving_an_uncached_hub_id_offline_fails_in_one_line_before_binding(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub")}
    result = _run_cli("serve", "gpt2-nonexistent-xyz", "--port", "0", env=env)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = _our_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("jaxserve: error: model 'gpt2-nonexistent-xyz' is not in the local")
    assert "a local model directory or a .gguf file" in lines[0] and "unset HF_HUB_OFFLINE" in lines[0]


def test_a_model_that_fails_to_load_for_a_flag_s_reason_says_why_in_one_line_and_exits_1(tmp_path):
    """An adapter of rank 64 under --max-lora-rank 16 is refused once the model's layout is known, while
    the server loads: the log says why without a traceback, and the process exits 1 for its supervisor."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 64, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    result = _run_cli("serve", "--host", "127.0.0.1", "--port", "0", "--enable-lora", "--lora-modules",
                      f"big={adapter}", "--max-lora-rank", "16")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "ERROR jaxserve.api.app: loading the model failed: LoRA adapter 'big': rank 64 is above " \
           "--max-lora-rank 16" in result.stderr


def test_the_platform_choice_is_logged_and_jax_backend_probes_are_not():
    # --max-model-len 0 fails after the preset is chosen (jax's backends initialised) and before any load.
    result = _run_cli("generate", "--prompt", "hi", "--max-model-len", "0", "--log-level", "info")
    assert result.returncode == 1
    assert "no --config given and the JAX backend is" in result.stderr
    assert "Unable to initialize backend" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("jaxserve: error: max_model_len must be >= 1, or -1 for auto, "
                                                      "got 0")


def test_bench_serve_prints_its_header_before_the_rows(monkeypatch, capsys, caplog):
    """Each level's row as soon as it is measured; the command takes `vllm bench serve`'s names for its
    flags (--max-concurrency, --request-rate, --random-input-len, ...) and names those without effect."""
    import jaxserve.bench.serve

    seen_before_level: list[str] = []
    calls: list[tuple] = []

    async def fake_run_level(base_url, model, concurrency, requests, **kwargs) -> dict:
        seen_before_level.append(capsys.readouterr().out)
        calls.append((concurrency, requests[0].prompt_len, requests[0].output_len, kwargs["request_rate"]))
        latency = {"mean": 1.0, "p50": 1.0, "p99": 1.0}
        return {"concurrency": concurrency, "request_rate": kwargs["request_rate"], "request_throughput": 1.0,
                "output_tokens_per_s": 2.0, "completed": len(requests), "failed": 0, "errors": [], "ttft_ms": latency,
                "tpot_ms": latency, "itl_ms": latency, "e2e_ms": latency}

    monkeypatch.setattr(jaxserve.bench.serve, "run_level", fake_run_level)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        main(["bench", "serve", "--max-concurrency", "1", "4", "--request-rate", "2.5", "--random-input-len", "64",
              "--random-output-len", "16", "--random-prefix-len", "8", "--dataset-name", "random", "--ignore-eos",
              "--disable-tqdm"])
    assert calls == [(1, 64 + 8, 16, 2.5), (4, 64 + 8, 16, 2.5)]
    rest = capsys.readouterr().out.splitlines()
    header = seen_before_level[0].splitlines()
    assert len(header) == 1 and header[0].split()[:3] == ["conc", "req/s", "out"] and header[0].split()[-1] == "rate"
    assert seen_before_level[1].split()[0] == "1"  # level 1's row, printed before level 4 ran
    assert [line.split()[0] for line in rest] == ["4", "(latencies"] and rest[0].split()[-1] == "2.5"
    assert "--ignore-eos changes nothing in jaxserve" in caplog.text
    assert "--disable-tqdm changes nothing in jaxserve" in caplog.text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--dataset-name", "sonnet"])
    assert "invalid choice: 'sonnet'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--backend", "sglang"])
    assert "invalid choice: 'sglang'" in capsys.readouterr().err
    calls.clear()
    main(["bench", "serve", "--request-rate", "3"])  # a rate without a cap: one level, uncapped, as vLLM's
    assert calls == [(None, 128, 128, 3.0)] and capsys.readouterr().out.splitlines()[0].split()[0] == "-"
    main(["bench", "serve"])
    assert [call[0] for call in calls[1:]] == [1, 4, 16]
    from jaxserve.config import ServeBenchConfig

    assert ServeBenchConfig().openai_base_url == "http://127.0.0.1:8000/v1"
    for base_url, url in [("http://gpu-box:8000", "http://gpu-box:8000/v1"),  # vLLM's: the server's root
                          ("http://gpu-box:8000/", "http://gpu-box:8000/v1"),
                          ("http://gpu-box:8000/v1/", "http://gpu-box:8000/v1"),  # jaxserve's: its OpenAI base
                          ("https://proxy/team-a", "https://proxy/team-a/v1")]:  # a server behind a path
        assert ServeBenchConfig(base_url=base_url).openai_base_url == url
    assert ServeBenchConfig(host="gpu-box", base_url="http://x/v1").openai_base_url == "http://x/v1", (
        "vLLM's order: a base URL wins over host and port")
    assert ServeBenchConfig(host="::1", port=9000).openai_base_url == "http://[::1]:9000/v1"
    with pytest.raises(ValueError, match="base_url must be an http:// or https:// URL"):
        ServeBenchConfig(base_url="gpu-box:8000")
    urls: list[str] = []
    monkeypatch.setattr(jaxserve.bench.serve, "run_level",
                        lambda base_url, model, concurrency, requests, **kwargs:
                        urls.append((base_url, sorted({r.prompt_len for r in requests}))) or
                        fake_run_level(base_url, model, concurrency, requests, **kwargs))
    main(["bench", "serve", "--host", "gpu-box", "--port", "9000", "--endpoint", "/v1/completions",
          "--random-range-ratio", "0.25", "--max-concurrency", "2"])
    [(url, lengths)] = urls
    assert url == "http://gpu-box:9000/v1" and len(lengths) > 1 and 96 <= min(lengths) <= max(lengths) <= 160
    for bad in (["--max-concurrency", "0"], ["--request-rate", "0"], ["--burstiness", "-1"],
                ["--random-range-ratio", "1"], ["--endpoint", "/v1/chat/completions"],
                ["--backend", "openai-chat", "--endpoint", "/v1/completions"], ["--endpoint", "/v1/embeddings"],
                ["--goodput", "itl:50"], ["--goodput", "ttft=50"], ["--goodput", "ttft:-1"], ["--goodput", "e2el:inf"],
                ["--metric-percentiles", "100"],
                ["--percentile-metrics", "ttft,latency"], ["--extra-body", "[1]"], ["--header", "no-equals"],
                ["--num-warmups", "-1"], ["--logprobs", "-2"]):
        with pytest.raises(SystemExit):
            main(["bench", "serve", *bad])
    with pytest.raises(ValueError, match="the openai backend streams /v1/completions, not /v1/chat/completions "
                                         r"\(that is the openai-chat backend's\)"):
        ServeBenchConfig(endpoint="/v1/chat/completions")
    assert ServeBenchConfig(backend="openai-chat", endpoint="/v1/chat/completions/").chat
    assert not ServeBenchConfig(backend="vllm").chat


def test_async_scheduling_flag_reaches_the_engine_config(tmp_path):
    """The bundled presets schedule asynchronously; the flag overrides a preset either way, and the
    engine API's own default (no preset) stays synchronous."""
    parser = build_parser()
    for preset in ("cpu", "gpu", "default"):
        assert _engine_config(parser.parse_args(["serve", "--config", preset])).scheduler.async_scheduling
        off = _engine_config(parser.parse_args(["serve", "--config", preset, "--no-async-scheduling"]))
        assert not off.scheduler.async_scheduling
    assert not EngineConfig.from_preset(None).scheduler.async_scheduling
    preset = tmp_path / "sync.yaml"
    preset.write_text("scheduler:\n  async_scheduling: false\n")
    assert not _engine_config(parser.parse_args(["serve", "--config", str(preset)])).scheduler.async_scheduling
    on = _engine_config(parser.parse_args(["serve", "--config", str(preset), "--async-scheduling"]))
    assert on.scheduler.async_scheduling


def test_serve_warms_up_auto_by_default_and_the_engine_api_fully():
    """`serve` restarts fast (`--warmup auto`); an engine built through the library or a benchmark is at its
    steady state once built (full), unless told otherwise."""
    from jaxserve.cli_flags import WARMUP_FLAGS

    parser = build_parser()
    assert read_flags(parser.parse_args(["serve"]), WARMUP_FLAGS) == {"warmup_mode": "auto"}
    assert read_flags(parser.parse_args(["serve", "--warmup", "full"]), WARMUP_FLAGS) == {"warmup_mode": "full"}
    assert EngineConfig.from_preset(None).warmup_mode == "full"
    with pytest.raises(ValueError, match="warmup_mode must be one of"):
        EngineConfig.from_preset(None, warmup_mode="lazy")


def test_commands_keep_a_gguf_file_s_blocks_by_default_and_the_library_does_not():
    """The commands' `--quantization auto` keeps a GGUF file's blocks where that runs (`load_model` settles it);
    `none` dequantizes; an engine built through the library dequantizes unless told otherwise."""
    from jaxserve.config import ModelConfig

    parser = build_parser()
    assert _engine_config(parser.parse_args(["serve"])).model.quantization == "auto"
    assert _engine_config(parser.parse_args(["generate", "--prompt", "hi"])).model.quantization == "auto"
    assert _engine_config(parser.parse_args(["serve", "--quantization", "none"])).model.quantization == "none"
    assert EngineConfig.from_preset(None).model.quantization is None
    with pytest.raises(ValueError, match="quantization must be one of auto, none, fp8, gguf"):
        ModelConfig(quantization="int4")


def test_flags_left_out_give_the_config_dataclasses_defaults(monkeypatch):
    """Each default is written once, in jaxserve.config: the parser's are read from the fields."""
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    parser = build_parser()
    assert _server_config(parser.parse_args(["serve"])) == ServerConfig()
    assert ServerConfig().host == "0.0.0.0"  # what `jaxserve serve` has always bound: all interfaces
    commands = {
        ("bench", "offline"): (OfflineBenchConfig, OFFLINE_FLAGS),
        ("bench", "serve"): (ServeBenchConfig, SERVE_BENCH_FLAGS),
        ("compile",): (CompileConfig, COMPILE_FLAGS),
    }
    for argv, (config_cls, flags) in commands.items():
        assert config_cls(**read_flags(parser.parse_args(argv), flags)) == config_cls(), argv
    buckets = parser.parse_args(["bench", "buckets", "--config", "cpu"])
    buckets_config = BucketBenchConfig(**read_flags(buckets, BUCKET_FLAGS + BUCKET_ARRIVAL_FLAGS))
    assert buckets_config == BucketBenchConfig(ladders=("cpu",))
    generate = read_flags(parser.parse_args(["generate", "--prompt", "hi"]), GENERATE_FLAGS)
    assert GenerateConfig(**generate) == GenerateConfig(prompt=("hi",))
    assert ServeBenchConfig().openai_base_url.endswith(f":{ServerConfig().port}/v1")


def test_a_flag_names_a_field_of_its_config():
    with pytest.raises(TypeError, match="ServerConfig has no field 'hots'"):
        Flag("--host", ServerConfig, "hots", "address to bind")


def test_the_speculative_config_flag_takes_vllm_s_json_and_refuses_bad_values(tmp_path, capsys):
    parser = build_parser()
    args = parser.parse_args(["serve", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'])
    speculative = _engine_config(args).scheduler.speculative_config
    assert (speculative.method, speculative.num_speculative_tokens) == ("ngram", 3)
    assert (speculative.prompt_lookup_min, speculative.prompt_lookup_max) == (4, 4)
    assert _engine_config(parser.parse_args(["serve"])).scheduler.speculative_config is None
    preset = tmp_path / "speculative.yaml"
    preset.write_text("scheduler:\n  speculative_config: {method: ngram, num_speculative_tokens: 2}\n")
    assert _engine_config(parser.parse_args(["serve", "--config", str(preset)])).scheduler.speculative_config == \
        SpeculativeConfig(num_speculative_tokens=2)
    for bad in ("{not json", '{"method": "medusa", "num_speculative_tokens": 2}', '{"method": "ngram"}'):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--speculative-config", bad])
        assert "--speculative-config" in capsys.readouterr().err


def test_the_lora_flags_take_vllm_s_forms_and_refuse_bad_values(tmp_path, capsys):
    parser = build_parser()
    args = parser.parse_args(["serve", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "64", "--max-cpu-loras",
                              "8", "--lora-modules",
                              "sql=/adapters/sql", '{"name": "chat", "path": "org/chat-lora", "base_model_name": "b"}'])
    lora = _engine_config(args).lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (True, 3, 64, 8)
    assert lora.lora_modules == (LoraModule("sql", "/adapters/sql"), LoraModule("chat", "org/chat-lora", "b"))
    assert _engine_config(parser.parse_args(["serve"])).lora == LoraConfig()
    preset = tmp_path / "lora.yaml"
    preset.write_text("lora:\n  enable_lora: true\n  lora_modules: [a=/x]\n  max_loras: 2\n")
    assert _engine_config(parser.parse_args(["serve", "--config", str(preset)])).lora == LoraConfig(
        True, (LoraModule("a", "/x"),), 2)
    for bad in ("no-equals", "=path", "name=", '{"name": "x"}', '{"name": "x", "path": "p", "rank": 4}', "{bad"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--enable-lora", "--lora-modules", bad])
        assert "--lora-modules" in capsys.readouterr().err
    for flags, error in ((["--lora-modules", "a=/x"], "needs --enable-lora"),
                         (["--enable-lora", "--max-lora-rank", "12"], "max_lora_rank must be one of"),
                         (["--enable-lora", "--max-loras", "0"], "max_loras must be in"),
                         (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "must be >= max_loras"),
                         (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names must differ"),
                         (["--enable-lora", "--kv-cache-dtype", "fp8"], "not with an FP8 KV cache")):
        with pytest.raises(ValueError, match=error):
            _engine_config(parser.parse_args(["serve", *flags]))


def test_runtime_lora_updates_follow_jaxserve_s_then_vllm_s_variable(monkeypatch):
    parser = build_parser()
    for name in ("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(name, raising=False)
    assert not _server_config(parser.parse_args(["serve"])).allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert _server_config(parser.parse_args(["serve"])).allow_runtime_lora_updating
    monkeypatch.setenv("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING", "0")
    assert not _server_config(parser.parse_args(["serve"])).allow_runtime_lora_updating


def test_data_parallel_flags_reach_the_config_and_keep_the_server_off_the_device(monkeypatch):
    import jaxserve.config

    probes = []
    monkeypatch.setattr(jaxserve.config, "platform_preset", lambda isolated: probes.append(isolated) or "cpu")
    parser = build_parser()
    for flags, size in ((["-dp", "2"], 2), (["--data-parallel-size", "3", "-tp", "2"], 3), ([], 1)):
        config = _engine_config(parser.parse_args(["serve", *flags]))
        assert config.parallel.data_parallel_size == size and config.core_processes == (size if size > 1 else 0)
    # The preset's probe runs in a subprocess when cores run in processes of their own: this one must not
    # open the GPU they need.
    assert probes == [True, True, False]
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        _engine_config(parser.parse_args(["serve", "-dp", "0"]))


def test_serve_looks_for_the_revision_it_was_given_before_binding(tmp_path, tiny_model_dir):
    """The front end's check of --model takes --revision and --download-dir: a revision that is not cached
    fails there, in one line, though main is (it checked main before); main in that directory passes it,
    and the start goes on to the next check (a tensor-parallel size of 0), though the default cache holds
    nothing."""
    downloads = tmp_path / "downloads"
    repo = downloads / "models--jaxserve-tests--tiny-llama"
    shutil.copytree(tiny_model_dir("llama"), repo / "snapshots" / ("1" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub")}
    model = ("serve", "jaxserve-tests/tiny-llama", "--download-dir", str(downloads), "--port", "0")
    missing = _run_cli(*model, "--revision", "v2", env=env)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    lines = _our_lines(missing.stderr)
    assert len(lines) == 1, missing.stderr
    assert f"'jaxserve-tests/tiny-llama' at revision 'v2' is not in the local Hugging Face cache ({downloads})" \
        in lines[0]
    found = _run_cli(*model, "--revision", "main", "--tensor-parallel-size", "0", env=env)
    assert found.returncode == 1 and "Traceback" not in found.stderr
    assert _our_lines(found.stderr)[-1] == "jaxserve: error: tensor_parallel_size must be >= 1, got 0", found.stderr


def test_the_model_source_flags_reach_the_engine_and_compile_configs():
    parser = build_parser()
    overrides = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}'
    argv = ["--revision", "v2", "--download-dir", "/models", "--hf-overrides", overrides]
    model = _engine_config(parser.parse_args(["serve", *argv, "--tokenizer", "org/tok", "--tokenizer-revision",
                                              "v3"])).model
    assert (model.revision, model.download_dir, model.hf_overrides) == (
        "v2", "/models", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert (model.tokenizer, model.tokenizer_revision) == ("org/tok", "v3")
    assert _engine_config(parser.parse_args(["serve"])).model.hf_overrides is None
    compile_args = parser.parse_args(["compile", *argv])
    compiled = CompileConfig(**read_flags(compile_args, COMPILE_FLAGS))
    assert (compiled.revision, compiled.download_dir, compiled.hf_overrides["rope_scaling"]["factor"]) == (
        "v2", "/models", 4.0)
    server = ServerConfig(**read_flags(parser.parse_args(
        ["serve", "--override-generation-config", '{"temperature": 0.5}']), SERVER_FLAGS))
    assert server.override_generation_config == {"temperature": 0.5}


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--hf-overrides", "[1]", "expected a JSON object"),
    ("--hf-overrides", "{bad", "expected a JSON object, got '{bad'"),
    ("--override-generation-config", '{"temperature": 5}', "temperature must be a finite number in [0.0, 2.0]"),
    ("--tokenizer", "./no-such-tokenizer", "jaxserve: error: tokenizer not found: ./no-such-tokenizer (a directory, "
                                           "a .gguf file or a hub id)"),
    ("--max-model-len", "1.5K", "a binary multiple (K, M, G, T) takes a whole number; 1.5k is decimal"),
    ("--hf-overrides", '{"num_hidden_layers": "two"}', "Field 'num_hidden_layers' expected int, got str"),
    ("--chat-template", "./no-such-template.jinja", "--chat-template './no-such-template.jinja' looks like a file "
                                                    "path but cannot be read: No such file or directory"),
    ("--generation-config", "./no-such-folder", "--generation-config: no generation_config.json in no-such-folder"),
    ("--seed", "-1", "seed must be >= 0, got -1"),
    ("--kv-cache-memory", "nan", "must be a number of GiB > 0, got nan"),
    ("--shutdown-timeout", "nan", "shutdown_timeout must be >= 0, got nan"),
    ("--coordinator-address", "nohost", "coordinator_address must be HOST:PORT"),
    ("--lora-modules", "x=./no-such-adapter", "LoRA adapter path './no-such-adapter' is not a directory"),
])
def test_model_flags_refuse_what_they_cannot_use_in_one_line(flag, value, message):
    result = _run_cli("serve", flag, value, "--port", "0")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert message in result.stderr, result.stderr


def test_max_model_len_reads_vllm_s_suffixes():
    from jaxserve.cli_flags import human_int

    assert [human_int(v) for v in ("2048", "32k", "32K", "25.6k", "1.005k", "1m", "1M", "2g", "1T")] == [
        2048, 32_000, 32_768, 25_600, 1005, 10**6, 2**20, 2 * 10**9, 2**40]
    for bad in ("1.5K", "32 tokens", "32 K", "0.0001k", "k", "infk", "-1k", "1e3k", "²", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            human_int(bad)
    parser = build_parser()
    config = _engine_config(parser.parse_args(["serve", "--config", "gpu", "--max-model-len", "32K",
                                               "--max-num-batched-tokens", "2K"]))
    assert (config.model.max_model_len, config.scheduler.max_num_batched_tokens) == (32_768, 2048)
    assert _engine_config(parser.parse_args(["serve", "--max-model-len", "4096"])).model.max_model_len == 4096
    compile_args = parser.parse_args(["compile", "--max-model-len", "128k"])
    assert CompileConfig(**read_flags(compile_args, COMPILE_FLAGS)).max_model_len == 128_000
    for auto in ("auto", "AUTO", "-1", " auto "):  # vLLM's: what the KV cache holds of the model's context
        assert _engine_config(parser.parse_args(["serve", "--max-model-len", auto])).model.max_model_len == -1
        compile_args = parser.parse_args(["compile", "--max-model-len", auto])
        assert CompileConfig(**read_flags(compile_args, COMPILE_FLAGS)).max_model_len == -1
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-model-len=-2"])
    from jaxserve.config import ModelConfig

    with pytest.raises(ValueError, match="max_model_len must be >= 1, or -1 for auto, got -2"):
        ModelConfig(max_model_len=-2)
