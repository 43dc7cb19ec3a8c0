"""`jaxserve serve | generate | bench`: flags become one EngineConfig (and a ServerConfig), built once.

Building the parser and printing `--help` must not import jax (it takes seconds): every choice comes
from jaxserve.config, and each command imports what it runs when it runs.
"""

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from jaxserve import __version__
from jaxserve.allocator import loaded_allocator, preload_tcmalloc
from jaxserve.api.tools import TOOL_PARSERS  # names only: light
from jaxserve.config import (
    ATTENTION_IMPLS,
    DTYPES,
    KV_CACHE_DTYPES,
    SERVER_LOG_LEVELS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    ServerConfig,
    platform_preset,
    preset_names,
)
from jaxserve.device import TARGETS, pool_gpu_memory
from jaxserve.model_configs import BUNDLED_SHAPES

logger = logging.getLogger("jaxserve")

# jax logs, at info, every platform it probes and cannot start ("Unable to initialize backend 'tpu'").
# That logger's warnings (a GPU present without CUDA jaxlib, ...) still show.
_JAX_PROBE_LOGGER = "jax._src.xla_bridge"


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


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="hub id, local HF directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    group.add_argument("--config", default=None,
                       help=f"a bundled preset ({', '.join(preset_names())}) or a YAML file: bucket ladders and "
                            "engine defaults (default: cpu on a CPU, gpu on a GPU)")
    group.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="the model's dtype: activations, norms, the KV cache (unless --kv-cache-dtype) and "
                            "the weights (unless --weight-dtype); auto is float32 on CPU, bfloat16 on GPU")
    group.add_argument("--weight-dtype", default=None, choices=DTYPES,
                       help="the matmul weights' dtype (projections, embeddings, LM head); auto (the default) is "
                            "--dtype's. bfloat16 under a float32 model: half the weights' memory and what a "
                            "decode reads, through the native kernels on CPUs; activations stay float32")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: the model's)")
    group.add_argument("--max-num-seqs", type=int, default=None,
                       help="the most sequences in one step (default: the preset's)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="the most tokens in one step (default: the preset's)")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule and dispatch each step before reading the previous step's tokens, so the "
                            "host's work overlaps the device's; a stop is seen one step late and the extra "
                            "token dropped (default: the preset's; the bundled presets turn it on)")
    group.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                       help="run the engine core (scheduler, model runner) in its own process, with tokenizing, "
                            "detokenizing and HTTP in this one, as vLLM V1 does (default: off)")
    group.add_argument("--block-size", dest="page_size", type=int, default=None,
                       help="tokens per KV page (default: the preset's)")
    group.add_argument("--num-kv-pages", type=int, default=None,
                       help="KV pages, overriding the memory budget (default: from the budget)")
    group.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                       help="the KV cache's dtype; auto (the default) is the model's. float16 or bfloat16 under "
                            "a float32 model halve the cache's memory and what attention reads")
    group.add_argument("--kv-cache-memory", dest="kv_cache_memory_gib", type=float, default=None,
                       help="KV cache budget in GiB on CPU (default: the preset's)")
    group.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="fraction of the GPU's memory for jaxserve (as in vLLM): weights, the step's temp "
                            "memory, and the KV cache, which gets the rest "
                            f"(default: {CacheConfig.gpu_memory_utilization})")
    group.add_argument("--attention-impl", default=None, choices=ATTENTION_IMPLS,
                       help="auto (the default): the Pallas kernel on CUDA GPUs with compute capability >= 8.0, "
                       "the cpu path on CPUs, the jnp reference elsewhere; interpret runs the kernel on CPU "
                       "(slow, for tests)")
    group.add_argument("--max-logprobs", type=int, default=None,
                       help=f"the most top logprobs a request may ask for (default: {ModelConfig.max_logprobs})")
    group.add_argument("--seed", type=int, default=None,
                       help=f"seed of the sampling RNG (default: {ModelConfig.seed})")
    group.add_argument("--compilation-cache-dir", default=None,
                       help="JAX's persistent compilation cache; 'none' disables it "
                            f"(default: {EngineConfig.compilation_cache_dir})")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="reuse the KV pages of prompt prefixes computed before (default: on, as in vLLM)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="devices to split the model over (heads, MLP width, vocabulary, KV pages); on CPU, "
                            "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N devices")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM compatibility; jaxserve never runs code from a model repository")
    group.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                       help="jaxserve's log level (default: info for serve, warning otherwise)")


