"""The Responses API's stored responses (`store`, `previous_response_id`): bounded, in memory, used on the
event loop only."""

import collections
from typing import Any

from jaxserve.api.protocol import ResponseObject

MAX_STORED_RESPONSES = 1024


class ResponseStore:
    """Stored responses with the conversation each ended (its messages, to continue from), at most
    `capacity`, least recently used first out."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self._capacity = capacity
        self._entries: collections.OrderedDict[str, tuple[ResponseObject, list[dict[str, Any]]]] = (
            collections.OrderedDict())

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        self._entries[response.id] = (response, conversation)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[ResponseObject, list[dict[str, Any]]] | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry
