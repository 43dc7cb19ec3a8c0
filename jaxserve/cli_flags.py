"""The flags of every command, one row each: names, the config field set, help. cli.py builds its parser from these.

A flag's default is its field's default in jaxserve.config (or, for the engine's flags that a preset
fills, None: not given), so a default is written once, there; the command reads its config back through
the same rows. Like cli.py this module must not import jax: `jaxserve --help` builds everything here.
"""

import argparse
import dataclasses
import decimal
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve.api.tools import TOOL_PARSERS  # names only: light
from jaxserve.config import (
    ATTENTION_IMPLS,
    AUTO_MAX_MODEL_LEN,
    BENCH_BACKENDS,
    BENCH_DATASETS,
    BENCH_METRICS,
    BENCH_SLO_METRICS,
    CHAT_TEMPLATE_CONTENT_FORMATS,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    METRICS_PREFIXES,
    POOLING_TYPES,
    QUANTIZATION_CHOICES,
    QUANTIZATIONS,
    REASONING_PARSER_NAMES,
    RUNNERS,
    SCHEDULING_POLICIES,
    SERVER_LOG_LEVELS,
    WARMUP_MODES,
    BucketBenchConfig,
    BucketConfig,
    CacheConfig,
    ClientConfig,
    CompileConfig,
    EngineConfig,
    GenerateConfig,
    LoraConfig,
    LoraModule,
    ModelConfig,
    OfflineBenchConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeBenchConfig,
    ServerConfig,
    SpeculativeConfig,
    field_default,
    preset_names,
)
from jaxserve.device import TARGETS
from jaxserve.model_configs import BUNDLED_SHAPES

Group = argparse.ArgumentParser | argparse._ArgumentGroup  # where arguments are added


class Flag:
    """One flag (or positional) that sets one field of a config dataclass: declared and read back from here.

    Its default is the field's (or `default`, where the command's differs from the library's), unless
    `preset`: then it is None unless given, so that the preset's value (else the field's) shows through, as
    EngineConfig.from_preset ignores None. `options` go to add_argument.
    """

    def __init__(self, names: str | tuple[str, ...], section: type, field: str, help: str, *,
                 preset: bool = False, default: Any = None, **options: Any) -> None:
        if field not in {f.name for f in dataclasses.fields(section)}:
            raise TypeError(f"{section.__name__} has no field {field!r}")  # at import: a typo never ships
        self.names = (names,) if isinstance(names, str) else names
        if not self.names[0].startswith("-") and self.names[0] != field:
            raise TypeError(f"a positional is named as its field: {self.names[0]!r} is not {field!r}")
        self.section = section
        self.field = field
        self.help = help
        self.preset = preset
        self.default = default
        self.options = options

    def add_to(self, group: Group) -> None:
        if self.preset:
            default = None
        elif self.default is not None:
            default = self.default
        else:
            default = field_default(self.section, self.field)
        options = dict(self.options)
        if self.names[0].startswith("-"):
            options["dest"] = self.field  # a positional's name is its dest
        default = list(default) if isinstance(default, tuple) else default  # argparse appends to lists
        group.add_argument(*self.names, default=default, help=self.help, **options)

    def read(self, args: argparse.Namespace) -> Any:
        value = getattr(args, self.field)
        return tuple(value) if isinstance(value, list) else value


@dataclasses.dataclass(frozen=True)
class InertFlag:
    """A flag of `vllm serve` that jaxserve takes, so that a vLLM command line runs unchanged, and that
    changes nothing here: `why` is its help, and is logged when it is given (`given_inert_flags`)."""

    names: tuple[str, ...]
    why: str
    kind: str = "value"  # value: takes one; values: one or more; switch: none; boolean: also --no-NAME
    check: Callable[[str], str] | None = None  # argparse's `type`: refuses a value that would mean something

    @property
    def option(self) -> str:
        """Its name as a keyword argument of vLLM's `LLM` (`trust_remote_code`)."""
        return self.names[0].lstrip("-").replace("-", "_")

    @property
    def dest(self) -> str:
        return "inert_" + self.option

    def add_to(self, group: Group) -> None:
        options: dict[str, Any] = {
            "value": {"metavar": "VALUE"}, "values": {"metavar": "VALUE", "nargs": "+"},
            "switch": {"action": "store_true"}, "boolean": {"action": argparse.BooleanOptionalAction},
        }[self.kind]
        if self.check is not None:
            options["type"] = self.check
        # store_true's default is False: None for every kind, so that "given" is "not None"
        group.add_argument(*self.names, dest=self.dest, default=None, help=f"no effect here: {self.why} (default: "
                           "not given)", **options)


def given_inert_flags(args: argparse.Namespace, flags: Sequence[InertFlag]) -> list[tuple[str, InertFlag]]:
    """(the flag as given, its row) for each of `flags` on the command line."""
    given = []
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        if value is False:  # --no-NAME
            given.append(("--no-" + flag.names[0].removeprefix("--"), flag))
        elif value is True:
            given.append((flag.names[0], flag))
        else:
            given.append((f"{flag.names[0]} {' '.join(value) if isinstance(value, list) else value}", flag))
    return given


def add_flags(parser: Group, flags: Sequence[Flag], title: str | None = None) -> None:
    group = parser.add_argument_group(title) if title else parser
    for flag in flags:
        flag.add_to(group)


def read_flags(args: argparse.Namespace, flags: Sequence[Flag]) -> dict[str, Any]:
    """{field: value} of `flags` as parsed."""
    return {flag.field: flag.read(args) for flag in flags}


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"top_k\": 20}}', got {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def _key_value(value: str) -> tuple[str, str]:
    key, equals, rest = value.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key.strip(), rest.strip()


def _slo(value: str) -> tuple[str, float]:
    metric, colon, bound = value.partition(":")
    try:
        if colon:
            return metric.strip(), float(bound)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected METRIC:MILLISECONDS such as ttft:500, got {value!r}")


