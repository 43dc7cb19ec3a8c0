"""The native bfloat16 matmuls and K/V write against float64 and jnp oracles (`jaxserve.ops.cpu_kernels`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxlib.version import __version_info__ as JAXLIB_VERSION

from jaxserve.ops import cpu_kernels, kernel_build
from jaxserve.ops.kv_write import write_kv
from tests.helpers import run_with_kernel_flags, skip_a_build_like_the_suite_s
from tests.ops.matmul_cases import (
    GROUPED_SHAPES,
    GROUPS,
    ROWS,
    SHAPES,
    assert_close,
    grouped_operands,
    grouped_oracle,
    operands,
    oracle,
)

pytestmark = [
    pytest.mark.cpu_only("the native CPU kernels, and what XLA:CPU compiles"),
    pytest.mark.skipif(cpu_kernels.kernel_error() is not None, reason=str(cpu_kernels.kernel_error())),
]


@pytest.mark.parametrize("output_major_w", [False, True], ids=["w[K,N]", "w[N,K]"])
@pytest.mark.parametrize("m", ROWS)
def test_matmul_against_float64(m, output_major_w):
    call = jax.jit(lambda x, w: cpu_kernels.matmul_bf16(x, w, output_major_w=output_major_w))
    for k, n in SHAPES:
        x, w = operands(m, k, n, output_major_w)
        assert_close(np.asarray(call(x, w)), oracle(x, w, output_major_w), k)


def test_matmul_is_xla_s_bfloat16_dot_with_float32_sums():
    """The contract the models rely on: `jnp.dot` of the same bfloat16 operands into float32."""
    x, w = operands(16, 576, 1536, output_major_w=False, seed=1)
    want = jnp.dot(x, w, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(cpu_kernels.matmul_bf16(x, w)), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_matmul_refuses_other_operands():
    x, w = operands(2, 8, 4, output_major_w=False)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_kernels.matmul_bf16(x.astype(jnp.float32), w)
    with pytest.raises(ValueError, match="2-D"):
        cpu_kernels.matmul_bf16(x[None], w)


def test_empty_rows_and_columns():
    x, w = operands(0, 8, 4, output_major_w=False)
    assert cpu_kernels.matmul_bf16(x, w).shape == (0, 4)
    x, w = operands(3, 8, 0, output_major_w=True)
    assert cpu_kernels.matmul_bf16(x, w, output_major_w=True).shape == (3, 0)


@pytest.mark.parametrize("groups", GROUPS, ids=lambda g: "-".join(map(str, g)))
def test_grouped_matmul_against_float64(groups):
    call = jax.jit(cpu_kernels.grouped_matmul_bf16)
    for k, n in GROUPED_SHAPES:
        rows, w, sizes = grouped_operands(groups, k, n, spare_rows=3)
        got = np.asarray(call(rows, w, sizes))
        assert_close(got, grouped_oracle(rows, w, groups), k)
        assert (got[sum(groups):] == 0).all()  # rows past the groups


def test_grouped_matmul_is_ragged_dot():
    """`jax.lax.ragged_dot`'s contract with float32 sums, which the mixture of experts relies on."""
    rows, w, sizes = grouped_operands((17, 0, 3, 40), 256, 96, spare_rows=4, seed=2)
    want = jax.lax.ragged_dot(rows, w, sizes, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(cpu_kernels.grouped_matmul_bf16(rows, w, sizes)), np.asarray(want),
                               rtol=1e-5, atol=1e-4)


def test_grouped_matmul_takes_sizes_past_the_rows_and_below_zero_as_the_rows_there_are():
    """Sizes summing past the rows stop at the last row, a negative size is an empty group: no read or write
    out of bounds whatever the sizes hold."""
    rows, w, _ = grouped_operands((4, 4), 64, 32)
    got = np.asarray(cpu_kernels.grouped_matmul_bf16(rows, w, jnp.asarray([-5, 54], jnp.int32)))
    np.testing.assert_allclose(got, grouped_oracle(rows, w, (0, 8)), atol=1e-3)


def test_grouped_matmul_refuses_other_operands():
    rows, w, sizes = grouped_operands((2, 1), 8, 4)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_kernels.grouped_matmul_bf16(rows.astype(jnp.float32), w, sizes)
    with pytest.raises(ValueError, match="group sizes"):
        cpu_kernels.grouped_matmul_bf16(rows, w, sizes[:1])
    assert cpu_kernels.grouped_matmul_bf16(rows[:0], w, jnp.zeros(2, jnp.int32)).shape == (0, 4)


