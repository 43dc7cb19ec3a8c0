"""`jaxserve serve | generate | bench | compile | convert`: flags become configs, built once, for the command.

cli.py parses and dispatches. The flags are rows of jaxserve/cli_flags.py (names, the config field each
sets, help), with their defaults in jaxserve/config.py; the parser is declared from those rows and the
configs read back through them. Each command's body lives beside what it runs (jaxserve/bench/,
compile_command.py, models/convert.py); `serve` and `generate` stay here, being mostly dispatch.

Building the parser and printing `--help` must not import jax (it takes seconds): every choice comes
from jaxserve.config, and each command imports what it runs when it runs.
"""

import argparse
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxserve import __version__
from jaxserve.allocator import preload_tcmalloc, runs_steps
from jaxserve.cli_flags import (
    BUCKET_ARRIVAL_FLAGS,
    BUCKET_FLAGS,
    CHAT_FLAGS,
    COMPILE_FLAGS,
    COMPLETE_FLAGS,
    CONVERT_FLAGS,
    ENGINE_FLAGS,
    GENERATE_FLAGS,
    HOST_FLAGS,
    INERT_BENCH_FLAGS,
    INERT_ENGINE_FLAGS,
    INERT_SERVER_FLAGS,
    OFFLINE_FLAGS,
    SERVE_BENCH_FLAGS,
    SERVER_FLAGS,
    SERVER_LOG_FLAGS,
    WARMUP_FLAGS,
    Group,
    InertFlag,
    add_flags,
    given_inert_flags,
    read_flags,
)
from jaxserve.config import (
    BucketBenchConfig,
    ClientConfig,
    CompileConfig,
    EngineConfig,
    GenerateConfig,
    ModelConfig,
    OfflineBenchConfig,
    ParallelConfig,
    ServeBenchConfig,
    ServerConfig,
    engine_preset,
    preset_names,
    profiler_dir,
)
from jaxserve.ops import kernel_build
from jaxserve.platform import cpu_backend_expected, prepare_jax_platform

logger = logging.getLogger("jaxserve")

