"""The KV page pool with automatic prefix caching (pure Python, no jax).

Page 0 is never handed out: padded rows of the page table point at it, and attention masks it.

Every other page has a reference count: how many requests hold it in their page table. Prefix caching
gives a page a key once all its `page_size` tokens are computed:

    key = sha256(parent key || extra keys || its token ids)

where the parent is the previous page's key (a fixed random root for the first page), so a key names
the whole prefix up to the page's end, and the extra keys (a request's `cache_salt`) enter at the first
page only and so separate whole chains. A keyed page is found by `cached_prefix`, and a request that
hits it takes a reference instead of computing those tokens again. Only full, computed pages are keyed,
and a request only writes K/V at positions it has not computed yet, so a page is never written while
it is keyed or shared.

Under a sliding window on every layer (Mistral, Phi-3), a request's pages that hold only keys before its
next query's window are released as it grows (`release_outside_window`): its page list keeps page 0 in
their place, which attention never reads (no implementation reads keys before a window), so positions
still index the list. Models with any full-attention layer keep every page.

A page whose count drops to zero is free but keeps its key: it sits in an LRU queue and a later hit
revives it. Allocation takes free pages from the front of that queue, unkeyed ones first, and evicts
(forgets the key of) a keyed page it takes. A request's pages are freed tail first, so the end of a
prefix is evicted before its start, which other prefixes may share.
"""

import hashlib
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence

# The parent of every first page. Random per process, as in vLLM: keys are meaningless across processes.
_ROOT_KEY = os.urandom(32)


def page_key(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """The key of a full page: sha256 over its parent's key, the extra keys (length-prefixed) and its tokens."""
    digest = hashlib.sha256(parent)
    digest.update(struct.pack("<Q", len(extra)))
    digest.update(extra)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def extend_page_keys(
    keys: list[bytes],
    num_full_pages: int,
    page_size: int,
    token_ids: Callable[[int, int], Sequence[int]],
    salt: str | None = None,
) -> list[bytes]:
    """Grows `keys` (a request's page keys, in order) in place to `num_full_pages` entries;
    `token_ids(start, end)` returns the request's tokens in [start, end)."""
    while len(keys) < num_full_pages:
        index = len(keys)
        parent = keys[-1] if keys else _ROOT_KEY
        extra = salt.encode() if index == 0 and salt else b""
        keys.append(page_key(parent, token_ids(index * page_size, (index + 1) * page_size), extra))
    return keys


def shared_window(layer_windows: Sequence[int | None]) -> int | None:
    """The window every layer keeps within (the widest), or None where some layer attends to everything."""
    return max(layer_windows) if layer_windows and all(layer_windows) else None


SCRATCH_PAGE = 0


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: every layer's (`shared_window`); pages before it are released as requests grow."""
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_pages
        self._keys: list[bytes | None] = [None] * num_pages  # a page's key while it is cached
        self._cached: dict[bytes, int] = {}  # key -> page
        # Free pages, next to be allocated first; values unused. Page 0 is never in it.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def capacity_tokens(self) -> int:
        """Tokens the usable pages hold: the most one request can ever need."""
        return self.num_usable_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        """Pages no request holds, cached ones included: allocation can take any of them."""
        return len(self._free)

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by requests (cached free pages count as free)."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def is_cached(self, page_id: int) -> bool:
        return self._keys[page_id] is not None

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def cached_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """The pages holding the longest run of `keys` from the start (no reference taken)."""
        pages = []
        for key in keys:
            page = self._cached.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def is_key_cached(self, key: bytes) -> bool:
        return key in self._cached

    def take(self, page_ids: Sequence[int]) -> None:
        """Takes a reference on each page (cache hits), reviving free ones."""
        for page in page_ids:
            if self._ref_counts[page] == 0:
                del self._free[page]
            self._ref_counts[page] += 1

    def allocate(self, page_ids: list[int], num_tokens: int) -> bool:
        """Grows `page_ids` in place with fresh pages so that it holds `num_tokens` tokens; False (and no
        change) if the pool is short. Taking a cached free page evicts it from the cache."""
        if num_tokens <= len(page_ids) * self.page_size:  # most calls: a decode with room in its last page
            return True
        num_new = self.num_pages_for(num_tokens) - len(page_ids)
        if num_new > len(self._free):
            return False
        for _ in range(num_new):
            page, _ = self._free.popitem(last=False)
            key = self._keys[page]
            if key is not None:
                del self._cached[key]
                self._keys[page] = None
            self._ref_counts[page] = 1
            page_ids.append(page)
        return True

    def num_freed_by(self, page_ids: list[int]) -> int:
        """How many pages `free(page_ids)` would return to the free queue: those no other request holds."""
        return sum(page != SCRATCH_PAGE and self._ref_counts[page] == 1 for page in page_ids)

    def free(self, page_ids: list[int]) -> None:
        """Drops the request's reference on each page and empties `page_ids`. Pages no one holds join
        the free queue: uncached ones at the front (reused first), cached ones at the back, tail first."""
        for page in reversed(page_ids):
            self._drop(page)
        page_ids.clear()

    def _drop(self, page: int) -> None:
        if page == SCRATCH_PAGE:  # a released page's place
            return
        self._ref_counts[page] -= 1
        if self._ref_counts[page] == 0:
            self._free[page] = None
            if self._keys[page] is None:
                self._free.move_to_end(page, last=False)

    def release_outside_window(self, page_ids: list[int], first_query_pos: int) -> int:
        """Under a sliding window, drops the request's reference on the pages whose keys all lie before the
        window of a query at `first_query_pos` (and so of every later one), putting page 0 in their place;
        returns how many it released. Released pages are freed as `free` frees them (a cached one stays
        cached until taken)."""
        if self.sliding_window is None:
            return 0
        end = min(max(0, first_query_pos - self.sliding_window + 1) // self.page_size, len(page_ids))
        released = 0
        for index in range(end - 1, -1, -1):  # released pages are a leading run: stop at the first one
            if page_ids[index] == SCRATCH_PAGE:
                break
            self._drop(page_ids[index])
            page_ids[index] = SCRATCH_PAGE
            released += 1
        return released

    def cache_pages(self, page_ids: Sequence[int], keys: Sequence[bytes], start: int, end: int) -> None:
        """Keys pages `page_ids[start:end]`, which are full and computed, with `keys[start:end]`. A key
        already cached keeps its page (the same tokens computed twice, as when a request's last page is
        recomputed after a hit): the duplicate stays unkeyed."""
        if not self.enable_prefix_caching:
            return
        for index in range(start, end):
            page, key = page_ids[index], keys[index]
            if page != SCRATCH_PAGE and key not in self._cached and self._keys[page] is None:
                self._cached[key] = page
                self._keys[page] = key

    def reset_prefix_cache(self) -> int:
        """Forgets every cached key (pages stay with their holders); returns how many were dropped."""
        dropped = len(self._cached)
        for page in self._cached.values():
            self._keys[page] = None
        self._cached.clear()
        return dropped