def test_the_portable_loops_match_too():
    """Built without AVX512-BF16 (`JAXSERVE_KERNEL_FLAGS=-mno-avx512f`, an AVX2 machine's build, which the GGUF
    and attention kernels' tests build too), the kernels take their plain float32 loops: the same oracle, in a
    process of its own (the library is loaded once per process)."""
    skip_a_build_like_the_suite_s("-mno-avx512f")
    script = f"""
        import jax, numpy as np
        from jaxserve.ops import cpu_kernels, kernel_build
        from tests.ops.matmul_cases import (GROUPED_SHAPES, GROUPS, SHAPES, assert_close, grouped_operands,
                                            grouped_oracle, operands, oracle)
        assert cpu_kernels.kernel_error() is None, cpu_kernels.kernel_error()
        for output_major_w in (False, True):
            call = jax.jit(lambda x, w: cpu_kernels.matmul_bf16(x, w, output_major_w=output_major_w))
            for m in {ROWS!r}:
                for k, n in SHAPES:
                    x, w = operands(m, k, n, output_major_w)
                    assert_close(np.asarray(call(x, w)), oracle(x, w, output_major_w), k)
        for groups in GROUPS:
            for k, n in GROUPED_SHAPES:
                rows, w, sizes = grouped_operands(groups, k, n, spare_rows=3)
                assert_close(np.asarray(cpu_kernels.grouped_matmul_bf16(rows, w, sizes)),
                             grouped_oracle(rows, w, groups), k)
        print("portable ok", kernel_build.built_library().name)
    """
    result = run_with_kernel_flags(script, "-mno-avx512f")
    assert result.returncode == 0 and "portable ok" in result.stdout, result.stderr[-3000:]
    built = result.stdout.split("portable ok")[1].split()[0]
    assert built != kernel_build.built_library().name, "the flags make a library of their own"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_write_kv_equals_the_scatter(dtype):
    """The in-place K/V write puts each token's rows where the jnp scatter does, and drops padding slots."""
    rng = np.random.default_rng(2)
    num_kv_heads, num_pages, page_size, head_dim, tokens = 3, 5, 4, 8, 7
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    v_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    k = jnp.asarray(rng.standard_normal((tokens, num_kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((tokens, num_kv_heads, head_dim)), jnp.float32)
    slots = jnp.asarray([0, 5, 19, 7, num_pages * page_size, num_pages * page_size + 3, 12], jnp.int32)
    want = write_kv(k_pages, v_pages, k, v, slots)
    got = jax.jit(cpu_kernels.write_kv)(k_pages, v_pages, k, v, slots)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    # A cache of keys alone (its values are its keys): K written as before, no V
    keys_only = jax.jit(cpu_kernels.write_kv)(k_pages, None, k, None, slots)
    assert keys_only[1] is None and write_kv(k_pages, None, k, None, slots)[1] is None
    np.testing.assert_array_equal(np.asarray(keys_only[0], np.float32), np.asarray(want[0], np.float32))


# XLA:CPU up to jaxlib 0.11.1 runs the jnp scatter on a bfloat16 cache by converting the whole cache to
# float32 and back, every step; from jaxlib 0.11.2 it scatters the bfloat16 cache in place.
XLA_WIDENS_BFLOAT16_SCATTERS = JAXLIB_VERSION < (0, 11, 2)


def test_a_bfloat16_cache_is_written_in_place_without_widening():
    """The first assertion pins which jaxlibs widen the jnp scatter's bfloat16 cache (once none that do is
    supported, the native write can go). The compiled native write holds no float32 copy of the cache, and
    its outputs alias the cache buffers."""
    shape = (3, 64, 16, 64)
    pages = jnp.zeros(shape, jnp.bfloat16)
    rows = jnp.zeros((8, 3, 64), jnp.bfloat16)
    slots = jnp.arange(8, dtype=jnp.int32)
    widened = ("f32[3,64,16,64]", "f32[3,1024,64]")

    def compiled(fn) -> str:
        return jax.jit(fn, donate_argnums=(0, 1)).lower(pages, pages, rows, rows, slots).compile().as_text()

    assert any(copy in compiled(write_kv) for copy in widened) == XLA_WIDENS_BFLOAT16_SCATTERS
    native = compiled(cpu_kernels.write_kv)
    assert not any(copy in native for copy in widened)
    assert native.count("output_to_operand_aliasing={{}: (0, {})}") == 2  # K's call and V's, each in place


def _raw_call(target: str, out_shape: tuple[int, ...], *args, **attrs):
    """The FFI target called directly, past the Python wrappers' own checks."""
    return jax.block_until_ready(jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, jnp.float32))(*args, **attrs))


@pytest.mark.parametrize("rank", [1, 5], ids=["rank 1", "rank 5"])
def test_every_handler_refuses_a_wrong_rank_with_its_kernel_s_message(rank):
    """Each handler hands its buffers to its kernel as views (`ffi_bindings.cc`), and a buffer of a rank past
    what a view holds comes as an empty one: the kernel's shape check still refuses it, by its own message,
    as an error for the caller rather than a read out of bounds."""
    bf16 = jnp.ones((2,) * rank, jnp.bfloat16)
    f32 = jnp.ones((2,) * rank, jnp.float32)
    u8 = jnp.ones((2,) * rank, jnp.uint8)
    sizes = jnp.ones((2,), jnp.int32)
    cases = {
        "jaxserve_matmul_bf16": ("x, w and out must be 2-D", (bf16, bf16), {}),
        "jaxserve_matmul_bf16_nt": ("x, w and out must be 2-D", (bf16, bf16), {}),
        "jaxserve_grouped_matmul_bf16": (r"x \[A, K\], w \[G, K, N\]", (bf16, bf16, sizes), {}),
        "jaxserve_matmul_gguf": ("x, w and out must be 2-D", (f32, u8), {"kind": np.int32(2)}),
        "jaxserve_grouped_matmul_gguf": (r"x \[A, K\], w \[G, ceil", (f32, u8, sizes), {"kind": np.int32(2)}),
    }
    for target, (message, args, attrs) in cases.items():
        with pytest.raises(Exception, match=message):
            _raw_call(target, (2, 2), *args, **attrs)


def test_the_kv_write_refuses_a_cache_of_rank_5():
    pages = jnp.zeros((1, 2, 2, 2, 8), jnp.float32)
    rows = jnp.ones((2, 1, 8), jnp.float32)
    call = jax.ffi.ffi_call("jaxserve_write_pages", jax.ShapeDtypeStruct(pages.shape, pages.dtype))
    with pytest.raises(Exception, match="write_pages: mismatched shapes or dtypes"):
        jax.block_until_ready(call(pages, rows, jnp.zeros((2,), jnp.int32)))