# jax logs, at info, every platform it probes and cannot start ("Unable to initialize backend 'tpu'").
# That logger's warnings (a GPU present without CUDA jaxlib, ...) still show.
_JAX_PROBE_LOGGER = "jax._src.xla_bridge"
LOG_LEVELS = ("debug", "info", "warning", "error")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the line breaks of descriptions and epilogs, and ends every flag's help with its default.

    Unlike ArgumentDefaultsHelpFormatter, a help text that already explains its default (`(default: the
    model's)`, `the default`, `by default`) is left alone, on/off flags read `(default: off)`, and lists
    print as they are typed.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        explained = any(words in text for words in ("(default", "the default", "by default"))
        positional = not action.option_strings and action.nargs not in ("?", "*")  # commands, required args
        if explained or positional or action.required or action.default is argparse.SUPPRESS:
            return text
        if action.nargs == 0:
            shown = "off"
        elif isinstance(action.default, list | tuple):
            shown = " ".join(str(v) for v in action.default)
        else:
            shown = str(action.default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose unknown-argument errors come from the (sub)command that was given them.

    argparse collects a subcommand's unknown arguments and reports them from the top-level parser, so
    `jaxserve serve --bad` would print `jaxserve`'s usage instead of `serve`'s. Each parser here
    (subparsers inherit this class) refuses its own leftovers instead; jaxserve has no use for them.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _add_log_level(parser: Group, help: str) -> None:
    parser.add_argument("--log-level", default=None, choices=LOG_LEVELS, help=help)


def _add_engine_args(parser: argparse.ArgumentParser, inert: Sequence[InertFlag] = INERT_ENGINE_FLAGS) -> None:
    group = parser.add_argument_group("engine")
    add_flags(group, ENGINE_FLAGS[:1])  # --model
    group.add_argument("--config", default=None,
                       help=f"a bundled preset ({', '.join(preset_names())}) or a YAML file: bucket ladders and "
                            "engine defaults (default: cpu on a CPU, gpu on a GPU)")
    add_flags(group, ENGINE_FLAGS[1:])
    _add_log_level(group, "jaxserve's log level (default: info for serve, warning otherwise)")
    _add_inert_flags(parser, inert)


def _add_inert_flags(parser: argparse.ArgumentParser, flags: Sequence[InertFlag]) -> None:
    group = parser.add_argument_group("vLLM's flags that change nothing here (taken so that its command lines run)")
    for flag in flags:
        flag.add_to(group)


def _log_inert_flags(args: argparse.Namespace) -> None:
    for given, flag in given_inert_flags(args, INERT_ENGINE_FLAGS + INERT_SERVER_FLAGS + INERT_BENCH_FLAGS):
        logger.warning("%s changes nothing in jaxserve: %s", given, flag.why)


def _engine_config(args: argparse.Namespace, **extra: Any) -> EngineConfig:
    settings = read_flags(args, ENGINE_FLAGS)
    preset = engine_preset(args.config, settings["gpu_memory_utilization"], bool(settings["engine_process"]),
                           settings["data_parallel_size"])
    return EngineConfig.from_preset(preset, **settings, **extra)


def _api_key(flag: str | None) -> str | None:
    """--api-key, else JAXSERVE_API_KEY, else vLLM's VLLM_API_KEY, so a vLLM deployment's env carries over."""
    return flag or os.environ.get("JAXSERVE_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def _runtime_lora_updating() -> bool:
    """JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING, else vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: true or 1."""
    value = os.environ.get("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING") or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    return (value or "").strip().lower() in ("1", "true")


def _server_config(args: argparse.Namespace) -> ServerConfig:
    settings = read_flags(args, SERVER_FLAGS + SERVER_LOG_FLAGS)
    return ServerConfig(**{**settings, "api_key": _api_key(settings["api_key"]),
                           "allow_runtime_lora_updating": _runtime_lora_updating(),
                           "profiler_dir": profiler_dir(settings["profiler_dir"])})


def _cmd_serve(args: argparse.Namespace) -> None:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    server_config = _server_config(args)
    hosts = read_flags(args, HOST_FLAGS)
    parallel = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size, **hosts)
    from jaxserve.torch_free import keep_torch_out
    from jaxserve.transformers_scan import remember_scans

    keep_torch_out(args.model)  # before transformers is imported: seconds of every start
    remember_scans()  # the same: transformers' scans of its sources, read from the last start's record
    from jaxserve.api.server import bind, run_server
    from jaxserve.api.serving import check_server_files
    from jaxserve.models.peft import check_adapter_source
    from jaxserve.models.source import load_hf_config, replacement_tokenizer, resolve_model, resolve_model_config

    # First the port and the server's files (a busy port ends the start in one line), then --model, before
    # anything loads.
    hypercorn = None  # a follower serves no HTTP
    if parallel.is_leader:
        hypercorn, port = bind(server_config)
        server_config = dataclasses.replace(server_config, port=port)  # the system's choice for --port 0
    check_server_files(server_config)
    if args.load_format == "dummy":
        resolve_model_config(args.model, args.revision, args.download_dir, args.hf_overrides)
    else:
        source = resolve_model(args.model, args.revision, args.download_dir)
        if args.hf_overrides:  # transformers checks the overridden values; a wrong one ends here
            load_hf_config(source, args.hf_overrides)
    replacement_tokenizer(args.tokenizer, args.tokenizer_revision, args.model, args.revision, args.download_dir)
    for module in args.lora_modules or ():
        check_adapter_source(module.name, module.path)
    if parallel.multihost:
        from jaxserve.engine.follower import run_follower
        from jaxserve.runner import multihost

        multihost.initialize(parallel)  # before anything starts a jax backend
        if not parallel.is_leader:  # no HTTP here: replay process 0's steps until it stops
            run_follower(_engine_config(args, **hosts))
            return
    from jaxserve.process_exit import exit_now

    # exit_now: the engine has stopped; compiles a background warm-up still runs are not waited for
    engine_config = _engine_config(args, **read_flags(args, WARMUP_FLAGS), **hosts)
    exit_now(run_server(engine_config, server_config, hypercorn))


def _cmd_generate(args: argparse.Namespace) -> None:
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    config = GenerateConfig(**read_flags(args, GENERATE_FLAGS))
    # Before the model loads and compiles: a sampling flag out of range ends the command in one line.
    params = SamplingParams(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                            max_tokens=config.max_tokens, seed=args.seed)
    llm = LLM.from_engine_config(_engine_config(args))
    start = time.perf_counter()
    if config.raw:
        outputs = llm.generate(list(config.prompt), params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in config.prompt], params)
    elapsed = time.perf_counter() - start
    for output in outputs:
        print(output.outputs[0].text)
    num_tokens = sum(o.num_generated_tokens for o in outputs)
    print(f"\n[{num_tokens} tokens in {elapsed:.2f}s]", file=sys.stderr)


def _cmd_chat(args: argparse.Namespace) -> None:
    from jaxserve import client

    try:
        client.chat(ClientConfig(**read_flags(args, CHAT_FLAGS)))
    except KeyboardInterrupt:  # Ctrl-C while an answer streams: the end, not a traceback
        print(file=sys.stderr)


