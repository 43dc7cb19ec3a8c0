"""Engine configuration: frozen dataclasses that validate themselves, and YAML presets from jaxserve/configs/.

No jax here: `jaxserve --help` builds its choices from this module and must stay fast. The presets ship
inside the package and are read through importlib.resources, so a wheel install finds them as an
editable one does.
"""

import dataclasses
import importlib.resources
import importlib.resources.abc
import json
import logging
import math
import os
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16")
LOAD_FORMATS = ("auto", "dummy")  # vLLM's names: the checkpoint's weights, or random ones in its shapes
# vLLM's names. fp8: e4m3 weights with a scale per output channel, quantized on load; gguf: a GGUF file's
# 2- to 8-bit layer weights and token embeddings kept in their blocks, for the native CPU kernel.
QUANTIZATIONS = ("fp8", "gguf")
# auto (the commands' default): gguf for a GGUF file where its kernel runs (a CPU, one device), else none
# (the library's default, None: every tensor dequantized, a 16- or 32-bit checkpoint as it is).
QUANTIZATION_CHOICES = ("auto", "none", *QUANTIZATIONS)
# ops/attention.py resolves and checks the choice; the names live here so the CLI need not import jax.
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "reference", "cpu", "cpu-native", "pallas", "interpret")
# auto: the model's dtype. A 16-bit cache under a float32 model halves what attention reads (llama.cpp's
# default cache is float16); the CPU paths and the native kernel compute in float32 either way.
# fp8 (vLLM's name; fp8_e4m3 the same): e4m3 pages with a scale of 1, half a 16-bit cache's bytes.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3")
# The HTTP server's own log levels (uvicorn's names, which vLLM's --uvicorn-log-level takes).
SERVER_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# Fields of a generation_config.json that become default sampling parameters (vLLM's rule), by their name
# there: the model's own file (--generation-config) and --override-generation-config.
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}
# The metrics' name prefix: jaxserve's own, or vLLM's, so dashboards and alerts written for vLLM work as is.
METRICS_PREFIXES = ("jaxserve", "vllm")
# How a message's content reaches the chat template (vLLM's --chat-template-content-format): string, its
# text parts joined; openai, OpenAI's list of parts ([{"type": "text", "text": ...}]); auto, openai for a
# template that loops over a message's content, else string.
CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")
# --max-model-len auto (vLLM's -1): the model's context, or as much of it as the KV cache holds
AUTO_MAX_MODEL_LEN = -1


def cache_home() -> Path:
    """Where jaxserve keeps what it converts or records between starts: `$JAXSERVE_CACHE_DIR`, by default
    `~/.cache/jaxserve` (XLA's compilation cache is `--compilation-cache-dir`'s)."""
    return Path(os.environ.get("JAXSERVE_CACHE_DIR") or "~/.cache/jaxserve").expanduser()


