"""The KV page pool: which pages are free, which request owns which (pure Python, no jax).

Page 0 is never handed out: padded rows of the page table point at it, and attention masks it.
"""

from collections import deque


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free_pages: deque[int] = deque(range(1, num_pages))

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by requests."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, page_ids: list[int], num_tokens: int) -> bool:
        """Grows `page_ids` in place so that it holds `num_tokens` tokens; False (and no change) if the
        pool is short."""
        num_new = self.num_pages_for(num_tokens) - len(page_ids)
        if num_new <= 0:
            return True
        if num_new > len(self._free_pages):
            return False
        page_ids.extend(self._free_pages.popleft() for _ in range(num_new))
        return True

    def free(self, page_ids: list[int]) -> None:
        """Returns pages to the pool and empties `page_ids`."""
        self._free_pages.extend(page_ids)
        page_ids.clear()
