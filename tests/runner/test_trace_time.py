"""`trace_time`: what a thread traces and lowers inside a block, nested traces counted once."""

import threading
import time

import jax
import jax.numpy as jnp

from jaxserve.runner import trace_time


def _sleeping(seconds: float):
    """A function whose trace takes at least `seconds` (it sleeps while it is traced)."""

    def f(x):
        time.sleep(seconds)
        return x + 1

    return f


def test_the_outermost_spans_are_summed():
    spans = [(0.0, 10.0), (2.0, 3.0), (4.0, 6.0), (4.5, 5.0), (11.0, 12.0)]
    assert trace_time._outermost_seconds(spans) == 11.0
    assert trace_time._outermost_seconds([]) == 0.0


def test_a_trace_nested_in_another_is_counted_once():
    inner = jax.jit(_sleeping(0.3))
    outer = jax.jit(lambda x: _sleeping(0.1)(inner(x)) * 2)
    with trace_time.measuring() as python:
        outer.trace(jnp.zeros(3)).lower()
    assert 0.4 <= python.trace_seconds < 0.7  # 0.7 and more: the inner trace counted in and beside the outer
    assert python.lower_seconds > 0


def test_a_block_counts_its_own_thread_and_adds_to_the_outer_one():
    with trace_time.measuring() as outer:
        thread = threading.Thread(target=lambda: jax.jit(_sleeping(0.3)).trace(jnp.zeros(2)).lower())
        thread.start()
        thread.join()  # another thread's trace: not this block's
        with trace_time.measuring() as inner:
            jax.jit(_sleeping(0.2)).trace(jnp.zeros(2)).lower()
    assert 0.2 <= inner.trace_seconds < 0.45  # 0.5 and more: the other thread's trace counted in
    assert outer.trace_seconds == inner.trace_seconds and outer.lower_seconds == inner.lower_seconds > 0
    with trace_time.measuring() as nothing:
        pass
    assert nothing == trace_time.TraceTime(0.0, 0.0)