def _comma_list(kind: Callable[[str], Any]) -> Callable[[str], tuple]:
    def parse(value: str) -> tuple:
        try:
            return tuple(kind(item.strip()) for item in value.split(",") if item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {value!r}") from None

    return parse


def _json_list(value: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected a JSON list such as '[\"*\"]', got {value!r}") from None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def human_int(value: str) -> int:
    """A token count, plain or with vLLM's suffixes: k, m, g, t by powers of ten (`25.6k` is 25,600), K, M, G,
    T by powers of two (`32K` is 32,768, whole multiples only)."""
    if value.isascii() and value.isdigit():
        return int(value)
    match = _HUMAN_INT.fullmatch(value)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a count such as 32768, 32k or 32K, got {value!r}")
    number, suffix = match.groups()
    if suffix.isupper() and "." in number:
        raise argparse.ArgumentTypeError(f"{value!r}: a binary multiple (K, M, G, T) takes a whole number; "
                                         f"{number}{suffix.lower()} is decimal")
    amount = decimal.Decimal(number) * _SUFFIXES[suffix]
    if amount != amount.to_integral_value():
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of tokens")
    return int(amount)


def max_model_len(value: str) -> int:
    """--max-model-len: a count as `human_int` reads it, or auto (vLLM's -1 too): the model's context, or as
    much of it as the KV cache holds."""
    return AUTO_MAX_MODEL_LEN if value.strip().lower() in ("auto", str(AUTO_MAX_MODEL_LEN)) else human_int(value)


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}: {error}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": 1}}', got {value!r}")
    return parsed


def _speculative_config(value: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.of(json.loads(value))
    except (json.JSONDecodeError, TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object such as '{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}': {error}"
        ) from None


def _lora_module(value: str) -> LoraModule:
    try:
        return LoraModule.parse(value)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# vLLM's former --task names for the runner that serves them
_TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling",
                 "classify": "pooling", "score": "pooling", "reward": "pooling"}


def _task_runner(value: str) -> str:
    if value not in _TASK_RUNNERS:
        raise argparse.ArgumentTypeError(f"{value!r}: say --runner generate or --runner pooling (--task takes "
                                         f"{', '.join(_TASK_RUNNERS)})")
    return _TASK_RUNNERS[value]


def _only(*allowed: str, why: str) -> Callable[[str], str]:
    """argparse's `type` for an inert flag: a value of `allowed` passes; another, which would change what
    jaxserve does, is refused with `why`."""
    def check(value: str) -> str:
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{value!r}: {why}")
        return value
    return check


def _cache_dir(value: str) -> str:
    return "" if value.lower() == "none" else value  # "" disables the cache


_BUNDLED_MODEL = "hub id, local HF directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)"
_OFF = {"action": "store_true"}

_LOAD_FORMAT_HELP = ("auto: the checkpoint's weights; dummy: random weights in the model's shapes, drawn on the "
                     "device (vLLM's flag), to benchmark without the weights: --model may then also be a bundled "
                     f"shape ({', '.join(BUNDLED_SHAPES)}) or a config.json (default: auto)")

_QUANTIZATION_HELP = ("fp8: the layers' dense weights in e4m3 with a float32 scale per output channel, quantized on "
                      "load (vLLM's flag): half the bytes a decode reads of them; the embeddings and the LM head "
                      "keep their dtype. gguf (CPUs, a .gguf --model): the layer weights, a mixture's "
                      "experts, the token embeddings and the LM head in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, "
                      "Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS stay in their blocks, multiplied by a native kernel")

_ENFORCE_EAGER_HELP = ("on GPUs, compile the steps without CUDA graphs (XLA's command buffers): the host launches "
                       "each kernel, as vLLM's flag runs without CUDA graphs; slower steps, to debug or compare "
                       "with; nothing changes on CPUs")
_REVISION_HELP = "a hub model's branch, tag or commit (default: main)"
_DOWNLOAD_DIR_HELP = "where a hub model's files are cached and downloaded to (default: the Hugging Face cache)"
_HF_OVERRIDES_HELP = ("fields of the model's transformers config replaced, a JSON object (vLLM's flag): "
                      "'{\"max_position_embeddings\": 65536}'; a RoPE scaling in either spelling, the model's "
                      "theta kept: '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                      "\"original_max_position_embeddings\": 32768}}' serves 131,072 tokens; an object for a "
                      "sub-config (text_config) updates its fields (default: none)")

