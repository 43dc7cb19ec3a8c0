"""What the engine hands back for each request (pure Python, no jax)."""

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from jaxserve.config import LoRARequest


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (vLLM's names and default)."""

    CUMULATIVE = "cumulative"  # everything so far: text, token ids and logprobs from the first token
    DELTA = "delta"  # only what the step added (a stream's chunk); prompt logprobs once, when known
    FINAL_ONLY = "final_only"  # one output, cumulative, when the request finishes


class Logprob(NamedTuple):
    """A token's log-probability and its rank in the distribution (1 = the most likely), as vLLM's Logprob."""

    logprob: float
    rank: int | None
    decoded_token: str | None = None  # the token's own text (vLLM's field), where it was decoded: `LLM` does


# Per prompt token: None for the first (nothing precedes it), else {token id: Logprob} holding the prompt's
# own token and the top alternatives the request asked for.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of a request's `n` completions. Text, token ids and logprobs are cumulative, or with
    `RequestOutputKind.DELTA` only what the latest step added; `*_delta` is always what the latest step
    added (what a stream sends)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] | None = None  # each token's own, when the request asked for logprobs
    token_ranks: list[int] | None = None  # each token's rank in its distribution (1 = the most likely), the same
    top_logprobs: list[dict[int, float]] | None = None  # per token, when it asked for logprobs > 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    # The sum of every token's logprob so far (with DELTA outputs too), when the request asked for
    # logprobs; a beam's score before its length penalty (vLLM's)
    cumulative_logprob: float | None = None
    # Each logprob's token id -> its own text (vLLM's Logprob.decoded_token), where the caller decoded them
    # (`LLM` does; the server writes its own token strings)
    decoded_tokens: dict[int, str] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def logprobs(self) -> "list[dict[int, Logprob]] | None":
        """vLLM's form of the logprobs: per token, {token id: Logprob} holding the token itself with its rank
        and the top alternatives asked for, ranked from 1."""
        if self.token_logprobs is None:
            return None
        tops = self.top_logprobs or [{} for _ in self.token_logprobs]
        ranks = self.token_ranks or [None] * len(self.token_logprobs)
        decoded = self.decoded_tokens or {}
        result = []
        for token_id, logprob, own_rank, top in zip(self.token_ids, self.token_logprobs, ranks, tops, strict=True):
            entry = {t: Logprob(lp, rank, decoded.get(t)) for rank, (t, lp) in enumerate(top.items(), start=1)}
            entry.setdefault(token_id, Logprob(logprob, own_rank, decoded.get(token_id)))
            result.append(entry)
        return result


@dataclass(frozen=True)
class RequestMetrics:
    """When a finished request passed each stage, stamped on the engine thread (`time.monotonic()`).

    The API turns these into vLLM's per-request histograms. The stages follow vLLM's: queued from
    arrival to first scheduled, prefill from first scheduled to first token, decode from first token to
    last token, inference from first scheduled to last token; preemptions do not restart a stage. For a
    request with n > 1, the parent is one record spanning its sequences: the earliest scheduling and
    first token, the latest last token. A stamp is None when the stage never happened (a request aborted
    while it waited).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0  # summed over the sequences
    max_tokens_param: int | None = None  # the request's max_tokens (vLLM's request_params_max_tokens)

    @property
    def queue_time(self) -> float | None:
        return _interval(self.arrival_time, self.first_scheduled_time)

    @property
    def prefill_time(self) -> float | None:
        return _interval(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        return _interval(self.first_token_time, self.last_token_time)

    @property
    def inference_time(self) -> float | None:
        return _interval(self.first_scheduled_time, self.last_token_time)


def _interval(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None  # set on the finished output only
    error: str | None = None  # set when the engine failed this request (finished, finish_reason "error")
    error_param: str | None = None  # the request field whose value caused the failure (a client error)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # once the prompt is computed, when the request asked
    embedding: list[float] | None = None  # --runner pooling: the prompt's pooled final hidden state

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]  # the prompt's pooled final hidden state, not normalized


@dataclass(frozen=True)
class EmbeddingRequestOutput:
    """`LLM.embed`'s record of one prompt, as vLLM's: the vector is `outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def of(cls, output: RequestOutput) -> "EmbeddingRequestOutput":
        if output.embedding is None:
            raise ValueError(f"request {output.request_id} has no embedding: {output.error or 'not pooled'}")
        return cls(output.request_id, output.prompt_token_ids, EmbeddingOutput(output.embedding), output.finished)


@dataclass(frozen=True)
class ClassificationOutput:
    probs: list[float]  # each class's probability (a softmax of the logits; a sigmoid for a single class)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(frozen=True)
class ClassificationRequestOutput:
    """`LLM.classify`'s record of one prompt, as vLLM's: the probabilities are `outputs.probs`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass(frozen=True)
class ScoringOutput:
    score: float  # the cosine similarity of the two texts' embeddings; a cross-encoder's relevance


@dataclass(frozen=True)
class ScoringRequestOutput:
    """`LLM.score`'s record of one pair, as vLLM's: the score is `outputs.score`; the request id and the
    token ids are the two texts' joined."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(frozen=True)
class BeamSearchSequence:
    """One of `LLM.beam_search`'s beams, as vLLM's: `tokens` the prompt's and the generated (a finished beam's
    EOS last), `text` all of them decoded, `logprobs` per generated token the alternatives it was chosen
    among, ranked; finish_reason "stop" for a beam an EOS ended (stop_reason that id), else "length"."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    text: str
    finish_reason: str
    stop_reason: int | None = None
    lora_request: "LoRARequest | None" = None


@dataclass(frozen=True)
class BeamSearchOutput:
    """`LLM.beam_search`'s answer for one prompt: its best beams, best first."""

    sequences: list[BeamSearchSequence]


def add_delta(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """`total` (None before the first) with a DELTA output added: completions extended in place, the
    latest status and facts taken. The first delta is copied, so the caller's delta stays its own."""
    if total is None:
        total = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, [])
    completions = {completion.index: completion for completion in total.outputs}
    for new in delta.outputs:
        old = completions.get(new.index)
        if old is None:
            old = completions[new.index] = CompletionOutput(
                new.index, token_logprobs=None if new.token_logprobs is None else [],
                token_ranks=None if new.token_ranks is None else [],
                top_logprobs=None if new.top_logprobs is None else [])
            total.outputs.append(old)
        old.text += new.text
        old.token_ids.extend(new.token_ids)
        if new.token_logprobs is not None:
            old.token_logprobs.extend(new.token_logprobs)
        if new.token_ranks is not None:
            old.token_ranks.extend(new.token_ranks)
        if new.top_logprobs is not None:
            old.top_logprobs.extend(new.top_logprobs)
        old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
        old.cumulative_logprob = new.cumulative_logprob
        old.text_delta, old.token_ids_delta = new.text_delta, new.token_ids_delta
    total.outputs.sort(key=lambda completion: completion.index)
    total.finished, total.metrics = delta.finished, delta.metrics
    total.error, total.error_param = delta.error, delta.error_param
    total.num_cached_tokens = delta.num_cached_tokens
    if delta.embedding is not None:
        total.embedding = delta.embedding
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    return total
