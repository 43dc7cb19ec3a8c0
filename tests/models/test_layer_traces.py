"""A model's layers go through `layers.apply_layers`: a step's trace traces and lowers each distinct layer once,
and XLA compiles the same program as a plain loop over the layers."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.models import layers, values_are_keys
from jaxserve.models.layers import AttentionMetadata, kv_cache_layers
from jaxserve.models.loader import load_model
from jaxserve.ops.attention import kv_cache_shape

PAGE_SIZE = 4


def _inputs(loaded) -> tuple:
    """One 6-token request over pages 1 and 2 of an 8-page cache: (state, ids, positions, kv, md)."""
    cfg = loaded.cfg
    shape = kv_cache_shape(8, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
    rng = np.random.default_rng(0)
    kv = kv_cache_layers(cfg.num_layers, values_are_keys(cfg),
                         lambda: jnp.asarray(rng.normal(size=shape), jnp.float32))
    md = AttentionMetadata(slot_mapping=np.arange(4, 10, dtype=np.int32), kv_lens=np.array([6], np.int32),
                           page_table=np.array([[1, 2, 0, 0]], np.int32), cu_q_lens=np.array([0, 6], np.int32))
    return loaded.state, np.arange(5, 11, dtype=np.int32), np.arange(6, dtype=np.int32), kv, md


def _forward(graphdef):
    def forward(state, ids, positions, kv, md):  # -> (f32[T, V] logits, the updated cache)
        model = nnx.merge(graphdef, state)
        hidden, kv = model(ids, positions, kv, md)
        return model.compute_logits(hidden), kv

    return jax.jit(forward)


def _layer_type(loaded) -> type:
    model = nnx.merge(loaded.graphdef, loaded.state)
    return type((model.h if hasattr(model, "h") else model.layers)[0])


def _count_layer_calls(monkeypatch, layer_type: type) -> collections.Counter:
    calls: collections.Counter = collections.Counter()
    original = layer_type.__call__

    def counted(self, *args, **kwargs):
        calls["layer"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(layer_type, "__call__", counted)
    return calls


# gpt2 and llama: identical layers; gemma2: windowed, full, windowed; qwen3-moe: experts, dense, experts
@pytest.mark.parametrize("kind, distinct", [("gpt2", 1), ("llama", 1), ("gemma2", 2), ("qwen3-moe", 2)])
def test_a_trace_calls_each_distinct_layer_once(kind, distinct, tiny_model_dir, monkeypatch):
    loaded = load_model(str(tiny_model_dir(kind)), dtype="float32")
    assert loaded.cfg.num_layers > distinct
    calls = _count_layer_calls(monkeypatch, _layer_type(loaded))  # (the patch clears jax's caches: conftest)
    _forward(loaded.graphdef).trace(*_inputs(loaded)).lower()
    assert calls["layer"] == distinct
    _forward(loaded.graphdef).trace(*_inputs(loaded)).lower()  # another step function: its layers kept
    assert calls["layer"] == distinct


def test_the_kernels_environment_is_part_of_a_layer_s_key(tiny_model_dir, monkeypatch):
    """The attention's kernel choice reads JAXSERVE_MOSAIC_* while it traces: a layer traced under one setting
    is not reused under another."""
    loaded = load_model(str(tiny_model_dir("llama")), dtype="float32")
    calls = _count_layer_calls(monkeypatch, _layer_type(loaded))
    _forward(loaded.graphdef).trace(*_inputs(loaded)).lower()
    monkeypatch.setenv("JAXSERVE_MOSAIC_DECODE", "0")
    _forward(loaded.graphdef).trace(*_inputs(loaded)).lower()
    assert calls["layer"] == 2


def _opcodes(hlo: str) -> collections.Counter:
    return collections.Counter(re.findall(r"=\s+\S.*?\s([a-z][a-z0-9\-_]*)\(", hlo))


@pytest.mark.parametrize("kind", ["gpt2", "gemma2"])
def test_xla_compiles_the_plain_loop_s_program(kind, tiny_model_dir, monkeypatch):
    """XLA inlines the layers' calls: the optimized program has the plain loop's instructions (no call left)
    and gives its outputs bit for bit."""
    loaded = load_model(str(tiny_model_dir(kind)), dtype="float32")
    inputs = _inputs(loaded)
    nested = _forward(loaded.graphdef).trace(*inputs).lower().compile()
    monkeypatch.setattr(layers, "_apply_layer", lambda graphdef, _, state, x, kv_cache, kwargs: nnx.merge(
        graphdef, state)(x, kv_cache=kv_cache, **kwargs))
    plain = _forward(loaded.graphdef).trace(*inputs).lower().compile()
    assert _opcodes(nested.as_text())["call"] == 0
    assert _opcodes(nested.as_text()) == _opcodes(plain.as_text())
    for got, want in zip(jax.tree.leaves(nested(*inputs)), jax.tree.leaves(plain(*inputs)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
