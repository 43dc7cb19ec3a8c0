"""The collector's thresholds while steps are traced (jaxserve/collector.py): raised inside, restored by the
last thread to leave, and raised while an engine loads and warms up."""

import gc
import threading

import pytest

from jaxserve.collector import START_UP_THRESHOLD, fewer_collections


@pytest.fixture(autouse=True)
def default_thresholds():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def test_the_young_threshold_is_raised_inside_and_restored_after():
    with fewer_collections():
        assert gc.get_threshold() == (START_UP_THRESHOLD, 10, 10)
        with fewer_collections():
            assert gc.get_threshold()[0] == START_UP_THRESHOLD
        assert gc.get_threshold()[0] == START_UP_THRESHOLD  # the outer one is still inside
    assert gc.get_threshold() == (700, 10, 10)


def test_a_higher_threshold_set_before_is_kept():
    gc.set_threshold(10**6, 10, 10)
    with fewer_collections():
        assert gc.get_threshold()[0] == 10**6
    assert gc.get_threshold() == (10**6, 10, 10)


def test_overlapping_threads_restore_once_the_last_leaves():
    """Two starts that overlap, leaving in the order they did not enter: the thresholds come back only when
    both have left, and as they were before the first."""
    first_in, second_in, first_may_leave = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first() -> None:
        with fewer_collections():
            first_in.set()
            first_may_leave.wait(10)
        seen["after the first left"] = gc.get_threshold()[0]

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(10)
    with fewer_collections():
        second_in.set()
        first_may_leave.set()
        thread.join(10)
        seen["while the second is inside"] = gc.get_threshold()[0]
    assert seen == {"after the first left": START_UP_THRESHOLD, "while the second is inside": START_UP_THRESHOLD}
    assert gc.get_threshold() == (700, 10, 10)


def test_an_exception_inside_restores_too():
    with pytest.raises(RuntimeError), fewer_collections():
        raise RuntimeError("a start that fails")
    assert gc.get_threshold() == (700, 10, 10)


def test_an_engine_loads_and_warms_up_under_the_raised_threshold(llama_dir, monkeypatch):
    from jaxserve.engine import core
    from jaxserve.runner.model_runner import ModelRunner
    from tests.engine.helpers import make_engine

    seen = {}
    load, warmup = core.load_model, ModelRunner.warmup

    def loading(*args, **kwargs):
        seen["load"] = gc.get_threshold()[0]
        return load(*args, **kwargs)

    def warming_up(self, *args, **kwargs):
        seen["warm-up"] = gc.get_threshold()[0]
        return warmup(self, *args, **kwargs)

    monkeypatch.setattr(core, "load_model", loading)
    monkeypatch.setattr(ModelRunner, "warmup", warming_up)
    make_engine(llama_dir, token_buckets=(16,), request_buckets=(1,), max_num_seqs=1, max_num_batched_tokens=16)
    assert seen == {"load": START_UP_THRESHOLD, "warm-up": START_UP_THRESHOLD}
    assert gc.get_threshold() == (700, 10, 10)


def test_lists_are_emptied_a_slice_at_a_time():
    """Each call frees at most a slice: a long list's free is many short calls, between which other threads run."""
    from jaxserve import collector

    slices = []

    class Recorded(list):
        def __delitem__(self, key: slice) -> None:
            slices.append(len(self[key]))
            super().__delitem__(key)

    items, other = Recorded(object() for _ in range(1000)), Recorded(range(3))
    collector.empty_in_pieces(items, other)
    assert items == [] and other == []
    assert slices == [256, 256, 256, 232, 3]
