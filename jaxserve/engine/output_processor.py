"""OutputProcessor: the core's outputs in (`CoreOutputs`, one a step), text and `RequestOutput`s out (pure
Python, no jax).

It holds what the frontend knows of each live request: its sequences' tokens, logprobs, detokenizers and
ends, and the request's prompt facts. A stop string ends a sequence here, and a sequence whose text fails
to decode fails its whole request here; `process` returns the sequence ids the core must then finish or
drop. An update for a sequence that already ended here (the core ran it one more step before it heard)
is ignored.
"""

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

from jaxserve.engine.core_io import CoreOutputs, engine_fault
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.request import RequestStatus, finish_reason, request_metrics
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, RequestOutputKind
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Sequence:
    seq_id: str
    index: int
    parent: "_RequestState"
    detokenizer: IncrementalDetokenizer
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # each token's rank, when the request asked for logprobs
    cumulative_logprob: float = 0.0  # the sum of `logprobs`, kept as they come
    status: RequestStatus | None = None  # a finished status once it ended
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0

    def output(self) -> CompletionOutput:
        """The completion as its request's output kind has it: what is new since the last output (DELTA,
        no copy of the rest), or everything so far."""
        params = self.parent.params
        finished = self.status is not None
        first_new = self.num_sent_tokens
        delta_ids = self.token_ids[first_new:]
        self.num_sent_tokens = len(self.token_ids)
        text_delta = self.detokenizer.take_delta(finished)
        if params.output_kind is RequestOutputKind.DELTA:
            text, token_ids = text_delta, list(delta_ids)  # two lists: a caller may change one
            token_logprobs = self.logprobs[first_new:] if params.logprobs is not None else None
            token_ranks = self.ranks[first_new:] if params.logprobs is not None else None
            top_logprobs = self.top_logprobs[first_new:] if params.logprobs else None
        else:  # the text streamed so far: not what take_delta holds back as a possible stop string's start
            text, token_ids = self.detokenizer.text[: self.detokenizer.num_emitted_chars], list(self.token_ids)
            token_logprobs = list(self.logprobs) if params.logprobs is not None else None
            token_ranks = list(self.ranks) if params.logprobs is not None else None
            top_logprobs = list(self.top_logprobs) if params.logprobs else None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            token_logprobs=token_logprobs,
            token_ranks=token_ranks,
            top_logprobs=top_logprobs,
            cumulative_logprob=self.cumulative_logprob if params.logprobs is not None else None,
            finish_reason=finish_reason(self.status) if finished else None,
            stop_reason=self.stop_reason,
            text_delta=text_delta,
            token_ids_delta=delta_ids,
        )


@dataclass(eq=False)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs_known: bool = False  # they came with the first sequence's first token
    embedding: list[float] | None = None  # --runner pooling: the prompt's pooled hidden state
    prompt_logprobs_sent: bool = False  # in a DELTA output (they are sent once)

    @property
    def finished(self) -> bool:
        return all(seq.status is not None for seq in self.sequences)

    def metrics(self) -> RequestMetrics:
        return request_metrics(self.sequences, self.params.max_tokens)

    def output(self) -> RequestOutput:
        finished = self.finished
        prompt_logprobs = None
        if self.params.prompt_logprobs is not None:
            if self.params.output_kind is not RequestOutputKind.DELTA:
                prompt_logprobs = [None, *self.prompt_logprobs]
            elif not self.prompt_logprobs_sent:  # known: `process` builds no output before they are
                prompt_logprobs, self.prompt_logprobs_sent = [None, *self.prompt_logprobs], True
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, [seq.output() for seq in self.sequences], finished,
            metrics=self.metrics() if finished else None,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            embedding=self.embedding,
        )


class _Step(NamedTuple):
    """What `process` gathers over a step's updates."""

    touched: dict[str, _RequestState]  # requests with news, in the order they came
    failed: list[RequestOutput]
    stopped: list[str]
    dropped: list[str]


class ProcessedStep(NamedTuple):
    outputs: list[RequestOutput]
    stopped: list[str]  # sequence ids a stop string ended: the core must finish them
    dropped: list[str]  # sequence ids of requests that failed here: the core must drop them


