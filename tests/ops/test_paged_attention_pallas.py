"""The Pallas kernels against the jnp reference and the float64 oracle, and lowered for CUDA (Triton IR) for
the production head shapes, which catches what only the GPU backend rejects.

On CPU (CI) the kernels run in Pallas' interpreter; on a CUDA GPU (sm_80+) the same tests run them compiled.

Unused page slots are NaN (see `make_case`), so any read past a request's length or outside its pages
shows up as NaN in the output.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.device import deviceless_device
from jaxserve.ops.attention import ragged_paged_attention, resolve_impl
from jaxserve.ops.paged_attention_pallas import (
    TRITON_BACKEND,
    decode_order,
    default_num_splits,
    missing_backend,
    paged_decode_attention_pallas,
    query_blocks,
    ragged_paged_attention_pallas,
)
from jaxserve.parallel import on_one_device
from tests.helpers import run_jitted
from tests.ops.paged_cases import MIXES, PagedCase, make_case, oracle

# The kernel runs interpreted on CPU (about a minute in all): part of `make test`, not of the quick loop.
# On a GPU, compiled, it is part of `make test-gpu`.
pytestmark = [pytest.mark.slow, pytest.mark.gpu,
              pytest.mark.skipif(not TRITON_BACKEND, reason=f"the Triton kernels: {missing_backend()}")]

KERNEL_IMPL = "pallas" if resolve_impl("auto") == "pallas" else "interpret"
INTERPRET = KERNEL_IMPL == "interpret"
# Compiled, the float32 sums run in another order and exp2 is the GPU's (tests/conftest.py keeps the
# dots in full float32 there; in TF32, serving's default, an H200 measured 1.4e-3 at serving shapes).
TOLERANCE = {np.float32: 1e-5 if INTERPRET else 1e-4, jnp.bfloat16: 2e-2}
GQA = [(4, 4), (4, 2), (8, 2), (8, 1), (9, 3)]  # group sizes 1, 2, 4, 8 and SmolLM2's 3


def check(got: jax.Array, case: PagedCase, sm_scale: float, dtype, tol: float | None = None) -> None:
    """Matches the oracle and the reference within `tol` (the dtype's tolerance), in as many of the values'
    first dims as `got` has (a cache of keys alone with `value_dims`); padding tokens are zeros."""
    got = np.asarray(got.astype(jnp.float32))
    num_real, dims = case.num_real_tokens, got.shape[-1]
    tol = tol or TOLERANCE[dtype]
    assert np.all(np.isfinite(got)), "NaN from an unused page slot leaked into the output"
    np.testing.assert_allclose(got[:num_real], oracle(case, sm_scale)[:num_real, :, :dims], atol=tol, rtol=tol)
    reference = run_jitted(ragged_paged_attention, *case.args, sm_scale=sm_scale, impl="reference")
    reference = np.asarray(reference.astype(jnp.float32))[..., :dims]
    np.testing.assert_allclose(got[:num_real], reference[:num_real], atol=tol, rtol=tol)
    assert np.all(got[num_real:] == 0), "padding tokens must come back as zeros"


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("num_q_heads,num_kv_heads", GQA)
def test_ragged_kernel_matches_oracle(mix, num_q_heads, num_kv_heads):
    rng = np.random.default_rng(sorted(MIXES).index(mix))
    case = make_case(rng, *MIXES[mix], num_q_heads, num_kv_heads, page_size=16, head_dim=64)
    got = run_jitted(ragged_paged_attention, *case.args, sm_scale=0.125, impl=KERNEL_IMPL)
    check(got, case, 0.125, np.float32)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_ragged_kernel_bfloat16(mix):
    rng = np.random.default_rng(10 + sorted(MIXES).index(mix))
    case = make_case(rng, *MIXES[mix], 8, 2, page_size=16, head_dim=64, dtype=jnp.bfloat16)
    check(run_jitted(ragged_paged_attention, *case.args, sm_scale=0.125, impl=KERNEL_IMPL), case, 0.125, jnp.bfloat16)


@pytest.mark.parametrize(
    "page_size,head_dim,block_rows,block_kv",
    [(32, 128, 64, 64), (16, 128, 16, 32), (32, 64, 32, 128), (16, 80, 64, 64)],  # 80: padded to 128
)
def test_ragged_kernel_page_sizes_head_dims_and_blocks(page_size, head_dim, block_rows, block_kv):
    rng = np.random.default_rng(page_size + head_dim)
    # Query blocks of several tokens, with kv lengths on, one before and one past page boundaries.
    q_lens, kv_lens = [1, 20, 0, 3, 40, 1], [page_size, 2 * page_size + 1, 5, 3 * page_size - 1, 70, 1]
    case = make_case(rng, q_lens, kv_lens, 8, 2, page_size=page_size, head_dim=head_dim)
    got = run_jitted(
        ragged_paged_attention_pallas,
        *case.args, sm_scale=0.1, interpret=INTERPRET, block_rows=block_rows, block_kv=block_kv
    )
    check(got, case, 0.1, np.float32)


def test_the_blocks_reaching_furthest_start_first():
    """The same blocks as request by request, by the key their last token reaches, furthest first: the
    700-key decode, then the 40-token chunk's blocks (its last first), the prefill's; ties keep the
    requests' order; unused blocks last."""
    q_lens, kv_lens = [100, 1, 1, 40], [100, 700, 30, 400]
    cu_q_lens = jnp.asarray(np.cumsum([0, *q_lens]), jnp.int32)
    plain, heavy = (np.stack([np.asarray(a) for a in query_blocks(cu_q_lens, jnp.asarray(kv_lens), 142, 16,
                                                                   heavy_first=first)], axis=1)
                    for first in (False, True))
    assert sorted(map(tuple, plain)) == sorted(map(tuple, heavy))
    used = heavy[heavy[:, 0] >= 0]
    assert len(used) == 7 + 1 + 1 + 3 and (heavy[len(used):, 0] == -1).all()
    req, start = used[:, 0], used[:, 1]
    reach = np.asarray(kv_lens)[req] - np.asarray(q_lens)[req] + np.minimum(start + 16, np.asarray(q_lens)[req])
    assert list(reach) == sorted(reach, reverse=True)
    assert list(req[:4]) == [1, 3, 3, 3] and list(start[1:4]) == [32, 16, 0]
    assert list(req[-2:]) == [2, 0] and reach[-2] == 30 and reach[-1] == 16  # the 30-key decode, the first block


def test_the_requests_order_matches_the_oracle_too():
    """The launch order is the programs' only difference: request by request, the same mix matches the
    oracle, bit for bit what the furthest-first order gives."""
    rng = np.random.default_rng(3)
    q_lens, kv_lens = [1, 20, 0, 3, 40, 1], [16, 33, 5, 47, 70, 1]
    case = make_case(rng, q_lens, kv_lens, 8, 2, page_size=16, head_dim=64)
    got = run_jitted(ragged_paged_attention_pallas, *case.args, sm_scale=0.1, interpret=INTERPRET, heavy_first=False)
    check(got, case, 0.1, np.float32)
    heavy = run_jitted(ragged_paged_attention_pallas, *case.args, sm_scale=0.1, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(heavy))  # each program computes the same


def decode_case(rng, kv_lens, num_q_heads, num_kv_heads, **kwargs) -> PagedCase:
    """One query token per request and T == R: padding requests (kv_len 0) own the padding tokens."""
    return make_case(rng, [1] * len(kv_lens), kv_lens, num_q_heads, num_kv_heads, pad_tokens=3, pad_reqs=3,
                     **kwargs)


def test_the_longest_decodes_start_first():
    """The decode kernel's launch order: longest first, ties in the requests' order, padding requests (no
    keys) last; or the requests' own order."""
    kv_lens = jnp.asarray([33, 150, 0, 1, 17, 150, 64, 0], jnp.int32)
    assert list(np.asarray(decode_order(kv_lens))) == [1, 5, 6, 0, 4, 3, 2, 7]
    assert list(np.asarray(decode_order(kv_lens, heavy_first=False))) == list(range(8))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decodes_in_the_requests_order_match_too(num_splits):
    """The decode kernel's launch order (longest request first, by default) changes only where each
    request's partials sit until the merge: in the requests' order, bit for bit the same outputs."""
    rng = np.random.default_rng(11)
    case = decode_case(rng, [33, 150, 1, 17, 150, 64], 8, 2, page_size=16, head_dim=64)
    kwargs = dict(sm_scale=0.125, interpret=INTERPRET, num_splits=num_splits)
    in_order = run_jitted(paged_decode_attention_pallas, *case.args[:5], heavy_first=False, **kwargs)
    check(in_order, case, 0.125, np.float32)
    longest_first = run_jitted(paged_decode_attention_pallas, *case.args[:5], **kwargs)
    np.testing.assert_array_equal(np.asarray(in_order), np.asarray(longest_first))


@pytest.mark.parametrize("num_q_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("num_splits", [1, 3, None])  # None: as many as the batch leaves room for
def test_decode_kernel_matches_oracle(num_q_heads, num_kv_heads, num_splits):
    rng = np.random.default_rng(num_q_heads * 10 + num_kv_heads)
    case = decode_case(rng, [1, 16, 17, 32, 33, 150], num_q_heads, num_kv_heads, page_size=16, head_dim=64,
                       max_pages=10)
    q, k_pages, v_pages, kv_lens, page_table, _ = case.args
    got = run_jitted(
        paged_decode_attention_pallas,
        q, k_pages, v_pages, kv_lens, page_table, sm_scale=0.125, interpret=INTERPRET, num_splits=num_splits,
        block_kv=32,
    )
    check(got, case, 0.125, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("page_size,head_dim", [(16, 64), (32, 128)])
def test_decode_kernel_dtypes_and_shapes_through_the_entry_point(dtype, page_size, head_dim):
    rng = np.random.default_rng(page_size)
    case = decode_case(rng, [3, 64, 65, 200, 1], 8, 2, page_size=page_size, head_dim=head_dim, dtype=dtype,
                       max_pages=16)
    got = run_jitted(ragged_paged_attention, *case.args, sm_scale=0.1, impl=KERNEL_IMPL, decode_only=True)
    check(got, case, 0.1, dtype)


def test_more_splits_than_blocks_leaves_the_extra_splits_empty():
    rng = np.random.default_rng(7)
    case = decode_case(rng, [1, 5, 40], 4, 2, page_size=16, head_dim=64, max_pages=4)
    q, k_pages, v_pages, kv_lens, page_table, _ = case.args
    got = run_jitted(
        paged_decode_attention_pallas,
        q, k_pages, v_pages, kv_lens, page_table, sm_scale=0.2, interpret=INTERPRET, num_splits=8, block_kv=16
    )
    check(got, case, 0.2, np.float32)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a deviceless compile: on a machine without a GPU")
def test_the_splits_merge_in_one_kernel_on_an_h100():
    """The split-KV decode compiled for an H100: the Triton kernel, one reduction that merges the splits'
    partial softmaxes, and one fusion that normalises and casts (the max over splits and the weighted
    sums were a kernel each before: one more kernel a layer, every decode step)."""
    num_q_heads, num_kv_heads, head_dim = PRODUCTION_HEADS["llama-3-8b"]
    placed = on_one_device(deviceless_h100())
    pages = ((num_kv_heads, 4096, 16, head_dim), jnp.bfloat16)
    shapes = [((1, num_q_heads, head_dim), jnp.bfloat16), pages, pages, ((1,), jnp.int32), ((1, 256), jnp.int32)]
    structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=placed) for shape, dtype in shapes]
    fn = jax.jit(lambda *a: paged_decode_attention_pallas(*a, sm_scale=head_dim**-0.5, num_splits=16))
    hlo = fn.trace(*structs).lower(lowering_platforms=("cuda",)).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}\n")]
    kernels = re.findall(r"^\s*(?:ROOT )?%\S+ = .*? (fusion|custom-call)\(", entry, re.MULTILINE)
    assert kernels.count("custom-call") == 1 and kernels.count("fusion") == 2, kernels


