"""The page tables a runner keeps from the scheduler's page deltas, for scheduler tests."""

import weakref

from jaxserve.engine.scheduler import Scheduler, SchedulerOutput


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

    def of(self, request_id: str) -> list[int]:
        return self.pages[request_id]


_replays: "weakref.WeakKeyDictionary[Scheduler, SentPages]" = weakref.WeakKeyDictionary()


def replay(scheduler: Scheduler, out: SchedulerOutput) -> SentPages:
    """Applies a step to the scheduler's own replay (made on its first step) and returns the replay."""
    sent = _replays.setdefault(scheduler, SentPages())
    sent.apply(scheduler, out)
    return sent
