"""For scheduler tests: the page tables a runner keeps from the scheduler's page deltas, and a step's rows."""

import weakref

from jaxserve.engine.scheduler import PENDING_TOKEN, Scheduler, SchedulerOutput


def shares(out: SchedulerOutput) -> list[tuple[str, int, tuple[int, ...]]]:
    """(request id, start position, tokens) of every row of a step, records and plain decodes alike, in
    row order; a token in flight is PENDING_TOKEN."""
    rows = [(item.request_id, item.start_position, item.token_ids) for item in out.scheduled]
    decodes = out.decodes
    rows += [(request_id, position, (token,)) for request_id, position, token
             in zip(decodes.request_ids, decodes.positions, decodes.token_ids, strict=True)]
    assert all(PENDING_TOKEN not in tokens[:-1] for _, _, tokens in rows), "only a row's last token can be in flight"
    return rows


class SentPages:
    """Replays each step's `first_new_page` / `new_page_ids` as the runner's persistent rows do (a row is
    cleared when its request starts or resumes, pages are written by index) and checks that every
    scheduled request's replayed pages are its pages."""

    def __init__(self) -> None:
        self.pages: dict[str, list[int]] = {}

    def apply(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        for request_id in out.finished_ids + out.preempted_ids:
            self.pages.pop(request_id, None)
        for item in out.scheduled:
            if item.resumed or item.request_id not in self.pages:
                self.pages[item.request_id] = []
            pages = self.pages[item.request_id]
            assert item.first_new_page <= len(pages), "a gap in the page table"
            pages[item.first_new_page : item.first_new_page + len(item.new_page_ids)] = item.new_page_ids
            assert pages == scheduler.requests[item.request_id].page_ids, item.request_id
        decodes = out.decodes
        for request_id, position in zip(decodes.request_ids, decodes.positions, strict=True):
            # A plain decode sends no pages: the runner's row must hold them all, the page it writes included.
            request = scheduler.requests[request_id]
            assert self.pages.get(request_id) == request.page_ids, f"plain decode {request_id} without its pages"
            assert position < len(request.page_ids) * scheduler.kv_cache.page_size, "a plain decode needs a page"
            assert (position + 1) % scheduler.kv_cache.page_size or not scheduler.kv_cache.enable_prefix_caching, \
                "a plain decode completes a page: the prefix cache would not key it"

    def of(self, request_id: str) -> list[int]:
        return self.pages[request_id]


_replays: "weakref.WeakKeyDictionary[Scheduler, SentPages]" = weakref.WeakKeyDictionary()


def replay(scheduler: Scheduler, out: SchedulerOutput) -> SentPages:
    """Applies a step to the scheduler's own replay (made on its first step) and returns the replay."""
    sent = _replays.setdefault(scheduler, SentPages())
    sent.apply(scheduler, out)
    return sent