ENGINE_FLAGS = (
    Flag("--model", ModelConfig, "model", _BUNDLED_MODEL),
    Flag("--revision", ModelConfig, "revision", _REVISION_HELP),
    Flag("--download-dir", ModelConfig, "download_dir", _DOWNLOAD_DIR_HELP),
    Flag("--hf-overrides", ModelConfig, "hf_overrides", type=_json_object, help=_HF_OVERRIDES_HELP),
    Flag("--tokenizer", ModelConfig, "tokenizer",
         "a hub id or directory whose tokenizer and chat template replace the model's (vLLM's flag; a GGUF "
         "file's base model's, say) (default: the model's)"),
    Flag("--tokenizer-revision", ModelConfig, "tokenizer_revision",
         "a hub tokenizer's branch, tag or commit (default: main)"),
    Flag("--load-format", ModelConfig, "load_format", choices=LOAD_FORMATS, help=_LOAD_FORMAT_HELP),
    Flag("--quantization", ModelConfig, "quantization", choices=QUANTIZATION_CHOICES, default="auto",
         help=_QUANTIZATION_HELP + "; auto: gguf for a .gguf --model on a CPU (one device), else none; none: "
              "a GGUF file's tensors dequantized (an FP8 checkpoint stays FP8) (default: auto)"),
    Flag("--dtype", ModelConfig, "dtype", choices=DTYPES,
         help="the model's dtype: activations, norms, the KV cache (unless --kv-cache-dtype) and the weights "
              "(unless --weight-dtype); auto is float32 on CPU, bfloat16 on GPU"),
    Flag("--weight-dtype", ModelConfig, "weight_dtype", preset=True, choices=DTYPES,
         help="the matmul weights' dtype (projections, embeddings, LM head); auto (the default) is --dtype's; "
              "with every dtype auto on a CPU with bfloat16 dot products (AVX512-BF16, AMX), weights and KV "
              "cache are bfloat16. "
              "bfloat16 under a float32 model: half the weights' memory and what a decode reads, through the "
              "native kernels on CPUs; activations stay float32"),
    Flag("--max-model-len", ModelConfig, "max_model_len", type=max_model_len, preset=True,
         help="context length, in tokens; 32k is 32,000 and 32K 32,768, as vLLM reads them; auto (or -1): the "
              "model's, or as much of it as the KV cache holds (default: the model's)"),
    Flag("--max-num-seqs", SchedulerConfig, "max_num_seqs", "the most sequences in one step (default: the preset's)",
         type=int, preset=True),
    Flag("--max-num-batched-tokens", SchedulerConfig, "max_num_batched_tokens",
         "the most tokens in one step, with --max-model-len's suffixes (default: the preset's)", type=human_int,
         preset=True),
    Flag("--async-scheduling", SchedulerConfig, "async_scheduling", preset=True,
         action=argparse.BooleanOptionalAction,
         help="schedule and dispatch each step before reading the previous step's tokens, so the host's work "
              "overlaps the device's; a stop is seen one step late and the extra token dropped (default: the "
              "preset's; the bundled presets turn it on)"),
    Flag("--scheduling-policy", SchedulerConfig, "scheduling_policy", choices=SCHEDULING_POLICIES,
         help="fcfs: requests in arrival order; priority: a request's `priority` field, lower first (ties in "
              "arrival order), and when pages or sequence slots run out the lowest-priority running request "
              "is preempted (vLLM's flag)"),
    Flag("--num-scheduler-steps", SchedulerConfig, "num_scheduler_steps", type=int, preset=True,
         help="decode steps per jitted call while every running request only decodes (vLLM's former flag): "
              "the sampled tokens are fed back on the device and stops read after, at most k - 1 tokens "
              "wasted per finished request; compiles each decode bucket once more (default: 1)"),
    Flag("--speculative-config", SchedulerConfig, "speculative_config", type=_speculative_config, preset=True,
         help="speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_max\": 5, \"prompt_lookup_min\": 2}': while every running request only decodes, "
              "each proposes up to k drafts by n-gram lookup in its own context and one step verifies them on a "
              "row each; or '{\"model\": \"<draft model>\", \"num_speculative_tokens\": 4}': drafts from a "
              "smaller model with the target's tokenizer, run beside the target with a KV cache of its own (sharing "
              "the cache's memory); or '{\"method\": \"eagle\" (or \"eagle3\"), \"model\": \"<drafter>\", "
              "\"num_speculative_tokens\": 3}': an EAGLE drafter reading the target's hidden states; or "
              "'{\"method\": \"mtp\", \"num_speculative_tokens\": 1}': DeepSeek-V3's or GLM-4.5's own "
              "multi-token prediction layer; outputs are token for token those of plain decoding (default: none)"),
    Flag("--enable-lora", LoraConfig, "enable_lora", preset=True, action=argparse.BooleanOptionalAction,
         help="serve LoRA adapters (vLLM's flag): each of --lora-modules is a model name of its own, and one step "
              "mixes requests of the base model and of up to --max-loras adapters (default: off)"),
    Flag("--lora-modules", LoraConfig, "lora_modules", type=_lora_module, nargs="+", preset=True,
         help="the adapters to serve, PEFT directories (adapter_config.json, adapter_model.safetensors), as "
              "name=path or vLLM's JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' (default: "
              "none)"),
    Flag("--max-loras", LoraConfig, "max_loras", type=int, preset=True,
         help=f"the most adapters one step runs; a request of another adapter waits for a slot (default: "
              f"{LoraConfig.max_loras})"),
    Flag("--max-cpu-loras", LoraConfig, "max_cpu_loras", type=int, preset=True,
         help="vLLM's bound on adapters kept in host memory; here every adapter served stays there (each load "
              "logs its size), so it is only checked: >= --max-loras (default: --max-loras)"),
    Flag("--max-lora-rank", LoraConfig, "max_lora_rank", type=int, preset=True,
         help=f"the largest adapter rank served; every slot is this wide (default: {LoraConfig.max_lora_rank})"),
    Flag("--greedy-decodes", BucketConfig, "greedy_decodes", preset=True, action=argparse.BooleanOptionalAction,
         help="also compile each decode bucket as a greedy-only step (an argmax, none of the sampler's control "
              "flow), run when every row of a step is greedy and asks for nothing more; twice the decode "
              "buckets' compile time (default: the preset's; on in the gpu preset)"),
    Flag("--engine-process", EngineConfig, "engine_process", preset=True, action=argparse.BooleanOptionalAction,
         help="run the engine core (scheduler, model runner) in its own process, with tokenizing, detokenizing "
              "and HTTP in this one, as vLLM V1 does (default: off)"),
    Flag("--block-size", CacheConfig, "page_size", "tokens per KV page (default: the preset's)", type=int,
         preset=True),
    Flag(("--num-kv-pages", "--num-gpu-blocks-override"), CacheConfig, "num_kv_pages", type=int, preset=True,
         help="KV pages, overriding the memory budget (vLLM's --num-gpu-blocks-override) (default: from the budget)"),
    Flag("--kv-cache-dtype", CacheConfig, "kv_cache_dtype", preset=True, choices=KV_CACHE_DTYPES,
         help="the KV cache's dtype; auto (the default) is the model's (but see --weight-dtype). float16 or "
              "bfloat16 under a float32 model halve the cache's memory and what attention reads; fp8 (e4m3 "
              "with per-layer scales: the checkpoint's k_scale/v_scale, else a calibration pass) halves a "
              "16-bit cache again: GPUs of compute capability >= 8.9, and the jnp CPU path"),
    Flag("--kv-cache-memory", CacheConfig, "kv_cache_memory_gib", "KV cache budget in GiB on CPU (default: the "
         "preset's)", type=float, preset=True),
    Flag("--gpu-memory-utilization", CacheConfig, "gpu_memory_utilization", type=float, preset=True,
         help="fraction of the GPU's memory for jaxserve (as in vLLM): weights, the step's temp memory, and the "
              f"KV cache, which gets the rest (default: {CacheConfig.gpu_memory_utilization})"),
    Flag("--runner", EngineConfig, "runner", choices=RUNNERS,
         help="generate: completions and chat; pooling: /v1/embeddings (/classify, /score and /rerank for a "
              "classifier), each prompt's final hidden states pooled by --pooling-type, through the same "
              "scheduler and buckets; auto (the default): pooling for a classifier or an encoder (BERT, "
              "XLM-RoBERTa), else generate (vLLM's flag)"),
    Flag("--task", EngineConfig, "runner", type=_task_runner,
         help="vLLM's former flag for --runner: generate, or embed (embedding) for pooling"),
    Flag("--pooling-type", EngineConfig, "pooling_type", choices=POOLING_TYPES,
         help="with --runner pooling: last (the last token's hidden state: decoder embedding models such as "
              "Qwen3-Embedding), mean (over the prompt's tokens), cls (the first token's: BERT's) or auto (the "
              "default): the model's sentence-transformers pooling where it has one (1_Pooling/config.json), "
              "else cls for an encoder and last for a decoder; an encoder classifier's head reads cls only"),
    Flag("--attention-impl", EngineConfig, "attention_impl", preset=True, choices=ATTENTION_IMPLS,
         help="auto (the default): the Pallas kernel on CUDA GPUs with compute capability >= 8.0, the cpu path "
              "on CPUs, the jnp reference elsewhere; interpret runs the kernel on CPU (slow, for tests)"),
    Flag("--max-logprobs", ModelConfig, "max_logprobs", type=int, preset=True,
         help=f"the most top logprobs a request may ask for (default: {ModelConfig.max_logprobs})"),
    Flag("--seed", ModelConfig, "seed", f"seed of the sampling RNG (default: {ModelConfig.seed})", type=int,
         preset=True),
    Flag("--enforce-eager", EngineConfig, "enforce_eager", action="store_true", help=_ENFORCE_EAGER_HELP),
    Flag("--compilation-cache-dir", EngineConfig, "compilation_cache_dir", type=_cache_dir, preset=True,
         help="JAX's persistent compilation cache; 'none' disables it "
              f"(default: {EngineConfig.compilation_cache_dir})"),
    Flag("--enable-prefix-caching", CacheConfig, "enable_prefix_caching", preset=True,
         action=argparse.BooleanOptionalAction,
         help="reuse the KV pages of prompt prefixes computed before (default: on, as in vLLM)"),
    Flag(("--tensor-parallel-size", "-tp"), ParallelConfig, "tensor_parallel_size", type=int,
         help="devices to split the model over (heads, MLP width, vocabulary, KV pages); on CPU, "
              "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N devices"),
    Flag(("--data-parallel-size", "-dp"), ParallelConfig, "data_parallel_size", type=int,
         help="engine cores, each in its own process on --tensor-parallel-size devices of its own (GPUs, or "
              "on a CPU its share of the physical cores); each request goes to the least loaded"),
    Flag("--enable-expert-parallel", ParallelConfig, "enable_expert_parallel", action="store_true",
         help="a mixture of experts: split the experts whole over the devices (default: each expert's MLP "
              "width split, as the dense MLP's)"),
)

