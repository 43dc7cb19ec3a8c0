"""What crosses between the engine core (scheduler, runner) and its frontend (pure Python, no jax).

The core works on sequences (a request with n > 1 is n of them) and reports, per step, what each sequence
gained in one record, `CoreOutputs`: the new tokens as columns, the few sequences' details (a first token,
an end, top logprobs) by index, and failures. The frontend turns them into text and `RequestOutput`s.
When the core runs in its own process, one such record a step crosses the pipe. `EngineCoreClient` is
what the frontend asks of a core, in this process (`EngineCore`) or in its own (`CoreProcessClient`).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from jaxserve.engine.request import Request, RequestStatus
from jaxserve.models.peft import LoraAdapter, LoraLayout
from jaxserve.outputs import Logprob
from jaxserve.sampling_params import RequestLimits

if TYPE_CHECKING:
    from jaxserve.engine.structured_output import CompiledGrammar


def engine_fault(cause: BaseException) -> str:
    """What a client is told when the engine failed its request for a reason that is not its input."""
    return f"the engine failed while processing this request: {type(cause).__name__}"


class FirstToken(NamedTuple):
    """Facts a sequence's first token carries once."""

    first_scheduled_time: float | None
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    prompt_logprobs: list[dict[int, Logprob]] | None  # prompt tokens 1, 2, ..., when the request asked


class SequenceDetails(NamedTuple):
    """What a sequence's new token carries beyond the token: few do (a first token, an end, top logprobs,
    a preemption count)."""

    top_logprobs: dict[int, float] | None = None
    status: RequestStatus | None = None  # a finished status once the core ended the sequence, else None
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_preemptions: int = 0
    first: FirstToken | None = None  # on the sequence's first token
    embedding: list[float] | None = None  # a pooling request's pooled hidden state, with its one token
    # the token that ended it is EOS or one of its stop ids, whose text is left out (vLLM's) unless the
    # request includes stop strings in its output
    stop_token: bool = False
    rank: int | None = None  # the token's rank in its distribution (1 = the most likely), when logprobs is set


class SequenceFailure(NamedTuple):
    """A sequence the core failed (its request fails whole)."""

    seq_id: str
    error: str
    error_param: str | None = None  # set when the request's own values caused it: a client error


class CoreOutputs(NamedTuple):
    """What a core step reports: each sequence that gained a token, as columns (most of a busy step's
    sequences carry nothing else), the few details by column index, and the sequences that failed. One
    record a step, cheap to build and to pickle across the core process's pipe."""

    seq_ids: list[str]
    token_ids: list[int]
    logprobs: list[float]
    time: float  # when the step's tokens were read (time.monotonic())
    details: dict[int, SequenceDetails]  # column index -> what that sequence's token carries besides
    failures: list[SequenceFailure]


def failed(failures: list[SequenceFailure]) -> CoreOutputs:
    """Outputs that report failures only."""
    return CoreOutputs([], [], [], 0.0, {}, failures)


@dataclass(frozen=True)
class EngineInfo:
    """Fixed facts about the loaded engine, safe to read from any thread or process."""

    model_name: str
    model_root: str  # the directory or .gguf file the weights came from
    model_dir: str | None  # the HF directory (generation_config.json), None for a .gguf
    limits: RequestLimits
    page_size: int
    num_kv_pages: int
    max_num_seqs: int
    max_num_batched_tokens: int
    scheduling_policy: str
    runner: str  # "generate", or "pooling": every request an embedding (EngineConfig.runner)
    hidden_size: int  # an embedding's length
    enable_prefix_caching: bool
    eos_token_ids: tuple[int, ...]
    dtype: str  # of the activations (and the KV cache, unless `kv_cache_dtype` says otherwise)
    weight_dtype: str  # of the matmul weights
    lora_layout: LoraLayout | None = None  # --enable-lora: what an adapter must fit
    # The config says its embeddings may be cut short (Qwen3-Embedding's; `--hf-overrides '{"is_matryoshka":
    # true}'`, vLLM's way, for a model that does not say so)
    matryoshka: bool = False
    class_labels: tuple[str, ...] = ()  # a classifier's (its pooled vectors are these classes' logits); else ()
    class_activation: str = "softmax"  # a classifier's logits to its outputs (`classifier.class_activation`)
    score_activation: str = "sigmoid"  # a cross-encoder's logit to its pair score (`classifier.score_activation`)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the scheduler after a step (read by /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable pages in use
    num_preemptions: int = 0  # since start
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of which were found cached
    iteration_tokens_buckets: tuple[int, ...] = ()  # per step: counts per ITERATION_TOKENS_BUCKETS bucket, +Inf last
    iteration_tokens_sum: int = 0
    # Speculative decoding, since start: requests' drafts verified, draft tokens, accepted ones, and accepted
    # ones per draft position (empty without speculative decoding).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    # --enable-lora (vLLM's lora_requests_info): the slots, and the adapters of running and waiting requests
    max_loras: int = 0  # 0: LoRA off
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # --data-parallel-size > 1: each rank's own snapshot (the fields above sum them); empty with one core.
    ranks: tuple["EngineStats", ...] = ()


class EngineCoreClient(Protocol):
    """A core as the frontend drives it: from one thread, sequences in, updates out."""

    info: EngineInfo
    warmup_seconds: float

    def add_sequences(self, sequences: list[Request], grammar: "CompiledGrammar | None" = None) -> None: ...

    def finish(self, seq_ids: list[str], status: RequestStatus) -> None: ...

    def add_lora(self, lora_id: int, adapter: LoraAdapter) -> None: ...

    def remove_lora(self, lora_id: int) -> None: ...

    def start_profile(self, log_dir: str) -> None: ...

    def stop_profile(self) -> None: ...

    def step(self) -> list[CoreOutputs]: ...

    def stats(self) -> EngineStats: ...

    def shutdown(self) -> None: ...
