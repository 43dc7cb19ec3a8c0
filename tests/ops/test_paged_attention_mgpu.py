"""The Mosaic GPU (Hopper) kernel against the float64 oracle, and compiled for an H100 without one.

On a CPU the kernel runs in Mosaic GPU's interpreter, which simulates its warpgroups, shared memory, TMA
copies and barriers (jax >= 0.11; jax 0.10's lacks `layout_cast`); on a Hopper GPU the same tests run it
compiled. The deviceless compiles run XLA:GPU and Mosaic GPU's lowering for an H100 (layouts, the
shared-memory budget), which catches what only the GPU backend rejects.

The kernel loads whole pages, so unused slots must hold finite values (the engine's cache does); the cases
put a large finite value there instead of NaN, which reaches the output unless it is masked exactly.
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.bench.ptxas import find_ptxas
from jaxserve.ops.attention import AttentionConfig, cuda_compute_capability, ragged_paged_attention
from jaxserve.ops.paged_attention_mgpu import (
    _END_STEP,
    _FIRST_STEP,
    _NUM_VALID,
    _REQ,
    _SLAB_POS,
    DECODE_DEFAULTS,
    DEFAULTS,
    MIN_Q_LEN,
    _describe_blocks,
    block_q_for,
    config_for,
    ragged_paged_attention_hopper,
    ragged_paged_attention_mgpu,
    supports,
)
from jaxserve.ops.paged_attention_pallas import ScoreRule
from jaxserve.parallel import on_one_device
from tests.helpers import run_jitted
from tests.ops.paged_cases import MIXES, PagedCase, blank_before_windows, make_case, oracle
from tests.ops.test_paged_attention_pallas import PRODUCTION_HEADS, deviceless_h100
from tests.ops.test_sliding_window import assert_sinks_matter, head_sinks

ON_HOPPER = AttentionConfig(impl="pallas", compute_capability=cuda_compute_capability()).hopper
INTERPRETER_RUNS = jax.__version_info__ >= (0, 11)
needs_a_runner = pytest.mark.skipif(
    not (ON_HOPPER or INTERPRETER_RUNS),
    reason="the kernel runs on a Hopper GPU, or in Mosaic GPU's interpreter from jax 0.11 (this is jax 0.10)",
)
pytestmark = pytest.mark.gpu
GARBAGE = 1e4  # in every slot no request owns
TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def finite(case: PagedCase) -> PagedCase:
    """The case with GARBAGE where it has NaN (slots that no request owns)."""
    fill = lambda pages: np.where(np.isnan(pages), GARBAGE, pages)  # noqa: E731
    return PagedCase(case.q, fill(case.k_pages), fill(case.v_pages), case.kv_lens, case.page_table, case.cu_q_lens)


def run(case: PagedCase, dtype, **kwargs) -> np.ndarray:
    args = [jnp.asarray(a, dtype) if a.dtype == np.float32 else jnp.asarray(a) for a in case.args]
    out = run_jitted(ragged_paged_attention_mgpu, *args, interpret=not ON_HOPPER, **kwargs)
    return np.asarray(out.astype(jnp.float32))


def check(got: np.ndarray, case: PagedCase, dtype, **scores) -> None:
    num_real = case.num_real_tokens
    want = oracle(case, **scores)
    np.testing.assert_allclose(got[:num_real], want[:num_real], atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert np.all(got[num_real:] == 0), "padding tokens must come back as zeros"


@needs_a_runner
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_every_mix_matches_the_oracle(mix):
    """Decodes, prefills, a chunk after cached tokens, empty requests and contexts; GQA groups of 4 over
    two consumer warpgroups, steps of 64 keys (4 pages of 16)."""
    rng = np.random.default_rng(sorted(MIXES).index(mix))
    case = finite(make_case(rng, *MIXES[mix], 8, 2, page_size=16, head_dim=64))
    check(run(case, jnp.bfloat16, sm_scale=0.125, block_kv=64), case, jnp.bfloat16, sm_scale=0.125)


@needs_a_runner
@pytest.mark.parametrize("num_q_heads,num_kv_heads,num_consumers", [(4, 4, 1), (9, 3, 2), (5, 1, 2), (16, 2, 1)])
def test_group_sizes_and_warpgroups(num_q_heads, num_kv_heads, num_consumers):
    """Groups of 1, 3 (padded to 4: SmolLM2's), 5 (padded to 8) and 8; one or two consumer warpgroups,
    so a head's rows span warpgroups or a warpgroup holds several heads."""
    rng = np.random.default_rng(num_q_heads)
    case = finite(make_case(rng, [1, 19, 6], [30, 19, 40], num_q_heads, num_kv_heads, page_size=16, head_dim=64,
                            max_pages=4))
    got = run(case, jnp.bfloat16, sm_scale=0.125, num_consumers=num_consumers, block_kv=64)
    check(got, case, jnp.bfloat16, sm_scale=0.125)


@needs_a_runner
@pytest.mark.parametrize("num_consumers,block_kv,stages,ping_pong,overlap", [
    (2, 64, 4, False, False), (1, 128, 2, False, False), (2, 64, 3, True, False), (2, 64, 3, False, True),
    (1, 128, 2, False, True), (1, 64, 1, False, True), (2, 64, 3, True, True)])
def test_long_contexts_cycle_the_stages(num_consumers, block_kv, stages, ping_pong, overlap):
    """Hundreds of keys: many steps through each stage, a 100-token prefill that fills several slabs, head
    dim 128, and a block that starts mid-tile (configurations within an H100's shared memory); the two
    consumers taking turns on the tensor cores (ping-pong), or each running its softmax under its own
    P V (overlap, one stage too), through masked and unmasked steps alike."""
    rng = np.random.default_rng(1)
    case = finite(make_case(rng, [3, 100, 1, 70], [300, 100, 520, 200], 8, 2, page_size=16, head_dim=128,
                            max_pages=40))
    config = dict(num_consumers=num_consumers, block_kv=block_kv, stages=stages, ping_pong=ping_pong,
                  overlap=overlap)
    assert supports(jnp.bfloat16, jnp.bfloat16, 8, 2, 128, 16, **config) is None
    check(run(case, jnp.bfloat16, sm_scale=0.09, **config), case, jnp.bfloat16, sm_scale=0.09)


@needs_a_runner
@pytest.mark.parametrize("page_size,block_kv,stages,overlap,programs", [
    (16, 64, 3, False, None), (32, 64, 3, False, None), (64, 128, 2, False, None), (16, 64, 3, True, None),
    (64, 128, 2, True, None), (16, 64, 2, False, 3)])
def test_a_decode_only_batch_on_one_warpgroup(page_size, block_kv, stages, overlap, programs):
    """The decode cases `attention_sweep.py` times on a GPU against the Triton decode kernel: one query
    token per request, so each program is one request and KV head, its group's 4 rows of the warpgroup's
    64 (the slab's other tokens are other requests'); contexts from one key to many stages; pages of 16
    (the `gpu` preset's), 32 and 64 tokens, one to four TMA copies a stage; the softmax under P V or not;
    and on a persistent grid, each program walking several requests' pages in one ring of stages."""
    rng = np.random.default_rng(3)
    kv_lens = [1, 63, 64, 65, 200, 17, 130, 300]
    case = finite(make_case(rng, [1] * len(kv_lens), kv_lens, 8, 2, page_size=page_size, head_dim=128,
                            max_pages=-(-320 // page_size)))
    got = run(case, jnp.bfloat16, sm_scale=0.09, num_consumers=1, block_kv=block_kv, stages=stages, overlap=overlap,
              programs_per_kv_head=programs)
    check(got, case, jnp.bfloat16, sm_scale=0.09)


@needs_a_runner
@pytest.mark.parametrize("page_size", [32, 64])
def test_a_mix_on_larger_pages(page_size):
    """Prefills, a chunk after cached tokens and decodes on pages of 32 and 64 tokens: a request's last
    page mostly past its length, slabs that start mid-page."""
    rng = np.random.default_rng(page_size)
    case = finite(make_case(rng, [3, 100, 1, 70], [300, 100, 520, 200], 8, 2, page_size=page_size,
                            head_dim=64, max_pages=-(-600 // page_size)))
    check(run(case, jnp.bfloat16, sm_scale=0.125, block_kv=128), case, jnp.bfloat16, sm_scale=0.125)


FP8 = jnp.float8_e4m3fn


def in_fp8(case: PagedCase) -> PagedCase:
    """The case with its K/V values rounded to e4m3 (the oracle then reads the cache's own values), every
    unowned slot at e4m3's largest finite value (a larger one would cast to NaN)."""
    stored = lambda pages: np.asarray(jnp.asarray(np.clip(pages, -448, 448), FP8).astype(jnp.float32))  # noqa: E731
    return PagedCase(case.q, stored(case.k_pages), stored(case.v_pages), case.kv_lens, case.page_table,
                     case.cu_q_lens)


# (decode-only, the kernel's settings): the prefill and decode settings `config_for` gives an FP8 cache at
# head dim 128, and beside them one stage, three, ping-pong, the overlapped softmax and a persistent grid.
FP8_SETTINGS = {
    "prefill": (False, dict(num_consumers=2, block_kv=64, stages=2, ping_pong=True)),
    "decode": (True, dict(num_consumers=1, block_kv=64, stages=2)),
    "one stage": (False, dict(num_consumers=2, block_kv=64, stages=1)),
    "three stages, one consumer": (False, dict(num_consumers=1, block_kv=64, stages=3)),
    "overlap": (False, dict(num_consumers=2, block_kv=64, stages=2, overlap=True)),
    "persistent": (False, dict(num_consumers=2, block_kv=64, stages=2, ping_pong=True, programs_per_kv_head=2)),
    "persistent decode": (True, dict(num_consumers=1, block_kv=64, stages=3, programs_per_kv_head=1)),
}


@needs_a_runner
@pytest.mark.parametrize("setting", FP8_SETTINGS)
def test_an_fp8_cache_matches_the_oracle_over_its_own_values(setting):
    """An FP8 cache: the producer copies e4m3 pages into staging buffers and widens each stage for the
    consumers a stage behind its copies; the output is the oracle's over the cache's e4m3 values, through
    prefills, a chunk after cached tokens and decodes (or decodes alone), every schedule. In the interpreter
    (a CPU) its race detector runs too: no widening reads a stage before its copy landed or writes one the
    consumers still read, no copy overwrites a stage before it was widened."""
    decode_only, config = FP8_SETTINGS[setting]
    rng = np.random.default_rng(7)
    q_lens, kv_lens = ([1] * 6, [1, 63, 65, 200, 17, 300]) if decode_only else ([3, 100, 1, 70], [300, 100, 520, 200])
    case = in_fp8(finite(make_case(rng, q_lens, kv_lens, 8, 2, page_size=16, head_dim=128, max_pages=40)))
    args = [jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else jnp.asarray(a) for a in case.args]
    args[1:3] = [jnp.asarray(pages, FP8) for pages in (case.k_pages, case.v_pages)]
    settings = {k: v for k, v in config.items() if k != "programs_per_kv_head"}
    assert supports(jnp.bfloat16, FP8, 8, 2, 128, 16, **settings, persistent=settings != config) is None
    if ON_HOPPER:
        out = run_jitted(ragged_paged_attention_mgpu, *args, sm_scale=0.09, **config)
    else:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        interpret_pallas_call.reset_gpu_interpret_mode_state()
        out = ragged_paged_attention_mgpu(*args, sm_scale=0.09, interpret=InterpretGPUParams(detect_races=True),
                                          **config)
        assert not interpret_pallas_call.get_races().races_found
    check(np.asarray(out.astype(jnp.float32)), case, jnp.bfloat16, sm_scale=0.09)


def test_an_fp8_cache_takes_half_the_keys_a_step_where_its_staging_would_pass_the_shared_memory():
    """`config_for`: the defaults where they fit (a 16-bit cache, SmolLM2's head dim 64 with FP8 too); with an
    FP8 cache at head dim 128 the staging buffers pass an H100's shared memory at 128 keys a step, so 64;
    None where nothing fits (Gemma's head dim 256) or the dtypes do not go together."""
    bf16 = jnp.bfloat16
    for decode_only, defaults in ((False, DEFAULTS), (True, DECODE_DEFAULTS)):
        assert config_for(decode_only, bf16, bf16, 32, 8, 128, 16) == defaults
        assert config_for(decode_only, bf16, FP8, 32, 8, 128, 16) == {**defaults, "block_kv": 64}
        assert config_for(decode_only, bf16, FP8, 9, 3, 64, 16) == defaults
        assert config_for(decode_only, bf16, FP8, 8, 4, 256, 16) is None
    assert config_for(False, bf16, jnp.float16, 32, 8, 128, 16) is None
    assert "shared memory" in supports(bf16, FP8, 32, 8, 128, 16, **DEFAULTS)


def describe(q_lens: list[int], kv_lens: list[int], heavy_first: bool, block_kv: int = 64) -> np.ndarray:
    """The programs' descriptions for a step, as the kernel would get them (GQA group 4, block_q 32)."""
    cu_q_lens = jnp.asarray(np.cumsum([0, *q_lens]), jnp.int32)
    padded_tokens = max(-(-sum(q_lens) // 8) * 8, 32)
    return np.asarray(_describe_blocks(cu_q_lens, jnp.asarray(kv_lens, jnp.int32), padded_tokens, 32, block_kv,
                                       ScoreRule(0.125, None, None), None, heavy_first))


def test_the_heaviest_blocks_start_first():
    """With `heavy_first`, the same programs as in the order of the requests, in the order of their steps over
    the keys, the most first: a causal prefill's last slab before its first, a long decode before a short
    one; blocks of equal steps keep the requests' order and the unused blocks come last."""
    q_lens, kv_lens = [100, 1, 1, 40], [100, 700, 30, 400]
    plain, heavy = describe(q_lens, kv_lens, False), describe(q_lens, kv_lens, True)
    steps = lambda info: info[:, _END_STEP] - info[:, _FIRST_STEP]  # noqa: E731
    assert sorted(map(tuple, plain)) == sorted(map(tuple, heavy))  # a permutation of the same rows
    assert list(steps(heavy)) == sorted(steps(plain), reverse=True)
    used = heavy[:, _NUM_VALID] > 0
    assert used[: used.sum()].all(), "every used block before the unused ones"
    # the 700-key decode (11 steps of 64) first, then the 400-key chunk's two slabs (7 steps each), then the
    # 100-token prefill's slabs (first tokens 0, 32, 64, 96: 1, 1, 2 and 2 steps), its later ones first
    assert list(heavy[:4, _REQ]) == [1, 3, 3, 0]
    prefill = heavy[used & (heavy[:, _REQ] == 0)]
    assert list(steps(prefill)) == [2, 2, 1, 1] and prefill[0, _SLAB_POS] > prefill[-1, _SLAB_POS]
    # ties keep the requests' order: the prefill's first two slabs and the 30-key decode walk one step each
    one_step = heavy[used & (steps(heavy) == 1)]
    assert list(one_step[:, _REQ]) == [0, 0, 2] and one_step[0, _SLAB_POS] < one_step[1, _SLAB_POS]


@needs_a_runner
def test_the_requests_order_matches_the_oracle_too():
    """The launch order is the programs' only difference: in the order of the requests (the sweep's
    comparison), the same mix matches the oracle, bit for bit what the heaviest-first order gives."""
    rng = np.random.default_rng(7)
    case = finite(make_case(rng, [3, 100, 1, 70], [300, 100, 520, 200], 8, 2, page_size=16, head_dim=64,
                            max_pages=40))
    in_order = run(case, jnp.bfloat16, sm_scale=0.125, block_kv=64, heavy_first=False)
    check(in_order, case, jnp.bfloat16, sm_scale=0.125)
    np.testing.assert_array_equal(in_order, run(case, jnp.bfloat16, sm_scale=0.125, block_kv=64))  # bit for bit


@needs_a_runner
@pytest.mark.parametrize("programs,num_consumers,stages,ping_pong,heavy_first", [
    (3, 2, 3, False, True), (2, 2, 2, True, True), (5, 1, 2, False, True), (4, 2, 3, True, False),
    (1, 2, 2, True, True)])
def test_a_persistent_grid_matches_the_oracle(programs, num_consumers, stages, ping_pong, heavy_first):
    """A persistent grid: each program walks several blocks (a 200-token prefill's slabs, a chunk after
    cached keys, decodes) with one ring of stages, so a block's steps start mid-ring and the next block's
    queries load once the consumers' last Q K^T of this one is done; one program a KV head walks them all.
    Bit for bit what a program a block gives: the same blocks, the same steps."""
    rng = np.random.default_rng(11)
    case = finite(make_case(rng, [3, 200, 1, 70], [300, 200, 520, 200], 8, 2, page_size=16, head_dim=64,
                            max_pages=40))
    config = dict(num_consumers=num_consumers, block_kv=64, stages=stages, ping_pong=ping_pong,
                  heavy_first=heavy_first)
    got = run(case, jnp.bfloat16, sm_scale=0.125, programs_per_kv_head=programs, **config)
    check(got, case, jnp.bfloat16, sm_scale=0.125)
    np.testing.assert_array_equal(got, run(case, jnp.bfloat16, sm_scale=0.125, **config))


def test_a_persistent_grid_deals_every_block_once_and_evens_out_the_steps():
    """Program p's rows: the blocks of the launch order p, 2P - 1 - p, 2P + p, ... (a snake), its used ones
    first; every used block in exactly one program, and no program more than one block's steps from
    another (the heaviest dealt against the lightest)."""
    q_lens, kv_lens = [2048], [2048]  # a causal prefill: 64 slabs of 32 tokens, 1 to 16 steps of 128 keys
    flat = describe(q_lens, kv_lens, True, block_kv=128)
    cu_q_lens = jnp.asarray([0, 2048], jnp.int32)
    dealt = np.asarray(_describe_blocks(cu_q_lens, jnp.asarray(kv_lens, jnp.int32), 2048, 32, 128,
                                        ScoreRule(0.125, None, None), None, True, programs=16))
    assert dealt.shape[:2] == (16, -(-flat.shape[0] // 16))
    used = dealt[:, :, _NUM_VALID] > 0
    assert all(row[: row.sum()].all() for row in used), "each program's used blocks first"
    as_set = lambda rows: sorted(map(tuple, rows))  # noqa: E731
    assert as_set(dealt[used]) == as_set(flat[flat[:, _NUM_VALID] > 0])
    steps = (dealt[:, :, _END_STEP] - dealt[:, :, _FIRST_STEP]).sum(axis=1)
    assert steps.sum() == (flat[:, _END_STEP] - flat[:, _FIRST_STEP]).sum()
    assert steps.max() - steps.min() <= (flat[:, _END_STEP] - flat[:, _FIRST_STEP]).max()
    # here exactly even: each step count 1..16 is 4 slabs', and program 0 takes the launch order's blocks 0,
    # 31, 32 and 63 (16 + 9 + 8 + 1 steps), program 15 its 15, 16, 47 and 48 (13 + 12 + 5 + 4)
    assert list(dealt[0, :4, _END_STEP] - dealt[0, :4, _FIRST_STEP]) == [16, 9, 8, 1]
    assert set(steps.tolist()) == {34}


@needs_a_runner
@pytest.mark.parametrize("ping_pong", [False, True])  # True: the prefill default's schedule
def test_sliding_window_and_soft_cap_in_float16(ping_pong):
    """Gemma 2's soft cap and a window of 37 keys; the pages wholly before each window hold garbage."""
    rng = np.random.default_rng(2)
    case = make_case(rng, [3, 100, 1, 70], [300, 100, 520, 200], 8, 2, page_size=16, head_dim=64, max_pages=40)
    case = finite(blank_before_windows(case, 37))
    scores = dict(sm_scale=0.09, sliding_window=37, logit_softcap=30.0)
    check(run(case, jnp.float16, block_kv=64, ping_pong=ping_pong, **scores), case, jnp.float16, **scores)


# GPT-OSS's attention: groups of 8 query heads a KV head, heads of 64, a window of 128 keys on every other layer.
GPT_OSS_HEADS = (64, 8, 64)


@needs_a_runner
@pytest.mark.parametrize("num_q_heads,window,schedule", [
    (16, None, dict(ping_pong=True, block_kv=64)), (16, 37, dict(block_kv=64)),
    (16, 37, dict(overlap=True, block_kv=64)), (16, None, dict(num_consumers=1, block_kv=128, stages=2)),
    (6, 37, dict(block_kv=64)), (16, None, dict(block_kv=64, programs_per_kv_head=3))])
def test_attention_sinks_join_each_row_s_denominator(num_q_heads, window, schedule):
    """GPT-OSS's sinks (`head_sinks`: far below the scores to far above them): each row's own head's sink
    joins its softmax's denominator after the last step, in every schedule (the overlapped one hands back
    its running max for it; the fourth is the decode defaults'), windowed or not, with GQA groups of 8 as
    GPT-OSS's (16 rows of 8 heads a block on two consumers, 8 of 8 on one), groups of 3 padded to 4 (rows
    of a padding head beside real ones), and on a persistent grid (a program's blocks in turn)."""
    rng = np.random.default_rng(7)
    case = make_case(rng, [1, 40, 3, 0, 70, 1], [130, 40, 300, 0, 200, 1], num_q_heads, 2, page_size=16,
                     head_dim=64, max_pages=20)
    case = finite(blank_before_windows(case, window) if window else case)
    sinks = head_sinks(num_q_heads)
    scores = dict(sm_scale=0.125, sliding_window=window)
    got = run(case, jnp.bfloat16, sinks=jnp.asarray(sinks), **scores, **schedule)
    check(got, case, jnp.bfloat16, sinks=sinks, **scores)
    assert_sinks_matter(got, case, 0.125, window)


@needs_a_runner
def test_a_hopper_step_with_sinks_passes_them_to_both_kernels():
    """GPT-OSS's prefill steps on Hopper: the long requests' rows through the Mosaic GPU kernel, the decodes'
    through the Triton kernel, each with its heads' sinks."""
    rng = np.random.default_rng(8)
    case = finite(make_case(rng, [1, 40, 3, 16], [50, 60, 20, 90], 16, 2, page_size=16, head_dim=64, max_pages=8))
    args = [jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else jnp.asarray(a) for a in case.args]
    sinks = head_sinks(16)
    got = run_jitted(ragged_paged_attention_hopper, *args, sm_scale=0.125, sinks=jnp.asarray(sinks),
                     interpret=not ON_HOPPER)
    got = np.asarray(got.astype(jnp.float32))
    check(got, case, jnp.bfloat16, sm_scale=0.125, sinks=sinks)
    assert_sinks_matter(got, case, 0.125, None)


@needs_a_runner
def test_a_hopper_step_sends_short_requests_to_triton():
    """Requests of MIN_Q_LEN tokens or more through the Mosaic GPU kernel, decodes and short chunks through
    the Triton one, in one step: together they match the oracle, padding tokens are zeros."""
    rng = np.random.default_rng(5)
    q_lens, kv_lens = [1, 40, 3, 0, 16, 1, 15], [50, 60, 20, 0, 16, 300, 90]
    assert min(q for q in q_lens if q >= MIN_Q_LEN) == MIN_Q_LEN and any(1 < q < MIN_Q_LEN for q in q_lens)
    case = finite(make_case(rng, q_lens, kv_lens, 8, 2, page_size=16, head_dim=64, max_pages=20))
    args = [jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else jnp.asarray(a) for a in case.args]
    got = run_jitted(ragged_paged_attention_hopper, *args, sm_scale=0.125, interpret=not ON_HOPPER)
    check(np.asarray(got.astype(jnp.float32)), case, jnp.bfloat16, sm_scale=0.125)


@needs_a_runner
def test_without_triton_s_backend_a_hopper_step_serves_every_request_itself(monkeypatch):
    """With a jax that has dropped Pallas' Triton backend (deprecated), the same step's decodes and short
    chunks go through the Mosaic GPU kernel too, never reaching the Triton one, and match the oracle."""
    from jaxserve.ops import paged_attention_pallas

    def refused(*args, **kwargs):
        raise AssertionError("the Triton kernel was called")

    monkeypatch.setattr(paged_attention_pallas, "TRITON_BACKEND", False)
    monkeypatch.setattr(paged_attention_pallas, "ragged_paged_attention_pallas", refused)
    jax.clear_caches()  # traced anew under the patch (the module's jit keeps earlier traces)
    rng = np.random.default_rng(5)
    case = finite(make_case(rng, [1, 40, 3, 0, 16, 1, 15], [50, 60, 20, 0, 16, 300, 90], 8, 2, page_size=16,
                            head_dim=64, max_pages=20))
    args = [jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else jnp.asarray(a) for a in case.args]
    try:
        got = run_jitted(ragged_paged_attention_hopper, *args, sm_scale=0.125, interpret=not ON_HOPPER)
    finally:
        jax.clear_caches()
    check(np.asarray(got.astype(jnp.float32)), case, jnp.bfloat16, sm_scale=0.125)


@needs_a_runner
def test_a_request_whose_keys_miss_its_queries_still_ends():
    """Outside the contract (a request with query tokens and no keys: their positions are below 0), the kernel
    still ends, with finite rows, every schedule alike: each block walks at least one step, so no consumer
    waits for keys the producer never loads, and two consumers' ping-pong turns pair up."""
    rng = np.random.default_rng(6)
    case = finite(make_case(rng, [20, 40], [0, 60], 8, 2, page_size=16, head_dim=64, max_pages=8))
    plain, overlapped, ping_pong = (run(case, jnp.bfloat16, sm_scale=0.125, block_kv=64, **schedule)
                                    for schedule in ({}, {"overlap": True}, {"ping_pong": True}))
    for got in (plain, overlapped, ping_pong):
        assert np.isfinite(got).all()
    np.testing.assert_allclose(overlapped, plain, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(ping_pong, plain, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not ON_HOPPER, reason="wgmma from registers: Mosaic GPU's interpreter cannot run it, a Hopper GPU")
@pytest.mark.parametrize("num_consumers,block_kv,stages,ping_pong,overlap", [
    (2, 128, 2, False, False), (2, 64, 4, False, False), (1, 128, 3, False, False), (2, 128, 2, True, False),
    (2, 128, 2, False, True), (1, 128, 3, False, True), (2, 128, 2, True, True)])
def test_p_in_registers_matches_the_oracle_on_hopper(num_consumers, block_kv, stages, ping_pong, overlap):
    """FlashAttention-3's P V: P from registers, the accumulator updated in place; with and without its
    ping-pong schedule or its intra-warpgroup overlap."""
    rng = np.random.default_rng(4)
    case = finite(make_case(rng, [3, 100, 1, 70], [300, 100, 520, 200], 8, 2, page_size=16, head_dim=128,
                            max_pages=40))
    got = run(case, jnp.bfloat16, sm_scale=0.09, num_consumers=num_consumers, block_kv=block_kv, stages=stages,
              p_in_registers=True, ping_pong=ping_pong, overlap=overlap)
    check(got, case, jnp.bfloat16, sm_scale=0.09)


@pytest.mark.skipif(ON_HOPPER or not INTERPRETER_RUNS, reason="the interpreter's race detector (a CPU, jax >= 0.11)")
@pytest.mark.parametrize("ping_pong,overlap,programs", [(False, False, None), (True, False, None), (False, True, None),
                                                       (True, True, None), (True, False, 2), (False, False, 1)])
def test_the_interpreter_finds_no_race_between_the_warpgroups(ping_pong, overlap, programs):
    """The producer's TMA copies, the consumers' wgmma reads and the barriers between them, checked by the
    interpreter's vector clocks: no shared-memory access races another, with the consumers taking turns,
    overlapping their softmax with their own P V, or neither; and on a persistent grid, where the next
    block's queries overwrite this one's and its output buffer is reused."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    rng = np.random.default_rng(3)
    case = finite(make_case(rng, [3, 40, 1], [300, 40, 200], 4, 2, page_size=16, head_dim=64, max_pages=20))
    args = [jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else jnp.asarray(a) for a in case.args]
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    out = ragged_paged_attention_mgpu(*args, sm_scale=0.1, block_kv=64, ping_pong=ping_pong, overlap=overlap,
                                      programs_per_kv_head=programs, interpret=InterpretGPUParams(detect_races=True))
    check(np.asarray(out.astype(jnp.float32)), case, jnp.bfloat16, sm_scale=0.1)
    assert not interpret_pallas_call.get_races().races_found


def test_what_the_kernel_refuses():
    """What it refuses falls back to the Triton kernel at the entry point."""
    bf16 = (jnp.bfloat16, jnp.bfloat16)
    assert supports(*bf16, 32, 8, 128, 16) is None  # Llama-3-8B
    assert supports(*bf16, 9, 3, 64, 16) is None  # SmolLM2
    assert "float16 or bfloat16" in supports(jnp.float32, jnp.float32, 32, 8, 128, 16)
    assert "alike or FP8" in supports(jnp.bfloat16, jnp.float16, 32, 8, 128, 16)
    assert supports(jnp.bfloat16, jnp.float8_e4m3fn, 32, 8, 128, 16, block_kv=64) is None  # an FP8 cache
    assert "multiple of 64" in supports(*bf16, 32, 8, 96, 16)
    assert "page size" in supports(*bf16, 32, 8, 64, 4)
    assert "block_kv 32" in supports(*bf16, 9, 3, 64, 16, block_kv=32)  # fails Mosaic GPU's tiling otherwise
    assert "shared memory" in supports(*bf16, 8, 4, 256, 16)  # Gemma's head dim 256 at the defaults
    assert "shared memory" in supports(*bf16, 32, 8, 128, 16, num_consumers=1, block_kv=128, stages=3)
    assert "per KV head" in supports(*bf16, 32, 1, 64, 16, num_consumers=1)  # 32 heads of 64 rows: 2 tokens
    assert "consumer" in supports(*bf16, 32, 8, 64, 16, num_consumers=3)
    assert "ping-pong" in supports(*bf16, 32, 8, 64, 16, num_consumers=1, ping_pong=True)
    assert supports(*bf16, 32, 8, 64, 16, ping_pong=True, overlap=True) is None  # FlashAttention-3's both
    assert "persistent" in supports(*bf16, 32, 8, 64, 16, overlap=True, persistent=True)
    assert supports(*bf16, 32, 8, 128, 16, num_consumers=1, overlap=True) is None  # one warpgroup overlaps too
    assert "registers" in supports(*bf16, 8, 4, 256, 16, num_consumers=1, block_kv=64, stages=1, overlap=True)
    assert block_q_for(32, 8, 2) == 32 and block_q_for(9, 3, 2) == 32 and block_q_for(12, 12, 2) == 128


# Llama-3-8B's and SmolLM2's heads at the gpu preset's widest bucket (2,048 tokens, 256 requests), and a
# lone short prefill.
COMPILE_CASES = [("llama-3-8b", 2048, 256, 16), ("llama-3-8b", 128, 1, 64), ("smollm2-135m", 2048, 256, 16)]


def h100_kernel_args(model: str, num_tokens: int, num_reqs: int, page_size: int, context: int = 8192):
    """The kernel's arguments as ShapeDtypeStructs on a deviceless H100, at `model`'s heads, and its head dim."""
    num_q_heads, num_kv_heads, head_dim = {**PRODUCTION_HEADS, "gpt-oss-20b": GPT_OSS_HEADS}[model]
    placed = on_one_device(deviceless_h100())
    pages = ((num_kv_heads, 65536 // page_size, page_size, head_dim), jnp.bfloat16)
    shapes = [((num_tokens, num_q_heads, head_dim), jnp.bfloat16), pages, pages, ((num_reqs,), jnp.int32),
              ((num_reqs, context // page_size), jnp.int32), ((num_reqs + 1,), jnp.int32)]
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=placed) for shape, dtype in shapes], head_dim


# Each schedule (P through shared memory or in registers, the consumers taking turns, each overlapping its
# softmax with its own P V, or neither) at Llama-3-8B's widest bucket; the other cases at the prefill defaults'.
SCHEDULES = [(False, False, False), (True, False, False), (True, True, False), (True, False, True),
             (False, False, True), (True, True, True)]
PREFILL_DEFAULTS = (DEFAULTS["p_in_registers"], DEFAULTS["ping_pong"], DEFAULTS["overlap"])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a deviceless compile: on a machine without a GPU")
@pytest.mark.parametrize("model,num_tokens,num_reqs,page_size,p_in_registers,ping_pong,overlap",
                         [(*COMPILE_CASES[0], *schedule) for schedule in SCHEDULES]
                         + [(*case, *PREFILL_DEFAULTS) for case in COMPILE_CASES[1:]])
def test_the_kernel_compiles_for_an_h100(model, num_tokens, num_reqs, page_size, p_in_registers, ping_pong, overlap):
    """Mosaic GPU lowers the kernel for sm_90a within the H100's 227 KiB of shared memory a block, with a
    temporary under a megabyte beside the queries (the descriptions of its blocks), in every schedule
    (`SCHEDULES`)."""
    structs, head_dim = h100_kernel_args(model, num_tokens, num_reqs, page_size)
    fn = jax.jit(lambda *a: ragged_paged_attention_mgpu(*a, sm_scale=head_dim**-0.5, p_in_registers=p_in_registers,
                                                        ping_pong=ping_pong, overlap=overlap))
    compiled = fn.trace(*structs).lower(lowering_platforms=("cuda",)).compile()
    assert "mosaic_gpu" in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes < 2**20


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a deviceless compile: on a machine without a GPU")
@pytest.mark.parametrize("decode_only", [False, True], ids=["prefill", "decode"])
def test_an_fp8_cache_compiles_for_an_h100(decode_only):
    """With an FP8 cache, at Llama-3-8B's heads and the gpu preset's widest mixed or decode bucket, the
    settings `config_for` gives lower and compile for sm_90a within the shared memory: the e4m3 copies and
    their widening (e4m3 -> float16 -> bfloat16: sm_90 has no direct convert, which ptxas would refuse)."""
    structs, head_dim = h100_kernel_args("llama-3-8b", 256 if decode_only else 2048, 256, 16)
    structs[1:3] = [jax.ShapeDtypeStruct(structs[1].shape, FP8, sharding=structs[1].sharding)] * 2
    config = config_for(decode_only, jnp.bfloat16, FP8, 32, 8, head_dim, 16)
    fn = jax.jit(lambda *a: ragged_paged_attention_mgpu(*a, sm_scale=head_dim**-0.5, **config))
    compiled = fn.trace(*structs).lower(lowering_platforms=("cuda",)).compile()
    assert "mosaic_gpu" in compiled.as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu" or jax.__version_info__ < (0, 12),
                    reason="a deviceless compile that prints Mosaic GPU's PTX: jax >= 0.12 without a GPU")
@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas here (the gpu-compile extra or a CUDA toolkit has one)")
def test_the_defaults_and_the_fp8_settings_assemble_without_spills(tmp_path):
    """`benchmarks/mosaic_registers.py` deviceless: the prefill default, and an FP8 cache's prefill and decode
    settings (the producer widening its stages within 64 registers, the consumers within 224), assembled by
    ptxas for sm_90a at Llama-3-8B's heads, spill nothing to local memory."""
    names = ["prefill default (ping-pong)", "prefill FP8 (ping-pong)", "decode FP8"]
    script = Path(__file__).parents[2] / "benchmarks" / "mosaic_registers.py"
    done = subprocess.run([sys.executable, str(script), "--deviceless", "--timeout", "240", "--configs", *names,
                           "--json", str(tmp_path / "rows.json")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {row["configuration"]: row for row in json.loads((tmp_path / "rows.json").read_text())}
    assert set(rows) == set(names), done.stdout
    for name, row in rows.items():
        assert not row["error"] and row["registers"] > 0, (name, row)
        assert row["spill_store_bytes"] == row["spill_load_bytes"] == row["stack_bytes"] == 0, (name, row)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a deviceless compile: on a machine without a GPU")
@pytest.mark.parametrize("model,num_tokens,num_reqs,page_size", COMPILE_CASES[:2])
def test_a_persistent_grid_compiles_for_an_h100(model, num_tokens, num_reqs, page_size):
    """The persistent grid at the prefill defaults, 16 programs a KV head (an H100's 132 multiprocessors
    over Llama-3-8B's 8 KV heads): each program's descriptions in shared memory beside the defaults' buffers,
    the loop over its blocks, the queries' barriers."""
    structs, head_dim = h100_kernel_args(model, num_tokens, num_reqs, page_size)
    fn = jax.jit(lambda *a: ragged_paged_attention_mgpu(*a, sm_scale=head_dim**-0.5, p_in_registers=True,
                                                        ping_pong=True, programs_per_kv_head=16))
    compiled = fn.trace(*structs).lower(lowering_platforms=("cuda",)).compile()
    assert "mosaic_gpu" in compiled.as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a deviceless compile: on a machine without a GPU")
@pytest.mark.parametrize("config", [DEFAULTS, DECODE_DEFAULTS])
def test_gpt_oss_s_sinks_compile_for_an_h100(config):
    """GPT-OSS-20B's heads with their sinks and a window of 128, at the prefill and the decode defaults: the
    sinks' reads and the denominator's extra term lower for sm_90a."""
    num_tokens, num_reqs = (2048, 256) if config is DEFAULTS else (256, 256)
    structs, head_dim = h100_kernel_args("gpt-oss-20b", num_tokens, num_reqs, 16)
    sinks = jax.ShapeDtypeStruct((GPT_OSS_HEADS[0],), jnp.float32, sharding=structs[0].sharding)
    fn = jax.jit(lambda s, *a: ragged_paged_attention_mgpu(*a, sm_scale=head_dim**-0.5, sliding_window=128, sinks=s,
                                                           **config))
    compiled = fn.trace(sinks, *structs).lower(lowering_platforms=("cuda",)).compile()
    assert "mosaic_gpu" in compiled.as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a deviceless compile: on a machine without a GPU")
def test_hopper_prefills_take_the_mosaic_kernel_and_decodes_stay_on_triton():
    """The entry point's choice on an H100: mixed steps through Mosaic GPU, with attention sinks too, decode-only
    steps and an FP8 cache through the Triton kernels, unless opted in (JAXSERVE_MOSAIC_DECODE=1 and
    JAXSERVE_MOSAIC_FP8=1: `hopper_decode`, `hopper_fp8`)."""
    placed = on_one_device(deviceless_h100())

    def lowered(decode_only: bool, cache_dtype, hopper_decode: bool = False, sinks: bool = False,
                hopper_fp8: bool = False) -> str:
        shapes = [((64, 32, 128), jnp.bfloat16), ((8, 1024, 16, 128), cache_dtype), ((8, 1024, 16, 128), cache_dtype),
                  ((64,), jnp.int32), ((64, 64), jnp.int32), ((65,), jnp.int32)]
        structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=placed) for shape, dtype in shapes]
        fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.1, impl="pallas", hopper=True,
                                                       decode_only=decode_only, hopper_decode=hopper_decode,
                                                       sinks=jnp.zeros(32) if sinks else None, hopper_fp8=hopper_fp8))
        with jax.default_device(deviceless_h100()):
            return fn.trace(*structs).lower(lowering_platforms=("cuda",)).as_text()

    assert "mosaic_gpu" in lowered(False, jnp.bfloat16)
    assert "mosaic_gpu" in lowered(False, jnp.bfloat16, sinks=True)
    assert "mosaic_gpu" not in lowered(True, jnp.bfloat16)
    assert "mosaic_gpu" not in lowered(False, jnp.float8_e4m3fn)
    # Opted in (JAXSERVE_MOSAIC_DECODE=1), decode-only steps take the Mosaic GPU kernel; an FP8 cache not.
    assert "mosaic_gpu" in lowered(True, jnp.bfloat16, hopper_decode=True)
    assert "mosaic_gpu" in lowered(True, jnp.bfloat16, hopper_decode=True, sinks=True)
    assert "mosaic_gpu" not in lowered(True, jnp.float8_e4m3fn, hopper_decode=True)
    # Opted in (JAXSERVE_MOSAIC_FP8=1), an FP8 cache's steps take it too, mixed and (opted in) decode-only.
    assert "mosaic_gpu" in lowered(False, jnp.float8_e4m3fn, hopper_fp8=True)
    assert "mosaic_gpu" in lowered(True, jnp.float8_e4m3fn, hopper_decode=True, hopper_fp8=True)
    assert "mosaic_gpu" not in lowered(True, jnp.float8_e4m3fn, hopper_fp8=True)


def test_mosaic_decode_is_the_default_on_hopper_where_command_buffers_keep_it(monkeypatch):
    from jaxserve.ops import attention

    monkeypatch.delenv("JAXSERVE_MOSAIC_DECODE", raising=False)
    config = AttentionConfig(impl="pallas", compute_capability=9.0)
    for in_command_buffers in (True, False):  # jaxlib >= 0.12, and older
        monkeypatch.setattr(attention, "MOSAIC_IN_COMMAND_BUFFERS", in_command_buffers)
        assert config.mosaic_attention and config.mosaic_decode is in_command_buffers
    for setting, wanted in (("1", True), ("0", False)):  # either way, whatever the jaxlib
        monkeypatch.setenv("JAXSERVE_MOSAIC_DECODE", setting)
        assert config.mosaic_decode is wanted
        assert not AttentionConfig(impl="pallas", compute_capability=8.0).mosaic_decode  # an A100: Triton


def test_an_fp8_cache_on_the_mosaic_kernel_is_opt_in_and_part_of_the_trace_key(monkeypatch):
    """JAXSERVE_MOSAIC_FP8=1 sends an FP8 cache's Hopper steps to the Mosaic GPU kernel (until a GPU has run
    it); the variable is part of the environment a kept trace is keyed by."""
    from jaxserve.ops.attention import trace_environment

    monkeypatch.delenv("JAXSERVE_MOSAIC_FP8", raising=False)
    h100 = AttentionConfig(impl="pallas", num_sms=132, compute_capability=9.0)
    before = trace_environment()
    assert not h100.mosaic_fp8
    monkeypatch.setenv("JAXSERVE_MOSAIC_FP8", "1")
    assert h100.mosaic_fp8 and trace_environment() != before
    assert not AttentionConfig(impl="pallas", compute_capability=8.9).mosaic_fp8  # an L4: Triton's
    assert not AttentionConfig(impl="interpret", compute_capability=9.0).mosaic_fp8


def test_the_persistent_grid_is_opt_in_and_takes_a_wave_of_programs(monkeypatch):
    """JAXSERVE_MOSAIC_PERSISTENT=1 puts the Mosaic GPU kernel on a persistent grid, on Hopper only and where
    the SM count is known; the entry point then asks for the SMs over the KV heads, prefill and decode alike
    (the decodes dealt longest first, as the snake needs)."""
    from jaxserve.ops import attention
    from jaxserve.ops import paged_attention_mgpu as mgpu

    monkeypatch.delenv("JAXSERVE_MOSAIC_PERSISTENT", raising=False)
    h100 = AttentionConfig(impl="pallas", num_sms=132, compute_capability=9.0)
    assert not h100.mosaic_persistent
    monkeypatch.setenv("JAXSERVE_MOSAIC_PERSISTENT", "1")
    assert h100.mosaic_persistent
    assert not AttentionConfig(impl="pallas", num_sms=108, compute_capability=8.0).mosaic_persistent  # an A100
    assert not AttentionConfig(impl="pallas", compute_capability=9.0).mosaic_persistent  # no SM count

    calls = []
    monkeypatch.setattr(mgpu, "ragged_paged_attention_mgpu", lambda *a, **k: calls.append(k) or a[0])
    monkeypatch.setattr(mgpu, "ragged_paged_attention_hopper", lambda *a, **k: calls.append(k) or a[0])
    args = [np.zeros((64, 32, 128), jnp.bfloat16), *[np.zeros((8, 64, 16, 128), jnp.bfloat16)] * 2,
            np.zeros(64, np.int32), np.zeros((64, 4), np.int32), np.zeros(65, np.int32)]
    for decode_only in (False, True):
        attention.ragged_paged_attention(*args, sm_scale=0.1, impl="pallas", num_sms=132, decode_only=decode_only,
                                         hopper=True, hopper_decode=True, persistent=True)
    assert [call["programs_per_kv_head"] for call in calls] == [16, 16]  # 132 SMs over 8 KV heads
    assert calls[1]["heavy_first"]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a deviceless lowering: on a machine without a GPU")
def test_a_persistent_grid_takes_more_programs_where_the_descriptions_would_not_fit():
    """One program a KV head over 1,136 query blocks (an 8,192-token step of 1,024 requests, MHA heads)
    would need 145 KiB of descriptions beside the kernel's buffers: the grid grows to as many programs as
    fit them, rather than failing the step."""
    placed = on_one_device(deviceless_h100())
    pages = ((32, 4096, 16, 128), jnp.bfloat16)
    shapes = [((8192, 32, 128), jnp.bfloat16), pages, pages, ((1024,), jnp.int32), ((1024, 64), jnp.int32),
              ((1025,), jnp.int32)]
    structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=placed) for shape, dtype in shapes]
    fn = jax.jit(lambda *a: ragged_paged_attention_mgpu(*a, sm_scale=0.1, p_in_registers=True, ping_pong=True,
                                                        programs_per_kv_head=1))
    with jax.default_device(deviceless_h100()):
        assert "mosaic_gpu" in fn.trace(*structs).lower(lowering_platforms=("cuda",)).as_text()