# vLLM's engine flags that mean nothing in jaxserve, on every command that builds an engine.
_PARTIAL_PREFILLS = ("the scheduler fills each step with prompt chunks up to --max-num-batched-tokens, however many "
                     "prompts that takes")
_LLGUIDANCE = "structured outputs are always compiled by llguidance"
INERT_ENGINE_FLAGS = (
    InertFlag(("--trust-remote-code",), "jaxserve's models are its own Flax ports and tokenizers load without "
              "remote code, so no code from a model repository ever runs", "switch"),
    InertFlag(("--swap-space",), "a preempted request's KV pages are computed again when it resumes, never "
              "swapped to host memory (as in vLLM V1)"),
    InertFlag(("--cpu-offload-gb",), "the weights stay on the devices that serve them; a model larger than "
              "they hold fails to load"),
    InertFlag(("--enable-chunked-prefill",), "prompts are always prefilled in chunks of up to "
              "--max-num-batched-tokens, beside the running requests' decodes (as in vLLM V1); an encoder's "
              "whole, in one step", "boolean"),
    InertFlag(("--max-num-partial-prefills",), _PARTIAL_PREFILLS),
    InertFlag(("--max-long-partial-prefills",), _PARTIAL_PREFILLS),
    InertFlag(("--long-prefill-token-threshold",), _PARTIAL_PREFILLS),
    InertFlag(("--max-seq-len-to-capture",), "every bucket of the ladder is one compiled program, whatever the "
              "context lengths in it"),
    InertFlag(("--cuda-graph-sizes",), "the compiled step sizes are the ladder's buckets (--config)", "values"),
    InertFlag(("--compilation-config", "-O"), "each bucket's step is one XLA program, compiled once "
              "(--enforce-eager: without CUDA graphs)"),
    InertFlag(("--disable-custom-all-reduce",), "the collectives are XLA's own", "switch"),
    InertFlag(("--distributed-executor-backend",), "jaxserve starts its own processes: --engine-process, "
              "--data-parallel-size, and --num-processes across hosts"),
    InertFlag(("--max-parallel-loading-workers",), "the weights load in one pass, while the steps compile"),
    InertFlag(("--tokenizer-mode",), "tokenizers load through transformers' AutoTokenizer (auto and hf only)",
              check=_only("auto", "hf", why="tokenizers load through transformers' AutoTokenizer, as vLLM's "
                                            "auto and hf modes load them, and in no other mode")),
    InertFlag(("--guided-decoding-backend",), _LLGUIDANCE),
    InertFlag(("--structured-outputs-config",), _LLGUIDANCE),
    InertFlag(("--limit-mm-per-prompt",), "jaxserve serves text models"),
    InertFlag(("--use-v2-block-manager",), "vLLM's former flag: KV pages are always managed as blocks", "switch"),
    InertFlag(("--pipeline-parallel-size", "-pp"), "one pipeline stage, the only size taken",
              check=_only("1", why="jaxserve runs one pipeline stage; split a model over devices with "
                                   "--tensor-parallel-size, over hosts with --num-processes")),
)

# `vllm bench serve`'s flags that mean nothing to `jaxserve bench serve`.
INERT_BENCH_FLAGS = (
    InertFlag(("--ignore-eos",), "every request ignores EOS, for exactly its output length", "switch"),
    InertFlag(("--disable-tqdm",), "the bench prints a row a level, not a progress bar", "switch"),
)

# vLLM's server flags that mean nothing in jaxserve: `serve` only.
INERT_SERVER_FLAGS = (
    InertFlag(("--enable-prompt-tokens-details",), "usage always has prompt_tokens_details.cached_tokens",
              "switch"),
    InertFlag(("--enable-server-load-tracking",), "GET /load is always served", "switch"),
    InertFlag(("--enable-reasoning",), "vLLM's former flag: --reasoning-parser alone turns it on", "switch"),
    InertFlag(("--max-log-len",), "--enable-log-requests logs a prompt's length, never its text"),
    InertFlag(("--disable-frontend-multiprocessing",), "the HTTP front end and the engine share one process "
              "unless --engine-process", "switch"),
    InertFlag(("--api-server-count",), "one process serves HTTP, off the engine's thread"),
)

