"""RequestRows: the runner's persistent batch, host rows that outlive a step (vLLM's InputBatch).

Each running request holds one row from the step it is first scheduled in (or resumed in, after a
preemption) until it finishes or is preempted. The row keeps what does not change from step to step:
the request's sampling parameters and its page table, to which a step writes only the pages the
scheduler allocated for it since. A step then gathers its requests' rows into its arrays
(`build_step_batch`) instead of rebuilding every column from Python objects, and a long request's page
list is never copied whole again. A request's row is also its row in the penalty tables.

Pure numpy, no jax; one thread (the engine's) uses it.
"""

from collections import deque
from typing import NamedTuple

import numpy as np

from jaxserve.engine.request import RequestFault
from jaxserve.engine.scheduler import ScheduledRequest

# The per-row sampling columns, named as in `SamplingArrays`, which a step gathers as they are.
SAMPLING_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "seeds", "wants_logprobs", "wants_top_logprobs",
                    "penalty_slots", "repetition_penalty", "frequency_penalty", "presence_penalty")


class RequestRows:
    """Rows 0..M-1 for up to M = max_num_seqs running requests."""

    def __init__(self, num_rows: int, max_pages_per_req: int) -> None:
        self.num_rows = num_rows
        self._free: deque[int] = deque(range(num_rows))
        self.row_of: dict[str, int] = {}
        self.page_table = np.zeros((num_rows, max_pages_per_req), np.int32)  # i32[M, P]; page 0 (scratch) pads
        self.temperature = np.zeros(num_rows, np.float32)  # f32[M]; 0 = greedy
        self.top_k = np.zeros(num_rows, np.int32)  # i32[M]; 0 = off
        self.top_p = np.ones(num_rows, np.float32)  # f32[M]
        self.min_p = np.zeros(num_rows, np.float32)  # f32[M]
        self.seeds = np.zeros(num_rows, np.uint32)  # u32[M]
        self.wants_logprobs = np.zeros(num_rows, np.bool_)  # bool[M]
        self.wants_top_logprobs = np.zeros(num_rows, np.bool_)  # bool[M]
        self.penalty_slots = np.full(num_rows, num_rows, np.int32)  # i32[M]: its own row, or M (none)
        self.repetition_penalty = np.ones(num_rows, np.float32)  # f32[M]
        self.frequency_penalty = np.zeros(num_rows, np.float32)  # f32[M]
        self.presence_penalty = np.zeros(num_rows, np.float32)  # f32[M]
        # bool[M]: the request uses a feature the step fills row by row (penalties, logit_bias,
        # min_tokens' bans, prompt logprobs); the others never leave the gathered columns.
        self.row_features = np.zeros(num_rows, np.bool_)
        # i32[M]: the batch row of the request's sample in the last step launched that kept one, and i64[M]
        # which step that was (`launched` counts them); a step feeds a token still in flight (async
        # scheduling) from that row of the previous step's samples.
        self.sample_row = np.zeros(num_rows, np.int32)
        self.sample_step = np.zeros(num_rows, np.int64)
        self.num_launched = 0
        self._seen_tokens: list[tuple[int, tuple[int, ...], int]] = []  # see take_seen_tokens

    @property
    def num_used(self) -> int:
        return len(self.row_of)

    def release(self, request_ids: tuple[str, ...] | list[str]) -> None:
        """Frees the rows of finished and preempted requests (ids without a row are skipped)."""
        for request_id in request_ids:
            row = self.row_of.pop(request_id, None)
            if row is not None:
                self._free.append(row)

    def update(self, scheduled: tuple[ScheduledRequest, ...], decode_ids: list[str] = ()) -> np.ndarray:
        """Records a step's requests: a row (re)written for each record that starts or resumes, or has none,
        and every record's new pages (a plain decode, `decode_ids`, has a row and no new page). Returns each
        request's row, intp[n], records first.

        A request whose parameters do not fit the rows raises RequestFault, after the other requests' rows
        are written: the engine drops it and plans the others again, as running requests (not resumed),
        so their rows must be there. Their pages are sent again and written to the same places."""
        fault = None
        for item in scheduled:
            if item.resumed or item.request_id not in self.row_of:
                try:
                    values = _row_values(item)
                except RequestFault as error:
                    fault = fault or error
                    continue
                row = self._write_row(item.request_id, values)
                if item.cached_token_ids is not None:  # after a prefix-cache hit, with penalties
                    self._seen_tokens.append((row, item.cached_token_ids, item.num_prompt_tokens))
        if fault is not None:
            raise fault
        row_of, page_table = self.row_of, self.page_table
        num_records = len(scheduled)
        rows = np.empty(num_records + len(decode_ids), np.intp)  # [n]
        try:
            rows[num_records:] = np.fromiter(map(row_of.__getitem__, decode_ids), np.intp, len(decode_ids))
        except KeyError as missing:  # the scheduler sends a plain decode only after its first record
            raise RequestFault(missing.args[0]) from RuntimeError("a plain decode of a request without a row")
        for index, item in enumerate(scheduled):
            row = rows[index] = row_of[item.request_id]
            if item.new_page_ids:
                first, end = item.first_new_page, item.first_new_page + len(item.new_page_ids)
                if end > page_table.shape[1]:  # past max_model_len: the scheduler's limits make this a bug
                    raise RequestFault(item.request_id) from ValueError(
                        f"{end} pages, at most {page_table.shape[1]} per request")
                page_table[row, first:end] = item.new_page_ids
        return rows

    def launched(self, row_ids: np.ndarray, keeps_sample: np.ndarray) -> None:
        """Notes where a launched step's kept samples sit: row_ids intp[n], keeps_sample bool[n]."""
        self.num_launched += 1
        kept = row_ids[keeps_sample]
        self.sample_row[kept] = np.flatnonzero(keeps_sample)
        self.sample_step[kept] = self.num_launched

    def in_flight_sample_rows(self, rows: np.ndarray) -> np.ndarray:
        """The previous step's batch rows of the samples these rows' requests have in flight, i32[k]. Raises
        if one did not sample in that step (a scheduler bug: its token would be another request's)."""
        if (self.sample_step[rows] != self.num_launched).any():
            raise RuntimeError("a token in flight from a step that did not sample it")
        return self.sample_row[rows]

    def take_seen_tokens(self) -> list[tuple[int, tuple[int, ...], int]]:
        """(row, tokens, prompt length) of rows written after a prefix-cache hit with penalties, since the
        last call: the runner counts those tokens into the row's penalty tables before a step runs."""
        taken, self._seen_tokens = self._seen_tokens, []
        return taken

    def _write_row(self, request_id: str, values: "RowValues") -> int:
        row = self.row_of.get(request_id)
        if row is None:
            if not self._free:
                raise RuntimeError("no free request row: more running requests than max_num_seqs")
            row = self.row_of[request_id] = self._free.popleft()
        self.page_table[row] = 0
        for name in _PARAMETER_COLUMNS:
            getattr(self, name)[row] = getattr(values, name)
        self.penalty_slots[row] = row if values.has_penalties else self.num_rows
        self.row_features[row] = values.row_features
        return row


class RowValues(NamedTuple):
    """A request's row values in the columns' dtypes."""

    temperature: np.float32
    top_k: np.int32
    top_p: np.float32
    min_p: np.float32
    seeds: np.uint32
    wants_logprobs: bool
    wants_top_logprobs: bool
    repetition_penalty: np.float32
    frequency_penalty: np.float32
    presence_penalty: np.float32
    has_penalties: bool
    row_features: bool


_PARAMETER_COLUMNS = tuple(name for name in SAMPLING_COLUMNS if name != "penalty_slots")


def _row_values(item: ScheduledRequest) -> RowValues:
    """Raises RequestFault for a value out of its column's range."""
    p = item.sampling_params
    try:
        return RowValues(
            np.float32(0.0 if p.is_greedy else p.temperature), np.int32(p.top_k), np.float32(p.top_p),
            np.float32(p.min_p), np.uint32(item.sampling_seed), p.logprobs is not None, bool(p.logprobs),
            np.float32(p.repetition_penalty), np.float32(p.frequency_penalty), np.float32(p.presence_penalty),
            p.has_penalties, p.fills_batch_rows,
        )
    except (OverflowError, ValueError, TypeError) as error:
        raise RequestFault(item.request_id) from error
