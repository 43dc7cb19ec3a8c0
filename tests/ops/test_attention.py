"""Reference ragged paged attention against a float64 numpy oracle."""

import numpy as np
import pytest

from jaxserve.ops.attention import ragged_paged_attention, resolve_impl

PAGE_SIZE = 4


def oracle(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, sm_scale):
    """Dense float64 attention, request by request, straight from the definition."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    num_kv_heads, _, page_size, head_dim = k_pages.shape
    group = q.shape[1] // num_kv_heads
    out = np.zeros_like(q)
    for r, kv_len in enumerate(kv_lens):
        q_start, q_end = cu_q_lens[r], cu_q_lens[r + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        pages = page_table[r, : -(-kv_len // page_size)]
        k = k_pages[:, pages].reshape(num_kv_heads, -1, head_dim)[:, :kv_len]  # [K, L, H]
        v = v_pages[:, pages].reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
        for i in range(q_len):
            pos = kv_len - q_len + i
            for head in range(q.shape[1]):
                kv_head = head // group
                scores = k[kv_head, : pos + 1] @ q[q_start + i, head] * sm_scale
                p = np.exp(scores - scores.max())
                out[q_start + i, head] = (p / p.sum()) @ v[kv_head, : pos + 1]
    return out


def make_case(rng, q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim=16, pad_tokens=5, pad_reqs=2):
    num_pages = 64
    max_pages = 12
    k_pages = np.full((num_kv_heads, num_pages, PAGE_SIZE, head_dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    free = list(rng.permutation(np.arange(1, num_pages)))  # shuffled page ids
    num_reqs = len(q_lens) + pad_reqs
    page_table = np.zeros((num_reqs, max_pages), np.int32)
    for r, kv_len in enumerate(kv_lens):
        num = -(-kv_len // PAGE_SIZE)
        pages = [free.pop() for _ in range(num)]
        page_table[r, :num] = pages
        for j, page in enumerate(pages):  # only real slots get values; the rest stay NaN
            used = min(PAGE_SIZE, kv_len - j * PAGE_SIZE)
            k_pages[:, page, :used] = rng.standard_normal((num_kv_heads, used, head_dim))
            v_pages[:, page, :used] = rng.standard_normal((num_kv_heads, used, head_dim))
    cu_q_lens = np.zeros(num_reqs + 1, np.int32)
    cu_q_lens[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu_q_lens[len(q_lens) + 1 :] = cu_q_lens[len(q_lens)]
    num_tokens = int(cu_q_lens[-1]) + pad_tokens
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    kv = np.zeros(num_reqs, np.int32)
    kv[: len(kv_lens)] = kv_lens
    return q, k_pages, v_pages, kv, page_table, cu_q_lens


CASES = {
    "decodes": ([1, 1, 1, 1], [1, 4, 5, 17]),
    "prefills": ([7, 4, 9], [7, 4, 9]),  # kv on and off page boundaries
    "chunk_after_cache": ([5, 3], [13, 8]),
    "mixed_with_empty": ([1, 0, 6, 1, 0, 11], [9, 3, 6, 4, 0, 40]),  # q_len 0, empty context
    "long": ([2, 30], [45, 30]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (6, 2), (8, 2), (3, 1)])
def test_reference_matches_oracle(case, num_q_heads, num_kv_heads):
    rng = np.random.default_rng(hash(case) % 2**32)
    q_lens, kv_lens = CASES[case]
    q, k_pages, v_pages, kv, page_table, cu_q_lens = make_case(rng, q_lens, kv_lens, num_q_heads, num_kv_heads)
    scale = 0.25
    got = np.asarray(ragged_paged_attention(
        q, k_pages, v_pages, kv, page_table, cu_q_lens, sm_scale=scale, impl="reference"
    ))
    want = oracle(q, k_pages, v_pages, kv, page_table, cu_q_lens, scale)
    num_real = int(cu_q_lens[-1])
    np.testing.assert_allclose(got[:num_real], want[:num_real], atol=2e-5, rtol=1e-5)
    assert np.all(got[num_real:] == 0), "padding tokens must come back as zeros"
    assert np.all(np.isfinite(got))


def test_auto_picks_reference_on_cpu_and_unknown_impl_is_rejected():
    assert resolve_impl("auto") == "reference"
    with pytest.raises(ValueError, match="unknown attention impl"):
        resolve_impl("flash")
