"""For scheduler tests: a step's rows as records, and the page tables a runner keeps from the scheduler's
page deltas."""

import weakref
from typing import NamedTuple

from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_io import PENDING_TOKEN, NewRequest, SchedulerOutput


class Row(NamedTuple):
    """One row of a plan, read back from its columns and sparse maps (tests only: nothing builds these)."""

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    num_output_tokens: int  # the index of its sample among the request's outputs
    keeps_sample: bool
    first_new_page: int | None  # None: no pages sent with this row
    new_page_ids: tuple[int, ...]
    banned_token_ids: tuple[int, ...]
    prompt_logprob_targets: tuple[int, ...]
    new: NewRequest | None  # set when the request takes a runner row in this step

    @property
    def resumed(self) -> bool:
        return self.new is not None

    @property
    def cached_token_ids(self) -> tuple[int, ...] | None:
        return None if self.new is None else self.new.cached_token_ids


def rows(out: SchedulerOutput) -> list[Row]:
    """Every row of a step, in order."""
    new = {item.request_id: item for item in out.new_requests}
    result, first = [], 0
    for row, (request_id, num_new) in enumerate(zip(out.request_ids, out.num_new_tokens, strict=True)):
        first_new_page, page_ids = out.new_pages.get(row, (None, ()))
        result.append(Row(request_id, tuple(out.token_ids[first : first + num_new]), out.start_positions[row],
                          out.output_indices[row], out.keeps_sample[row], first_new_page, page_ids,
                          out.banned_token_ids.get(row, ()), out.prompt_logprob_targets.get(row, ()),
                          new.get(request_id)))
        first += num_new
    return result


def plan(records: list[Row]) -> SchedulerOutput:
    """A plan made of rows (the inverse of `rows`)."""
    index = dict(enumerate(records))
    return SchedulerOutput(
        [r.request_id for r in records], [len(r.token_ids) for r in records],
        [t for r in records for t in r.token_ids], [r.start_position for r in records],
        [r.num_output_tokens for r in records], [r.keeps_sample for r in records],
        tuple(r.new for r in records if r.new is not None),
        {i: (r.first_new_page, r.new_page_ids) for i, r in index.items() if r.first_new_page is not None},
        {i: r.banned_token_ids for i, r in index.items() if r.banned_token_ids},
        {i: r.prompt_logprob_targets for i, r in index.items() if r.prompt_logprob_targets},
    )


def shares(out: SchedulerOutput) -> list[tuple[str, int, tuple[int, ...]]]:
    """(request id, start position, tokens) of every row of a step, in row order; a token in flight is
    PENDING_TOKEN."""
    shared = [(row.request_id, row.start_position, row.token_ids) for row in rows(out)]
    assert all(PENDING_TOKEN not in tokens[:-1] for _, _, tokens in shared), "only a row's last token can be in flight"
    return shared


class SentPages:
    """Replays each step's page deltas (`new_pages`) as the runner's persistent rows do (a row is cleared
    when its request starts or resumes, pages are written by index) and checks that every scheduled
    request's replayed pages are its pages (but those it released), the page its last token is written to
    included."""

    def __init__(self) -> None:
        self.pages: dict[str, list[int]] = {}

    def apply(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        for request_id in out.finished_ids + out.preempted_ids:
            self.pages.pop(request_id, None)
        for row in rows(out):
            if row.resumed:
                self.pages[row.request_id] = []
            assert row.request_id in self.pages, f"{row.request_id} runs without having taken a row"
            pages = self.pages[row.request_id]
            if row.first_new_page is not None:
                assert row.first_new_page <= len(pages), "a gap in the page table"
                pages[row.first_new_page : row.first_new_page + len(row.new_page_ids)] = row.new_page_ids
            request = scheduler.requests[row.request_id]
            # Pages released outside a sliding window are page 0 in the scheduler's list; the runner keeps
            # the old ids there, which attention never reads.
            held = [page if held else 0 for page, held in zip(pages, request.page_ids, strict=False)]
            assert held == request.page_ids, row.request_id
            end = row.start_position + len(row.token_ids)
            assert end <= len(pages) * scheduler.kv_cache.page_size, "a token without a page"

    def of(self, request_id: str) -> list[int]:
        return self.pages[request_id]


_replays: "weakref.WeakKeyDictionary[Scheduler, SentPages]" = weakref.WeakKeyDictionary()


def replay(scheduler: Scheduler, out: SchedulerOutput) -> SentPages:
    """Applies a step to the scheduler's own replay (made on its first step) and returns the replay."""
    sent = _replays.setdefault(scheduler, SentPages())
    sent.apply(scheduler, out)
    return sent
