"""Each token's hidden state kept in pages, as its K/V is, for an EAGLE or MTP drafter (speculative decoding).

An EAGLE drafter (`models/eagle.py`) predicts the token after position j from the token at j + 1 and the
target's final hidden state at j. The target's step writes that state for every token it computes into one
more array of pages beside its layers' K/V, at the token's own slot: the KV cache's last entry, (features,
None), features [1, num_pages, page_size, F]. Kept by page, the states share everything the K/V pages have:
the page tables, prefix-cache hits (a cached page's states are those of the tokens its key names), preemption
(recomputed with the K/V), and the step's donation. The drafter reads them whenever it catches up, not only
right after the step that computed them, so it runs under the scheduler's plans as a draft model does.

The drafter's own cache ends with such an entry too: there, the slot of position j holds the feature its
position j takes in, copied from the target's pages for the positions it catches up on, and written by its
own step at position j - 1 for the drafts it runs ahead on (its output there stands in for the target's).
"""

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.ops.kv_write import write_kv


@dataclass(frozen=True)
class FeaturePages:
    """The trailing entry of a KV cache that keeps hidden states: F values a token in `dtype`."""

    width: int
    dtype: Any

    def shape(self, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
        return (1, num_pages, page_size, self.width)


def feature_pages(cfg: Any, dtype: Any, feature_layers: tuple[int, ...] | None = None) -> FeaturePages | None:
    """The pages of hidden states that the KV cache of a model of config `cfg` (activations in `dtype`) ends
    with (`models/features.py`): an EAGLE or MTP drafter's input features where the model is one; where the
    model keeps features for one (`feature_layers`), its final states (empty) or the inputs of those layers side
    by side; else None."""
    if (width := getattr(cfg, "feature_width", 0)) > 0:
        return FeaturePages(width, jnp.dtype(dtype))
    if feature_layers is None:
        return None
    return FeaturePages(cfg.hidden_size * max(1, len(feature_layers)), jnp.dtype(dtype))


def write_features(
    pages: jax.Array,  # [1, num_pages, page_size, F]
    hidden: jax.Array,  # [T, F]
    slots: jax.Array,  # i32[T]: page_id * page_size + offset; past the cache for padding (dropped)
) -> jax.Array:
    """`pages` with token t's state at slot `slots[t]`."""
    written, _ = write_kv(pages, None, hidden[:, None, :], None, slots)
    return written


def read_features(
    pages: jax.Array,  # [1, num_pages, page_size, F]
    slots: jax.Array,  # i32[T]; past the cache for padding (read as zeros)
) -> jax.Array:  # [T, F]
    """The states at `slots`."""
    flat = pages.reshape(-1, pages.shape[-1])
    return flat.at[slots].get(mode="fill", fill_value=0)
