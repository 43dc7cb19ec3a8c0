"""`jaxserve generate | bench offline`: flags become one EngineConfig, built once."""

import argparse
import json
import logging
import sys
import time

from jaxserve import __version__
from jaxserve.config import DTYPES, EngineConfig
from jaxserve.ops.attention import ATTENTION_IMPLS


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="hub id, local HF directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    group.add_argument("--config", default="default", help="preset in configs/ (name) or a YAML path")
    group.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="weights and KV cache dtype (auto: float32 on CPU, bfloat16 on GPU)")
    group.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    group.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step")
    group.add_argument("--block-size", dest="page_size", type=int, default=None, help="tokens per KV page")
    group.add_argument("--num-kv-pages", type=int, default=None, help="KV pages (overrides the memory budget)")
    group.add_argument("--kv-cache-memory", dest="kv_cache_memory_gib", type=float, default=None,
                       help="KV cache budget in GiB on CPU")
    group.add_argument("--gpu-memory-utilization", type=float, default=None)
    group.add_argument("--attention-impl", default=None, choices=ATTENTION_IMPLS)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--log-level", default="warning")


def _engine_config(args: argparse.Namespace, **extra) -> EngineConfig:
    return EngineConfig.from_preset(
        args.config,
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=args.page_size,
        num_kv_pages=args.num_kv_pages,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_impl=args.attention_impl,
        seed=args.seed,
        **extra,
    )


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
        "model": engine.model.name,
        "dtype": engine.model.dtype.dtype.name,
        "startup_s": round(startup, 1),
        "warmup_s": round(engine.warmup_seconds, 1),
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "results": results,
    }
    print(f"model {report['model']} dtype {report['dtype']}  start-up {startup:.1f}s "
          f"(warm-up {engine.warmup_seconds:.1f}s)  peak RSS {report['peak_rss_gib']} GiB")
    print(f"{'seqs':>5} {'out tok/s':>10} {'TPOT ms':>8} {'TTFT ms':>8} {'wall s':>7}")
    for r in results:
        print(f"{r['concurrency']:>5} {r['output_tokens_per_s']:>10.1f} {r['mean_tpot_ms']:>8.1f} "
              f"{r['mean_ttft_ms']:>8.1f} {r['seconds']:>7.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="A JAX-native LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"jaxserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate a reply to one prompt and print it")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable with --raw)")
    gen.add_argument("--raw", action="store_true", help="complete the prompt as is, no chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.set_defaults(func=_cmd_generate)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench_kind", required=True)
    offline = bench_kinds.add_parser("offline", help="engine throughput without HTTP")
    _add_engine_args(offline)
    offline.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    offline.add_argument("--input-len", type=int, default=128)
    offline.add_argument("--output-len", type=int, default=128)
    offline.add_argument("--json", default=None, help="also write the report to this file")
    offline.set_defaults(func=_cmd_bench_offline)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        sys.exit(1)