SERVER_FLAGS = (
    Flag("--host", ServerConfig, "host", "address to bind; 0.0.0.0 is all interfaces"),
    Flag("--port", ServerConfig, "port", "port to bind", type=int),
    Flag("--served-model-name", ServerConfig, "served_model_name", nargs="+",
         help="name(s) clients use in `model` (default: the model's name)"),
    Flag("--api-key", ServerConfig, "api_key",
         help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize, the scoring routes and "
              "/invocations (SageMaker sends no key) (default: $JAXSERVE_API_KEY, else $VLLM_API_KEY, else none)"),
    Flag("--allowed-origins", ServerConfig, "allowed_origins", "CORS origins, a JSON list", type=_json_list),
    Flag("--allow-credentials", ServerConfig, "allow_credentials", "CORS: allow credentials", **_OFF),
    Flag("--allowed-methods", ServerConfig, "allowed_methods", "CORS methods, a JSON list", type=_json_list),
    Flag("--allowed-headers", ServerConfig, "allowed_headers", "CORS headers, a JSON list", type=_json_list),
    Flag("--ssl-keyfile", ServerConfig, "ssl_keyfile", "TLS private key file (default: plain HTTP)"),
    Flag("--ssl-certfile", ServerConfig, "ssl_certfile", "TLS certificate file (default: plain HTTP)"),
    Flag("--root-path", ServerConfig, "root_path", "path prefix when behind a path-based proxy (default: none)"),
    Flag("--enable-request-id-headers", ServerConfig, "enable_request_id_headers", **_OFF,
         help="add X-Request-Id to every response (a client's own id is always echoed)"),
    Flag("--enable-force-include-usage", ServerConfig, "enable_force_include_usage", **_OFF,
         help="every streamed completion and chat completion ends with a usage chunk, as if its "
              "stream_options asked for it (vLLM's flag: for metering)"),
    Flag("--chat-template", ServerConfig, "chat_template",
         "a Jinja chat template, or a file holding one (default: the tokenizer's)"),
    Flag("--chat-template-content-format", ServerConfig, "chat_template_content_format",
         choices=CHAT_TEMPLATE_CONTENT_FORMATS,
         help="how a message's content reaches the chat template (vLLM's flag): string, its text parts joined "
              "by newlines; openai, a list of OpenAI's parts, [{\"type\": \"text\", \"text\": ...}]; auto, "
              "openai for a template that loops over a message's content, else string"),
    Flag("--trust-request-chat-template", ServerConfig, "trust_request_chat_template", **_OFF,
         help="let a request bring its own `chat_template` (refused otherwise: a template is code that runs on "
              "the server)"),
    Flag("--enable-auto-tool-choice", ServerConfig, "enable_auto_tool_choice", **_OFF,
         help="tool_choice 'auto': the model decides, and --tool-call-parser reads its calls ('required' and "
              "named choices need neither: the grammar enforces them)"),
    Flag("--tool-call-parser", ServerConfig, "tool_call_parser", choices=sorted(TOOL_PARSERS),
         help="how the model writes tool calls: hermes (Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.1/3.2 "
              "JSON), mistral (Mistral, both of its formats), pythonic (Llama 3.2/4 Python lists) (default: none, "
              "so tool_choice 'auto' is refused)"),
    Flag("--reasoning-parser", ServerConfig, "reasoning_parser", choices=REASONING_PARSER_NAMES,
         help="split a reasoning model's <think>...</think> part into message.reasoning_content (and "
              "delta.reasoning_content when streaming); structured outputs and tool calls apply to the answer "
              "after it: deepseek_r1 (DeepSeek-R1 and its distills), qwen3 (Qwen3), openai_gptoss (GPT-OSS's "
              "harmony analysis channel; its final channel is the answer) (default: none)"),
    Flag("--generation-config", ServerConfig, "generation_config",
         "default sampling parameters: 'auto' (the model's generation_config.json), 'vllm' (none), or a folder"),
    Flag("--override-generation-config", ServerConfig, "override_generation_config", type=_json_object,
         help="default sampling parameters over --generation-config's, a JSON object of generation_config.json "
              "names (vLLM's flag): '{\"temperature\": 0.6, \"top_p\": 0.95, \"max_new_tokens\": 512}'; "
              "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens (default: none)"),
    Flag("--default-chat-template-kwargs", ServerConfig, "default_chat_template_kwargs", type=_json_object,
         help="arguments for the chat template under each request's chat_template_kwargs, a JSON object (vLLM's "
              "flag): '{\"enable_thinking\": false}' (default: none)"),
    Flag("--response-role", ServerConfig, "response_role",
         help="a chat reply's role where the prompt opens a new turn (add_generation_prompt); a reply that "
              "continues the last message has that message's role"),
    Flag("--return-tokens-as-token-ids", ServerConfig, "return_tokens_as_token_ids", **_OFF,
         help="logprobs name tokens 'token_id:{id}', as if every request asked for it"),
    Flag("--profiler-dir", ServerConfig, "profiler_dir",
         "serve POST /start_profile and /stop_profile, which record a jax.profiler trace of the engine (XProf / "
         "TensorBoard and Perfetto files) into this folder (default: $JAXSERVE_PROFILER_DIR, else "
         "$VLLM_TORCH_PROFILER_DIR, else not served)"),
    Flag("--disable-fastapi-docs", ServerConfig, "disable_fastapi_docs", **_OFF,
         help="no /docs nor /openapi.json (vLLM's name for it)"),
    Flag("--body-read-timeout", ServerConfig, "body_read_timeout", type=float,
         help="seconds for a request body to arrive in full; a slower one gets a 408"),
    Flag("--shutdown-timeout", ServerConfig, "shutdown_timeout", type=float,
         help="seconds to finish in-flight requests after SIGTERM/SIGINT"),
)

SERVER_LOG_FLAGS = (
    Flag("--disable-log-stats", ServerConfig, "disable_log_stats", "no periodic throughput log lines", **_OFF),
    Flag("--metrics-prefix", ServerConfig, "metrics_prefix", choices=METRICS_PREFIXES,
         help="the name prefix of every series /metrics serves: jaxserve (the default), or vllm, so dashboards "
              "and alerts written for vLLM's metrics read jaxserve's unchanged (the names mean the same)"),
    Flag(("--disable-uvicorn-access-log", "--disable-access-log"), ServerConfig, "access_log", action="store_false",
         help="no access log (by default one line per HTTP request)"),
    Flag("--uvicorn-log-level", ServerConfig, "server_log_level", choices=SERVER_LOG_LEVELS,
         help="log level of the HTTP server's own loggers (vLLM's name for it)"),
    Flag("--enable-log-requests", ServerConfig, "log_requests", **_OFF,
         help="log one line per request with its sampling parameters and prompt length (default: off)"),
    Flag("--disable-log-requests", ServerConfig, "log_requests", action="store_false",
         help="no per-request lines: the default, accepted for vLLM compatibility"),
)

WARMUP_FLAGS = (
    Flag("--warmup", EngineConfig, "warmup_mode", choices=list(WARMUP_MODES), default="auto",
         help="full: ready once every bucket is compiled; background: ready once the largest bucket (which "
              "holds any step) is compiled, the others compiling while it serves; auto: background, and full "
              "in a multi-host job (default: auto)"),
)