def context_served(max_model_len: int | None, context: int) -> int:
    """The context length served, before the KV cache is sized: --max-model-len cut to the model's
    `context`; the context itself for None and auto (which the cache's size may shorten: `fit_to_kv_cache`)."""
    return context if max_model_len in (None, AUTO_MAX_MODEL_LEN) else min(max_model_len, context)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # hub id, local directory or .gguf file; None: the bundled SmolLM2
    dtype: str = "auto"  # activations, norms, biases; and the weights unless weight_dtype says otherwise
    # The matmul weights' dtype (projections, token embeddings, LM head); auto: `dtype`'s. bfloat16 under a
    # float32 model is llama.cpp's F16 split: 16-bit weights, activations and the residual stream in float32.
    weight_dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length; AUTO_MAX_MODEL_LEN: what fits
    seed: int = 0
    revision: str | None = None  # a hub id's branch, tag or commit; None: main
    download_dir: str | None = None  # where a hub id's files are cached; None: the Hugging Face cache
    # The tokenizer (and its chat template) from elsewhere (vLLM's --tokenizer): a hub id or a directory;
    # None: the model's own (a GGUF file's converted one)
    tokenizer: str | None = None
    tokenizer_revision: str | None = None  # a hub tokenizer's branch, tag or commit; None: main
    # Fields of the model's transformers config replaced (vLLM's --hf-overrides): {"max_position_embeddings":
    # 65536}, {"rope_scaling": {...}}; a dict for a sub-config updates its fields (`source.with_hf_overrides`)
    hf_overrides: dict[str, Any] | None = None
    max_logprobs: int = 20  # the most top alternatives a request may ask for (a compiled shape)
    load_format: str = "auto"  # one of LOAD_FORMATS: the checkpoint's weights, or "dummy": random ones
    quantization: str | None = None  # one of QUANTIZATION_CHOICES: the weights' quantized form, or None

    def __post_init__(self) -> None:
        for name in ("dtype", "weight_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got {getattr(self, name)!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 1 and self.max_model_len != AUTO_MAX_MODEL_LEN:
            raise ValueError(f"max_model_len must be >= 1, or {AUTO_MAX_MODEL_LEN} for auto, got {self.max_model_len}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict of config fields, got {self.hf_overrides!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.max_logprobs < 0:  # vLLM's -1 (the whole vocabulary) would be a vocabulary-wide compiled top-k
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_kv_pages: int | None = None  # overrides the memory budget
    kv_cache_memory_gib: float = 2.0  # the budget on CPU
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True  # reuse computed KV pages of shared prompt prefixes
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_kv_pages is not None and self.num_kv_pages < 2:
            raise ValueError(f"num_kv_pages must be >= 2, got {self.num_kv_pages}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if not 0.0 < self.kv_cache_memory_gib < math.inf:
            raise ValueError(f"kv_cache_memory_gib (--kv-cache-memory) must be a number of GiB > 0, "
                             f"got {self.kv_cache_memory_gib}")


MAX_SCHEDULER_STEPS = 64


SCHEDULING_POLICIES = ("fcfs", "priority")
RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("auto", "last", "mean", "cls")
WARMUP_MODES = ("auto", "full", "background")  # see EngineConfig.warmup_mode
REASONING_PARSER_NAMES = ("deepseek_r1", "glm45", "openai_gptoss", "qwen3")  # jaxserve.api.reasoning.REASONING_PARSERS


SPECULATIVE_METHODS = ("ngram", "draft_model", "suffix", "eagle", "eagle3", "mtp")
MODEL_METHODS = ("draft_model", "eagle", "eagle3")  # the methods that take a "model"
# The methods whose drafter reads the target's hidden states (`models/features.py`)
FEATURE_METHODS = ("eagle", "eagle3", "mtp")
# vLLM's older names of "mtp", one a family
MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config: each decode proposes up to `num_speculative_tokens` drafts, which the
    model verifies in one step. Method "ngram" (prompt lookup): the tokens that followed the latest n-gram of
    the context (n in [prompt_lookup_min, prompt_lookup_max]) where it appeared before. Method "draft_model":
    a smaller model's greedy continuation (`model`: a hub id, directory or GGUF file, with the target's
    tokenizer), run beside the target with a KV cache of its own. Methods "eagle" and "eagle3": an EAGLE or
    EAGLE-3 drafter's (`model`: its directory or hub id, a Llama-layer checkpoint with `fc`; `models/eagle.py`,
    `models/eagle3.py`), which reads the target's hidden states. Method "mtp": the model's own
    multi-token prediction layer (DeepSeek-V3's, GLM-4.5's; `models/mtp.py`), which reads them too; its
    "model", where given, is the target's. Method "suffix" (SuffixDecoding): what
    followed the longest suffix of the context in the context and in recent requests' outputs
    (`engine/suffix_proposer.py`; `num_speculative_tokens` defaults to the most, 16). The other fields are
    vLLM's of the same names."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 5  # vLLM's defaults, both
    prompt_lookup_min: int = 5
    model: str | None = None  # the draft model ("draft_model")
    revision: str | None = None  # the draft model's hub revision
    quantization: str | None = None  # the draft's weights' quantized form (QUANTIZATION_CHOICES); None: its own
    max_model_len: int | None = None  # drafts stop where a sequence passes it (and the draft's own context)
    draft_tensor_parallel_size: int | None = None  # the target's (the draft is split as the target is)
    disable_by_batch_size: int | None = None  # no drafts while more requests than this run
    suffix_decoding_max_tree_depth: int = 24  # "suffix": the longest suffix of the context matched
    suffix_decoding_max_cached_requests: int = 10000  # "suffix": finished outputs searched (0: none)
    suffix_decoding_max_spec_factor: float = 1.0  # "suffix": drafts at most this times the match's length
    suffix_decoding_min_token_prob: float = 0.1  # "suffix": a path's probability at least this

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                             f"{self.method!r}")
        if self.method in MODEL_METHODS and self.model is None:
            raise ValueError('methods "draft_model", "eagle" and "eagle3" take their model as "model"')
        if self.method not in (*MODEL_METHODS, "mtp") and self.model is not None:
            raise ValueError(f'method "{self.method}" takes no "model"')
        if self.method in FEATURE_METHODS and self.quantization not in (None, "none"):
            raise ValueError("an EAGLE or MTP drafter's weights are not quantized: no \"quantization\" for it")
        if self.method == "mtp" and self.revision is not None:
            raise ValueError("an MTP drafter is the model's own layer: no \"revision\" for it")
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError(f"the draft model must be a hub id, directory or file, got {self.model!r}")
        drafted_by_model = ("revision", "quantization", "max_model_len", "draft_tensor_parallel_size")
        given = [name for name in drafted_by_model if getattr(self, name) is not None]
        if self.model is None and self.method != "mtp" and given:  # an MTP drafter's "model" is the target
            raise ValueError(f"{', '.join(given)}: a draft model's settings, and no \"model\" is given")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision):
            raise ValueError(f"revision must be a non-empty string, got {self.revision!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"the draft's quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        depth = self.suffix_decoding_max_tree_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or not 2 <= depth <= 64:  # matches start from pairs
            raise ValueError(f"suffix_decoding_max_tree_depth must be an integer in [2, 64], got {depth!r}")
        cached = self.suffix_decoding_max_cached_requests
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValueError(f"suffix_decoding_max_cached_requests must be an integer >= 0, got {cached!r}")
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 <= factor <= 64:
            raise ValueError(f"suffix_decoding_max_spec_factor must be a number in [0, 64], got {factor!r}")
        if isinstance(prob, bool) or not isinstance(prob, int | float) or not 0 <= prob <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob must be a number in [0, 1], got {prob!r}")
        for name in ("max_model_len", "draft_tensor_parallel_size", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= 64, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        """From vLLM's JSON object (a preset's mapping, the flag's parsed value); None stays None. As in vLLM,
        `num_speculative_tokens` is required and a lookup bound given alone is the other's default too."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"the speculative config must be a JSON object, got {value!r}")
        value = dict(value)
        if value.get("model") in ("ngram", "[ngram]") and "method" not in value:  # vLLM's older spelling
            value["method"] = value.pop("model")
        if value.get("method") == "[ngram]":
            value["method"] = "ngram"
        if value.get("method") in MTP_ALIASES:
            value["method"] = "mtp"
        if "model" in value and "method" not in value:  # vLLM infers the method from the model's name
            name = str(value["model"]).lower()
            value["method"] = "eagle3" if "eagle3" in name else "eagle" if "eagle" in name else "draft_model"
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        suffix_keys = sorted(key for key in value if key.startswith("suffix_decoding_"))
        if suffix_keys and value.get("method") != "suffix":
            raise ValueError(f"{', '.join(suffix_keys)}: settings of the \"suffix\" method only")
        if value.get("method") == "suffix":  # as in vLLM, as many drafts as a match may earn (at most 16 here)
            value.setdefault("num_speculative_tokens", MAX_SPECULATIVE_TOKENS)
        if "num_speculative_tokens" not in value:
            raise ValueError("the speculative config needs num_speculative_tokens")
        values = dict(value)
        if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
            values["prompt_lookup_min"] = values["prompt_lookup_max"]
        elif "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
            values["prompt_lookup_max"] = values["prompt_lookup_min"]
        return cls(**values)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # Schedule and dispatch step N + 1 before reading step N's tokens (vLLM's --async-scheduling).
    async_scheduling: bool = False
    # Decode steps run per jitted call when every running request only decodes (vLLM's former
    # --num-scheduler-steps): the k tokens are fed back on the device and the stops read after.
    num_scheduler_steps: int = 1
    # "fcfs": arrival order. "priority" (vLLM's): a request's `priority`, lower first, then arrival; when
    # pages or sequence slots run out, the lowest-priority running request is the one preempted.
    scheduling_policy: str = "fcfs"
    # Speculative decoding (vLLM's --speculative-config), None for none.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if not 1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS:
            raise ValueError(f"num_scheduler_steps must be in [1, {MAX_SCHEDULER_STEPS}], "
                             f"got {self.num_scheduler_steps}")

    @property
    def max_drafts(self) -> int:
        """Drafts a speculative decode verifies per request at most; 0 without speculative decoding."""
        return 0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens


MAX_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's choices for --max-lora-rank


@dataclass(frozen=True)
class LoraModule:
    """An adapter served under its own model name: `path`, a PEFT adapter directory (adapter_config.json and
    adapter_model.safetensors); `base_model_name`, the model /v1/models lists as its parent (None: the
    served model's)."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """A preset's module validates by `parse`, the flag's rule, so YAML takes the flag's forms."""
        from pydantic_core import core_schema

        return core_schema.no_info_plain_validator_function(cls.parse)

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | LoraModule") -> "LoraModule":
        """vLLM's --lora-modules forms: `name=path`, or a JSON object {"name", "path", "base_model_name"}."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                value = json.loads(text)
            else:
                name, equals, path = text.partition("=")
                if not equals or not name or not path:
                    raise ValueError(f"a LoRA module is name=path or a JSON object, got {value!r}")
                return cls(name, path)
        if not isinstance(value, dict):
            raise ValueError(f"a LoRA module is name=path or a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"unknown LoRA module keys {unknown}; known: {sorted(known)}")
        if not isinstance(value.get("name"), str) or not isinstance(value.get("path"), str):
            raise ValueError(f"a LoRA module needs a string name and path, got {value!r}")
        return cls(**value)


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest` for `LLM.generate` and `LLM.chat`: the adapter at `lora_path` (a PEFT directory)
    under the model name `lora_name`, loaded on first use. `lora_int_id` is accepted for vLLM's signature;
    the engine numbers adapters itself."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name or not self.lora_path:
            raise ValueError("a LoRARequest needs a lora_name and a lora_path")


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA serving (vLLM's flags): each adapter in `lora_modules` is a model name of its own; one
    step mixes requests of up to `max_loras` adapters (and of the base model), each adapter of rank at most
    `max_lora_rank` in one of the device's `max_loras` slots."""

    enable_lora: bool = False
    lora_modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1  # adapters in one step: the device slots
    max_lora_rank: int = 16
    # vLLM's bound on adapters cached in host memory (None: max_loras). Every adapter served stays in host
    # memory here (each load logs its size), so it is only checked, as vLLM checks it.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        modules = tuple(LoraModule.parse(module) for module in self.lora_modules)
        object.__setattr__(self, "lora_modules", modules)
        if modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        names = [module.name for module in modules]
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA module names must differ: {names}")
        if not 1 <= self.max_loras <= 64:
            raise ValueError(f"max_loras must be in [1, 64], got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}, "
                             f"got {self.max_lora_rank}")


@dataclass(frozen=True)
class BucketConfig:
    token_buckets: tuple[int, ...] = (32, 64, 128, 256, 512)
    request_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    # Each decode bucket also compiled as a greedy-only step (an argmax, no sampler control flow), run when
    # every row of a step is greedy and asks for nothing more: on a GPU the full sampler's top-level
    # `lax.cond`s each read a predicate on the host every step. Twice the decode buckets' compile time.
    greedy_decodes: bool = False

    def __post_init__(self) -> None:
        for name in ("token_buckets", "request_buckets"):
            ladder = tuple(getattr(self, name))
            if not ladder or list(ladder) != sorted(set(ladder)) or ladder[0] < 1:
                raise ValueError(f"{name} must be a strictly increasing list of positive ints: {ladder}")
            object.__setattr__(self, name, ladder)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # devices the weights, heads and KV pages are split over (all processes')
    num_processes: int = 1  # jax.distributed processes (hosts); process 0 serves, the others follow
    process_id: int = 0
    coordinator_address: str | None = None  # HOST:PORT of process 0's jax.distributed coordinator
    enable_expert_parallel: bool = False  # a mixture of experts' experts split whole over the devices
    # Engine cores, each in its own process with its own tensor_parallel_size devices (vLLM's
    # --data-parallel-size): the frontend sends each request to the least loaded one.
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.data_parallel_size > 1 and self.num_processes > 1:
            raise ValueError("data_parallel_size > 1 runs its engine cores on one host: not with num_processes > 1")
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("num_processes > 1 needs a coordinator_address HOST:PORT")
        if self.coordinator_address is not None:
            host, _, port = self.coordinator_address.rpartition(":")
            # PORT + 1 carries the work channel (channel_address), so PORT stops one short of the last port.
            if not host or not port.isdigit() or not 1 <= int(port) < 65535:
                raise ValueError(f"coordinator_address must be HOST:PORT with PORT in [1, 65534], "
                                 f"got {self.coordinator_address!r}")
        if self.num_processes > 1 and self.tensor_parallel_size % self.num_processes:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of "
                             f"num_processes ({self.num_processes}): each process brings its devices")

    @property
    def multihost(self) -> bool:
        return self.num_processes > 1

    @property
    def data_parallel(self) -> bool:
        return self.data_parallel_size > 1

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def channel_address(self) -> tuple[str, int]:
        """Where process 0 sends device work to the others: the coordinator's host, its port + 1."""
        host, port = str(self.coordinator_address).rsplit(":", 1)
        return host, int(port) + 1


def _same_model(first: str, second: str | None) -> bool:
    """Whether two model names are one model: the same hub id, or paths to the same directory or file."""
    if first == second:
        return True
    return second is not None and os.path.exists(first) and os.path.exists(second) and os.path.samefile(first, second)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    buckets: BucketConfig = field(default_factory=BucketConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    attention_impl: str = "auto"
    compilation_cache_dir: str | None = "~/.cache/jaxserve/xla"
    # When the engine is ready (WARMUP_MODES): once every bucket is compiled (full), or once the largest,
    # which holds any step, is (background: the rest compile while serving). auto, `serve`'s default, is
    # background on one host and full across hosts (every process runs the same buckets in the same
    # order); full here keeps library and benchmark engines at their steady state once built.
    warmup_mode: str = "full"
    # The engine core (scheduler, runner, the model) in its own process; detokenizing and outputs stay in
    # the caller's (vLLM V1's split).
    engine_process: bool = False
    # "generate", or "pooling" (vLLM's --runner): every request is a prompt to embed, its final hidden
    # state pooled (`pooling_type`: the last token's, the mean over its tokens, or the first token's, "cls")
    # instead of decoded; "auto" (vLLM's default): pooling for a classifier or an encoder, else generate,
    # once the model is read (engine/core.py). A pooling type "auto" is the model's: its sentence-transformers
    # pooling where it has one, else the first token's for an encoder and the last one's for a decoder.
    runner: str = "auto"
    pooling_type: str = "auto"
    # The steps compiled without XLA's command buffers (CUDA graphs) on GPUs: each kernel launched by the
    # host, as vLLM's --enforce-eager runs without CUDA graphs (`runner/aot.step_compiler_options`).
    enforce_eager: bool = False

    @property
    def core_processes(self) -> int:
        return core_process_count(self.engine_process, self.parallel.data_parallel_size)

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS or self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)} and pooling_type one of "
                             f"{', '.join(POOLING_TYPES)}; got {self.runner!r}, {self.pooling_type!r}")
        if self.runner == "pooling" and self.parallel.multihost:
            raise ValueError("--runner pooling is single-host")
        if self.parallel.multihost and self.engine_process:
            raise ValueError("a multi-host engine runs its core in the server's process: engine_process is "
                             "single-host")
        if self.lora.enable_lora and (self.parallel.multihost or self.runner == "pooling"):
            raise ValueError("--enable-lora serves generation on one host (no --runner pooling, no multi-host)")
        if self.lora.enable_lora and self.cache.kv_cache_dtype in ("fp8", "fp8_e4m3"):
            raise ValueError("--enable-lora: not with an FP8 KV cache, whose scales are folded into the projections")
        speculative = self.scheduler.speculative_config
        if speculative is not None and speculative.method in MODEL_METHODS and self.parallel.multihost:
            raise ValueError("a draft model (--speculative-config's \"model\") runs beside a model on one host: "
                             "not with hosts above 1")
        if speculative is not None and speculative.method == "mtp" and self.parallel.multihost:
            raise ValueError("an MTP drafter runs beside a model on one host: not with hosts above 1")
        if (speculative is not None and speculative.method == "mtp" and speculative.model is not None
                and not _same_model(speculative.model, self.model.model)):
            raise ValueError(f"method \"mtp\" drafts with the model's own layer: its \"model\" is the served one "
                             f"({self.model.model!r}) or left out, got {speculative.model!r}")
        draft_tp = None if speculative is None else speculative.draft_tensor_parallel_size
        if draft_tp is not None and draft_tp != self.parallel.tensor_parallel_size:
            raise ValueError(f"draft_tensor_parallel_size {draft_tp}: the draft model is split over the target's "
                             f"devices, as the target is: give {self.parallel.tensor_parallel_size} or leave it out")
        if self.warmup_mode not in WARMUP_MODES:
            raise ValueError(f"warmup_mode must be one of {', '.join(WARMUP_MODES)}; got {self.warmup_mode!r}")
        if self.parallel.multihost and self.warmup_mode == "background":
            raise ValueError("a multi-host engine warms up fully: every process must run the same buckets in "
                             "the same order")
        max_rows = min(self.scheduler.max_num_seqs, self.scheduler.max_num_batched_tokens)  # in one step
        if self.buckets.request_buckets[-1] < max_rows:
            raise ValueError(
                f"the largest request bucket ({self.buckets.request_buckets[-1]}) must cover "
                f"max_num_seqs ({self.scheduler.max_num_seqs}), or max_num_batched_tokens where that is smaller"
            )
        if self.buckets.token_buckets[-1] < self.scheduler.max_num_batched_tokens:
            raise ValueError(
                f"the largest token bucket ({self.buckets.token_buckets[-1]}) must cover "
                f"max_num_batched_tokens ({self.scheduler.max_num_batched_tokens})"
            )

    @classmethod
    def from_preset(cls, preset: str | Path | None = None, **overrides: Any) -> "EngineConfig":
        """Builds a config from a YAML preset (a name in jaxserve/configs/ or a path), then flat overrides.

        Overrides are field names of any sub-config (`max_num_seqs=8`, `dtype="float32"`) or of
        EngineConfig itself; None values are ignored so CLI defaults don't mask the preset.
        """
        sections: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}, "buckets": {},
                                               "parallel": {}, "lora": {}}
        top: dict[str, Any] = {}
        owners = {
            "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "buckets": BucketConfig,
            "parallel": ParallelConfig, "lora": LoraConfig,
        }
        if preset is not None:
            for section, values in load_preset(preset).items():
                if section not in sections:
                    raise ValueError(f"unknown section {section!r} in preset {preset}")
                sections[section].update(_preset_values(owners[section], values, f"preset {preset}: {section}"))
        for key, value in overrides.items():
            if value is None:
                continue
            owner = next((s for s, c in owners.items() if key in _field_names(c)), None)
            if owner is not None:
                sections[owner][key] = value
            elif key in _field_names(cls):
                top[key] = value
            else:
                raise TypeError(f"unknown engine option {key!r}")
        if "lora_modules" in sections["lora"]:
            sections["lora"]["lora_modules"] = tuple(sections["lora"]["lora_modules"])
        for name in ("token_buckets", "request_buckets"):
            if name in sections["buckets"]:
                sections["buckets"][name] = tuple(sections["buckets"][name])
        _cover_given_limits(sections, overrides)
        return cls(**{s: owners[s](**sections[s]) for s in sections}, **top)


def _preset_values(owner: type, values: Any, where: str) -> dict[str, Any]:
    """A preset section's values, each checked against its field's type (a YAML list becomes the tuple a
    ladder is), so a wrong one fails naming its field rather than deep in a comparison."""
    from pydantic import TypeAdapter, ValidationError

    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"{where} must map field names to values, got {values!r}")
    hints = typing.get_type_hints(owner)
    checked = {}
    for name, value in values.items():
        if name not in _field_names(owner):
            raise ValueError(f"{where} has no field {name!r}; its fields: {', '.join(sorted(_field_names(owner)))}")
        try:
            checked[name] = TypeAdapter(hints[name]).validate_python(value)
        except ValidationError as e:
            raise ValueError(f"{where}.{name}: {e.errors()[0]['msg']}, got {value!r}") from None
    return checked


# A limit given beside a preset, and the ladder whose largest bucket must hold it.
_LIMIT_LADDERS = {"max_num_seqs": "request_buckets", "max_num_batched_tokens": "token_buckets"}


def _cover_given_limits(sections: dict[str, dict[str, Any]], overrides: dict[str, Any]) -> None:
    """A --max-num-seqs or --max-num-batched-tokens above the preset's largest bucket (vLLM's `--max-num-seqs
    512` on the gpu preset's 256) extends that ladder up to it, doubling, so that a step pads by less than
    2x; a ladder given beside it is the caller's, and must hold it already (__post_init__). Rows are
    extended only as far as the step's tokens reach: a step of N tokens has at most N rows."""
    scheduler = sections["scheduler"]
    max_tokens = scheduler.get("max_num_batched_tokens", field_default(SchedulerConfig, "max_num_batched_tokens"))
    for limit, ladder_name in _LIMIT_LADDERS.items():
        given = overrides.get(limit)
        if given is None or overrides.get(ladder_name) is not None:
            continue
        if limit == "max_num_seqs":
            given = min(given, max_tokens)
        ladder = tuple(sections["buckets"].get(ladder_name, field_default(BucketConfig, ladder_name)))
        extended = extend_ladder(ladder, given)
        if extended != ladder:
            logger.info("%s %d is above the preset's largest bucket: %s %s added (more to compile)",
                        limit, given, ladder_name, ", ".join(map(str, extended[len(ladder):])))
            sections["buckets"][ladder_name] = extended


def extend_ladder(ladder: tuple[int, ...], limit: int) -> tuple[int, ...]:
    """A bucket ladder extended up to `limit`, doubling, so that a step pads by less than 2x."""
    extended = list(ladder)
    while extended[-1] < limit:
        extended.append(min(2 * extended[-1], limit))
    return tuple(extended)


def core_process_count(engine_process: bool, data_parallel_size: int) -> int:
    """How many engine cores run in processes of their own: one per data-parallel rank, or one with
    engine_process; 0 when the core runs in the caller's process."""
    return data_parallel_size if data_parallel_size > 1 else int(engine_process)


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (its factory called): what a flag left out gives."""
    found = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if found is None:
        raise TypeError(f"{cls.__name__} has no field {name!r}")
    if found.default_factory is not dataclasses.MISSING:
        return found.default_factory()
    if found.default is dataclasses.MISSING:
        raise TypeError(f"{cls.__name__}.{name} has no default")
    return found.default


def _bundled_presets() -> importlib.resources.abc.Traversable:
    return importlib.resources.files("jaxserve") / "configs"


def preset_names() -> list[str]:
    """The presets bundled with the package (the names `--config` takes)."""
    return sorted(e.name.removesuffix(".yaml") for e in _bundled_presets().iterdir() if e.name.endswith(".yaml"))


def load_preset(preset: str | Path) -> dict[str, Any]:
    """A preset's sections: a bare name is a bundled preset, anything with a suffix a YAML file."""
    if Path(preset).suffix:
        path = Path(preset).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        text = path.read_text()
    else:
        resource = _bundled_presets() / f"{preset}.yaml"
        if not resource.is_file():
            raise FileNotFoundError(f"no config preset {preset!r}; choose from {', '.join(preset_names())} "
                                    "or pass a .yaml path")
        text = resource.read_text()
    try:
        sections = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"config {preset} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(sections, dict):
        raise ValueError(f"config {preset} must map section names (model, cache, scheduler, ...) to fields, "
                         f"got {type(sections).__name__}")
    return sections


def platform_preset(isolated: bool = False) -> str:
    """The preset for the default JAX backend when `--config` is not given: `cpu` on a CPU, `gpu` on a GPU.

    The `default` ladder compiles about forty buckets, over a minute at every start on a CPU, for batches
    a CPU cannot fill anyway; `cpu` compiles a handful. Other backends keep `default`.
    Imports jax, so only call it when the engine is about to start. `isolated`: ask a short-lived
    subprocess, so this process never opens the device (an engine core in its own process needs all of a
    GPU's memory).
    """
    if isolated:
        import subprocess
        import sys

        probe = [sys.executable, "-c", "import jax; print(jax.default_backend())"]
        backend = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
    else:
        import jax

        backend = jax.default_backend()
    preset = backend if backend in ("cpu", "gpu") else "default"
    logger.info("using preset %r: no --config given and the JAX backend is %s", preset, backend)
    return preset


def engine_preset(config: str | Path | None, gpu_memory_utilization: float | None = None,
                  engine_process: bool = False, data_parallel_size: int | None = None) -> str | Path:
    """The preset an engine starts from, as `serve` and `LLM()` pick it: `config` where given, else the
    platform's (`platform_preset`). First lets JAX pool the GPU memory the engine may use
    (`--gpu-memory-utilization`; JAX pools 75% of a GPU by default), which holds only before jax starts a
    backend, as `platform_preset` does; an engine core in its own process (`--engine-process`, data
    parallelism) needs all of its device, so then the platform is asked in a subprocess."""
    from jaxserve.device import pool_gpu_memory

    pool_gpu_memory(gpu_memory_utilization or CacheConfig.gpu_memory_utilization)
    if config is not None:
        return config
    return platform_preset(isolated=core_process_count(engine_process, data_parallel_size or 1) > 0)


# apply_chat_template's own arguments: chat_template_kwargs (a request's, or --default-chat-template-kwargs)
# may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side of `jaxserve serve`; flag names and defaults follow `vllm serve`."""

    host: str = "0.0.0.0"  # all interfaces, as `vllm serve`
    port: int = 8000
    served_model_name: tuple[str, ...] = ()  # empty: the model's own name
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    root_path: str = ""
    enable_request_id_headers: bool = False
    enable_force_include_usage: bool = False  # every stream ends with a usage chunk, asked for or not (vLLM's)
    chat_template: str | None = None  # a file or an inline Jinja template; None: the tokenizer's
    chat_template_content_format: str = "auto"  # one of CHAT_TEMPLATE_CONTENT_FORMATS
    generation_config: str = "auto"  # "auto": the model's generation_config.json; "vllm": none; or a folder
    # Default sampling parameters over --generation-config's (vLLM's --override-generation-config), by their
    # generation_config.json names (GENERATION_CONFIG_FIELDS): {"temperature": 0.6, "max_new_tokens": 512}
    override_generation_config: dict[str, Any] | None = None
    disable_log_stats: bool = False
    shutdown_timeout: float = 30.0  # seconds to finish in-flight requests after SIGTERM
    max_request_body_bytes: int = 16 * 2**20
    access_log: bool = True  # one line per request, like vLLM's (uvicorn's) access log
    server_log_level: str = "info"  # the HTTP server's own loggers (--uvicorn-log-level)
    log_requests: bool = False  # one line per request with its sampling params and prompt length
    trust_request_chat_template: bool = False  # without it a request's own `chat_template` is refused
    body_read_timeout: float = 30.0  # seconds for a request body to arrive in full, else 408
    enable_auto_tool_choice: bool = False  # tool_choice "auto": calls read from the output by the parser
    tool_call_parser: str | None = None  # how the model writes calls: "hermes", "llama3_json"
    metrics_prefix: str = "jaxserve"  # one of METRICS_PREFIXES: /metrics serves `jaxserve:*` or `vllm:*`
    reasoning_parser: str | None = None  # "deepseek_r1", "qwen3": <think> text into reasoning_content
    disable_fastapi_docs: bool = False  # no /docs nor /openapi.json (vLLM's --disable-fastapi-docs)
    response_role: str = "assistant"  # a chat reply's role where the prompt asks for a new turn (vLLM's)
    # chat_template_kwargs under each request's own (vLLM's --default-chat-template-kwargs): {"enable_thinking": false}
    default_chat_template_kwargs: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool = False  # every request's default for the field of that name (vLLM's)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, behind the same switch: its
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING, or JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False
    # POST /start_profile and /stop_profile record a jax.profiler trace of the engine into this folder
    # (vLLM's routes, behind the same switch: its VLLM_TORCH_PROFILER_DIR, or JAXSERVE_PROFILER_DIR)
    profiler_dir: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        if not self.shutdown_timeout >= 0:  # inf waits for every request; nan is refused
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.server_log_level not in SERVER_LOG_LEVELS:
            raise ValueError(f"server_log_level must be one of {', '.join(SERVER_LOG_LEVELS)}, "
                             f"got {self.server_log_level!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics_prefix must be one of {', '.join(METRICS_PREFIXES)}, "
                             f"got {self.metrics_prefix!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSER_NAMES):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSER_NAMES)}, "
                             f"got {self.reasoning_parser!r}")
        if not self.body_read_timeout > 0:  # also refuses NaN
            raise ValueError(f"body_read_timeout must be > 0 seconds, got {self.body_read_timeout}")
        if self.override_generation_config is not None:
            check_generation_overrides(self.override_generation_config)
        if self.chat_template_content_format not in CHAT_TEMPLATE_CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {', '.join(CHAT_TEMPLATE_CONTENT_FORMATS)}, "
                             f"got {self.chat_template_content_format!r}")
        if not self.response_role:
            raise ValueError("response_role must not be empty")
        if self.default_chat_template_kwargs is not None:
            if not isinstance(self.default_chat_template_kwargs, dict):
                raise ValueError(f"default_chat_template_kwargs must be a dict, got "
                                 f"{self.default_chat_template_kwargs!r}")
            if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(self.default_chat_template_kwargs)):
                raise ValueError(f"default_chat_template_kwargs may not set {', '.join(reserved)}")


def profiler_dir(given: str | None = None) -> str | None:
    """Where a profile goes: `given` (--profiler-dir), else JAXSERVE_PROFILER_DIR, else vLLM's
    VLLM_TORCH_PROFILER_DIR (its switch for the profiling routes, so a vLLM deployment's env carries over)."""
    return given or os.environ.get("JAXSERVE_PROFILER_DIR") or os.environ.get("VLLM_TORCH_PROFILER_DIR") or None


def check_generation_overrides(overrides: Any) -> None:
    """Each default a valid sampling parameter: a bad one is refused at start, not in every request's 400."""
    from jaxserve.sampling_params import InvalidParam, SamplingParams  # no jax

    if not isinstance(overrides, dict):
        raise ValueError(f"override_generation_config must be a dict, got {overrides!r}")
    for name, value in overrides.items():
        if name not in GENERATION_CONFIG_FIELDS:  # vLLM ignores them too (a model card's do_sample, say)
            logger.warning("--override-generation-config: %r is not a default jaxserve takes (%s): ignored", name,
                           ", ".join(GENERATION_CONFIG_FIELDS))
            continue
        if value is None:
            continue
        try:
            SamplingParams(**{GENERATION_CONFIG_FIELDS[name]: value})
        except InvalidParam as error:
            raise ValueError(f"--override-generation-config: {name}: {error}") from None


# The commands' own settings, beside the engine's and the server's: `jaxserve --help` shows these defaults
# and each command reads its flags into one of these. A field that is a setting of serve's too takes its
# default from serve's config.


@dataclass(frozen=True)
class ClientConfig:
    """`jaxserve chat` and `jaxserve complete`: a running server's terminal clients (vLLM's commands)."""

    url: str = "http://localhost:8000/v1"  # the server's OpenAI base URL
    model_name: str | None = None  # None: the first model /v1/models lists
    api_key: str | None = None  # None: OPENAI_API_KEY, else none
    system_prompt: str | None = None  # the chat's first message
    max_tokens: int | None = None  # None: the server's default
    quick: str | None = None  # send this one message, print the answer and exit

    def __post_init__(self) -> None:
        if urllib.parse.urlsplit(self.url).scheme not in ("http", "https"):
            raise ValueError(f"url must be an http:// or https:// URL, got {self.url!r}")
        self.__dict__["url"] = self.url.rstrip("/")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class GenerateConfig:
    """`jaxserve generate`: the prompts and their sampling (the engine is an EngineConfig)."""

    prompt: tuple[str, ...] = ()
    raw: bool = False  # complete the prompt as is, no chat template
    max_tokens: int = 128
    temperature: float = 0.0  # greedy
    top_p: float = 1.0
    top_k: int = 0  # all tokens


@dataclass(frozen=True)
class OfflineBenchConfig:
    """`jaxserve bench offline`: one wave per concurrency level (the engine is an EngineConfig)."""

    concurrency: tuple[int, ...] = (1, 16, 64)
    input_len: int = 128
    output_len: int = 128
    json: str | None = None  # a file for the report
    profile: bool = False  # profile decode steps per level instead of running waves (`bench/step_profile.py`)
    profile_steps: int = 32  # decode steps timed per level

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        for name in ("input_len", "output_len", "profile_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


BENCH_DATASETS = ("random", "sharegpt", "custom")  # `bench serve`'s, vLLM's names (bench/datasets.py)
# `bench serve`'s backends, vLLM's names, and the route each streams: the completions API takes a prompt, the
# chat API one user message (the server applies the chat template)
BENCH_BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
# `bench serve`'s latency metrics, vLLM's names (--percentile-metrics), and those a goodput SLO may bound
BENCH_METRICS = ("ttft", "tpot", "itl", "e2el")
BENCH_SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class ServeBenchConfig:
    """`jaxserve bench serve`: HTTP load on a running server, one row per concurrency level."""

    base_url: str | None = None  # a server's root (vLLM's meaning) or its OpenAI base; None: host and port's
    host: str = "127.0.0.1"  # vLLM's --host and --port: the server at http://HOST:PORT, without a base_url
    port: int = ServerConfig.port
    model: str | None = None  # the `model` field sent (and the tokenizer's source); None: none, the server's
    served_model_name: str | None = None  # the `model` field sent in place of `model` (vLLM's flag)
    api_key: str | None = None
    concurrency: tuple[int, ...] | None = None  # levels, requests in flight at most; None: `levels`
    num_prompts: int | None = None  # per level; None: `prompts_per_level`
    request_rate: float = math.inf  # requests sent per second (vLLM's schedule, bench/serve.py); inf: all at once
    burstiness: float = 1.0  # the gaps' gamma shape: 1 a Poisson process, < 1 burstier, > 1 steadier (vLLM's)
    input_len: int = 128
    prefix_len: int = 0
    output_len: int = 128
    # vLLM's --random-range-ratio: each request's input and output lengths drawn uniformly within this
    # fraction of input_len and output_len, either side
    range_ratio: float = 0.0
    # vLLM's datasets (bench/datasets.py): random token ids of the lengths above, or a file's prompts, counted
    # with `tokenizer` (None: --model's, else that of the model the server names in /v1/models)
    backend: str = "openai"  # BENCH_BACKENDS: openai-chat streams /v1/chat/completions, the others /v1/completions
    endpoint: str | None = None  # the backend's route, as vLLM's --endpoint names it; None: the backend's
    dataset_name: str = "random"
    dataset_path: str | None = None  # sharegpt: a ShareGPT JSON file; custom: a JSONL file of prompts
    tokenizer: str | None = None
    sharegpt_output_len: int | None = None  # None: each conversation's reply's length
    custom_output_len: int = 256  # -1: each line's output_tokens
    skip_chat_template: bool = False  # custom: each prompt as written, not as a user turn of the chat template
    disable_shuffle: bool = False  # the file's order, not the seed's shuffle
    no_oversample: bool = False  # where fewer prompts than num_prompts pass, send those, not repeats to fill
    seed: int = 0
    temperature: float = 0.0
    top_p: float | None = None  # None: not sent
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None  # per token; None: none asked for
    extra_body: dict[str, Any] | None = None  # fields added to every request's body (vLLM's --extra-body)
    headers: tuple[tuple[str, str], ...] = ()  # sent with every request (vLLM's --header KEY=VALUE)
    request_id_prefix: str | None = None  # each request's X-Request-Id is this and its number; None: a random one
    insecure: bool = False  # https without checking the server's certificate
    # the report: which metrics the table shows, and the percentiles of each beside mean and median
    percentile_metrics: tuple[str, ...] = BENCH_METRICS
    metric_percentiles: tuple[float, ...] = (99.0,)
    goodput: tuple[tuple[str, float], ...] = ()  # SLOs in ms (metric, bound): requests/s that meet them all
    ready_check_timeout_sec: float = 0.0  # wait this long for the server to answer a request first; 0: no wait
    num_warmups: int = 0  # requests sent, not measured, before the first level
    json: str | None = None  # a file for the results
    # vLLM's --save-result: the results also in result_dir/result_filename, by default named from the label
    # (else the backend), the rate, the levels, the model and the time; `metadata` pairs added to each record
    save_result: bool = False
    result_dir: str | None = None
    result_filename: str | None = None
    label: str | None = None
    metadata: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.concurrency is not None and min(self.concurrency, default=0) < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.request_rate > 0 or not self.burstiness > 0:
            raise ValueError(f"request_rate and burstiness must be > 0 (a rate of inf sends every request at once), "
                             f"got {self.request_rate} and {self.burstiness}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.base_url is not None and urllib.parse.urlsplit(self.base_url).scheme not in ("http", "https"):
            raise ValueError(f"base_url must be an http:// or https:// URL, got {self.base_url!r}")
        if self.dataset_name not in BENCH_DATASETS:
            raise ValueError(f"dataset_name must be one of {', '.join(BENCH_DATASETS)}, got {self.dataset_name!r}")
        if self.backend not in BENCH_BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BENCH_BACKENDS)}, got {self.backend!r}")
        if self.endpoint is not None and self.endpoint.rstrip("/") != BENCH_BACKENDS[self.backend]:
            others = [name for name, route in BENCH_BACKENDS.items() if route == self.endpoint.rstrip("/")]
            raise ValueError(f"the {self.backend} backend streams {BENCH_BACKENDS[self.backend]}, not {self.endpoint}"
                             + (f" (that is the {others[-1]} backend's)" if others else
                                f"; jaxserve serves {' and '.join(sorted(set(BENCH_BACKENDS.values())))}"))
        if (self.dataset_name == "random") != (self.dataset_path is None):
            raise ValueError("the random dataset takes no dataset path; name the file's kind (sharegpt or custom)"
                             if self.dataset_path is not None else
                             f"the {self.dataset_name} dataset reads a file: give its dataset path")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError(f"sharegpt_output_len must be >= 1, got {self.sharegpt_output_len}")
        if not set(self.percentile_metrics) <= set(BENCH_METRICS) or not self.percentile_metrics:
            raise ValueError(f"percentile_metrics must name some of {', '.join(BENCH_METRICS)}, got "
                             f"{', '.join(self.percentile_metrics) or 'none'}")
        if not all(0 < p < 100 for p in self.metric_percentiles):
            raise ValueError(f"metric_percentiles must be in (0, 100), got {self.metric_percentiles}")
        for metric, bound in self.goodput:
            if metric not in BENCH_SLO_METRICS or not 0 <= bound < math.inf:
                raise ValueError(f"a goodput SLO is METRIC:MS with METRIC one of {', '.join(BENCH_SLO_METRICS)} and "
                                 f"MS finite and >= 0, got {metric}:{bound}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.num_warmups < 0 or not self.ready_check_timeout_sec >= 0:
            raise ValueError(f"num_warmups and ready_check_timeout_sec must be >= 0, got {self.num_warmups} and "
                             f"{self.ready_check_timeout_sec}")
        if self.custom_output_len != -1 and self.custom_output_len < 1:
            raise ValueError(f"custom_output_len must be >= 1, or -1 for each line's output_tokens, got "
                             f"{self.custom_output_len}")

    @property
    def openai_base_url(self) -> str:
        """The server's OpenAI base URL, as vLLM's bench finds the server: base_url where given, with /v1
        added unless its path ends in it (`http://gpu:8000` is a server's root, as vLLM's --base-url names
        one; `http://gpu:8000/v1` works too); else http://HOST:PORT/v1 (an IPv6 host bracketed)."""
        if self.base_url is not None:
            base = self.base_url.rstrip("/")
            return base if urllib.parse.urlsplit(base).path.endswith("/v1") else f"{base}/v1"
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def chat(self) -> bool:
        """Whether requests go to the chat API (each prompt one user message) rather than the completions API."""
        return BENCH_BACKENDS[self.backend] == "/v1/chat/completions"

    @property
    def levels(self) -> tuple[int | None, ...]:
        """The rows' in-flight caps: those given; else, with a finite rate, one level without a cap (as vLLM's
        --request-rate without --max-concurrency), else 1, 4 and 16."""
        if self.concurrency is not None:
            return self.concurrency
        return (None,) if math.isfinite(self.request_rate) else (1, 4, 16)

    def prompts_per_level(self, concurrency: int | None) -> int:
        """--num-prompts, else 4 per request in flight, or 10 seconds of arrivals without a cap; at least 8."""
        if self.num_prompts is not None:
            return self.num_prompts
        return max(8, 4 * concurrency if concurrency is not None else math.ceil(10 * self.request_rate))


@dataclass(frozen=True)
class BucketBenchConfig:
    """`jaxserve bench buckets`: ladders compared on a workload (jaxserve/bench/bucket_bench.py)."""

    ladders: tuple[str, ...] = ()  # preset names, YAML files or tokens=...;requests=... specs
    workload: str = "sharegpt"
    rate: float | None = None  # Poisson arrivals per second; None: a closed loop
    concurrency: int | None = None  # the closed loop's requests in flight; None: 16 unless `rate`
    num_requests: int = 200
    max_model_len: int = 2048
    seed: int = 0
    target: str | None = None  # a GPU target to predict on; None: no predictions
    model: str = "gpt2"  # whose shapes the predictions use
    dtype: str = ModelConfig.dtype
    measure: bool = False
    measure_model: str | None = ModelConfig.model
    load_format: str = ModelConfig.load_format  # of the model --measure serves
    suggest: bool = False
    max_buckets: int = 24
    out: str = "bench-buckets"

    def __post_init__(self) -> None:
        if self.rate is not None and not 0 < self.rate < math.inf:
            raise ValueError(f"rate must be a finite number of requests per second > 0, got {self.rate}")
        for name in ("concurrency", "num_requests", "max_model_len", "max_buckets"):
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class CompileConfig:
    """`jaxserve compile`: every bucket of a ladder compiled for a GPU target or the local device."""

    model: str | None = ModelConfig.model
    revision: str | None = ModelConfig.revision
    download_dir: str | None = ModelConfig.download_dir
    hf_overrides: dict[str, Any] | None = ModelConfig.hf_overrides
    target: str = "h100"  # a TARGETS name, or "local": this machine's default device
    preset: str = "gpu"
    dtype: str = ModelConfig.dtype
    attention_impl: str = EngineConfig.attention_impl
    max_model_len: int | None = ModelConfig.max_model_len
    max_num_seqs: int | None = None  # None: the preset's; above its ladder, as serve extends it
    max_num_batched_tokens: int | None = None  # the same
    speculative_config: SpeculativeConfig | None = None  # the same
    context_len: int | None = None  # None: max_model_len / 2
    gpu_memory_utilization: float | None = None  # None: the preset's
    kv_cache_dtype: str | None = None  # None: the preset's
    num_kv_pages: int | None = None  # None: the preset's, else the memory budget's (as serve sizes the cache)
    jobs: int = field(default_factory=lambda: os.cpu_count() or 1)
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    enable_expert_parallel: bool = ParallelConfig.enable_expert_parallel
    quantization: str | None = ModelConfig.quantization
    # --enable-lora's adapter slots compiled into the step: max_loras slots of rank max_lora_rank (0: none)
    max_loras: int = 0
    max_lora_rank: int = LoraConfig.max_lora_rank
    xla_cost: bool = True
    enforce_eager: bool = EngineConfig.enforce_eager
    variants: bool = True  # the decode buckets' variants the preset turns on (greedy, multi-step)
    json: str | None = None  # a file for the report

    def __post_init__(self) -> None:
        for name in ("jobs", "tensor_parallel_size", "max_lora_rank", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens", "context_len"):
            if (value := getattr(self, name)) is not None and value < 1 and (name, value) != (
                    "max_model_len", AUTO_MAX_MODEL_LEN):
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.num_kv_pages is not None and self.num_kv_pages < 2:
            raise ValueError(f"num_kv_pages must be >= 2, got {self.num_kv_pages}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