def test_splits_fill_the_gpu_only_when_the_batch_does_not():
    assert default_num_splits(num_reqs=1, num_kv_heads=8, max_pages=256, pages_per_block=8) == 32
    assert default_num_splits(num_reqs=64, num_kv_heads=8, max_pages=256, pages_per_block=8) == 1
    assert default_num_splits(num_reqs=1, num_kv_heads=1, max_pages=16, pages_per_block=8) == 2
    assert default_num_splits(num_reqs=4, num_kv_heads=8, max_pages=256, pages_per_block=8, num_sms=132) == 9
    assert default_num_splits(num_reqs=16, num_kv_heads=8, max_pages=256, pages_per_block=8, num_sms=132) == 1


# (query heads, KV heads, head dim) of the models jaxserve serves.
PRODUCTION_HEADS = {"gpt2": (12, 12, 64), "smollm2-135m": (9, 3, 64), "llama-3-8b": (32, 8, 128)}


# The custom call a Pallas Triton kernel lowers to: jaxlib <= 0.10.2 hands XLA the Triton IR, newer ones
# compile it to PTX while lowering (jax/_src/pallas/triton/pallas_call_registration.py).
TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


@functools.cache
def deviceless_h100() -> jax.Device:
    return deviceless_device("h100")


def lower_for_cuda(fn, *shapes) -> str:
    structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    # From jax 0.11, Pallas lowers a Triton kernel for the default device's GPU (0.10 took compute
    # capability 9.0 without one): here the local GPU, or an H100's description on a CPU.
    with jax.default_device(deviceless_h100() if jax.default_backend() == "cpu" else None):
        return jax.jit(fn).trace(*structs).lower(lowering_platforms=("cuda",)).as_text()