HOST_FLAGS = (
    Flag("--num-processes", ParallelConfig, "num_processes", type=int,
         help="processes in the jax.distributed job; --tensor-parallel-size counts all their devices"),
    Flag("--process-id", ParallelConfig, "process_id", type=int,
         help="this process's rank: 0 serves HTTP and schedules, the others replay its steps"),
    Flag("--coordinator-address", ParallelConfig, "coordinator_address",
         help="HOST:PORT of process 0's jax.distributed coordinator; process 0 also listens on PORT+1 for the "
              "others (default: none, one process)"),
)

GENERATE_FLAGS = (
    Flag("--prompt", GenerateConfig, "prompt", "prompt text (repeatable)", action="append", required=True),
    Flag("--raw", GenerateConfig, "raw", "complete the prompt as is, no chat template", **_OFF),
    Flag("--max-tokens", GenerateConfig, "max_tokens", "the most tokens to generate", type=int),
    Flag("--temperature", GenerateConfig, "temperature", "sampling temperature; 0 is greedy", type=float),
    Flag("--top-p", GenerateConfig, "top_p", "nucleus sampling threshold", type=float),
    Flag("--top-k", GenerateConfig, "top_k", "sample from the k likeliest tokens; 0 is all", type=int),
)

_CLIENT_FLAGS = (
    Flag("--url", ClientConfig, "url", "the server's OpenAI base URL"),
    Flag("--model-name", ClientConfig, "model_name", "the model to ask (default: the first /v1/models lists)"),
    Flag("--api-key", ClientConfig, "api_key", "the server's API key (default: OPENAI_API_KEY, else none)"),
)
CHAT_FLAGS = (
    *_CLIENT_FLAGS,
    Flag("--system-prompt", ClientConfig, "system_prompt", "the conversation's system message (default: none)"),
    Flag("--max-tokens", ClientConfig, "max_tokens", "the most tokens of each reply (default: the server's)",
         type=int),
    Flag(("-q", "--quick"), ClientConfig, "quick",
         "send this one message, print the reply and exit (default: none: read messages until end of input)",
         metavar="MESSAGE"),
)
COMPLETE_FLAGS = (
    *_CLIENT_FLAGS,
    Flag("--max-tokens", ClientConfig, "max_tokens", "the most tokens of each completion (default: the "
         "server's)", type=int),
    Flag(("-q", "--quick"), ClientConfig, "quick", "complete this one prompt, print it and exit "
         "(default: none: read prompts until end of input)", metavar="PROMPT"),
)

OFFLINE_FLAGS = (
    Flag("--concurrency", OfflineBenchConfig, "concurrency", "sequences per wave; one row per level", type=int,
         nargs="+"),
    Flag("--input-len", OfflineBenchConfig, "input_len", "prompt length in tokens", type=int),
    Flag("--output-len", OfflineBenchConfig, "output_len", "tokens generated per sequence", type=int),
    Flag("--json", OfflineBenchConfig, "json", "also write the report to this file (default: none)"),
    Flag("--profile", OfflineBenchConfig, "profile", **_OFF,
         help="instead of waves, where each decode step's time goes at each level: host phases, dispatch, "
              "device, token read, the gap between device steps, kernels per step (from a jax.profiler "
              "trace) and the fraction of the step's roofline reached"),
    Flag("--profile-steps", OfflineBenchConfig, "profile_steps", "decode steps timed per level", type=int),
)