def _compilation_cache(setting: str | None) -> dict[str, str]:
    if setting is None:
        return {}
    return {"compilation_cache_dir": "" if setting.lower() == "none" else setting}  # "" disables


def _engine_config(args: argparse.Namespace, **extra) -> EngineConfig:
    # Before jax starts a backend (platform_preset starts one): JAX pools 75% of a GPU by default.
    pool_gpu_memory(args.gpu_memory_utilization or CacheConfig.gpu_memory_utilization)
    if args.trust_remote_code:
        logger.info("--trust-remote-code changes nothing here: jaxserve's models are its own Flax ports and "
                    "tokenizers load without remote code, so no code from a model repository ever runs")
    return EngineConfig.from_preset(
        args.config if args.config is not None else platform_preset(isolated=bool(args.engine_process)),
        model=args.model,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=args.async_scheduling,
        engine_process=args.engine_process,
        page_size=args.page_size,
        num_kv_pages=args.num_kv_pages,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_impl=args.attention_impl,
        seed=args.seed,
        max_logprobs=args.max_logprobs,
        enable_prefix_caching=args.enable_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        **extra,
        **_compilation_cache(args.compilation_cache_dir),
    )


def _api_key(flag: str | None) -> str | None:
    """--api-key, else JAXSERVE_API_KEY, else vLLM's VLLM_API_KEY, so a vLLM deployment's env carries over."""
    return flag or os.environ.get("JAXSERVE_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def _cmd_generate(args: argparse.Namespace) -> None:
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    llm = LLM.from_engine_config(_engine_config(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    if args.raw:
        outputs = llm.generate(args.prompt, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    elapsed = time.perf_counter() - start
    for output in outputs:
        print(output.outputs[0].text)
    num_tokens = sum(o.num_generated_tokens for o in outputs)
    print(f"\n[{num_tokens} tokens in {elapsed:.2f}s]", file=sys.stderr)


def _cmd_bench_offline(args: argparse.Namespace) -> None:
    from jaxserve.bench.offline import peak_rss_gib, run_offline_benchmark
    from jaxserve.engine.llm_engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine(_engine_config(args))
    startup = time.perf_counter() - start
    results = run_offline_benchmark(engine, args.concurrency, args.input_len, args.output_len)
    report = {
        "model": engine.info.model_name,
        "dtype": engine.info.dtype,
        "weight_dtype": engine.info.weight_dtype,
        "async_scheduling": engine.async_scheduling,
        "allocator": loaded_allocator(),
        "startup_s": round(startup, 1),
        "warmup_s": round(engine.warmup_seconds, 1),
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "results": results,
    }
    print(f"model {report['model']} dtype {report['dtype']} (weights {report['weight_dtype']})  "
          f"start-up {startup:.1f}s (warm-up {engine.warmup_seconds:.1f}s)  peak RSS {report['peak_rss_gib']} GiB  "
          f"allocator {report['allocator']}")
    print(f"{'seqs':>5} {'out tok/s':>10} {'TPOT ms':>8} {'TTFT ms':>8} {'wall s':>7}")
    for r in results:
        print(f"{r['concurrency']:>5} {r['output_tokens_per_s']:>10.1f} {r['mean_tpot_ms']:>8.1f} "
              f"{r['mean_ttft_ms']:>8.1f} {r['seconds']:>7.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def _cmd_bench_serve(args: argparse.Namespace) -> None:
    import asyncio

    from jaxserve.bench.serve import format_report, run_level

    # format_report([]) is the header and the footnote; each level's row is printed as soon as it is measured.
    header, footer = format_report([]).splitlines()
    print(header, flush=True)
    results = []
    for concurrency in args.concurrency:
        num_prompts = args.num_prompts or max(4 * concurrency, 8)
        results.append(asyncio.run(run_level(
            args.base_url, args.model, concurrency, num_prompts, args.input_len, args.output_len,
            api_key=_api_key(args.api_key), seed=args.seed, prefix_len=args.prefix_len,
            sampling={"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p},
        )))
        print("\n".join(format_report(results[-1:]).splitlines()[1:-1]), flush=True)
    print(footer)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _cmd_bench_buckets(args: argparse.Namespace) -> None:
    from jaxserve.bench import bucket_bench
    from jaxserve.bench.ladders import load_ladder
    from jaxserve.bench.workload import make_workload

    concurrency = args.concurrency if args.concurrency is not None or args.rate is not None else 16
    if args.workload.endswith(".jsonl") and args.concurrency is None:
        concurrency = None  # the file's own arrivals unless a loop is asked for
    workload = make_workload(args.workload, args.num_requests, args.rate, concurrency, args.max_model_len, args.seed)
    step_seconds = None
    if args.target:
        from jaxserve.bench.predict import roofline_step_seconds

        step_seconds = roofline_step_seconds(args.model, args.target, args.dtype)
    measure = bucket_bench.engine_measurement(args.measure_model, args.dtype, args.max_model_len) if args.measure \
        else None
    results = bucket_bench.run(
        [load_ladder(c) for c in args.config], workload, Path(args.out), step_seconds, measure,
        args.max_buckets if args.suggest else None, command="jaxserve " + " ".join(sys.argv[1:]), target=args.target,
    )
    print(f"{workload.name}: {len(workload.requests)} requests")
    print(bucket_bench.format_table(results))
    print(f"results, plots and report in {args.out}/")


def _server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host or "0.0.0.0",
        port=args.port,
        served_model_name=tuple(args.served_model_name or ()),
        api_key=_api_key(args.api_key),
        allowed_origins=tuple(args.allowed_origins),
        allow_credentials=args.allow_credentials,
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        root_path=args.root_path,
        enable_request_id_headers=args.enable_request_id_headers,
        chat_template=args.chat_template,
        generation_config=args.generation_config,
        disable_log_stats=args.disable_log_stats,
        shutdown_timeout=args.shutdown_timeout,
        access_log=args.access_log,
        server_log_level=args.uvicorn_log_level,
        log_requests=args.log_requests,
        trust_request_chat_template=args.trust_request_chat_template,
        body_read_timeout=args.body_read_timeout,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )


def _cmd_serve(args: argparse.Namespace) -> None:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    server_config = _server_config(args)

    from jaxserve.models.loader import resolve_model

    resolve_model(args.model)  # before binding the port: a wrong --model ends here, in one line
    hosts = dict(num_processes=args.num_processes, process_id=args.process_id,
                 coordinator_address=args.coordinator_address)
    parallel = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size, **hosts)
    if parallel.multihost:
        from jaxserve.runner import multihost

        multihost.initialize(parallel)  # before anything starts a jax backend
        if not parallel.is_leader:  # no HTTP here: replay process 0's steps until it stops
            multihost.run_follower(_engine_config(args, **hosts))
            return
    from jaxserve.api.server import run_server

    background = args.warmup == "background"
    sys.exit(run_server(_engine_config(args, background_warmup=background, **hosts), server_config))


def _cmd_convert(args: argparse.Namespace) -> None:
    from jaxserve.models.checkpoint import save_checkpoint
    from jaxserve.models.loader import load_model, metadata_dir

    model = load_model(args.model, args.dtype, revision=args.revision, weight_dtype=args.weight_dtype)
    out = save_checkpoint(model, metadata_dir(model.source), Path(args.output_dir))
    print(f"wrote {model.name} ({model.dtype.__name__}, weights {model.weight_dtype.__name__}) as an orbax "
          f"checkpoint to {out}; "
          f"serve it with: jaxserve serve --model {out}")


def _cmd_compile(args: argparse.Namespace) -> None:
    if args.target != "local":
        from jaxserve.device import use_cpu_platform

        use_cpu_platform()  # before jax starts a backend: the CUDA plugin must not look for a driver
    from jaxserve.compile_ladder import compile_ladder, format_report

    report = compile_ladder(
        args.model,
        target=None if args.target == "local" else args.target,
        preset=args.config,
        dtype=args.dtype,
        attention_impl=args.attention_impl,
        max_model_len=args.max_model_len,
        context_len=args.context_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        jobs=args.jobs,
        xla_cost=not args.no_xla_cost,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(report.to_json())
        print(f"wrote {args.json}")


def _json_list(value: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected a JSON list such as '[\"*\"]', got {value!r}") from None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="same as --model (default: the bundled SmolLM2-135M-Instruct)")
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=None, help="address to bind (default: all interfaces)")
    group.add_argument("--port", type=int, default=8000, help="port to bind")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients use in `model` (default: the model's name)")
    group.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize "
                            "(default: $JAXSERVE_API_KEY, else $VLLM_API_KEY, else none)")
    group.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS origins, a JSON list")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    group.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods, a JSON list")
    group.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers, a JSON list")
    group.add_argument("--ssl-keyfile", default=None, help="TLS private key file (default: plain HTTP)")
    group.add_argument("--ssl-certfile", default=None, help="TLS certificate file (default: plain HTTP)")
    group.add_argument("--root-path", default="", help="path prefix when behind a path-based proxy (default: none)")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="add X-Request-Id to every response (a client's own id is always echoed)")
    group.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a request bring its own `chat_template` (refused otherwise: a template is code "
                            "that runs on the server)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="tool_choice 'auto': the model decides, and --tool-call-parser reads its calls "
                            "('required' and named choices need neither: the grammar enforces them)")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how the model writes tool calls: hermes (Qwen2.5, Hermes), llama3_json (Llama 3.1/3.2) "
                            "(default: none, so tool_choice 'auto' is refused)")
    group.add_argument("--generation-config", default="auto",
                       help="default sampling parameters: 'auto' (the model's generation_config.json), "
                            "'vllm' (none), or a folder")
    group.add_argument("--body-read-timeout", type=float, default=30.0,
                       help="seconds for a request body to arrive in full; a slower one gets a 408")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds to finish in-flight requests after SIGTERM/SIGINT")

    logs = parser.add_argument_group("logging")
    logs.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput log lines")
    logs.add_argument("--disable-uvicorn-access-log", "--disable-access-log", dest="access_log",
                      action="store_false", help="no access log (by default one line per HTTP request)")
    logs.add_argument("--uvicorn-log-level", default="info", choices=SERVER_LOG_LEVELS,
                      help="log level of the HTTP server's own loggers (vLLM's name for it)")
    logs.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=False,
                      help="log one line per request with its sampling parameters and prompt length (default: off)")
    logs.add_argument("--disable-log-requests", dest="log_requests", action="store_false", default=False,
                      help="no per-request lines: the default, accepted for vLLM compatibility")


def _add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    parser.add_argument("--model", default=None, help="the `model` field to send (default: none, the server's)")
    parser.add_argument("--api-key", default=None,
                        help="bearer token to send (default: $JAXSERVE_API_KEY, else $VLLM_API_KEY, else none)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16],
                        help="requests in flight; one row per level")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests per level (default: 4 x concurrency, at least 8)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt length in tokens (random token ids)")
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="tokens of one shared prefix before each prompt, like a system prompt "
                             "(vLLM's --random-prefix-len; default: 0)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="tokens generated per request (EOS ignored, so exactly this many)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--temperature", type=float, default=0.0, help="sent with every request (default: 0, greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="sent with every request (default: not sent)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sent with every request, a vLLM/llama.cpp extension (default: not sent)")
    parser.add_argument("--min-p", type=float, default=None,
                        help="sent with every request, a vLLM/llama.cpp extension (default: not sent)")
    parser.add_argument("--json", default=None, help="also write the results to this file (default: none)")


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
    _add_server_args(serve)
    _add_engine_args(serve)
    serve.add_argument("--warmup", choices=["full", "background"], default="full",
                       help="background: ready once the largest bucket (which holds any step) is compiled, the "
                            "others compiling while it serves; full: ready once every bucket is compiled")
    hosts = serve.add_argument_group("multi-host (one model over the devices of several processes)")
    hosts.add_argument("--num-processes", type=int, default=1,
                       help="processes in the jax.distributed job; --tensor-parallel-size counts all their devices")
    hosts.add_argument("--process-id", type=int, default=0,
                       help="this process's rank: 0 serves HTTP and schedules, the others replay its steps")
    hosts.add_argument("--coordinator-address", default=None,
                       help="HOST:PORT of process 0's jax.distributed coordinator; process 0 also listens on "
                            "PORT+1 for the others (default: none, one process)")
    serve.set_defaults(func=_cmd_serve, default_log_level="info", runs_steps=True)

    gen = commands.add_parser("generate", help="generate a reply to one prompt and print it",
                              description="Generate without a server: a chat reply, or with --raw a completion.")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--raw", action="store_true", help="complete the prompt as is, no chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="the most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0 is all")
    gen.set_defaults(func=_cmd_generate, runs_steps=True)

    bench = commands.add_parser("bench", help="benchmarks", description="Benchmarks: offline engine or HTTP load.")
    bench_kinds = bench.add_subparsers(dest="bench_kind", required=True, metavar="KIND")
    offline = bench_kinds.add_parser("offline", help="engine throughput without HTTP",
                                     description="Engine throughput without HTTP: one wave per concurrency.")
    _add_engine_args(offline)
    offline.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64],
                         help="sequences per wave; one row per level")
    offline.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    offline.add_argument("--output-len", type=int, default=128, help="tokens generated per sequence")
    offline.add_argument("--json", default=None, help="also write the report to this file (default: none)")
    offline.set_defaults(func=_cmd_bench_offline, runs_steps=True)

    serve_bench = bench_kinds.add_parser(
        "serve", help="load a running server over HTTP (like `vllm bench serve`)",
        description="Load a running server over HTTP (like `vllm bench serve`): streamed /v1/completions; "
                    "req/s, output tok/s, TTFT/TPOT/ITL/E2E mean, p50 and p99 per concurrency level.",
    )
    _add_bench_serve_args(serve_bench)
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
    buckets_bench.add_argument("--config", action="append", required=True,
                               help="a ladder: preset name, YAML file, or tokens=32,128;requests=1,4,16 (repeatable)")
    buckets_bench.add_argument("--workload", default="sharegpt",
                               help="fixed:P,O | uniform:P1-P2,O1-O2 | sharegpt[:MEAN_IN,MEAN_OUT] | a .jsonl "
                                    "file of prompt_len, output_len[, arrival_s] (default: sharegpt)")
    arrivals = buckets_bench.add_mutually_exclusive_group()
    arrivals.add_argument("--rate", type=float, default=None,
                          help="Poisson arrivals, requests per second (default: none, a closed loop)")
    arrivals.add_argument("--concurrency", type=int, default=None,
                          help="closed loop: this many requests in flight (default: 16 unless --rate)")
    buckets_bench.add_argument("--num-requests", type=int, default=200, help="requests in a synthetic trace")
    buckets_bench.add_argument("--max-model-len", type=int, default=2048, help="lengths are clipped to fit it")
    buckets_bench.add_argument("--seed", type=int, default=0, help="seed of the trace")
    buckets_bench.add_argument("--target", default=None, choices=sorted(TARGETS),
                               help="predict on this GPU with a roofline (default: none, no predictions)")
    buckets_bench.add_argument("--model", default="gpt2",
                               help="the model whose shapes the predictions use: a bundled name "
                                    f"({', '.join(BUNDLED_SHAPES)}), a config.json, or --model as serve takes it")
    buckets_bench.add_argument("--dtype", default="auto", choices=DTYPES, help="dtype for predictions and --measure")
    buckets_bench.add_argument("--measure", action="store_true",
                               help="also run the engine here on the trace, per ladder (slow: compiles each ladder)")
    buckets_bench.add_argument("--measure-model", default=None,
                               help="the model --measure serves (default: the bundled SmolLM2)")
    buckets_bench.add_argument("--suggest", action="store_true",
                               help="propose a ladder for the workload within --max-buckets (written to "
                                    "OUT/suggested.yaml, and compared with the others)")
    buckets_bench.add_argument("--max-buckets", type=int, default=24, help="the bucket budget of --suggest")
    buckets_bench.add_argument("--out", default="bench-buckets", help="output directory (default: bench-buckets)")
    buckets_bench.set_defaults(func=_cmd_bench_buckets, log_level="warning", runs_steps=True)

    compile_cmd = commands.add_parser(
        "compile", help="compile every bucket for a GPU (no GPU needed) and predict step times",
        description="Compile the whole step (model, attention kernels, sampler) for every bucket of a ladder, "
                    "from the model's config alone, for a GPU target without a GPU (XLA's deviceless "
                    "compilation: Triton and ptxas run) or for the local device; print per bucket the compile "
                    "time, XLA's memory analysis and a roofline step time, and the KV budget. Needs the CUDA "
                    "compile pieces for GPU targets: pip install 'jaxserve[gpu-compile]'.",
    )
    compile_cmd.add_argument("--model", default=None,
                             help=f"a bundled shape ({', '.join(BUNDLED_SHAPES)}), a config.json, or anything "
                                  "serve --model takes (default: the bundled SmolLM2)")
    compile_cmd.add_argument("--target", default="h100", choices=[*TARGETS, "local"],
                             help="the GPU to compile for; local: this machine's default device")
    compile_cmd.add_argument("--config", default="gpu",
                             help=f"the ladder: a preset ({', '.join(preset_names())}) or a .yaml path")
    compile_cmd.add_argument("--dtype", default="auto", choices=DTYPES,
                             help="auto: bfloat16 on GPUs, float32 on CPU")
    compile_cmd.add_argument("--attention-impl", default="auto", choices=ATTENTION_IMPLS,
                             help="auto picks what a real device of the target's kind would")
    compile_cmd.add_argument("--max-model-len", type=int, default=None, help="(default: the model's)")
    compile_cmd.add_argument("--context-len", type=int, default=None,
                             help="keys each request attends in the predicted step times (default: max-model-len/2)")
    compile_cmd.add_argument("--gpu-memory-utilization", type=float, default=None,
                             help=f"for the KV budget (default: {CacheConfig.gpu_memory_utilization})")
    compile_cmd.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1,
                             help="buckets compiled at once (default: the CPU count)")
    compile_cmd.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                             help="compile the step split over this many devices (GPUs of one node for a "
                                  "target); memory is reported per device")
    compile_cmd.add_argument("--no-xla-cost", action="store_true",
                             help="skip XLA's cost analysis (a CPU lowering per bucket)")
    compile_cmd.add_argument("--json", default=None, help="also write the report to this file (default: none)")
    compile_cmd.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                             help="(default: warning)")
    compile_cmd.set_defaults(func=_cmd_compile)

    convert = commands.add_parser(
        "convert", help="write a model's converted weights, config and tokenizer as an orbax checkpoint",
        description="Load MODEL (anything serve --model takes), convert it to jaxserve's Flax layout in "
                    "--dtype, and write it to OUTPUT_DIR as an orbax checkpoint beside its config and "
                    "tokenizer; serve --model OUTPUT_DIR then restores each array straight onto its devices.",
    )
    convert.add_argument("model", nargs="?", default=None,
                         help="hub id, local HF directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    convert.add_argument("output_dir", help="where to write the checkpoint (new or empty)")
    convert.add_argument("--dtype", default="auto", choices=DTYPES,
                         help="the model's dtype (norms, biases; the weights unless --weight-dtype): auto is "
                              "float32 on CPU, bfloat16 on GPUs")
    convert.add_argument("--weight-dtype", default="auto", choices=DTYPES,
                         help="the matmul weights' dtype; auto (the default) is --dtype's")
    convert.add_argument("--revision", default=None, help="hub revision (default: the latest)")
    convert.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                         help="jaxserve's log level (default: info)")
    convert.set_defaults(func=_cmd_convert, default_log_level="info")
    return parser


def main(argv: list[str] | None = None) -> None:
    """The command line (`argv` None) or a call from Python (`argv` given: never re-executed)."""
    args = build_parser().parse_args(argv)
    runs_steps = getattr(args, "runs_steps", False)
    level = args.log_level or getattr(args, "default_log_level", "warning")
    try:
        if argv is None and runs_steps:
            preload_tcmalloc()  # re-executes this command once with tcmalloc preloaded, when one is found
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
        if level != "debug":
            logging.getLogger(_JAX_PROBE_LOGGER).setLevel(logging.WARNING)
        args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        sys.exit(1)
