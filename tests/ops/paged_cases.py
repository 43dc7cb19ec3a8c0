"""Ragged paged-attention cases and the float64 oracle that every implementation is checked against."""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PagedCase:
    q: np.ndarray  # [T, N, H]
    k_pages: np.ndarray  # [K, num_pages, page_size, H]
    v_pages: np.ndarray  # [K, num_pages, page_size, H]
    kv_lens: np.ndarray  # i32[R]
    page_table: np.ndarray  # i32[R, P]
    cu_q_lens: np.ndarray  # i32[R+1]

    @property
    def args(self) -> tuple[np.ndarray, ...]:
        return self.q, self.k_pages, self.v_pages, self.kv_lens, self.page_table, self.cu_q_lens

    @property
    def num_real_tokens(self) -> int:
        return int(self.cu_q_lens[-1])


# name -> (q_len per request, kv_len per request)
MIXES = {
    "decodes": ([1, 1, 1, 1], [1, 4, 5, 17]),
    "prefills": ([7, 4, 9], [7, 4, 9]),  # kv on and off page boundaries
    "chunk_after_cache": ([5, 3], [13, 8]),
    "mixed_with_empty": ([1, 0, 6, 1, 0, 11], [9, 3, 6, 4, 0, 40]),  # q_len 0, empty context
    "long": ([2, 30], [45, 30]),
}


def make_case(
    rng: np.random.Generator,
    q_lens: list[int],
    kv_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    *,
    page_size: int = 4,
    head_dim: int = 16,
    dtype: np.dtype | type = np.float32,
    pad_tokens: int = 5,
    pad_reqs: int = 2,
    max_pages: int = 12,
) -> PagedCase:
    """Random queries and pages; page ids are shuffled and every slot no request owns is NaN, so a kernel
    that reads past a request's length or outside its pages produces NaN."""
    num_pages = 1 + sum(-(-kv // page_size) for kv in kv_lens) + 7
    k_pages = np.full((num_kv_heads, num_pages, page_size, head_dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    free = list(rng.permutation(np.arange(1, num_pages)))  # page 0 is the scratch page
    num_reqs = len(q_lens) + pad_reqs
    page_table = np.zeros((num_reqs, max_pages), np.int32)
    for r, kv_len in enumerate(kv_lens):
        num = -(-kv_len // page_size)
        pages = [free.pop() for _ in range(num)]
        page_table[r, :num] = pages
        for j, page in enumerate(pages):
            used = min(page_size, kv_len - j * page_size)
            k_pages[:, page, :used] = rng.standard_normal((num_kv_heads, used, head_dim))
            v_pages[:, page, :used] = rng.standard_normal((num_kv_heads, used, head_dim))
    cu_q_lens = np.zeros(num_reqs + 1, np.int32)
    cu_q_lens[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu_q_lens[len(q_lens) + 1 :] = cu_q_lens[len(q_lens)]
    num_tokens = int(cu_q_lens[-1]) + pad_tokens
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim))
    kv = np.zeros(num_reqs, np.int32)
    kv[: len(kv_lens)] = kv_lens
    return PagedCase(
        q.astype(dtype), k_pages.astype(dtype), v_pages.astype(dtype), kv, page_table, cu_q_lens
    )


def oracle(case: PagedCase, sm_scale: float, sliding_window: int | None = None,
           logit_softcap: float | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
    """Dense float64 attention, request by request, straight from the definition: a query at position p
    sees keys max(0, p - sliding_window + 1) .. p; scaled scores are soft-capped as cap * tanh(s / cap);
    a head's sink logit joins the scores in the softmax and its weight is dropped (GPT-OSS)."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (case.q, case.k_pages, case.v_pages))
    num_kv_heads, _, page_size, head_dim = k_pages.shape
    group = q.shape[1] // num_kv_heads
    out = np.zeros_like(q)
    for r, kv_len in enumerate(case.kv_lens):
        q_start, q_end = case.cu_q_lens[r], case.cu_q_lens[r + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        pages = case.page_table[r, : -(-kv_len // page_size)]
        k = k_pages[:, pages].reshape(num_kv_heads, -1, head_dim)[:, :kv_len]  # [K, L, H]
        v = v_pages[:, pages].reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
        for i in range(q_len):
            pos = kv_len - q_len + i
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for head in range(q.shape[1]):
                kv_head = head // group
                scores = k[kv_head, first : pos + 1] @ q[q_start + i, head] * sm_scale
                if logit_softcap is not None:
                    scores = logit_softcap * np.tanh(scores / logit_softcap)
                if sinks is not None:
                    scores = np.append(scores, sinks[head])
                p = np.exp(scores - scores.max())
                p = p / p.sum()
                out[q_start + i, head] = p[: pos + 1 - first] @ v[kv_head, first : pos + 1]
    return out


def blank_before_windows(case: PagedCase, sliding_window: int) -> PagedCase:
    """The case with NaN in every page that lies wholly before its request's earliest query's window (pages a
    server may free): an implementation that reads any of them produces NaN."""
    k_pages, v_pages = case.k_pages.copy(), case.v_pages.copy()
    page_size = k_pages.shape[2]
    for r, kv_len in enumerate(case.kv_lens):
        q_len = case.cu_q_lens[r + 1] - case.cu_q_lens[r]
        if q_len == 0:
            continue
        earliest_key = max(0, int(kv_len - q_len) - sliding_window + 1)
        for page in case.page_table[r, : earliest_key // page_size]:
            k_pages[:, page], v_pages[:, page] = np.nan, np.nan
    return PagedCase(case.q, k_pages, v_pages, case.kv_lens, case.page_table, case.cu_q_lens)
