"""The records that cross between the scheduler and the model runner (pure Python and numpy, no jax).

This is the only module of `jaxserve.engine` that `jaxserve.runner` imports: the runner never sees a
live `Request`, a `SamplingParams` or a grammar matcher, only plain values fixed when a step was planned.

A step's plan, `SchedulerOutput`, has one shape for every row (vLLM's `SchedulerOutput`, with its running
requests as columns): the rows' dense columns (request ids, tokens, start positions, ...), a `NewRequest`
for each request that takes a runner row this step (it starts, or resumes after a preemption), and sparse
maps, keyed by row, for what few rows carry (pages the runner has not been sent, tokens `min_tokens`
bans, prompt tokens to score, a grammar's bitmask). A plain decode costs a few list appends.
The runner answers with `StepOutput`: one sampled token per row, in the same order. A multi-step decode
plan (`decode_steps`) runs several decode steps in one call; the runner answers it with a `StepOutput` per step.
A speculative plan (`draft_lengths`) gives a sequence with m drafts m + 1 consecutive decode rows, one per
position, which the runner runs as any decode rows; the scheduler reads their samples as a verification.
"""

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from jaxserve.outputs import Logprob
from jaxserve.sampling_params import SamplingParams, sampling_row

# Stands in a row's tokens for a token sampled by the previous step and not yet read (async scheduling):
# the runner takes it from the previous step's samples on the device.
PENDING_TOKEN = -1
# A row's LoRA slot when its request runs the base model: no slot's index, so no adapter's weights apply.
NO_LORA_SLOT = -1


def bitmask_words(vocab_size: int) -> int:
    """Width of a token bitmask row: one bit per token, 32 to an int32."""
    return (vocab_size + 31) // 32


