"""RoPE's two layouts of a head's rotary dims, and the reordering from one to the other.

Interleaved (GPT-J's; GLM-4's checkpoints, and the Q/K rows of llama.cpp's files) rotates adjacent pairs
(0, 1), (2, 3), ...; rotate-half (HF Llama's, and every attention path here) rotates dim i with dim i + R/2.
Reordering the rows of the query and key projections (and their biases) from the one layout to the other
leaves every q.k unchanged, since both sides move alike: a model of the interleaved kind then runs as a
rotate-half one, and the keys it caches are in that order.
"""

from typing import Any

import numpy as np


def rotate_half_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """i64[head_dim]: the interleaved dim each rotate-half dim takes. The first R/2 take the pairs' first
    dims, the next R/2 their second; dims past R (partial rotary) stay."""
    return np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2), np.arange(rotary_dim, head_dim)])


def to_rotate_half(rows: Any, num_heads: int, rotary_dim: int) -> Any:
    """A projection's output rows (or a bias), [N*H, ...] head by head, from interleaved to rotate-half: an
    array, or anything that takes rows by an index array (an FP8 checkpoint's `Fp8Tensor`, its rows' scales
    moving with them)."""
    head_dim = rows.shape[0] // num_heads
    return rows[(np.arange(num_heads)[:, None] * head_dim + rotate_half_order(head_dim, rotary_dim)).reshape(-1)]
