"""The Responses API's stored responses (`store`, `previous_response_id`) and the background ones still being
answered (`background`): bounded, in memory, used on the event loop only.

A background response is answered by a task of its own, which the store holds until it ends. The task
writes the response as it moves (queued, in progress, then completed, incomplete, failed or cancelled)
through `settle`, which writes only while the task is still registered: a response deleted while it runs
stays deleted, and the least-recently-used eviction passes over a response that runs (its client may still
cancel it). The stored responses are kept within a budget of bytes too (`MAX_STORED_BYTES`, each counted
by its request's body and its answer's JSON: an input may be as large as the body limit), and a streamed
one's events within a budget over all of them (`MAX_EVENT_BYTES`, the oldest let go first). `cancel` and
`delete` wait for the task to end, so its engine request has been aborted and its last state written
before they answer.

The store is this process's memory: a restart loses it. So a shutdown's drain does not wait for background
responses that no client could read after it (only, as for any HTTP request, for a client still reading
one's events, within the drain's timeout), and the app's shutdown cancels them (`cancel_all`) before its
engine stops.
"""

import asyncio
import collections
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxserve.api.protocol import ResponseObject

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 512 * 2**20  # the stored responses' requests and answers together; the oldest go first past it
MAX_EVENT_BYTES = 256 * 2**20  # the ended responses' event logs together; the oldest go first past it

Conversation = list[dict[str, Any]]  # the chat messages a response ended, to continue from


class EventLog:
    """A streamed background response's server-sent events (each one frame, `sequence_number` its index),
    kept for its clients: the one that created it, and any that resume later from a sequence number
    (GET ...?stream=true&starting_after=N). A client that leaves stops reading; the response goes on."""

    def __init__(self) -> None:
        self.frames: list[str] = []
        self.nbytes = 0  # the frames' characters: what the store's budget counts
        self.done = False
        self.dropped = False  # its frames were let go (the store's budget): it can no longer be read
        self._changed = asyncio.Event()  # set, then replaced, at each change

    def append(self, frame: str) -> None:
        self.frames.append(frame)
        self.nbytes += len(frame)
        self._wake()

    def drop(self) -> None:
        """Lets an ended log's frames go: a new list, so that readers already following it finish theirs."""
        self.frames, self.nbytes, self.dropped = [], 0, True

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, start: int) -> AsyncIterator[str]:
        """The frames from index `start` on, then each as it comes, until the log closes."""
        # One list to its end: frames are appended to it while the log runs, and a drop (of an ended log only)
        # replaces it, so a reader inside an ended log finishes it.
        index, frames = start, self.frames
        while True:
            while index < len(frames):
                yield frames[index]
                index += 1
            if self.done:
                return
            await self._changed.wait()  # the event of this moment: the next change sets it


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: Conversation | None  # None while a background one runs, or where it failed or was cancelled
    input_items: Sequence[dict[str, Any]] = field(default=())  # its request's input as OpenAI's items, with ids
    events: EventLog | None = None  # a background response created with stream=true: its events
    request_bytes: int = 0  # its request's body: what its input items, and the conversation, hold at most
    nbytes: int = 0  # what the store's budget counts: the request's body and the response's JSON


