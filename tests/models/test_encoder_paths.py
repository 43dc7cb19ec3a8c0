"""An encoder's two ways to attend (`models/bert.py`): one dense product over the step masked to each prompt, and
the paged kernels with each token a request of one query over its prompt's pages (`each_token_a_row`), on every
attention path a CPU runs, against each other and a float64 oracle: prompts packed back to back, padding after."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.bert import each_token_a_row
from jaxserve.models.layers import AttentionMetadata, paged_attention
from jaxserve.ops.attention import resolve_attention
from jaxserve.ops.encoder_attention import encoder_attention, token_rows
from tests.ops.test_encoder_attention import _oracle

PAGE = 4


def _packed(lengths: list[int], num_tokens: int, num_rows: int):
    """The step's metadata for prompts of `lengths` in pages of 4 (request rows past them empty), its pages."""
    cu_q_lens = np.zeros(num_rows + 1, np.int32)
    cu_q_lens[1:len(lengths) + 1] = np.cumsum(lengths)
    cu_q_lens[len(lengths) + 1:] = cu_q_lens[len(lengths)]
    width = max(-(-n // PAGE) for n in lengths)
    num_pages = sum(-(-n // PAGE) for n in lengths) + 1  # the last one: padding's
    page_table = np.zeros((num_rows, width), np.int32)
    slots = np.full(num_tokens, (num_pages - 1) * PAGE, np.int32)
    first = 0
    for row, n in enumerate(lengths):
        pages = np.arange(first, first + -(-n // PAGE))
        page_table[row, :len(pages)] = pages
        slots[cu_q_lens[row]:cu_q_lens[row] + n] = pages[np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
        first += len(pages)
    kv_lens = np.zeros(num_rows, np.int32)
    kv_lens[:len(lengths)] = lengths
    md = AttentionMetadata(*(jnp.asarray(x) for x in (slots, kv_lens, page_table, cu_q_lens)))
    return md, cu_q_lens[:len(lengths) + 1].tolist(), num_pages


@pytest.mark.parametrize("impl", ["cpu-native", "cpu", "reference"])
def test_the_paged_way_is_the_dense_way(impl):
    if impl == "cpu-native" and resolve_attention("auto").impl != "cpu-native":
        pytest.skip("the native CPU kernels are not built here")
    heads, dims, num_tokens = 2, 8, 40
    lengths = [5, 1, 13, 9]  # 28 tokens of 4 prompts in 6 request rows, 12 of padding
    md, cu_q_lens, num_pages = _packed(lengths, num_tokens, num_rows=6)
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(num_tokens, heads, dims)) for _ in range(3))
    rows = token_rows(md.cu_q_lens, num_tokens)
    inputs = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    cache = tuple(jnp.zeros((heads, num_pages, PAGE, dims), jnp.float32) for _ in range(2))
    paged, _ = paged_attention(*inputs, cache, each_token_a_row(md, rows), attention=resolve_attention(impl))
    dense = encoder_attention(*inputs, rows)
    expected = _oracle(q, k, v, cu_q_lens)[:28]
    np.testing.assert_allclose(np.asarray(paged)[:28], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dense)[:28], expected, rtol=1e-5, atol=1e-5)