def _cmd_complete(args: argparse.Namespace) -> None:
    from jaxserve import client

    try:
        client.complete(ClientConfig(**read_flags(args, COMPLETE_FLAGS)))
    except KeyboardInterrupt:
        print(file=sys.stderr)


def _cmd_bench_offline(args: argparse.Namespace) -> None:
    from jaxserve.bench import offline

    offline.main(OfflineBenchConfig(**read_flags(args, OFFLINE_FLAGS)), lambda: _engine_config(args))


def _cmd_bench_serve(args: argparse.Namespace) -> None:
    from jaxserve.bench import serve

    settings = read_flags(args, SERVE_BENCH_FLAGS)
    serve.main(ServeBenchConfig(**{**settings, "api_key": _api_key(settings["api_key"])}))


def _cmd_bench_buckets(args: argparse.Namespace) -> None:
    from jaxserve.bench import bucket_bench

    bucket_bench.main(BucketBenchConfig(**read_flags(args, BUCKET_FLAGS + BUCKET_ARRIVAL_FLAGS)))


def _cmd_compile(args: argparse.Namespace) -> None:
    from jaxserve import compile_command

    compile_command.main(CompileConfig(**read_flags(args, COMPILE_FLAGS)))


def _cmd_convert(args: argparse.Namespace) -> None:
    from jaxserve.models import convert

    convert.main(ModelConfig(**read_flags(args, CONVERT_FLAGS)), Path(args.output_dir))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="jaxserve",
        description="A JAX-native LLM inference server: paged KV cache, bucketed jit steps, continuous batching.",
        epilog="examples:\n"
               "  jaxserve serve                          # the bundled SmolLM2-135M-Instruct on port 8000\n"
               "  jaxserve serve gpt2 --port 8001         # a hub id, a local HF directory or a .gguf file\n"
               "  jaxserve generate --prompt \"Hi there\"   # one chat reply, no server\n"
               "  jaxserve bench serve --concurrency 1 4 16\n"
               "  jaxserve bench offline --concurrency 1 16 64\n"
               "  jaxserve compile --model llama-3-8b --target h100   # every bucket for an H100, no GPU needed\n"
               "'jaxserve COMMAND --help' lists a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"jaxserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="serve a model over OpenAI-compatible HTTP",
        description="Serve a model with OpenAI-compatible endpoints (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /tokenize, /detokenize, /health, /metrics).",
    )
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="same as --model (default: the bundled SmolLM2-135M-Instruct)")
    add_flags(serve, SERVER_FLAGS, "server")
    add_flags(serve, SERVER_LOG_FLAGS, "logging")
    _add_engine_args(serve, INERT_ENGINE_FLAGS + INERT_SERVER_FLAGS)
    add_flags(serve, WARMUP_FLAGS)
    add_flags(serve, HOST_FLAGS, "multi-host (one model over the devices of several processes)")
    serve.set_defaults(func=_cmd_serve, default_log_level="info")

    gen = commands.add_parser("generate", help="generate a reply to one prompt and print it",
                              description="Generate without a server: a chat reply, or with --raw a completion.")
    _add_engine_args(gen)
    add_flags(gen, GENERATE_FLAGS)
    gen.set_defaults(func=_cmd_generate)

    chat = commands.add_parser(
        "chat", help="chat with a running server from the terminal (like `vllm chat`)",
        description="Chat with a running server: each line read is a user message, the reply streams back, and "
                    "the conversation goes on until end of input (Ctrl-D); --quick sends one message.")
    add_flags(chat, CHAT_FLAGS)
    chat.set_defaults(func=_cmd_chat, log_level="warning")
    complete = commands.add_parser(
        "complete", help="complete prompts on a running server from the terminal (like `vllm complete`)",
        description="Complete prompts on a running server: each line read is a prompt, its completion streams "
                    "back; --quick completes one prompt.")
    add_flags(complete, COMPLETE_FLAGS)
    complete.set_defaults(func=_cmd_complete, log_level="warning")

    bench = commands.add_parser("bench", help="benchmarks", description="Benchmarks: offline engine or HTTP load.")
    bench_kinds = bench.add_subparsers(dest="bench_kind", required=True, metavar="KIND")
    offline = bench_kinds.add_parser("offline", help="engine throughput without HTTP",
                                     description="Engine throughput without HTTP: one wave per concurrency.")
    _add_engine_args(offline)
    add_flags(offline, OFFLINE_FLAGS)
    offline.set_defaults(func=_cmd_bench_offline)

    serve_bench = bench_kinds.add_parser(
        "serve", help="load a running server over HTTP (like `vllm bench serve`)",
        description="Load a running server over HTTP (like `vllm bench serve`): streamed /v1/completions (or "
                    "/v1/chat/completions: --backend openai-chat); "
                    "req/s, output tok/s, TTFT/TPOT/ITL/E2E mean, p50 and p99 per concurrency level.",
    )
    add_flags(serve_bench, SERVE_BENCH_FLAGS)
    _add_inert_flags(serve_bench, INERT_BENCH_FLAGS)
    serve_bench.set_defaults(func=_cmd_bench_serve, log_level="warning")

    buckets_bench = bench_kinds.add_parser(
        "buckets", help="compare bucket ladders on a workload, here and predicted on a GPU",
        description="Compare bucket ladders on a workload: compiled bucket count, padding waste, predicted "
                    "throughput and latency on a GPU target (--target, --model), and with --measure the engine "
                    "on this machine (warm-up cold and warm, tok/s, TTFT/TPOT/E2E). Writes results.json, "
                    "results.csv, plots (pip install 'jaxserve[bench]') and report.md to --out. --suggest "
                    "proposes a ladder within --max-buckets.",
        epilog="examples:\n"
               "  jaxserve bench buckets --config default --config buckets/sparse --workload sharegpt "
               "--concurrency 32 --target h100 --model gpt2\n"
               "  jaxserve bench buckets --config cpu --config default --workload fixed:128,64 --rate 4 --measure\n"
               "  jaxserve bench buckets --config gpu --workload sharegpt --concurrency 128 --target h100 "
               "--model llama-3-8b --suggest --max-buckets 24",
    )
    add_flags(buckets_bench, BUCKET_FLAGS[:2])
    add_flags(buckets_bench.add_mutually_exclusive_group(), BUCKET_ARRIVAL_FLAGS)
    add_flags(buckets_bench, BUCKET_FLAGS[2:])
    buckets_bench.set_defaults(func=_cmd_bench_buckets, log_level="warning")

    compile_cmd = commands.add_parser(
        "compile", help="compile every bucket for a GPU (no GPU needed) and predict step times",
        description="Compile the whole step (model, attention kernels, sampler) for every bucket of a ladder, "
                    "from the model's config alone, for a GPU target without a GPU (XLA's deviceless "
                    "compilation: Triton and ptxas run) or for the local device; print per bucket the compile "
                    "time, XLA's memory analysis and a roofline step time, and the KV budget. Needs the CUDA "
                    "compile pieces for GPU targets: pip install 'jaxserve[gpu-compile]'.",
    )
    add_flags(compile_cmd, COMPILE_FLAGS)
    _add_log_level(compile_cmd, "(default: warning)")
    compile_cmd.set_defaults(func=_cmd_compile)

    convert = commands.add_parser(
        "convert", help="write a model's converted weights, config and tokenizer as an orbax checkpoint",
        description="Load MODEL (anything serve --model takes), convert it to jaxserve's Flax layout in "
                    "--dtype, and write it to OUTPUT_DIR as an orbax checkpoint beside its config and "
                    "tokenizer; serve --model OUTPUT_DIR then restores each array straight onto its devices.",
    )
    add_flags(convert, CONVERT_FLAGS[:1])
    convert.add_argument("output_dir", help="where to write the checkpoint (new or empty)")
    add_flags(convert, CONVERT_FLAGS[1:])
    _add_log_level(convert, "jaxserve's log level (default: info)")
    convert.set_defaults(func=_cmd_convert, default_log_level="info")
    return parser


def main(argv: list[str] | None = None) -> None:
    """The command line (`argv` None) or a call from Python (`argv` given: never re-executed)."""
    args = build_parser().parse_args(argv)
    level = args.log_level or getattr(args, "default_log_level", "warning")
    try:
        if argv is None and runs_steps(sys.argv[1:]):  # done already where `__main__.main` started it
            preload_tcmalloc()  # re-executes this command once with tcmalloc preloaded, when one is found
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
        if level != "debug":
            logging.getLogger(_JAX_PROBE_LOGGER).setLevel(logging.WARNING)
        prepare_jax_platform()  # before any backend starts: no CUDA plugin tracebacks on a machine without a GPU
        if runs_steps(sys.argv[1:] if argv is None else argv) and cpu_backend_expected():
            kernel_build.start_early()  # a first start's C++ compiles run while jax is imported and the model loads
        _log_inert_flags(args)
        args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        sys.exit(1)
