"""Weights loaded on a thread while the steps compile (`load_model(in_background=True)`, the engine core's
way): the plain load's weights, the first bucket compiled before they are in and the same greedy tokens,
the load's errors raised at start-up, weights other than those compiled for refused, and what cannot be
known before reading the file loaded as before."""

import logging
import threading
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import loader
from jaxserve.models.loader import load_model
from jaxserve.ops import cpu_kernels
from jaxserve.runner.model_runner import ModelRunner
from tests.engine.helpers import make_engine, make_prompts, run_alone
from tests.helpers import startup_phases


def _assert_same_weights(plain, background) -> None:
    assert jax.tree.structure(plain.state) == jax.tree.structure(background.state)
    for want, got in zip(jax.tree.leaves(plain.state), jax.tree.leaves(background.state), strict=True):
        assert isinstance(got, jax.Array) and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


@pytest.mark.parametrize("options", [{}, {"quantization": "fp8"}, {"load_format": "dummy"},
                                     {"weight_dtype": "bfloat16"}], ids=["float32", "fp8", "dummy", "bfloat16"])
def test_a_background_load_gives_the_plain_load_s_weights(llama_dir, options, caplog):
    plain = load_model(str(llama_dir), "float32", **options)
    with caplog.at_level(logging.INFO, "jaxserve.models"):  # the load logs on its thread
        background = load_model(str(llama_dir), "float32", in_background=True, **options)
        assert background.loading is not None
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(background.state))  # their shapes
        assert background.wait_for_weights() >= 0 and background.loading is None
    _assert_same_weights(plain, background)
    assert startup_phases()["load_s"].search(caplog.text)  # what was loaded and in how long, dummy draws too
    assert background.wait_for_weights() == 0.0  # in already


@pytest.mark.cpu_only("the native CPU kernels")
@pytest.mark.skipif(cpu_kernels.kernel_error() is not None, reason=str(cpu_kernels.kernel_error()))
def test_a_gguf_s_kept_blocks_load_before_the_model_returns(smollm2_gguf):
    """Which tensors stay in their blocks, and in which format, is read from the file: no shapes to compile
    for before it is read."""
    model = load_model(str(smollm2_gguf), quantization="gguf", in_background=True)
    assert model.loading is None and all(not isinstance(x, jax.ShapeDtypeStruct)
                                         for x in jax.tree.leaves(model.state))


@pytest.mark.gpu  # on a GPU, the KV cache is allocated once the weights are in: that path runs there
def test_the_first_bucket_compiles_while_the_weights_load_and_serves_the_same_tokens(llama_dir, monkeypatch,
                                                                                       caplog):
    """The load is held until the warm-up has compiled a bucket: an engine that waited for its weights before
    compiling would never compile one (and the held load would give up after two minutes). The log says how
    long the load took and how long the start waited for it, as `benchmarks/startup.py` reads them."""
    reference = make_engine(llama_dir, model=load_model(str(llama_dir), "float32"))  # loaded first
    compiled = threading.Event()
    compile_one = ModelRunner._compile_one

    def compile_and_tell(self, job, slots):
        result = compile_one(self, job, slots)
        compiled.set()
        return result

    held = []
    load_tensors = loader._load_tensors

    def load_after_a_compile(*args, **kwargs):
        held.append(compiled.wait(timeout=120))
        return load_tensors(*args, **kwargs)

    monkeypatch.setattr(ModelRunner, "_compile_one", compile_and_tell)
    monkeypatch.setattr(loader, "_load_tensors", load_after_a_compile)
    with caplog.at_level(logging.INFO, "jaxserve"):
        background = make_engine(llama_dir)
    assert held == [True]
    phases = startup_phases()
    assert phases["load_s"].search(caplog.text) and phases["weights_wait_s"].search(caplog.text)
    assert background.model.loading is None  # in before the engine was
    for prompt in make_prompts(3):
        assert run_alone(background, prompt, 12) == run_alone(reference, prompt, 12)


@pytest.mark.parametrize("warmup", [True, False])
def test_a_failed_load_fails_the_start_with_its_error(llama_dir, monkeypatch, warmup):
    def broken(*args, **kwargs):
        assert threading.current_thread().name == "jaxserve-weights"  # beside the compiles
        raise ValueError("checkpoint is missing weights for ('layers', 'attn', 'q_proj')")

    monkeypatch.setattr(loader, "_load_tensors", broken)
    with pytest.raises(ValueError, match="checkpoint is missing weights"):
        make_engine(llama_dir, warmup=warmup)


def test_weights_other_than_those_compiled_for_are_refused(llama_dir):
    model = load_model(str(llama_dir), "float32", in_background=True)
    state, kv_scales = model.loading.result()
    widened = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state)  # the same structure, another dtype
    model.loading = Future()
    model.loading.set_result((widened, kv_scales))
    with pytest.raises(RuntimeError, match="was compiled for"):
        model.wait_for_weights()
    assert model.loading is not None  # not taken


@pytest.mark.gpu
def test_a_start_that_fails_stops_its_load(llama_dir, monkeypatch):
    """A start that fails while its weights load (no room for a KV cache, say) stops the load at the next
    tensor and waits for its thread, so no load goes on beside whatever the caller does next."""
    first_loaded, runner_built, stopping = threading.Event(), threading.Event(), []

    def runner_that_fails(self, model, *args, **kwargs):
        stopping.append(model.stop_loading)
        runner_built.set()
        assert first_loaded.wait(timeout=60)
        raise RuntimeError("no room for a KV cache")

    taken = []
    iter_safetensors = loader.iter_safetensors

    def tensors(directory):
        for name, tensor in iter_safetensors(directory):
            if taken:  # asked for a second: the first is loaded; the rest once the start has stopped the load
                first_loaded.set()
                assert runner_built.wait(timeout=60) and stopping[0].wait(timeout=60)
            taken.append(name)
            yield name, tensor

    monkeypatch.setattr(ModelRunner, "__init__", runner_that_fails)
    monkeypatch.setattr(loader, "iter_safetensors", tensors)
    with pytest.raises(RuntimeError, match="no room for a KV cache"):
        make_engine(llama_dir)
    assert len(taken) == 2  # the first loaded; the second taken, then the stop seen
    assert not [thread for thread in threading.enumerate() if thread.name == "jaxserve-weights"]