SERVE_BENCH_FLAGS = (
    Flag("--base-url", ServeBenchConfig, "base_url",
         "the server's root, or its OpenAI base URL ending in /v1 (vLLM's flag names the root) (default: "
         "http://HOST:PORT)"),
    Flag("--host", ServeBenchConfig, "host", "the server's host, without --base-url (vLLM's flag)"),
    Flag("--port", ServeBenchConfig, "port", "the server's port, without --base-url (vLLM's flag)", type=int),
    Flag("--model", ServeBenchConfig, "model", "the `model` field to send (default: none, the server's)"),
    Flag("--api-key", ServeBenchConfig, "api_key",
         "bearer token to send (default: $JAXSERVE_API_KEY, else $VLLM_API_KEY, else none)"),
    Flag(("--concurrency", "--max-concurrency"), ServeBenchConfig, "concurrency", type=int, nargs="+",
         help="requests in flight, at most (vLLM's --max-concurrency); one row per level (default: 1 4 16, or "
              "with a --request-rate one row without a cap)"),
    Flag("--request-rate", ServeBenchConfig, "request_rate", type=float,
         help="requests sent per second, at random times as vLLM sends them (a Poisson process, the last sent "
              "at num-prompts / rate); inf sends them all at once"),
    Flag("--burstiness", ServeBenchConfig, "burstiness", type=float,
         help="with --request-rate, the gaps' gamma shape (vLLM's flag): 1 a Poisson process, below 1 burstier, "
              "above 1 steadier"),
    Flag("--num-prompts", ServeBenchConfig, "num_prompts", type=int,
         help="requests per level (default: 4 x concurrency, or 10 s of arrivals without a cap; at least 8)"),
    Flag(("--input-len", "--random-input-len"), ServeBenchConfig, "input_len", type=int,
         help="prompt length in tokens (random token ids)"),
    Flag(("--prefix-len", "--random-prefix-len"), ServeBenchConfig, "prefix_len", type=int,
         help="tokens of one shared prefix before each prompt, like a system prompt"),
    Flag(("--output-len", "--random-output-len"), ServeBenchConfig, "output_len", type=int,
         help="tokens generated per request (EOS ignored, so exactly this many)"),
    Flag("--random-range-ratio", ServeBenchConfig, "range_ratio", type=float,
         help="each request's input and output lengths drawn uniformly within this fraction of theirs, either "
              "side (vLLM's flag): 0.5 with --input-len 128 is 64-192 tokens"),
    Flag("--backend", ServeBenchConfig, "backend", choices=tuple(BENCH_BACKENDS),
         help="vLLM's backends: openai and vllm stream /v1/completions; openai-chat streams /v1/chat/completions, "
              "each prompt one user message in the server's chat template (random token ids decoded to text "
              "first; a custom file's prompts not templated here) (default: openai)"),
    Flag("--endpoint", ServeBenchConfig, "endpoint",
         "the backend's route (vLLM's flag): /v1/completions, or /v1/chat/completions for openai-chat (default: "
         "the backend's)"),
    Flag("--dataset-name", ServeBenchConfig, "dataset_name", choices=BENCH_DATASETS,
         help="vLLM's datasets: random token ids of the lengths above; sharegpt, a ShareGPT JSON file's "
              "conversations, each one's first turn for as many tokens as its reply (vLLM's filter and "
              "order); custom, a JSONL file of {\"prompt\": ..., \"output_tokens\": ...}, each prompt in the "
              "chat template (default: random)"),
    Flag("--dataset-path", ServeBenchConfig, "dataset_path",
         "the sharegpt or custom dataset's file (default: none, for the random dataset)"),
    Flag("--tokenizer", ServeBenchConfig, "tokenizer",
         "counts a file's prompt and reply tokens: a directory, a .gguf file or a hub id (default: --model, "
         "else the model the server names in /v1/models)"),
    Flag("--sharegpt-output-len", ServeBenchConfig, "sharegpt_output_len", type=int,
         help="sharegpt: every request's output length (default: each conversation's reply's)"),
    Flag("--custom-output-len", ServeBenchConfig, "custom_output_len", type=int,
         help="custom: every request's output length; -1 takes each line's output_tokens (default: 256)"),
    Flag("--skip-chat-template", ServeBenchConfig, "skip_chat_template", **_OFF,
         help="custom: send each prompt as written, not as a user turn in the tokenizer's chat template"),
    Flag("--disable-shuffle", ServeBenchConfig, "disable_shuffle", **_OFF,
         help="take a file's prompts in its order, not in the seed's shuffle"),
    Flag("--no-oversample", ServeBenchConfig, "no_oversample", **_OFF,
         help="where fewer of a file's prompts pass than --num-prompts, send those alone, not repeats to fill"),
    Flag("--seed", ServeBenchConfig, "seed", "seed of the random prompts, a file's shuffle, the arrival times",
         type=int),
    Flag("--temperature", ServeBenchConfig, "temperature", "sent with every request; 0 is greedy", type=float),
    Flag("--top-p", ServeBenchConfig, "top_p", "sent with every request (default: not sent)", type=float),
    Flag("--top-k", ServeBenchConfig, "top_k", "sent with every request, a vLLM/llama.cpp extension (default: "
         "not sent)", type=int),
    Flag("--min-p", ServeBenchConfig, "min_p", "sent with every request, a vLLM/llama.cpp extension (default: "
         "not sent)", type=float),
    Flag("--frequency-penalty", ServeBenchConfig, "frequency_penalty", "sent with every request (default: not sent)",
         type=float),
    Flag("--presence-penalty", ServeBenchConfig, "presence_penalty", "sent with every request (default: not sent)",
         type=float),
    Flag("--repetition-penalty", ServeBenchConfig, "repetition_penalty", "sent with every request, a vLLM extension "
         "(default: not sent)", type=float),
    Flag("--logprobs", ServeBenchConfig, "logprobs", type=int,
         help="log-probabilities per token, asked of every request (the chat API's logprobs and top_logprobs) "
              "(default: none)"),
    Flag("--extra-body", ServeBenchConfig, "extra_body", type=_json_object,
         help="a JSON object whose fields every request also carries, over the bench's own (vLLM's flag), e.g. "
              "'{\"chat_template_kwargs\": {\"enable_thinking\": false}}' (default: none)"),
    Flag("--served-model-name", ServeBenchConfig, "served_model_name",
         "the `model` field to send where it differs from --model, which then names the tokenizer (vLLM's flag) "
         "(default: --model)"),
    Flag("--header", ServeBenchConfig, "headers", type=_key_value, nargs="*", metavar="KEY=VALUE",
         help="headers sent with every request (vLLM's flag) (default: none)"),
    Flag("--request-id-prefix", ServeBenchConfig, "request_id_prefix",
         "each request's X-Request-Id is this, the level's number and the request's, as in PREFIX0-12 "
         "(default: bench- and 8 random hex digits)"),
    Flag("--insecure", ServeBenchConfig, "insecure", **_OFF, help="https without checking the server's certificate"),
    Flag("--percentile-metrics", ServeBenchConfig, "percentile_metrics", type=_comma_list(str),
         help=f"the latencies the table shows, comma-separated: some of {','.join(BENCH_METRICS)} (vLLM's names; "
              f"every one is in the JSON) (default: all)"),
    Flag("--metric-percentiles", ServeBenchConfig, "metric_percentiles", type=_comma_list(float),
         help="percentiles reported beside each latency's mean and median, comma-separated, as 90,99 (default: 99)"),
    Flag("--goodput", ServeBenchConfig, "goodput", type=_slo, nargs="+", metavar="METRIC:MS",
         help=f"service level objectives in ms, METRIC one of {', '.join(BENCH_SLO_METRICS)} (vLLM's flag): the "
              f"requests per second that met them all (good/s) (default: none)"),
    Flag("--ready-check-timeout-sec", ServeBenchConfig, "ready_check_timeout_sec", type=float,
         help="first send the first request until the server answers it, waiting at most this long, as for a "
              "server still starting (vLLM's flag); a refusal (4xx) ends the wait at once; 0 sends none "
              "(default: 0)"),
    Flag("--num-warmups", ServeBenchConfig, "num_warmups", type=int,
         help="requests of the first prompt sent, and not measured, before the first level (default: 0)"),
    Flag("--json", ServeBenchConfig, "json", "also write the results to this file (default: none)"),
    Flag("--save-result", ServeBenchConfig, "save_result", **_OFF,
         help="also write the results, a record a level with the run's settings and vLLM's flat names for "
              "the figures (median_ttft_ms, output_throughput, ...), to a file named as vLLM names it: "
              "LABEL-RATEqps-concurrencyC-MODEL-DATE.json"),
    Flag("--result-dir", ServeBenchConfig, "result_dir", "--save-result's folder (default: the current one)"),
    Flag("--result-filename", ServeBenchConfig, "result_filename", "--save-result's file name (default: vLLM's)"),
    Flag("--label", ServeBenchConfig, "label", "names the run in its records and --save-result's file (default: "
         "the backend)"),
    Flag("--metadata", ServeBenchConfig, "metadata", type=_key_value, nargs="*", metavar="KEY=VALUE",
         help="pairs added to each record of the results (vLLM's flag) (default: none)"),
)

