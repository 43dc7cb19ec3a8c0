"""The EAGLE drafters' pieces alone (`models/eagle.py`, `models/eagle3.py`, `models/features.py`): where each
token writes the feature of the position after it, and how checkpoint names map (the engine tests hold the
drafts to float64 references: tests/engine/test_eagle.py)."""

import jax.numpy as jnp
import numpy as np

from jaxserve.models.eagle import is_eagle_checkpoint, map_eagle_weight, next_slots
from jaxserve.models.eagle3 import is_eagle3_checkpoint, map_eagle3_weight
from jaxserve.models.features import read_features, write_features
from jaxserve.models.layers import AttentionMetadata


def test_each_token_writes_the_slot_of_the_position_after_it():
    """Two requests of pages of 4: a token at the end of a page writes the first slot of the request's next
    page; padding tokens, and a position past the request's page table, write past the cache (dropped)."""
    num_pages, page = 10, 4
    page_table = jnp.array([[7, 2, 0], [5, 9, 0]], jnp.int32)  # request 0's pages 7, 2; request 1's 5, 9
    positions = jnp.array([2, 3, 4, 2, 3, 11, 0], jnp.int32)
    rows = [0, 0, 0, 1, 1, 1]
    slots = [int(page_table[r, p // page]) * page + p % page for r, p in zip(rows, positions[:6].tolist(), strict=True)]
    padding = num_pages * page
    md = AttentionMetadata(slot_mapping=jnp.array([*slots, padding], jnp.int32), kv_lens=jnp.array([5, 12]),
                           page_table=page_table, cu_q_lens=jnp.array([0, 3, 6], jnp.int32))
    after = next_slots(md, positions, num_pages, page).tolist()
    # request 0: 2 -> 3 (page 7), 3 -> 4 (page 2's first), 4 -> 5; request 1: 2 -> 3 (page 5), 3 -> 4 (page 9's
    # first), 11 -> 12: page index 3, past the table (three pages wide): dropped; padding: dropped
    assert after == [7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 5 * 4 + 3, 9 * 4 + 0, padding, padding]


def test_features_are_written_and_read_by_slot():
    pages = jnp.zeros((1, 3, 2, 4), jnp.float32)
    hidden = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    written = write_features(pages, hidden, jnp.array([5, 0, 6], jnp.int32))  # 6: past the cache, dropped
    np.testing.assert_array_equal(read_features(written, jnp.array([0, 5, 6], jnp.int32)),
                                  [hidden[1], hidden[0], np.zeros(4)])


def test_checkpoint_names_of_both_formats():
    eagle1 = ["fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "embed_tokens.weight"]
    eagle3 = ["midlayer.self_attn.q_proj.weight", "fc.weight", "d2t", "t2d", "norm.weight", "lm_head.weight"]
    assert is_eagle_checkpoint(eagle1) and is_eagle_checkpoint(eagle3)
    assert not is_eagle_checkpoint(["model.layers.0.self_attn.q_proj.weight", "lm_head.weight"])
    assert not is_eagle3_checkpoint(eagle1) and is_eagle3_checkpoint(eagle3)
    assert map_eagle_weight("fusion_fc.weight", None)[0] == ("fc",)  # the speculators library's name
    assert map_eagle_weight("model.fc.bias", None)[0] == ("fc_bias",)
    assert map_eagle_weight("embed_tokens.weight", None) is None  # the target's
    assert map_eagle_weight("layers.0.input_layernorm.weight", None) is None  # EAGLE's first layer has none
    assert map_eagle3_weight("midlayer.hidden_norm.weight", None)[0] == ("layers", 0, "hidden_norm", "scale")
    assert map_eagle3_weight("t2d", None) is None
    path, transform = map_eagle3_weight("d2t", None)
    assert path == ("draft_to_target",)
    np.testing.assert_array_equal(transform(np.array([5, 5, 7]), None), [5, 6, 9])  # draft id + offset


def test_a_decode_step_s_token_r_is_row_r_s():
    """Decode-only steps (one token a row, token r row r's; the multi-step loop's too): each row's page table."""
    page_table = jnp.array([[3, 1], [6, 2], [0, 0]], jnp.int32)
    positions = jnp.array([3, 1, 0], jnp.int32)  # row 2: padding
    md = AttentionMetadata(slot_mapping=jnp.array([3 * 4 + 3, 6 * 4 + 1, 8 * 4], jnp.int32),
                           kv_lens=jnp.array([4, 2, 0]), page_table=page_table,
                           cu_q_lens=jnp.array([0, 1, 2, 2], jnp.int32), decode_only=True)
    assert next_slots(md, positions, 8, 4).tolist() == [1 * 4 + 0, 6 * 4 + 2, 8 * 4]