def calls_triton(lowered: str) -> bool:
    return any(call in lowered for call in TRITON_CALLS)


@pytest.mark.parametrize("model", sorted(PRODUCTION_HEADS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("page_size", [16, 32])
def test_kernels_lower_for_cuda(model, dtype, page_size):
    num_q_heads, num_kv_heads, head_dim = PRODUCTION_HEADS[model]
    pages = ((num_kv_heads, 4096, page_size, head_dim), dtype)
    max_pages = 8192 // page_size
    for num_tokens, num_reqs in [(2048, 256), (128, 1)]:  # the GPU preset's widest and narrowest buckets
        ragged = lower_for_cuda(
            lambda *a: ragged_paged_attention_pallas(*a, sm_scale=0.1),
            ((num_tokens, num_q_heads, head_dim), dtype), pages, pages,
            ((num_reqs,), jnp.int32), ((num_reqs, max_pages), jnp.int32), ((num_reqs + 1,), jnp.int32),
        )
        assert calls_triton(ragged)
    for num_reqs in (1, 64, 256):
        decode = lower_for_cuda(
            lambda *a: paged_decode_attention_pallas(*a, sm_scale=0.1),
            ((num_reqs, num_q_heads, head_dim), dtype), pages, pages,
            ((num_reqs,), jnp.int32), ((num_reqs, max_pages), jnp.int32),
        )
        assert calls_triton(decode)


# Serving shapes (Llama-3-8B's heads, the gpu preset's widest buckets) on the device: 256 decodes over
# contexts of up to 2,048 tokens, and a 1,024-token prefill chunk beside 63 decodes.
SERVING_MIXES = ("256 decodes", "a chunk beside 63 decodes")
SERVING_TOLERANCE = {np.float32: TOLERANCE[np.float32], jnp.bfloat16: 5e-2}  # bfloat16: 1.5e-2 on an H200


@pytest.mark.skipif(INTERPRET, reason="minutes in Pallas' interpreter: where the kernel runs compiled (a GPU)")
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("mix", SERVING_MIXES)
def test_kernels_match_the_oracle_at_serving_shapes(mix, dtype):
    num_q_heads, num_kv_heads, head_dim = PRODUCTION_HEADS["llama-3-8b"]
    rng = np.random.default_rng(SERVING_MIXES.index(mix))
    shape = dict(page_size=16, head_dim=head_dim, dtype=dtype, max_pages=2048 // 16 + 1)
    decode_only = mix == "256 decodes"
    if decode_only:
        case = decode_case(rng, rng.integers(1, 2049, 256).tolist(), num_q_heads, num_kv_heads, **shape)
    else:  # the chunk follows 512 cached tokens
        kv_lens = [1536, *rng.integers(100, 1500, 63).tolist()]
        case = make_case(rng, [1024] + [1] * 63, kv_lens, num_q_heads, num_kv_heads, **shape)
    sm_scale = head_dim**-0.5
    got = run_jitted(ragged_paged_attention, *case.args, sm_scale=sm_scale, impl=KERNEL_IMPL, decode_only=decode_only)
    check(got, case, sm_scale, dtype, tol=SERVING_TOLERANCE[dtype])


@pytest.mark.skipif(INTERPRET, reason="minutes in Pallas' interpreter at these shapes (tests/ops/test_attention.py "
                                      "runs the wide heads' blocks interpreted, smaller)")
@pytest.mark.parametrize("num_q_heads", [16, 64])  # DeepSeek-V2-Lite's, and a group the calls split in two
@pytest.mark.parametrize("mix", SERVING_MIXES)
def test_deepseek_s_wide_heads_match_the_oracle_on_the_device(mix, num_q_heads):
    """DeepSeek's latent attention (one KV head of 576 dims, the wide-head blocks, a cache of keys alone whose first
    512 dims the kernels read as the values, the head in two pieces) at bfloat16 serving shapes: 64 decodes over
    contexts of up to 2,048 tokens, and a 512-token chunk beside 15 decodes."""
    rng = np.random.default_rng(num_q_heads)
    shape = dict(page_size=16, head_dim=576, dtype=jnp.bfloat16, max_pages=2048 // 16 + 1)
    decode_only = mix == "256 decodes"
    if decode_only:
        case = decode_case(rng, rng.integers(1, 2049, 64).tolist(), num_q_heads, 1, **shape)
    else:
        case = make_case(rng, [512] + [1] * 15, [1024, *rng.integers(100, 1500, 15).tolist()], num_q_heads, 1,
                         **shape)
    sm_scale = 192**-0.5  # (nope + rope)^-1/2, not the cached width's
    case = dataclasses.replace(case, v_pages=case.k_pages)
    q, k_pages, _, *rest = case.args
    got = run_jitted(ragged_paged_attention, q, k_pages, None, *rest, sm_scale=sm_scale, impl=KERNEL_IMPL,
                     decode_only=decode_only, value_dims=512)
    assert got.shape[-1] == 512
    check(got, case, sm_scale, jnp.bfloat16, tol=SERVING_TOLERANCE[jnp.bfloat16])
