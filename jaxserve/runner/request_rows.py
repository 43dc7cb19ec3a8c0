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

import numpy as np

from jaxserve.engine.step_io import NO_LORA_SLOT, NewRequest, RequestFault, token_bitmask
from jaxserve.sampling_params import SAMPLING_ROW

# The per-row sampling columns a step gathers as they are, named as in `SamplingArrays`: the table's, and
# the rows' seeds and penalty slots.
SAMPLING_COLUMNS = (*(column.name for column in SAMPLING_ROW), "seeds", "penalty_slots")


class RequestRows:
    """Rows 0..M-1 for up to M = max_num_seqs running requests."""

    def __init__(self, num_rows: int, max_pages_per_req: int, vocab_size: int) -> None:
        self.num_rows = num_rows
        self.vocab_size = vocab_size  # the logits' width, which a token bitmask covers
        self._free: deque[int] = deque(range(num_rows))
        self.row_of: dict[str, int] = {}
        self.page_table = np.zeros((num_rows, max_pages_per_req), np.int32)  # i32[M, P]; page 0 (scratch) pads
        for column in SAMPLING_ROW:  # [M] each, in the table's dtype, neutral until a request writes its row
            setattr(self, column.name, np.full(num_rows, column.neutral, column.dtype))
        self.seeds = np.zeros(num_rows, np.uint32)  # u32[M]
        self.penalty_slots = np.full(num_rows, num_rows, np.int32)  # i32[M]: its own row, or M (none)
        self.num_top_logprobs = np.zeros(num_rows, np.int32)  # i32[M]: alternatives per sampled token
        self.num_prompt_logprobs = np.zeros(num_rows, np.int32)  # i32[M]: alternatives per prompt token
        self.logit_bias: list[tuple[tuple[int, float], ...]] = [()] * num_rows  # per row: (token id, bias)
        # per row: its allowed_token_ids as a token bitmask, i32[ceil(V / 32)], or None
        self.allowed_masks: list[np.ndarray | None] = [None] * num_rows
        # bool[M]: the request uses a feature the step fills row by row (penalties, logit_bias,
        # min_tokens' bans, prompt logprobs, allowed tokens); the others never leave the gathered columns.
        self.row_features = np.zeros(num_rows, np.bool_)
        self.num_prompt_tokens = np.zeros(num_rows, np.int64)  # i64[M]
        self.lora_slots = np.full(num_rows, NO_LORA_SLOT, np.int32)  # i32[M]: its adapter's slot (--enable-lora)
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

    def update(self, new_requests: tuple[NewRequest, ...], request_ids: list[str],
               new_pages: dict[int, tuple[int, tuple[int, ...]]]) -> np.ndarray:
        """Records a step's requests: a row (re)written for each new request, and the pages each step row
        was not sent before (`new_pages`, by step row). Returns each step row's request row, intp[n].

        A request whose values do not fit the rows raises RequestFault, after the other requests' rows
        are written: the engine drops it and plans the others again, as running requests (not resumed),
        so their rows must be there. Their pages are sent again and written to the same places."""
        fault = None
        for new in new_requests:
            try:
                row = self._write_row(new)
            except RequestFault as error:
                fault = fault or error
                continue
            if new.cached_token_ids is not None:  # after a prefix-cache hit, with penalties
                self._seen_tokens.append((row, new.cached_token_ids, new.num_prompt_tokens))
        if fault is not None:
            raise fault
        try:
            rows = np.fromiter(map(self.row_of.__getitem__, request_ids), np.intp, len(request_ids))  # [n]
        except KeyError as missing:  # the scheduler plans a running request only after it took a row
            raise RequestFault(missing.args[0]) from RuntimeError("a running request without a row")
        page_table = self.page_table
        for index, (first, page_ids) in new_pages.items():
            end = first + len(page_ids)
            if end > page_table.shape[1]:  # past max_model_len: the scheduler's limits make this a bug
                raise RequestFault(request_ids[index]) from ValueError(
                    f"{end} pages, at most {page_table.shape[1]} per request")
            page_table[rows[index], first:end] = page_ids
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

    def _write_row(self, new: NewRequest) -> int:
        """Raises RequestFault for a value out of its column's range (nothing written then)."""
        try:
            values = [np.dtype(column.dtype).type(value) for column, value in zip(SAMPLING_ROW, new.sampling_row,
                                                                                     strict=True)]
            seed = np.uint32(new.sampling_seed)
            allowed = None if new.allowed_token_ids is None else token_bitmask(new.allowed_token_ids, self.vocab_size)
        except (OverflowError, ValueError, TypeError) as error:
            raise RequestFault(new.request_id) from error
        row = self.row_of.get(new.request_id)
        if row is None:
            if not self._free:
                raise RuntimeError("no free request row: more running requests than max_num_seqs")
            row = self.row_of[new.request_id] = self._free.popleft()
        self.page_table[row] = 0
        for column, value in zip(SAMPLING_ROW, values, strict=True):
            getattr(self, column.name)[row] = value
        self.seeds[row] = seed
        self.penalty_slots[row] = row if new.has_penalties else self.num_rows
        self.num_top_logprobs[row] = new.num_top_logprobs
        self.num_prompt_logprobs[row] = new.num_prompt_logprobs
        self.logit_bias[row] = new.logit_bias
        self.allowed_masks[row] = allowed
        self.row_features[row] = new.fills_row
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.lora_slots[row] = new.lora_slot
        return row
