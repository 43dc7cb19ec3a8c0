"""The Mosaic GPU W8A8 block kernel (`ops/fp8_block_matmul_mgpu.py`): against float64 over its own e4m3 operands,
on a Hopper GPU or in Mosaic GPU's interpreter (jax >= 0.11); and compiled deviceless for an H100, where its PTX
must multiply e4m3 by e4m3 on wgmma and assemble without spills (jax >= 0.12, which compiles Mosaic GPU kernels
without a GPU)."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.bench.ptxas import find_ptxas, ptx_modules, ptxas_figures, tensor_core_instructions
from jaxserve.models.quantization import quantize_rows
from jaxserve.ops import fp8_block_matmul_mgpu as kernel
from jaxserve.ops.attention import AttentionConfig, cuda_compute_capability

ON_HOPPER = AttentionConfig(impl="pallas", compute_capability=cuda_compute_capability()).hopper
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (ON_HOPPER or jax.__version_info__ >= (0, 11)),
                       reason="the kernel runs on a Hopper GPU, or in Mosaic GPU's interpreter from jax 0.11 "
                              "(this is jax 0.10)"),
]
FP8 = jnp.float8_e4m3fn


def operands(rows: int, k: int, n: int, seed: int = 0):
    """(x in e4m3, its scales f32[rows, k / 128], values_t e4m3[n, k], scale f32[k / 128, n], x in float32),
    x's rows and scales from `quantize_rows`, the weight's values spread over e4m3's range."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, k)) * rng.uniform(0.1, 10, (rows, 1)), jnp.float32)
    xq, x_scale = quantize_rows(x, kernel.BLOCK)
    values_t = jnp.asarray(rng.standard_normal((n, k)) * 60, jnp.float32).astype(FP8)
    scale = jnp.asarray(rng.uniform(1e-4, 1e-3, (k // kernel.BLOCK, n)), jnp.float32)
    return xq, x_scale, values_t, scale, x


def oracle(xq, x_scale, values_t, scale) -> np.ndarray:
    """float64 [rows, n]: each operand's e4m3 values times its own block's scale, multiplied."""
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    x = f64(xq) * np.repeat(f64(x_scale), kernel.BLOCK, axis=1)
    w = f64(values_t) * np.repeat(f64(scale).T, kernel.BLOCK, axis=1)  # [n, k]
    return x @ w.T


def run(*args, **kwargs) -> jax.Array:
    return kernel.fp8_block_matmul_mgpu(*args, kernel.BLOCK, interpret=not ON_HOPPER, **kwargs)


@pytest.mark.parametrize(("rows", "k", "n", "consumers", "stages", "ping_pong", "num_sms"), [
    (70, 256, 128, 2, 4, True, 132),  # rows padded to a tile; fewer blocks than stages
    (1, 512, 64, 1, 2, False, 132),  # a decode's row, the narrow output tile, the ring cycled twice
    (130, 384, 192, 2, 2, True, 132),  # two row tiles of 128, outputs a multiple of 64 only
    (256, 1024, 256, 2, 3, True, 132),  # eight blocks through three stages, the consumers taking turns
    (256, 1024, 256, 2, 3, True, 1),  # the same in output tiles of 128 (one multiprocessor to fill)
    (256, 1024, 256, 2, 3, False, 1),  # and the consumers walking the stages side by side
    (128, 384, 128, 2, 1, True, 132),  # one stage refilled: side by side (turns there would deadlock)
    (128, 128, 128, 2, 1, True, 132),  # one stage, one block: turns
])
def test_the_kernel_matches_float64_over_its_own_operands(rows, k, n, consumers, stages, ping_pong, num_sms):
    """Every block's product scaled by its rows' and its outputs' own scales before the blocks are summed:
    float32 sums within float32's rounding of the float64 product."""
    assert kernel.block_n_for(rows, n, 64 * consumers, num_sms) == (128 if num_sms == 1 else 64)
    xq, x_scale, values_t, scale, _ = operands(rows, k, n)
    got = run(xq, x_scale, values_t, scale, out_dtype=jnp.float32, consumers=consumers, stages=stages,
              ping_pong=ping_pong, num_sms=num_sms)
    want = oracle(xq, x_scale, values_t, scale)
    assert got.shape == (rows, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_bfloat16_outputs_and_rows_in_e4m3_track_the_unquantized_product():
    """The default output (bfloat16) rounds the float32 sum once; and the rows rounded to e4m3 with a scale per
    row and block (`quantize_rows`) keep the product within a few percent of the rows unrounded."""
    xq, x_scale, values_t, scale, x = operands(96, 512, 128, seed=1)
    got = np.asarray(run(xq, x_scale, values_t, scale).astype(jnp.float32), np.float64)
    want = oracle(xq, x_scale, values_t, scale)
    np.testing.assert_allclose(got, want, rtol=1 / 128, atol=1e-3 * np.abs(want).max())
    w = np.asarray(values_t.astype(jnp.float32), np.float64) * np.repeat(np.asarray(scale, np.float64).T,
                                                                          kernel.BLOCK, axis=1)
    unrounded = np.asarray(x, np.float64) @ w.T
    assert np.abs(got - unrounded).mean() < 0.05 * np.abs(unrounded).mean()


@pytest.mark.skipif(not ON_HOPPER, reason="a served shape on a Hopper GPU (the interpreter takes minutes at it)")
def test_a_served_shape_on_hopper():
    """Llama-3-8B's q projection at 2,048 rows: 32 blocks through the default ring of stages, on the device."""
    xq, x_scale, values_t, scale, _ = operands(2048, 4096, 4096)
    got = run(xq, x_scale, values_t, scale, out_dtype=jnp.float32)
    want = oracle(xq, x_scale, values_t, scale)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_what_the_kernel_refuses():
    xq, x_scale, values_t, scale, x = operands(8, 256, 128)
    assert kernel.fits(256, 128, 128) and not kernel.fits(256, 128, 64) and not kernel.fits(320, 128, 128)
    assert not kernel.fits(256, 96, 128)
    bad = [
        (x, x_scale, values_t, scale, 128),  # rows not in e4m3
        (xq, x_scale, values_t.astype(jnp.bfloat16), scale, 128),  # a weight not in e4m3
        (xq, x_scale, values_t.T, scale, 128),  # a weight stored [K, N]
        (xq, x_scale[:, :1], values_t, scale, 128),  # a scale short for the rows
        (xq, x_scale, values_t, scale[:1], 128),  # a scale short for the weight
        (xq, x_scale, values_t, scale, 64),  # a block other than 128
    ]
    for args in bad:
        with pytest.raises(ValueError, match="fp8_block_matmul_mgpu"):
            kernel.fp8_block_matmul_mgpu(*args, interpret=True)


_COMPILE_FOR_H100 = """
import jax, jax.numpy as jnp
from jaxserve.device import deviceless_device
from jaxserve.ops.fp8_block_matmul_mgpu import fp8_block_matmul_mgpu
from jaxserve.parallel import on_one_device

placed = on_one_device(deviceless_device("h100"))
struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=placed)
rows, k, n = 2048, 4096, 4096
args = [struct((rows, k), jnp.float8_e4m3fn), struct((rows, k // 128), jnp.float32),
        struct((n, k), jnp.float8_e4m3fn), struct((k // 128, n), jnp.float32)]
product = lambda *a: fp8_block_matmul_mgpu(*a, 128, ping_pong=PING_PONG)
jax.jit(product).trace(*args).lower(lowering_platforms=("cuda",)).compile()
"""


@pytest.mark.skipif(jax.default_backend() != "cpu" or jax.__version_info__ < (0, 12),
                    reason="a deviceless compile that prints Mosaic GPU's PTX: jax >= 0.12 without a GPU")
@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas here (the gpu-compile extra or a CUDA toolkit has one)")
@pytest.mark.parametrize("ping_pong", [True, False])
def test_it_compiles_for_an_h100_to_fp8_wgmma_without_spills(ping_pong):
    """Llama-3-8B's q projection at 2,048 rows, compiled for an H100 with Mosaic GPU printing its PTX: each block
    of 128 contracted columns is four e4m3 x e4m3 wgmmas of 64 x 128 x 32 with float32 sums (the FP8 rate: no
    widened operand), and ptxas assembles the kernel for sm_90a without spilling to local memory, with the
    consumers taking turns or not."""
    script = f"PING_PONG = {ping_pong}\n" + textwrap.dedent(_COMPILE_FOR_H100)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MOSAIC_GPU_DUMP_PTX": "1",
                                            "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    (ptx,) = ptx_modules(done.stdout)
    assert tensor_core_instructions(ptx) == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3": 4}
    (figures,) = ptxas_figures(ptx)
    assert figures.registers > 0
    assert figures.spill_store_bytes == figures.spill_load_bytes == figures.stack_bytes == 0, figures