class ResponseStore:
    """Stored responses with the conversation each ended and their input items, at most `capacity` and
    `max_bytes`, least recently used first out; and the tasks answering background responses."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES, max_event_bytes: int = MAX_EVENT_BYTES,
                 max_bytes: int = MAX_STORED_BYTES) -> None:
        self._capacity = capacity
        self._max_event_bytes = max_event_bytes
        self._max_bytes = max_bytes
        self._nbytes = 0  # the entries' `nbytes`
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._running: dict[str, asyncio.Task] = {}

    def put(self, response: ResponseObject, conversation: Conversation | None,
            input_items: Sequence[dict[str, Any]] = (), events: EventLog | None = None,
            request_bytes: int = 0) -> None:
        """Stores (or rewrites) a response; `request_bytes`: its request's body."""
        entry = StoredResponse(response, conversation, input_items, events, request_bytes,
                               request_bytes + len(response.model_dump_json()))
        if (old := self._entries.get(response.id)) is not None:
            self._nbytes -= old.nbytes
        self._entries[response.id] = entry
        self._nbytes += entry.nbytes
        self._entries.move_to_end(response.id)
        excess = len(self._entries) - self._capacity
        if excess > 0 or self._nbytes > self._max_bytes:  # the oldest go, but none that runs and not this one
            for key in [key for key in self._entries if key not in self._running and key != response.id]:
                if excess <= 0 and self._nbytes <= self._max_bytes:
                    break
                self._nbytes -= self._entries.pop(key).nbytes
                excess -= 1

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def start(self, response: ResponseObject, input_items: Sequence[dict[str, Any]],
              work: Coroutine[Any, Any, None], events: EventLog | None = None, request_bytes: int = 0) -> None:
        """Stores `response` (queued) and answers it in the background: `work` runs as a task of its own,
        held here until it ends, however it ends (cancelled before it started too); `events`, where the
        response streams, closes then too."""
        task = asyncio.get_running_loop().create_task(work)
        self._running[response.id] = task
        self.put(response, None, input_items, events, request_bytes)

        def ended(_: asyncio.Task) -> None:
            if self._running.get(response.id) is task:
                del self._running[response.id]
            if events is not None:
                events.close()
                self._trim_events()

        task.add_done_callback(ended)

    def _trim_events(self) -> None:
        """Past the budget, the oldest ended responses' event logs let their frames go (their responses stay
        stored: GET without stream still answers)."""
        logs = [entry.events for entry in self._entries.values() if entry.events is not None and entry.events.done]
        total = sum(log.nbytes for log in logs)
        for log in logs:  # oldest first
            if total <= self._max_event_bytes:
                break
            total -= log.nbytes
            log.drop()

    def settle(self, response: ResponseObject, conversation: Conversation | None = None) -> None:
        """A background response's new state, from its own task; dropped once the response was deleted."""
        if response.id in self._running:
            entry = self._entries.get(response.id)
            if entry is None:  # evicted: not while it runs, unless the store was built over capacity
                entry = StoredResponse(response, None)
            self.put(response, conversation, entry.input_items, entry.events, entry.request_bytes)

    def is_running(self, response_id: str) -> bool:
        return response_id in self._running

    async def cancel(self, response_id: str) -> None:
        """Cancels a running background response and waits until its task has ended (its engine request
        aborted, `cancelled` written); nothing happens to one that has ended."""
        if (task := self._running.get(response_id)) is not None:
            task.cancel()
            await asyncio.wait({task})
            # A task cancelled before it first ran wrote nothing (and started no engine request): its
            # response still reads queued. Written here, after the task, as its own write would have been.
            entry = self._entries.get(response_id)
            if entry is not None and entry.response.status in ("queued", "in_progress"):
                self.put(entry.response.model_copy(update={"status": "cancelled"}), None, entry.input_items,
                         entry.events, entry.request_bytes)

    async def cancel_all(self) -> None:
        """Cancels every background response that runs (the app's shutdown: their engine requests abort
        while the engine and the event loop still run)."""
        await asyncio.gather(*(self.cancel(response_id) for response_id in list(self._running)))

    async def delete(self, response_id: str) -> bool:
        """Forgets a response, cancelling it first if it runs; False if it is not stored."""
        task = self._running.pop(response_id, None)
        if task is not None:  # unregistered first: what its task still writes is dropped
            task.cancel()
            await asyncio.wait({task})
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._nbytes -= entry.nbytes
        return entry is not None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def max_running(self) -> int:
        """The most background responses that run at once: half the store, so that the other half keeps
        room for responses that ended (a client that enqueues background work without end is refused)."""
        return max(1, self._capacity // 2)

    @property
    def is_full(self) -> bool:
        return len(self._running) >= self.max_running
