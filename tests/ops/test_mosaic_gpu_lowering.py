"""Mosaic GPU's lowering asks jaxlib for ptxas's PTX ISA version at each narrow-type conversion, and jaxlib
runs ptxas for each answer: jaxserve remembers it for the process (ops/mosaic_gpu_lowering.py)."""

from collections.abc import Callable
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from jaxserve.ops.mosaic_gpu_lowering import remember_ptxas_version
from jaxserve.ops.paged_attention_mgpu import config_for, ragged_paged_attention_mgpu
from tests.ops.test_paged_attention_mgpu import FP8, h100_kernel_args


def _counted(answer: object, calls: list) -> Callable[[], object]:
    def query():
        calls.append(1)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return query


def test_the_version_is_asked_once_and_a_failure_is_not_remembered():
    calls = []
    extension = SimpleNamespace(_get_ptxas_isa_version=_counted(90, calls))
    assert remember_ptxas_version(extension)
    assert [extension._get_ptxas_isa_version() for _ in range(5)] == [90] * 5
    assert len(calls) == 1
    remembered = extension._get_ptxas_isa_version
    assert remember_ptxas_version(extension) and extension._get_ptxas_isa_version is remembered  # not wrapped again
    failing = SimpleNamespace(_get_ptxas_isa_version=_counted(RuntimeError("no ptxas"), calls := []))
    remember_ptxas_version(failing)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="no ptxas"):
            failing._get_ptxas_isa_version()
    assert len(calls) == 2, "a failed query is asked again, as jaxlib's own would be"
    assert not remember_ptxas_version(SimpleNamespace())  # a jaxlib laid out otherwise: nothing changed


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a deviceless lowering: on a machine without a GPU")
def test_lowering_the_hopper_kernel_runs_ptxas_once(monkeypatch):
    """An FP8 cache's mixed-step kernel at Llama-3-8B's heads converts booleans and e4m3 values dozens of
    times; lowered for an H100, it asks jaxlib's ptxas query once (it asked once per conversion before)."""
    from jax._src.lib import mosaic_gpu

    extension = mosaic_gpu._mosaic_gpu_ext
    assert hasattr(extension._get_ptxas_isa_version, "cache_info"), "remembered once the kernel's module is in"
    calls = []
    asked = extension._get_ptxas_isa_version.__wrapped__
    monkeypatch.setattr(extension, "_get_ptxas_isa_version", _counted(asked(), calls))
    assert remember_ptxas_version()
    structs, head_dim = h100_kernel_args("llama-3-8b", 512, 64, 16)
    structs[1:3] = [jax.ShapeDtypeStruct(structs[1].shape, FP8, sharding=structs[1].sharding)] * 2
    config = config_for(False, jnp.bfloat16, FP8, 32, 8, head_dim, 16)
    fn = jax.jit(lambda *a: ragged_paged_attention_mgpu(*a, sm_scale=head_dim**-0.5, **config))
    assert "mosaic_gpu" in fn.trace(*structs).lower(lowering_platforms=("cuda",)).as_text()
    assert len(calls) == 1