BUCKET_FLAGS = (
    Flag("--config", BucketBenchConfig, "ladders", action="append", required=True, metavar="CONFIG",
         help="a ladder: preset name, YAML file, or tokens=32,128;requests=1,4,16 (repeatable)"),
    Flag("--workload", BucketBenchConfig, "workload",
         "fixed:P,O | uniform:P1-P2,O1-O2 | sharegpt[:MEAN_IN,MEAN_OUT] | a .jsonl file of prompt_len, "
         "output_len[, arrival_s]"),
    Flag("--num-requests", BucketBenchConfig, "num_requests", "requests in a synthetic trace", type=int),
    Flag("--max-model-len", BucketBenchConfig, "max_model_len", "lengths are clipped to fit it", type=int),
    Flag("--seed", BucketBenchConfig, "seed", "seed of the trace", type=int),
    Flag("--target", BucketBenchConfig, "target", choices=sorted(TARGETS),
         help="predict on this GPU with a roofline (default: none, no predictions)"),
    Flag("--model", BucketBenchConfig, "model",
         f"the model whose shapes the predictions use: a bundled name ({', '.join(BUNDLED_SHAPES)}), a "
         "config.json, or --model as serve takes it"),
    Flag("--dtype", BucketBenchConfig, "dtype", "dtype for predictions and --measure", choices=DTYPES),
    Flag("--measure", BucketBenchConfig, "measure", **_OFF,
         help="also run the engine here on the trace, per ladder (slow: compiles each ladder)"),
    Flag("--measure-model", BucketBenchConfig, "measure_model", "the model --measure serves (default: the "
         "bundled SmolLM2)"),
    Flag("--load-format", BucketBenchConfig, "load_format", choices=LOAD_FORMATS, help=_LOAD_FORMAT_HELP),
    Flag("--suggest", BucketBenchConfig, "suggest", **_OFF,
         help="propose a ladder for the workload within --max-buckets (written to OUT/suggested.yaml, and "
              "compared with the others)"),
    Flag("--max-buckets", BucketBenchConfig, "max_buckets", "the bucket budget of --suggest", type=int),
    Flag("--out", BucketBenchConfig, "out", "output directory"),
)

BUCKET_ARRIVAL_FLAGS = (  # one or the other
    Flag("--rate", BucketBenchConfig, "rate", "Poisson arrivals, requests per second (default: none, a closed "
         "loop)", type=float),
    Flag("--concurrency", BucketBenchConfig, "concurrency", "closed loop: this many requests in flight "
         "(default: 16 unless --rate)", type=int),
)

COMPILE_FLAGS = (
    Flag("--model", CompileConfig, "model",
         f"a bundled shape ({', '.join(BUNDLED_SHAPES)}), a config.json, or anything serve --model takes "
         "(default: the bundled SmolLM2)"),
    Flag("--revision", CompileConfig, "revision", _REVISION_HELP),
    Flag("--download-dir", CompileConfig, "download_dir", _DOWNLOAD_DIR_HELP),
    Flag("--hf-overrides", CompileConfig, "hf_overrides", type=_json_object, help=_HF_OVERRIDES_HELP),
    Flag("--target", CompileConfig, "target", "the GPU to compile for; local: this machine's default device",
         choices=[*TARGETS, "local"]),
    Flag("--config", CompileConfig, "preset", f"the ladder: a preset ({', '.join(preset_names())}) or a .yaml path",
         metavar="CONFIG"),
    Flag("--dtype", CompileConfig, "dtype", "auto: bfloat16 on GPUs, float32 on CPU", choices=DTYPES),
    Flag("--attention-impl", CompileConfig, "attention_impl", "auto picks what a real device of the target's "
         "kind would", choices=ATTENTION_IMPLS),
    Flag("--max-model-len", CompileConfig, "max_model_len", "as serve's (default: the model's)", type=max_model_len),
    Flag("--max-num-seqs", CompileConfig, "max_num_seqs", type=int,
         help="as serve's: above the preset's largest bucket, its ladder extended as serve extends it (default: "
              "the preset's)"),
    Flag("--max-num-batched-tokens", CompileConfig, "max_num_batched_tokens", type=human_int,
         help="as serve's, the same (default: the preset's)"),
    Flag("--speculative-config", CompileConfig, "speculative_config", type=_speculative_config,
         help="as serve's: the step as speculative decoding runs it (default: the preset's)"),
    Flag("--context-len", CompileConfig, "context_len", type=int,
         help="keys each request attends in the predicted step times (default: max-model-len/2)"),
    Flag("--gpu-memory-utilization", CompileConfig, "gpu_memory_utilization", type=float,
         help=f"for the KV budget (default: {CacheConfig.gpu_memory_utilization})"),
    Flag("--kv-cache-dtype", CompileConfig, "kv_cache_dtype", choices=KV_CACHE_DTYPES,
         help="the KV cache's dtype, as serve takes it (default: the preset's); fp8 compiles the kernels that "
              "read FP8 pages"),
    Flag("--num-kv-pages", CompileConfig, "num_kv_pages", type=int,
         help="KV pages, as serve takes them: no memory budget, and no compiles for it (default: the budget's)"),
    Flag(("--jobs", "-j"), CompileConfig, "jobs", "buckets compiled at once (default: the CPU count)", type=int),
    Flag(("--tensor-parallel-size", "-tp"), CompileConfig, "tensor_parallel_size", type=int,
         help="compile the step split over this many devices (GPUs of one node for a target); memory is "
              "reported per device"),
    Flag("--enable-expert-parallel", CompileConfig, "enable_expert_parallel", action="store_true",
         help="a mixture of experts: split the experts whole over the devices"),
    Flag("--quantization", CompileConfig, "quantization", choices=QUANTIZATIONS,
         help=_QUANTIZATION_HELP + " (default: none)"),
    Flag("--max-loras", CompileConfig, "max_loras", type=int,
         help="compile the step as --enable-lora serves it, with this many adapter slots (default: 0, no LoRA)"),
    Flag("--max-lora-rank", CompileConfig, "max_lora_rank", type=int, help="the slots' rank, with --max-loras"),
    Flag("--no-xla-cost", CompileConfig, "xla_cost", "skip XLA's cost analysis (a CPU lowering per bucket)",
         action="store_false"),
    Flag("--enforce-eager", CompileConfig, "enforce_eager", action="store_true", help=_ENFORCE_EAGER_HELP),
    Flag("--no-variants", CompileConfig, "variants", action="store_false",
         help="only the plain step per bucket, not the decode buckets' greedy and multi-step variants the "
              "preset turns on (an EAGLE or MTP drafter's steps are compiled still: they are what it runs)"),
    Flag("--json", CompileConfig, "json", "also write the report to this file (default: none)"),
)

CONVERT_FLAGS = (
    Flag("model", ModelConfig, "model", _BUNDLED_MODEL, nargs="?"),
    Flag("--dtype", ModelConfig, "dtype", choices=DTYPES,
         help="the model's dtype (norms, biases; the weights unless --weight-dtype): auto is float32 on CPU, "
              "bfloat16 on GPUs"),
    Flag("--weight-dtype", ModelConfig, "weight_dtype", "the matmul weights' dtype; auto (the default) is "
         "--dtype's", choices=DTYPES),
    Flag("--revision", ModelConfig, "revision", _REVISION_HELP),
    Flag("--download-dir", ModelConfig, "download_dir", _DOWNLOAD_DIR_HELP),
)