def token_bitmask(token_ids: tuple[int, ...], vocab_size: int) -> np.ndarray:
    """A bitmask row allowing exactly `token_ids` (each below vocab_size): i32[ceil(vocab_size / 32)]."""
    ids = np.asarray(token_ids, np.int64)  # [k]
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"a token id outside the vocabulary [0, {vocab_size})")
    words = np.zeros(bitmask_words(vocab_size), np.uint32)
    np.bitwise_or.at(words, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
    return words.view(np.int32)


class NewRequest(NamedTuple):
    """What a request's runner row holds from the step it starts or resumes in until it ends or is
    preempted: the values that stay the same from step to step."""

    request_id: str
    sampling_row: tuple  # the values of `sampling_params.SAMPLING_ROW`, in its order
    sampling_seed: int
    num_prompt_tokens: int
    num_top_logprobs: int  # alternatives reported per sampled token (logprobs), 0 for none
    num_prompt_logprobs: int  # alternatives reported per prompt token (prompt_logprobs), 0 for none
    logit_bias: tuple[tuple[int, float], ...]  # (token id, bias)
    has_penalties: bool  # its samples depend on the tokens seen (the runner keeps a penalty row)
    fills_row: bool  # the runner fills this row itself each step (penalties, biases, bans, prompt logprobs, a mask)
    # After a prefix-cache hit with penalties: the cached tokens, which the penalty row counts as if they ran.
    cached_token_ids: tuple[int, ...] | None = None
    lora_id: int | None = None  # its LoRA adapter's id (--enable-lora), None for the base model
    lora_slot: int = NO_LORA_SLOT  # the device slot the adapter is in while the request runs
    allowed_token_ids: tuple[int, ...] | None = None  # the only tokens it may sample (vLLM's allowed_token_ids)

    @classmethod
    def of(cls, request_id: str, params: SamplingParams, sampling_seed: int, num_prompt_tokens: int,
           cached_token_ids: tuple[int, ...] | None = None, lora_id: int | None = None,
           lora_slot: int = NO_LORA_SLOT) -> "NewRequest":
        """A request's row values, read from its parameters (the one place they are)."""
        return cls(request_id, sampling_row(params), sampling_seed, num_prompt_tokens, params.logprobs or 0,
                   params.prompt_logprobs or 0, tuple(params.logit_bias.items()), params.has_penalties,
                   params.fills_batch_rows, cached_token_ids, lora_id, lora_slot, params.allowed_token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """A step's plan. Rows in order: the batch's rows and `StepOutput`'s."""

    request_ids: list[str]
    num_new_tokens: list[int]  # per row: tokens to compute this step (1 for a decode)
    token_ids: list[int]  # the rows' tokens end to end; a row's last may be PENDING_TOKEN
    start_positions: list[int]  # per row: the position of its first token
    output_indices: list[int]  # per row: its sample's index among the request's outputs (seeds reproduce)
    keeps_sample: list[bool]  # per row: the step computes its last known token, so the sample is its next
    new_requests: tuple[NewRequest, ...] = ()  # requests taking a runner row this step
    # row -> (first_new_page, page ids): the request's pages from that index on, which the runner has not
    # been sent (those this step allocated, or all of them when it starts or resumes).
    new_pages: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    banned_token_ids: dict[int, tuple[int, ...]] = field(default_factory=dict)  # row -> min_tokens' bans
    prompt_logprob_targets: dict[int, tuple[int, ...]] = field(default_factory=dict)  # row -> next prompt tokens
    rows_completing_pages: tuple[int, ...] = ()  # rows whose tokens fill a page (prefix caching keys it)
    grammar_rows: tuple[int, ...] = ()  # rows whose sample is constrained by a grammar
    grammar_bitmask: np.ndarray | None = None  # i32[len(grammar_rows), W]: their next-token masks
    preempted_ids: tuple[str, ...] = ()
    finished_ids: tuple[str, ...] = ()  # finished or aborted since the last schedule: drop their state
    filling_keys: frozenset[bytes] = frozenset()  # prefix-cache keys of the full pages this step fills
    # A multi-step decode (every row decodes): per row, the decode steps it runs in one call, each
    # feeding its sample to the next (fewer where a request reaches its last token); empty for one step.
    decode_steps: tuple[int, ...] = ()
    # A speculative decode (every row decodes): per sequence, in row order, its drafts m; its m + 1 rows
    # are consecutive, row i feeding its last known token (i = 0) or draft i at the next position and
    # sampling what follows. Empty for a plan without drafts.
    draft_lengths: tuple[int, ...] = ()

    @property
    def num_reqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.request_ids

    @property
    def is_multi_step(self) -> bool:
        return bool(self.decode_steps)

    @property
    def is_speculative(self) -> bool:
        return bool(self.draft_lengths)

    @property
    def num_steps(self) -> int:
        """Decode steps the plan runs in one call (1 unless a multi-step decode)."""
        return max(self.decode_steps, default=1)

    def steps_of(self, row: int) -> int:
        """The steps row `row` runs (and samples it keeps, if it keeps its sample)."""
        return self.decode_steps[row] if self.decode_steps else 1


EMPTY_PLAN = SchedulerOutput([], [], [], [], [], [])  # read-only by convention


@dataclass(frozen=True)
class StepOutput:
    """What the runner returns for one step: one sampled token (and its logprob) per row of the plan, in
    order (a multi-step decode returns one per step, rows past their steps holding padding)."""

    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[float]
    top_logprobs: dict[int, dict[int, float]] = field(default_factory=dict)  # row -> {token: logprob}
    ranks: dict[int, int] = field(default_factory=dict)  # row -> its sampled token's rank, for rows asking logprobs
    # row -> (first prompt token scored, {token: Logprob} per token), for rows scoring prompt tokens.
    prompt_logprobs: dict[int, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    # --runner pooling: row -> (its hidden state at its first and its last token this step, the sum over its
    # tokens), f32[D] each.
    pooled: dict[int, tuple[Any, Any, Any]] = field(default_factory=dict)


class RequestFault(Exception):
    """Building one request's batch row raised: the engine fails that request alone and serves on.
    `__cause__` holds the original exception."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id} failed")
        self.request_id = request_id