class OutputProcessor:
    def __init__(self) -> None:
        self._requests: dict[str, _RequestState] = {}
        self._sequences: dict[str, _Sequence] = {}  # by sequence id

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            seq_ids: list[str], detokenizers: list[IncrementalDetokenizer], arrival_time: float) -> None:
        state = _RequestState(request_id, prompt, prompt_token_ids, params)
        for index, (seq_id, detokenizer) in enumerate(zip(seq_ids, detokenizers, strict=True)):
            state.sequences.append(_Sequence(seq_id, index, state, detokenizer, arrival_time))
        self._requests[request_id] = state
        self._sequences.update((seq.seq_id, seq) for seq in state.sequences)

    def abort(self, request_id: str) -> list[str]:
        """Forgets a request; returns its sequence ids (empty if it is not live)."""
        state = self._requests.get(request_id)
        if state is None:
            return []
        self._forget(state)
        return [seq.seq_id for seq in state.sequences]

    def process(self, core_outputs: list[CoreOutputs]) -> ProcessedStep:
        """Applies the core's outputs (one or more steps', in order) and returns the outputs of the requests
        with news, their kind permitting, and what the core must finish or drop."""
        step = _Step({}, [], [], [])
        sequences = self._sequences
        for update in core_outputs:
            details = update.details
            for index, (seq_id, token_id, logprob) in enumerate(zip(update.seq_ids, update.token_ids,
                                                                    update.logprobs, strict=True)):
                seq = sequences.get(seq_id)
                if seq is None or seq.status is not None:  # gone, or ended here before the core heard
                    continue
                detail = details.get(index) if details else None
                if detail is None:  # a plain token: no first token, no end, no top logprobs
                    self._add_token(step, seq, token_id, logprob, update.time)
                    continue
                if detail.first is not None:
                    seq.first_scheduled_time = detail.first.first_scheduled_time
                    seq.first_token_time = update.time
                    if seq.index == 0:
                        state = seq.parent
                        state.num_cached_tokens = detail.first.num_cached_tokens
                        state.prompt_logprobs = detail.first.prompt_logprobs or []
                        state.prompt_logprobs_known = True
                if detail.top_logprobs is not None:
                    seq.top_logprobs.append(detail.top_logprobs)
                if detail.rank is not None:
                    seq.ranks.append(detail.rank)
                seq.num_preemptions = detail.num_preemptions
                if detail.embedding is not None:
                    seq.parent.embedding = detail.embedding
                self._add_token(step, seq, token_id, logprob, update.time, detail.status, detail.stop_reason,
                                detail.stop_token)
            for failure in update.failures:  # the core failed them (and logged why)
                seq = sequences.get(failure.seq_id)
                if seq is None or seq.status is not None:
                    continue
                step.failed.append(self._fail(seq.parent, failure.error, failure.error_param, step.dropped))
                step.touched.pop(seq.parent.request_id, None)
        outputs = []
        for state in step.touched.values():
            if state.params.output_kind is RequestOutputKind.FINAL_ONLY and not state.finished:
                continue  # its one output comes when it finishes
            if state.params.prompt_logprobs is not None and not state.prompt_logprobs_known:
                continue  # a sibling ran ahead of the first sequence: the first output carries the prompt's
            output = state.output()
            outputs.append(output)
            if output.finished:
                self._forget(state)
        return ProcessedStep(outputs + step.failed, step.stopped, step.dropped)

    def _add_token(self, step: _Step, seq: _Sequence, token_id: int, logprob: float, time: float,
                   status: RequestStatus | None = None, stop_reason: int | str | None = None,
                   stop_token: bool = False) -> None:
        """A sequence's new token: its text (none for the EOS or stop id that ended it, unless the request
        includes stop strings), a stop string, or the core's end (`status`). A stop string completed by the
        token the core ended on max_tokens still makes the end a stop, as the text is cut there."""
        state = seq.parent
        seq.token_ids.append(token_id)
        seq.logprobs.append(logprob)
        seq.cumulative_logprob += logprob
        seq.last_token_time = time
        try:
            stop = (not stop_token or state.params.include_stop_str_in_output) and seq.detokenizer.add_token(token_id)
        except Exception as e:
            logger.error("request %s failed and was dropped: %r", state.request_id, e, exc_info=e)
            step.failed.append(self._fail(state, engine_fault(e), None, step.dropped))
            step.touched.pop(state.request_id, None)
            return
        if stop and status in (None, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            seq.status, seq.stop_reason = RequestStatus.FINISHED_STOPPED, seq.detokenizer.stop_reason
            if status is None:  # the core still runs it: it finishes it on hearing
                step.stopped.append(seq.seq_id)
        elif status is not None:
            seq.status, seq.stop_reason = status, stop_reason
        step.touched[state.request_id] = state

    def _forget(self, state: _RequestState) -> None:
        del self._requests[state.request_id]
        for seq in state.sequences:
            del self._sequences[seq.seq_id]

    def _fail(self, state: _RequestState, error: str, error_param: str | None, dropped: list[str]) -> RequestOutput:
        """Ends a request whose sequence failed: every sequence of it goes (the core drops the live ones)."""
        self._forget(state)
        dropped.extend(seq.seq_id for seq in state.sequences if seq.status is None)
        completions = [CompletionOutput(index=i, finish_reason="error") for i in range(len(state.sequences))]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, finished=True,
                             error=error, error_param=error_param)
