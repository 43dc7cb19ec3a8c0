"""A request's host-side state as it moves through the scheduler (pure Python, no jax)."""

import enum
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from jaxserve.engine.kv_cache_manager import extend_page_keys
from jaxserve.engine.step_io import NO_LORA_SLOT
from jaxserve.outputs import Logprob, RequestMetrics
from jaxserve.sampling_params import SamplingParams, max_num_tokens

if TYPE_CHECKING:
    from jaxserve.engine.structured_output import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    def __init__(self, value: str) -> None:
        # A plain attribute: asked for every request every step (a property costs 4x as much).
        self.is_finished = value.startswith("finished")


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def finish_reason(status: RequestStatus) -> str | None:
    """The OpenAI finish_reason for a finished status, None while the request lives."""
    return _FINISH_REASONS.get(status)


@dataclass(eq=False, slots=True)
class Request:
    """One sequence to generate. (A request with n > 1 is n of these, one per completion.)

    `num_computed_tokens` counts tokens whose K/V sit in the request's pages or are written by a step
    already scheduled; the scheduler advances it when it schedules them. After preemption it drops to 0
    and the prompt plus generated tokens are recomputed. `num_inflight_tokens` counts tokens sampled by
    scheduled steps whose results the engine has not read yet (at most one: async scheduling reads step N
    before it schedules N + 2).

    The scheduler stamps `first_scheduled_time`, `first_token_time` and `last_token_time` (monotonic
    seconds, like `arrival_time`) for the per-request metrics; a preemption keeps the first stamps, as
    vLLM does, so its recompute counts as prefill or decode time rather than queueing.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    sampling_seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)  # when logprobs > 0
    output_ranks: list[int] = field(default_factory=list)  # each output token's rank, when logprobs is set
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_inflight_tokens: int = 0
    page_ids: list[int] = field(default_factory=list)
    num_pages_scheduled: int = 0  # leading pages of page_ids the runner has been sent
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None  # a finished request's last token: its finish time
    # Prefix caching: separates this request's cache entries from requests with another salt.
    cache_salt: str | None = None
    priority: int = 0  # under the priority policy: lower is served first
    lora_id: int | None = None  # its LoRA adapter's id (`LLMEngine.add_lora`), None for the base model
    lora_slot: int = NO_LORA_SLOT  # the device slot its adapter is in while it runs (`LoraSlots`)
    # bad_words as token sequences (`llm_engine.bad_words_token_ids`): the last token of each is banned
    # where the output ends with the others.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # --runner pooling: how its final hidden states pool into its embedding ("last", "mean", "cls"), the
    # running sum over the tokens computed so far (mean) or its first token's (cls), and the embedding once its
    # prompt is computed.
    pooling_type: str | None = None
    pooled_sum: Any = None  # f32[D]
    pooled_first: Any = None  # f32[D]
    embedding: list[float] | None = None
    page_keys: list[bytes] = field(default_factory=list)  # keys of its full pages, as tokens become known
    num_keyed_pages: int = 0  # leading pages of page_ids already offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    # Prompt logprobs of prompt tokens 1, 2, ... (token 0 has none), filled as the prompt is computed
    # when the request asked for them.
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # Structured outputs: where this sequence stands in its grammar; every sampled token advances it.
    grammar: "GrammarMatcher | None" = None
    grammar_error: str | None = None  # the grammar refused a sampled token (a bug: the mask forbids it)
    # Prompt + output length at which the request must stop (fixed; read every step). Set from the
    # module's function of the same name: a method's body sees the module, not the class.
    max_num_tokens: int = field(init=False)
    num_tokens: int = field(init=False)  # prompt + output tokens, kept by append_output_token (read 3x a step)
    # Its steps carry nothing beyond the plan's columns: the runner fills nothing of its row itself and
    # reads back no top logprobs for it. (A grammar, set later, is asked on its own.)
    has_plain_decodes: bool = field(init=False)
    has_long_bad_words: bool = field(init=False)  # a bad word of several tokens: its ban reads the last token

    def pool(self, pooling_type: str) -> None:
        """Makes this a request to embed (--runner pooling): its prompt pooled, its one sample dropped."""
        self.pooling_type = pooling_type
        self.max_num_tokens = max_num_tokens(len(self.prompt_token_ids), 1, self.max_model_len, pooled=True)

    def __post_init__(self) -> None:
        self.max_num_tokens = max_num_tokens(len(self.prompt_token_ids), self.sampling_params.max_tokens,
                                             self.max_model_len)
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)
        params = self.sampling_params
        self.has_plain_decodes = not params.fills_batch_rows and not params.logprobs
        self.has_long_bad_words = any(len(word) > 1 for word in self.bad_words_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_scheduled_outputs(self) -> int:
        """Output tokens read plus those sampled by steps in flight: the index of the next sample."""
        return len(self.output_token_ids) + self.num_inflight_tokens

    def banned_token_ids(self) -> tuple[int, ...]:
        """Tokens the next sample may not be: while fewer than min_tokens are out (counting samples in
        flight), the stop ids and (unless EOS is ignored) EOS; and each bad word's last token where the
        output ends with the rest of it (the engine reads every token before it schedules such a request:
        `reads_last_token`)."""
        params = self.sampling_params
        banned: tuple[int, ...] = ()
        if self.num_scheduled_outputs < params.min_tokens:
            banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(self.eos_token_ids))
        if self.bad_words_token_ids:
            output = self.output_token_ids
            banned += tuple(word[-1] for word in self.bad_words_token_ids
                            if len(word) == 1 or (len(output) >= len(word) - 1
                                                  and tuple(output[len(output) - len(word) + 1 :]) == word[:-1]))
        return banned

    @property
    def stopped_on_token(self) -> bool:
        """It stopped on its last token being EOS or one of its stop ids (not on a grammar's end alone)."""
        if self.status is not RequestStatus.FINISHED_STOPPED or not self.output_token_ids:
            return False
        params, last = self.sampling_params, self.output_token_ids[-1]
        return last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids)

    @property
    def decodes_on_device(self) -> bool:
        """Its decodes may run k to a call (multi-step) or carry drafts (speculative decoding): nothing between
        its steps comes from the host. Plain decodes, and those whose row holds the same for every step
        (penalties, counted on the device; logit_bias; allowed tokens) once min_tokens' bans are over; not
        with a grammar, bad words or top logprobs."""
        if self.grammar is not None:
            return False
        if self.has_plain_decodes:
            return True
        params = self.sampling_params
        return not params.logprobs and not params.bad_words and self.num_scheduled_outputs >= params.min_tokens

    @property
    def reads_last_token(self) -> bool:
        """Its next step depends on the token before it (a grammar's mask, a bad word's ban), so that
        token must be read, not left in flight."""
        return self.grammar is not None or self.has_long_bad_words

    @property
    def reads_prefix_cache(self) -> bool:
        """A request that reports prompt logprobs (or pools the mean of its tokens, or its first token's state)
        computes its whole prompt."""
        return self.sampling_params.prompt_logprobs is None and self.pooling_type not in ("mean", "cls")

    @property
    def prefix_cache_salt(self) -> str | None:
        """What keeps its prefix-cache pages apart from other requests': its cache_salt, and its adapter
        (the same tokens' K/V differ under another adapter)."""
        if self.cache_salt is None and self.lora_id is None:
            return None
        return json.dumps([self.cache_salt, self.lora_id])  # one string per pair, whatever a salt holds

    def full_page_keys(self, num_full_pages: int, page_size: int) -> list[bytes]:
        """Its page keys, grown to hold at least its first `num_full_pages` full pages: one list, which the
        scheduler and a draft model's cache both read (`kv_cache_manager.extend_page_keys`)."""
        return extend_page_keys(self.page_keys, num_full_pages, page_size, self.token_ids, self.prefix_cache_salt)

    def add_prompt_logprobs(self, first_token: int, entries: list[dict[int, Logprob]]) -> None:
        """Records the prompt logprobs of prompt tokens first_token, first_token + 1, ...; tokens already
        recorded (a prompt recomputed after preemption) are kept."""
        known = len(self.prompt_logprobs) + 1  # the next prompt token without logprobs
        if first_token > known:
            raise ValueError(f"prompt logprobs from token {first_token} leave a gap after token {known - 1}")
        self.prompt_logprobs.extend(entries[known - first_token :])

    def append_output_token(self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None = None,
                            rank: int | None = None) -> None:
        """Records a sampled token and finishes the request if it hit a stop condition."""
        self.output_token_ids.append(token_id)
        self.num_tokens += 1
        self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)
        if rank is not None:
            self.output_ranks.append(rank)
        if self.grammar is not None:
            if not self.grammar.consume(token_id):
                self.grammar_error = self.grammar.error or f"token {token_id} is not allowed here"
                self.status = RequestStatus.FINISHED_ABORTED
                return
            if self.grammar.is_stopped:  # complete: only EOS could follow, so it ends here, min_tokens or not
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, None
                return
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, None
                return
            if token_id in params.stop_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
                return
        if self.num_tokens >= self.max_num_tokens:
            self.status = RequestStatus.FINISHED_LENGTH


class Stamped(Protocol):
    """A sequence's stage stamps (monotonic seconds), as the scheduler sets them on a `Request` and the
    frontend learns them from the core's updates."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    num_preemptions: int


def request_metrics(sequences: Sequence[Stamped], max_tokens_param: int | None) -> RequestMetrics:
    """One record for a request made of `sequences` (its n completions): the earliest arrival,
    scheduling and first token, the latest last token, as vLLM reports a parent request."""

    def earliest(stamps: list[float | None]) -> float | None:
        return min((t for t in stamps if t is not None), default=None)

    return RequestMetrics(
        arrival_time=min(r.arrival_time for r in sequences),
        first_scheduled_time=earliest([r.first_scheduled_time for r in sequences]),
        first_token_time=earliest([r.first_token_time for r in sequences]),
        last_token_time=max((r.last_token_time for r in sequences if r.last_token_time is not None), default=None),
        num_preemptions=sum(r.num_preemptions for r in sequences),
        max_tokens_param=max_tokens_param,
    )
