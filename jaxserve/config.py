"""Engine configuration: frozen dataclasses that validate themselves, and YAML presets from configs/."""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # hub id, local directory or .gguf file; None: the bundled SmolLM2
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    revision: str | None = None
    max_logprobs: int = 20  # the most top alternatives a request may ask for (a compiled shape)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_kv_pages: int | None = None  # overrides the memory budget
    kv_cache_memory_gib: float = 2.0  # the budget on CPU
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_kv_pages is not None and self.num_kv_pages < 2:
            raise ValueError(f"num_kv_pages must be >= 2, got {self.num_kv_pages}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass(frozen=True)
class BucketConfig:
    token_buckets: tuple[int, ...] = (32, 64, 128, 256, 512)
    request_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)

    def __post_init__(self) -> None:
        for name in ("token_buckets", "request_buckets"):
            ladder = tuple(getattr(self, name))
            if not ladder or list(ladder) != sorted(set(ladder)) or ladder[0] < 1:
                raise ValueError(f"{name} must be a strictly increasing list of positive ints: {ladder}")
            object.__setattr__(self, name, ladder)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    buckets: BucketConfig = field(default_factory=BucketConfig)
    attention_impl: str = "auto"
    compilation_cache_dir: str | None = "~/.cache/jaxserve/xla"

    def __post_init__(self) -> None:
        if self.buckets.request_buckets[-1] < self.scheduler.max_num_seqs:
            raise ValueError(
                f"the largest request bucket ({self.buckets.request_buckets[-1]}) must cover "
                f"max_num_seqs ({self.scheduler.max_num_seqs})"
            )
        if self.buckets.token_buckets[-1] < self.scheduler.max_num_batched_tokens:
            raise ValueError(
                f"the largest token bucket ({self.buckets.token_buckets[-1]}) must cover "
                f"max_num_batched_tokens ({self.scheduler.max_num_batched_tokens})"
            )

    @classmethod
    def from_preset(cls, preset: str | Path | None = None, **overrides: Any) -> "EngineConfig":
        """Builds a config from a YAML preset (a name in configs/ or a path), then flat overrides.

        Overrides are field names of any sub-config (`max_num_seqs=8`, `dtype="float32"`) or of
        EngineConfig itself; None values are ignored so CLI defaults don't mask the preset.
        """
        sections: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}, "buckets": {}}
        top: dict[str, Any] = {}
        if preset is not None:
            for section, values in load_preset(preset).items():
                if section not in sections:
                    raise ValueError(f"unknown section {section!r} in preset {preset}")
                sections[section].update(values or {})
        owners = {
            "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "buckets": BucketConfig
        }
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
        for name in ("token_buckets", "request_buckets"):
            if name in sections["buckets"]:
                sections["buckets"][name] = tuple(sections["buckets"][name])
        return cls(**{s: owners[s](**sections[s]) for s in sections}, **top)


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def load_preset(preset: str | Path) -> dict[str, Any]:
    path = Path(preset)
    if not path.suffix:
        path = CONFIGS_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"config preset not found: {path}")
    with path.open() as f:
        return yaml.safe_load(f) or {}


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side of `jaxserve serve`; flag names and defaults follow `vllm serve`."""

    host: str = "127.0.0.1"
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
    chat_template: str | None = None  # a file or an inline Jinja template; None: the tokenizer's
    generation_config: str = "auto"  # "auto": the model's generation_config.json; "vllm": none; or a folder
    disable_log_stats: bool = False
    shutdown_timeout: float = 30.0  # seconds to finish in-flight requests after SIGTERM
    max_request_body_bytes: int = 16 * 2**20

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must be >= 0")
