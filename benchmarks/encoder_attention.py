"""One encoder layer's attention on this CPU, both ways `models/bert.py` attends: one dense product over the step
masked to each prompt (`ops.encoder_attention`), and the paged kernels with each token a request of one query
over its prompt's pages (`bert.each_token_a_row`), float32, 12 heads of 32 (all-MiniLM-L6-v2's), pages of 16.
Prints each case's time a call (the mean of 20, after one) and the two ways' largest difference.

    python -m benchmarks.encoder_attention
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.bert import each_token_a_row
from jaxserve.models.layers import AttentionMetadata, paged_attention
from jaxserve.ops.attention import resolve_attention
from jaxserve.ops.encoder_attention import encoder_attention, token_rows

HEADS, DIMS, PAGE = 12, 32, 16
CASES = [(512, [256] * 2), (512, [128] * 4), (512, [100] * 5), (512, [68] * 7), (2048, [500] * 4),
         (2048, [128] * 16), (2048, [68] * 30)]


def _case(attention, num_tokens: int, lengths: list[int]) -> None:
    rng = np.random.default_rng(0)
    cu_q_lens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    pages = [-(-n // PAGE) for n in lengths]
    num_pages = sum(pages) + 1  # the last one: padding's
    page_table = np.zeros((len(lengths), 512 // PAGE), np.int32)
    slots = np.full(num_tokens, (num_pages - 1) * PAGE, np.int32)
    first = 0
    for row, n in enumerate(lengths):
        page_table[row, :pages[row]] = np.arange(first, first + pages[row])
        slots[cu_q_lens[row]:cu_q_lens[row] + n] = page_table[row, np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
        first += pages[row]
    md = AttentionMetadata(*(jnp.asarray(x) for x in (slots, np.asarray(lengths, np.int32), page_table, cu_q_lens)))
    q, k, v = (jnp.asarray(rng.normal(size=(num_tokens, HEADS, DIMS)), jnp.float32) for _ in range(3))
    cache = tuple(jnp.zeros((HEADS, num_pages, PAGE, DIMS), jnp.float32) for _ in range(2))
    rows = token_rows(md.cu_q_lens, num_tokens)
    dense = jax.jit(lambda q, k, v: encoder_attention(q, k, v, rows))
    paged = jax.jit(lambda q, k, v, c: paged_attention(q, k, v, c, each_token_a_row(md, rows), attention=attention)[0])
    real = int(cu_q_lens[-1])
    difference = float(jnp.abs(dense(q, k, v)[:real] - paged(q, k, v, cache)[:real]).max())
    times = {}
    for name, call in (("dense", lambda: dense(q, k, v)), ("paged", lambda: paged(q, k, v, cache))):
        call().block_until_ready()
        start = time.perf_counter()
        for _ in range(20):
            call().block_until_ready()
        times[name] = (time.perf_counter() - start) / 20 * 1e3
    print(f"{num_tokens:5d} tokens, {len(lengths):2d} x {lengths[0]:3d}: dense {times['dense']:7.2f} ms, "
          f"paged {times['paged']:7.2f} ms, largest difference {difference:.1e}")


def main() -> None:
    attention = resolve_attention("auto")
    print(f"attention: {attention.impl}")
    for num_tokens, lengths in CASES:
        _case(attention, num_tokens, lengths)


if __name__ == "__main__":
    main()
