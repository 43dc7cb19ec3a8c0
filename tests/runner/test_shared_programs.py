"""Runners made alike in one process share their step functions (`step_fn._shared`) while one holds them,
and with them what JAX holds for those: an engine made again (an `LLM` in a notebook cell run twice) traces
and compiles nothing, says so, and generates what the first one did. Runners that differ in anything the
step is traced from get programs of their own."""

import gc
import logging
import weakref

import jax

from jaxserve.runner import compile_origin
from jaxserve.runner.model_runner import PLAIN
from jaxserve.runner.step_fn import make_decode_steps_fn, make_sample_fn, make_step_fn
from tests.engine.helpers import make_engine, make_prompts
from tests.helpers import count_compilations
from tests.runner.test_background_warmup import run_all


def test_an_engine_made_again_compiles_nothing_and_generates_the_same_tokens(llama_dir, caplog):
    first = make_engine(llama_dir)
    want = run_all(first, make_prompts(), max_tokens=8)
    first.shutdown()
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.model_runner"), count_compilations() as compiles:
        again = make_engine(llama_dir)
        assert run_all(again, make_prompts(), max_tokens=8) == want
    assert compiles == [], "the second engine's warm-up or steps reached XLA"
    assert again.runner._step_fns[PLAIN] is first.runner._step_fns[PLAIN]
    buckets = len(again.runner.ladder.all_buckets())
    assert f"compiled {buckets} buckets on " in caplog.text
    assert f", 0 from the persistent cache, {buckets} {compile_origin.KEPT}" in caplog.text
    assert "jax traced their steps for 0.0s and lowered them for 0.0s" in caplog.text  # nor traced anything
    again.shutdown()


def test_what_the_step_is_traced_from_keys_its_function(llama_dir, monkeypatch):
    runner = make_engine(llama_dir, warmup=False).runner
    graphdef, treedef = runner.model.graphdef, jax.tree.structure(runner.model.state)
    step = make_step_fn(graphdef, treedef, 5)
    assert make_step_fn(graphdef, treedef, num_top_logprobs=5) is step  # however the arguments are passed
    assert make_step_fn(graphdef, treedef, 6) is not step
    assert make_step_fn(graphdef, treedef, 5, greedy=True) is not step
    assert make_step_fn(graphdef, treedef, 5, compiler_options={"xla_gpu_enable_command_buffer": ""}) is not step
    monkeypatch.setenv("JAXSERVE_MOSAIC_DECODE", "0")  # read by the attention's code while tracing
    assert make_step_fn(graphdef, treedef, 5) is not step
    monkeypatch.delenv("JAXSERVE_MOSAIC_DECODE")
    assert make_step_fn(graphdef, treedef, 5) is step
    steps = make_decode_steps_fn(graphdef, treedef, 5, 4, runner.page_size, 1024)
    assert make_decode_steps_fn(graphdef, treedef, 5, 4, runner.page_size, 1024) is steps
    assert make_decode_steps_fn(graphdef, treedef, 5, 8, runner.page_size, 1024) is not steps
    assert make_decode_steps_fn(graphdef, treedef, 5, 4, runner.page_size, 2048) is not steps
    assert make_sample_fn(5, 8) is make_sample_fn(5, 8)
    sampler = make_sample_fn(5, 16)
    held = weakref.ref(sampler)
    del sampler
    gc.collect()
    assert held() is None, "a function no runner holds is not kept"
    assert make_sample_fn(5, 8, mesh=["unhashable"]) is not make_sample_fn(5, 8, mesh=["unhashable"])  # not shared


def test_the_origin_of_a_compile_is_where_its_executable_came_from(tmp_path):
    """XLA's compile, a persistent-cache load, or nothing reaching XLA: told apart per thread."""
    def program(x):
        return x * 3.0 + 1.0

    jitted = jax.jit(program)
    x = jax.numpy.arange(7.0)
    with compile_origin.counting() as origin:
        jitted.trace(x).lower().compile()
    assert origin() in (compile_origin.COMPILED, compile_origin.LOADED)  # the suite's cache may hold it
    with compile_origin.counting() as origin:
        jitted.trace(x).lower().compile()
    assert origin() == compile_origin.KEPT
    with compile_origin.counting() as origin:
        jax.jit(lambda x: x * 5.0 - 2.0).trace(jax.numpy.arange(11.0)).lower().compile()
    assert origin() in (compile_origin.COMPILED, compile_origin.LOADED)
    with compile_origin.counting() as outer:
        with compile_origin.counting() as inner:
            jax.jit(lambda x: x * 7.0 + 3.0).trace(jax.numpy.arange(13.0)).lower().compile()
        jitted.trace(x).lower().compile()  # kept: the outer block's own compile adds nothing
    assert inner() in (compile_origin.COMPILED, compile_origin.LOADED) and outer() == inner()
    assert compile_origin.worst(compile_origin.KEPT, compile_origin.LOADED) == compile_origin.LOADED
    assert compile_origin.worst(compile_origin.LOADED, compile_origin.COMPILED) == compile_origin.COMPILED
