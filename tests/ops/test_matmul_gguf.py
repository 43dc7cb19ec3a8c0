"""The native GGUF matmul against a float64 oracle of the `gguf` package's own dequantization and of the kernel's
8-bit rounding of the activations, for every block format it reads (`cpu_kernels.matmul_gguf`)."""

import threading

import jax
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL, dequantize, quantize

from jaxserve.ops import cpu_kernels, gguf_packing
from tests.helpers import run_with_kernel_flags, skip_a_build_like_the_suite_s

pytestmark = [
    pytest.mark.cpu_only("the native CPU kernels"),
    pytest.mark.skipif(cpu_kernels.kernel_error() is not None, reason=str(cpu_kernels.kernel_error())),
]

KINDS = tuple(cpu_kernels.GGUF_KINDS)
# Rows: one tile row, a partial tile, whole tiles, past a 64-row chunk. Columns: below and past a 4-row tile
# and a 16-row unit, a group's second 8 features in part (AVX2's second half tile, AVX-512's masked store). K:
# one block, odd block counts, SmolLM2's widths.
ROWS = (1, 3, 4, 7, 64, 65)
SHAPES = ((32, 1), (32, 5), (96, 17), (576, 192), (1536, 33), (160, 64), (64, 29))
SUPER_SHAPES = ((256, 1), (256, 17), (512, 33), (768, 192), (1536, 5), (256, 29))  # K in super-blocks of 256
SUPER_KINDS = gguf_packing.SUPER_KINDS  # the gguf package quantizes to none of them: random super-blocks


def shapes(kind: str) -> tuple[tuple[int, int], ...]:
    return SUPER_SHAPES if kind in SUPER_KINDS else SHAPES


def _f16_bytes(values: np.ndarray) -> np.ndarray:  # f32[...] -> u8[..., 2]
    return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8).reshape(*values.shape, 2)


def _q4_k_blocks(n: int, k: int, rng: np.random.Generator, size: int = 144) -> np.ndarray:  # u8[N, K / 256 * size]
    """Random Q4_K (or Q5_K: `size` 176) super-blocks: any 6-bit scales and mins and codes (and 5th bits), d
    and dmin of a real file's magnitudes, one super-block far from the others' scale, a zero row, and scales
    among float16's subnormals."""
    blocks = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    blocks[..., 0:2] = _f16_bytes(rng.uniform(1e-3, 2e-2, blocks.shape[:2]))
    blocks[..., 2:4] = _f16_bytes(rng.uniform(0.0, 2e-2, blocks.shape[:2]))
    blocks[:, 0, 0:2] = _f16_bytes(np.full(n, 0.8))
    if n > 2:
        blocks[1] = 0
        blocks[2, 0, 0:4] = _f16_bytes(np.full(2, 1e-6)).reshape(4)
    return blocks.reshape(n, -1)


# Where the float16 factors lie in a super-block (d, and Q2_K's dmin after it), and how many, for the formats
# whose random blocks take any bytes elsewhere.
FACTORS_AT = {"Q2_K": (80, 2), "Q3_K": (108, 1), "Q6_K": (208, 1), "IQ4_XS": (0, 1)}


def _random_super_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:  # u8[N, row bytes]
    """Random Q2_K, Q3_K, Q6_K or IQ4_XS super-blocks: any codes, scales (Q6_K's int8 -128 and 127 among them)
    and mins, d (and dmin) of a real file's magnitudes, one super-block far from the others' scale, a zero row,
    and a d among float16's subnormals."""
    size, (at, count) = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1], FACTORS_AT[kind]
    blocks = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    if kind == "Q6_K":
        blocks[..., 192] = 0x80  # scale -128
        blocks[..., 193] = 0x7F
    factors = _f16_bytes(rng.uniform(-1e-3, 1e-3, (*blocks.shape[:2], count)))
    blocks[..., at: at + 2 * count] = factors.reshape(*blocks.shape[:2], -1)
    blocks[:, 0, at: at + 2] = _f16_bytes(np.full(n, 0.05))
    if n > 2:
        blocks[1] = 0
        blocks[2, 0, at: at + 2] = _f16_bytes(np.full(1, 1e-6)).reshape(2)
    return blocks.reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:  # f32[N, K] -> u8[N, K / 256 * 210]
    """Q6_K blocks of real weights (the gguf package does not quantize to Q6_K): each sub-block of 16 a scale
    max|w| / 31 rounded to an int8 multiple of the super-block's d, codes rint(w / (d * sc)) + 32 in 0 .. 63."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(-1) / 31  # [N, super, 16]
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16)  # [N, super, 1]
    d32 = d.astype(np.float32)
    sc = np.rint(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)).clip(-128, 127)
    step = (d32 * sc)[..., None]
    codes = np.rint(np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)).clip(-32, 31) + 32
    bits = gguf_packing._q6_k_bytes(codes.astype(np.uint8).reshape(n, k // 256, 256))
    return np.concatenate([bits, sc.astype(np.int8).view(np.uint8), d.view(np.uint8)], -1).reshape(n, -1)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:  # f32[N, K] -> u8[N, K / 256 * 110]
    """Q3_K blocks of real weights: each sub-block of 16 a scale (its largest magnitude over -4) as a 6-bit
    multiple of the super-block's d (less 32: -32 .. 31), codes rint(w / (d * sc)) in -4 .. 3."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    scale = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0] / -4  # [N, S, 16]
    d = (np.abs(scale).max(-1, keepdims=True) / 32).astype(np.float16)
    d32 = d.astype(np.float32)
    sc = np.rint(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)).clip(-32, 31)
    step = (d32 * sc)[..., None]
    q = (np.rint(np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)).clip(-4, 3) + 4).astype(np.uint8)
    q = q.reshape(n, k // 256, 256)
    hmask = ((q >> 2).reshape(n, k // 256, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)
    parts = [hmask, gguf_packing._two_bit_qs(q & 3), gguf_packing._q3_k_scale_bytes((sc + 32).astype(np.uint8)),
             d.view(np.uint8)]
    return np.concatenate(parts, -1).reshape(n, -1)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:  # f32[N, K] -> u8[N, K / 256 * 84]
    """Q2_K blocks of real weights: each sub-block of 16 a 4-bit multiple of d for its step (its range over 3)
    and of dmin for its min (at most 0), codes rint((w + min) / step) in 0 .. 3."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    low = np.maximum(-sub.min(-1), 0.0)  # [N, S, 16]: the min to add back
    step = (sub.max(-1) + low) / 3
    d, dmin = ((x.max(-1, keepdims=True) / 15).astype(np.float16) for x in (step, low))
    sc, mn = (np.rint(np.divide(x, f.astype(np.float32), out=np.zeros_like(x), where=f > 0)).clip(0, 15)
              for x, f in ((step, d), (low, dmin)))
    width, offset = (d.astype(np.float32) * sc)[..., None], (dmin.astype(np.float32) * mn)[..., None]
    q = np.rint(np.divide(sub + offset, width, out=np.zeros_like(sub), where=width > 0)).clip(0, 3).astype(np.uint8)
    scales = (sc.astype(np.uint8) | (mn.astype(np.uint8) << 4))
    parts = [scales, gguf_packing._two_bit_qs(q.reshape(n, k // 256, 256)), d.view(np.uint8), dmin.view(np.uint8)]
    return np.concatenate(parts, -1).reshape(n, -1)


IQ4_VALUES = np.asarray(IQ4_NL.kvalues, np.float32)


def _nearest_iq4_codes(w: np.ndarray, step: np.ndarray) -> np.ndarray:  # f32[..., 32], [..., 1] -> u8 0 .. 15
    scaled = np.divide(w, step, out=np.zeros_like(w), where=step != 0)
    return np.abs(scaled[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)


def _iq4_bytes(codes: np.ndarray) -> np.ndarray:  # u8[..., 32] codes -> [..., 16]: weight j low, j + 16 high
    return codes[..., :16] | (codes[..., 16:] << 4)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:  # f32[N, K] -> u8[N, K / 32 * 18]
    """IQ4_NL blocks of real weights (the gguf package does not quantize to the IQ4 formats): a block's d maps
    its largest magnitude to the table's -127, each code the table's nearest value."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32).astype(np.float32)
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)  # [N, block, 1]
    d = (largest / -127).astype(np.float16)
    codes = _nearest_iq4_codes(blocks, d.astype(np.float32))
    return np.concatenate([d.view(np.uint8), _iq4_bytes(codes)], -1).reshape(n, -1)


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:  # f32[N, K] -> u8[N, K / 256 * 136]
    """IQ4_XS super-blocks of real weights: each block's scale (its largest magnitude over -127) a 6-bit multiple
    of the super-block's d (scales less 32 in -32 .. 31), each code the table's nearest value."""
    n, k = w.shape
    blocks = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0] / -127  # [N, S, 8]
    d = (np.abs(largest).max(-1, keepdims=True) / 32).astype(np.float16)  # [N, S, 1]
    d32 = d.astype(np.float32)
    sc = np.rint(np.divide(largest, d32, out=np.zeros_like(largest), where=d32 > 0)).clip(-32, 31)
    codes = _nearest_iq4_codes(blocks, (d32 * sc)[..., None])  # [N, S, 8, 32]
    ls = (sc + 32).astype(np.uint8)
    scales_h = ((ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)
    scales_l = (ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)
    parts = [d.view(np.uint8), scales_h[..., None].astype("<u2").view(np.uint8), scales_l,
             _iq4_bytes(codes).reshape(n, k // 256, 128)]
    return np.concatenate(parts, -1).reshape(n, -1)


def _blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:  # u8[N, file's row bytes]
    rng = np.random.default_rng(seed)
    if kind in ("Q4_K", "Q5_K"):
        return _q4_k_blocks(n, k, rng, 144 if kind == "Q4_K" else 176)
    if kind in FACTORS_AT:
        return _random_super_blocks(kind, n, k, rng)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[:, :32] *= 40.0  # one block per row far from the others' scale
    if n > 2:
        w[1] = 0.0  # a zero row: scale 0
        w[2, :32] = 1e-6  # scales among float16's subnormals
    if kind != "IQ4_NL":
        return quantize(w, GGMLQuantizationType[kind])
    blocks = quantize_iq4_nl(w).reshape(n, -1, 18)
    if n > 2:  # this quantizer's d for 1e-6 rounds to 0 in float16: a subnormal d, set directly
        blocks[2, 0, 0:2] = _f16_bytes(np.full(1, 1e-6)).reshape(2)
    return blocks.reshape(n, -1)


def rounded_activations(x: np.ndarray) -> np.ndarray:
    """f64 of x [M, K] as the kernel rounds it, per block of 32: dx = max|x| / 127, integers rint(x * (1 / dx)),
    in float32 arithmetic as the kernel computes them."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    dx = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    inverse = np.divide(np.float32(1), dx, out=np.zeros_like(dx), where=dx >= np.finfo(np.float32).tiny)
    return (np.rint(blocks * inverse).astype(np.float64) * dx.astype(np.float64)).reshape(m, k)


def check_product(kind: str, x: np.ndarray, blocks: np.ndarray, rounding_cost: float | None = 2e-2) -> None:
    """The kernel's x [M, K] @ blocks' weights^T against the float64 product of x rounded to 8 bits per block with
    the dequantized weights (the kernel's contract, up to float32 sums), and within `rounding_cost` of the
    product with x as it is (what the rounding costs; None: not checked)."""
    n = blocks.shape[0]
    weights = dequantize(blocks, GGMLQuantizationType[kind]).astype(np.float64)  # [N, K]
    call = jax.jit(cpu_kernels.matmul_gguf, static_argnums=(2, 3))
    got = np.asarray(call(x, gguf_packing.pack(blocks, kind), kind, n))
    assert got.shape == (x.shape[0], n)
    scale = np.abs(x).astype(np.float64) @ np.abs(weights).T  # float32 sums: error relative to sum |x||w|
    assert np.all(np.abs(got - rounded_activations(x) @ weights.T) <= 1e-6 * scale + 1e-30), (kind, x.shape, n)
    if rounding_cost is not None:
        exact = x.astype(np.float64) @ weights.T
        assert np.all(np.abs(got - exact) <= rounding_cost * scale + 1e-30), (kind, x.shape, n)


def check_against_float64(kind: str, m: int) -> None:
    """`check_product` on random activations and blocks of every shape, one block of x all zeros (scale 0)."""
    rng = np.random.default_rng(m)
    for k, n in shapes(kind):
        x = rng.standard_normal((m, k)).astype(np.float32)
        if k > 32:
            x[0, 32:64] = 0.0  # an all-zero block of activations: scale 0
        check_product(kind, x, _blocks(kind, n, k))


# Where each block's codes lie in the file's bytes, and the code byte of largest magnitude: every nibble 15
# (Q8_0: 127; Q5's qh and Q6_K's high bits all ones too; the IQ4 formats: every nibble 0, the value -127). Q3_K's
# and Q2_K's bytes all ones give their largest unsigned codes, what AVX2's pairs of products in int16 take.
CODE_BYTES = {"Q4_0": (18, slice(2, 18), 0xFF), "Q4_1": (20, slice(4, 20), 0xFF), "Q5_0": (22, slice(2, 22), 0xFF),
              "Q5_1": (24, slice(4, 24), 0xFF), "Q8_0": (34, slice(2, 34), 0x7F), "Q4_K": (144, slice(16, 144), 0xFF),
              "Q5_K": (176, slice(16, 176), 0xFF), "Q6_K": (210, slice(0, 192), 0xFF),
              "IQ4_NL": (18, slice(2, 18), 0x00), "IQ4_XS": (136, slice(8, 136), 0x00),
              "Q3_K": (110, slice(0, 96), 0xFF), "Q2_K": (84, slice(16, 80), 0xFF)}


def check_largest_sums(kind: str) -> None:
    """Every code at its largest and every activation at +-127 after rounding: the largest integer sums a block can
    make (AVX2's `vpmaddubsw` adds pairs of products in int16 lanes, saturating); the same oracle."""
    k, n = (512, 33) if kind in SUPER_KINDS else (96, 33)
    size, codes, largest = CODE_BYTES[kind]
    blocks = _blocks(kind, n, k).reshape(n, -1, size)
    blocks[..., codes] = largest
    x = np.stack([np.ones(k), -np.ones(k), np.where(np.arange(k) // 32 % 2 == 0, 3.0, -0.5)]).astype(np.float32)
    check_product(kind, x, blocks.reshape(n, -1), rounding_cost=None)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", ROWS)
def test_matmul_against_float64(kind, m):
    check_against_float64(kind, m)


@pytest.mark.parametrize("kind", KINDS)
def test_the_largest_block_sums_do_not_overflow(kind):
    check_largest_sums(kind)


def check_grouped(kind: str) -> None:
    """The grouped kernel: each group's rows times its own blocks against the same float64 oracle, groups
    empty, of one row, of a partial and of several tiles, past a 64-row chunk; rows past the groups zero."""
    rng = np.random.default_rng(7)
    (k, n), groups = shapes(kind)[2], (3, 0, 1, 70, 0, 4)
    blocks = [_blocks(kind, n, k, seed=g) for g in range(len(groups))]
    x = rng.standard_normal((sum(groups) + 2, k)).astype(np.float32)
    packed = np.stack([gguf_packing.pack(b, kind) for b in blocks])
    call = jax.jit(cpu_kernels.grouped_matmul_gguf, static_argnums=(3, 4))
    got = np.asarray(call(x, packed, np.asarray(groups, np.int32), kind, n))
    start = 0
    for size, group_blocks in zip(groups, blocks, strict=True):
        weights = dequantize(group_blocks, GGMLQuantizationType[kind]).astype(np.float64)
        rows = x[start:start + size]
        scale = np.abs(rows).astype(np.float64) @ np.abs(weights).T
        want = rounded_activations(rows) @ weights.T
        assert np.all(np.abs(got[start:start + size] - want) <= 1e-6 * scale + 1e-30), (kind, size)
        start += size
    assert (got[start:] == 0).all()
    # Sizes below zero are empty groups, and sizes past the rows stop at the last row.
    sizes = np.asarray([-3, 0, len(x) + 9, 0, 0, 0], np.int32)
    got = np.asarray(call(x, packed, sizes, kind, n))
    weights = dequantize(blocks[2], GGMLQuantizationType[kind]).astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(weights).T
    assert np.all(np.abs(got - rounded_activations(x) @ weights.T) <= 1e-6 * scale + 1e-30), kind


@pytest.mark.parametrize("kind", KINDS)
def test_grouped_matmul_against_float64(kind):
    check_grouped(kind)


@pytest.mark.slow
@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx"], ids=["avx2", "plain loops"])
def test_the_other_instruction_sets_match_too(flags):
    """Built without AVX-512 (AVX2's `vpmaddubsw` and rounding) and without AVX (plain loops, F16C's conversions
    too), in a process of its own (the library is loaded once per process): the same oracle. The flags are the
    attention kernel's narrower builds' (tests/ops/test_attention.py), so the suite builds each library once."""
    skip_a_build_like_the_suite_s(flags)
    script = """
        from tests.ops.test_matmul_gguf import KINDS, ROWS, check_against_float64, check_grouped, check_largest_sums
        for kind in KINDS:
            check_largest_sums(kind)
            check_grouped(kind)
            for m in ROWS:
                check_against_float64(kind, m)
        print("ok")
    """
    result = run_with_kernel_flags(script, flags)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"])
def test_packing_is_a_permutation_that_unpacks_exactly(kind):
    """Packed, every byte of the file's blocks is kept once (Q5's 5th bits once, as a plane; features past N are
    zero), and unpacking gives the file's rows back; a packed tile holds the 16 features' scales, their plane,
    then their codes 4 bytes at a time."""
    blocks = _blocks(kind, 37, 96, seed=1)
    packed = gguf_packing.pack(blocks, kind)
    assert packed.shape == (3, 3 * gguf_packing.tile_bytes(kind))
    assert np.array_equal(gguf_packing.unpack(packed, kind, 37), blocks)
    plane_bytes = gguf_packing.PLANE_BYTES.get(kind, 0)
    if plane_bytes:
        assert np.unpackbits(packed).sum() == np.unpackbits(blocks).sum()
    else:
        assert np.array_equal(np.sort(packed, axis=None)[-blocks.size:], np.sort(blocks, axis=None))
    scale_bytes = 2 * gguf_packing.SCALES[kind]
    tile = packed[0, : gguf_packing.tile_bytes(kind)]  # group 0, block 0
    assert np.array_equal(tile[2:4], blocks[1, :2])  # feature 1's d
    chunk_1 = 16 * (scale_bytes + plane_bytes) + 64  # code bytes 4 .. 7 of each feature
    codes = scale_bytes + plane_bytes
    assert np.array_equal(tile[chunk_1 + 4 * 5: chunk_1 + 4 * 6], blocks[5, codes + 4: codes + 8])
    if plane_bytes:  # feature 5's byte 3 of chunk 1: weights 7 and 23's 5th bits
        qh = int.from_bytes(blocks[5, scale_bytes: codes].tobytes(), "little")
        byte = tile[16 * scale_bytes + 4 * 5 + 3]
        assert (byte >> 1) & 1 == (qh >> 7) & 1 and (byte >> 5) & 1 == (qh >> 23) & 1


@pytest.mark.parametrize("kind", KINDS)
def test_packing_reads_the_file_s_rows_wherever_they_lie(kind):
    """Blocks read-only (as a memory-mapped file gives them), at an odd byte offset and a row stride that no 2- or
    4-byte word divides, or in Fortran order (where packing cannot view its fields as words), pack as their
    contiguous copy does, at whole and partial groups of 16 features, and unpack to them; the features past N
    pack as zero rows would."""
    for n in (32, 37):
        blocks = _blocks(kind, n, 512, seed=7)
        wider = np.zeros((n, blocks.shape[1] + 3), np.uint8)
        wider[:, 1: 1 + blocks.shape[1]] = blocks
        lying = wider[:, 1: 1 + blocks.shape[1]]
        lying.flags.writeable = False
        packed = gguf_packing.pack(blocks.copy(), kind)
        for layout in (lying, np.asfortranarray(blocks)):
            assert np.array_equal(gguf_packing.pack(layout, kind), packed), n
        assert np.array_equal(gguf_packing.unpack(packed, kind, n), blocks), n
        zero_rows = np.zeros((48 - n, blocks.shape[1]), np.uint8)
        assert np.array_equal(packed, gguf_packing.pack(np.concatenate([blocks, zero_rows]), kind)[: len(packed)])


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_K", "Q6_K"])
def test_a_large_tensor_packs_in_pieces_on_threads_as_it_does_whole(kind, monkeypatch):
    """A tensor past `PIECE_BYTES` is packed in pieces of whole groups (here 3 uneven ones, on 3 cores: 5, 5 and
    6 groups, the last partial), the first on the calling thread and the others on the pool's, each in place in
    one array."""
    blocks = _blocks(kind, 16 * 15 + 7, 512, seed=8)
    whole = gguf_packing.pack(blocks, kind)
    pieces = {}  # the piece's first row -> (its rows, the thread that packed it)
    outs = []  # where each piece was packed
    pack_rows = gguf_packing._pack_rows

    def spying(rows: np.ndarray, kind: str, out: np.ndarray | None = None) -> np.ndarray:
        first = (rows.__array_interface__["data"][0] - blocks.__array_interface__["data"][0]) // blocks.strides[0]
        pieces[first] = rows.shape[0], threading.current_thread().name
        outs.append(out)
        return pack_rows(rows, kind, out)

    monkeypatch.setattr(gguf_packing, "PIECE_BYTES", 1024)
    monkeypatch.setattr(gguf_packing.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(gguf_packing, "_pack_rows", spying)
    packed = gguf_packing.pack(blocks, kind)
    assert np.array_equal(packed, whole)
    assert all(out is not None and np.shares_memory(out, packed) for out in outs), "each piece packed in place"
    assert {first: rows for first, (rows, _) in pieces.items()} == {0: 80, 80: 80, 160: 87}
    assert pieces[0][1] == threading.current_thread().name
    assert all(pieces[first][1].startswith("jaxserve-gguf-pack") for first in (80, 160)), pieces


@pytest.mark.parametrize("pieces", [1, 3])
def test_packed_blocks_are_aligned_so_the_cpu_takes_them_without_a_copy(pieces, monkeypatch):
    """Every format's packed blocks (and a mixture's stacked experts', each packed as alone) start on a 64-byte
    boundary, packed whole or in pieces on threads, and `jax.device_put` on the CPU keeps that buffer as the
    device array's (a copy would be a second 4.6 GB at an 8B model's start)."""
    if pieces > 1:
        monkeypatch.setattr(gguf_packing, "PIECE_BYTES", 1024)
        monkeypatch.setattr(gguf_packing.os, "sched_getaffinity", lambda pid: set(range(pieces)))
    for kind in KINDS:
        blocks = _blocks(kind, 16 * 9 + 5, 512, seed=9)
        experts = np.stack([blocks, blocks[::-1]])
        for packed in (gguf_packing.pack(blocks, kind), gguf_packing.pack_experts(experts, kind)):
            assert packed.ctypes.data % gguf_packing.ALIGNMENT == 0, kind
            on_device = jax.device_put(packed, jax.devices("cpu")[0])
            assert on_device.unsafe_buffer_pointer() == packed.ctypes.data, kind
        assert np.array_equal(gguf_packing.pack_experts(experts, kind)[1], gguf_packing.pack(blocks[::-1], kind))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_q4_k_and_q5_k_packing_unpack_exactly_with_scales_and_codes_in_bytes(kind):
    """Q4_K's and Q5_K's 6-bit scales and mins come out one per byte, in ggml's order, and pack back to the same
    12 bytes; each block's codes are laid out as Q4_0's, Q5_K's after the block's plane of 5th bits (bit b of
    qh[j]: block b's weight j)."""
    size = gguf_packing.SCALED_SUPER_BYTES[kind]
    tile_bytes = gguf_packing.super_tile(kind)
    plane = 64 if kind == "Q5_K" else 0
    blocks = _blocks(kind, 37, 512, seed=2)
    packed = gguf_packing.pack(blocks, kind)
    assert packed.shape == (3, 2 * tile_bytes)
    assert np.array_equal(gguf_packing.unpack(packed, kind, 37), blocks)
    supers = blocks.reshape(37, 2, size)
    scales, mins = gguf_packing._q4_k_scales(supers[..., 4:16])
    tile = packed[0, :tile_bytes]  # group 0, super-block 0
    assert np.array_equal(tile[64 + 16 * 5: 64 + 16 * 6], scales[:16, 0, 5])  # every feature's scale of block 5
    assert np.array_equal(tile[192 + 16 * 6: 192 + 16 * 7], mins[:16, 0, 6])
    # block 3 is the high nibbles of the file's second 32 bytes; feature 4's code byte 0 holds weights 0 and 16
    qs = supers[4, 0, 16 + plane // 2 + 32: 16 + plane // 2 + 64] >> 4
    block_3 = tile[320 + (plane + 256) * 3:]
    assert block_3[plane + 4 * 4] == qs[0] | (qs[16] << 4)
    if plane:  # feature 4's plane byte 2: bit 1 the 5th bit of weight 6, bit 5 of weight 22 (bit 3 of qh[6], qh[22])
        qh = supers[4, 0, 16:48]
        assert (block_3[4 * 4 + 2] >> 1) & 1 == (qh[6] >> 3) & 1 and (block_3[4 * 4 + 2] >> 5) & 1 == (qh[22] >> 3) & 1
    with pytest.raises(Exception, match="mismatched shapes"):  # K must be whole super-blocks
        cpu_kernels.matmul_gguf(np.ones((2, 480), np.float32), packed[:, :-tile_bytes // 2], kind, 37)


def test_q6_k_packing_unpacks_exactly_with_its_high_bits_in_planes():
    """Q6_K's codes come apart into a Q4_0 block's low 4 bits and two planes of high 2 bits, and pack back to the
    file's ql and qh; each feature's d and 16 scales lead the tile."""
    blocks = _blocks("Q6_K", 37, 512, seed=3)
    packed = gguf_packing.pack(blocks, "Q6_K")
    assert packed.shape == (3, 2 * gguf_packing.Q6_K_TILE)
    assert np.array_equal(gguf_packing.unpack(packed, "Q6_K", 37), blocks)
    supers = blocks.reshape(37, 2, 210)
    codes = gguf_packing._q6_k_codes(supers[..., :192])  # [feature, super, 256]
    weights = dequantize(blocks, GGMLQuantizationType.Q6_K).reshape(37, 2, 256)
    scales = supers[..., 192:208].view(np.int8).astype(np.float32)
    d = supers[..., 208:210].copy().view(np.float16).astype(np.float32)  # [feature, super, 1]
    assert np.array_equal(weights, d * np.repeat(scales, 16, -1) * (codes.astype(np.float32) - 32))
    tile = packed[0, gguf_packing.Q6_K_TILE:]  # group 0, super-block 1
    assert np.array_equal(tile[2 * 7: 2 * 8], supers[7, 1, 208:210])  # feature 7's d
    assert np.array_equal(tile[32 + 16 * 9: 32 + 16 * 10], supers[:16, 1, 192 + 9])  # every feature's scale 9
    block = tile[288 + 384 * 3:]  # block 3: codes 96 .. 127; feature 4's byte 2 of chunk 1: codes 102 and 118
    assert block[64 + 4 * 4 + 2] == (codes[4, 1, 102] & 15) | ((codes[4, 1, 118] & 15) << 4)
    assert (block[256 + 4 * 4 + 2] >> 2) & 3 == codes[4, 1, 102] >> 4  # the low nibbles' plane, bits 2c ..
    assert (block[320 + 4 * 4 + 2] >> 2) & 3 == codes[4, 1, 118] >> 4  # the high nibbles' plane


def test_iq4_xs_packing_unpacks_exactly_with_its_scales_as_int8():
    """IQ4_XS's 6-bit scales come out one int8 a byte (less 32), in ggml's order, and pack back to the file's
    scales_h and scales_l; each block's codes are laid out as Q4_0's; the weights are d * sc * value(q)."""
    blocks = _blocks("IQ4_XS", 37, 512, seed=5)
    packed = gguf_packing.pack(blocks, "IQ4_XS")
    assert packed.shape == (3, 2 * gguf_packing.IQ4_XS_TILE)
    assert np.array_equal(gguf_packing.unpack(packed, "IQ4_XS", 37), blocks)
    supers = blocks.reshape(37, 2, 136)
    tile = packed[0, gguf_packing.IQ4_XS_TILE:]  # group 0, super-block 1
    scales = tile[32:160].view(np.int8).reshape(8, 16).T.astype(np.float32)  # [feature, block]
    d = supers[:16, 1, 0:2].copy().view(np.float16).astype(np.float32)  # [feature, 1]
    codes = supers[:16, 1, 8:].reshape(16, 8, 16)
    values = IQ4_VALUES[np.concatenate([codes & 15, codes >> 4], -1)]  # [feature, block, 32]
    weights = dequantize(blocks, GGMLQuantizationType.IQ4_XS).reshape(37, 2, 8, 32)
    assert np.array_equal(weights[:16, 1], (d * scales)[..., None] * values)
    assert (scales >= -32).all() and (scales <= 31).all() and scales.min() == -32 and scales.max() == 31
    assert np.array_equal(tile[2 * 7: 2 * 8], supers[7, 1, 0:2])  # feature 7's d
    block = tile[gguf_packing.IQ4_XS_HEAD + 256 * 3:]  # block 3; feature 4's bytes 4 .. 7 lead chunk 1
    assert np.array_equal(block[64 + 4 * 4: 64 + 4 * 5], codes[4, 3, 4:8])


@pytest.mark.parametrize("kind", ["Q3_K", "Q2_K"])
def test_q3_k_and_q2_k_packing_unpacks_exactly_with_2_bit_codes_in_chunks(kind):
    """Q3_K's and Q2_K's codes come apart into chunks of 2 bits (and Q3_K's plane of third bits) and pack back to
    the file's bytes; each feature's d (Q2_K: and dmin) and 16 scales lead the tile; the weights are
    d * sc * (q - 4) (Q3_K) or d * sc * q - dmin * mn (Q2_K)."""
    blocks = _blocks(kind, 37, 512, seed=6)
    packed = gguf_packing.pack(blocks, kind)
    assert packed.shape == (3, 2 * gguf_packing.super_tile(kind))
    assert np.array_equal(gguf_packing.unpack(packed, kind, 37), blocks)
    size = blocks.shape[1] // 2
    supers = blocks.reshape(37, 2, size)
    weights = dequantize(blocks, GGMLQuantizationType[kind]).reshape(37, 2, 16, 16)
    if kind == "Q3_K":
        codes = gguf_packing.two_bit_codes(supers[..., 32:96]) | (gguf_packing.q3_k_third_bits(supers[..., :32]) << 2)
        scales = gguf_packing.q3_k_scales(supers[..., 96:108]).astype(np.float32) - 32
        d = supers[..., 108:110].copy().view(np.float16).astype(np.float32)[..., None]  # [feature, super, 1, 1]
        assert np.array_equal(weights, d * scales[..., None] * (codes.reshape(37, 2, 16, 16) - 4.0))
    else:
        codes = gguf_packing.two_bit_codes(supers[..., 16:80]).reshape(37, 2, 16, 16).astype(np.float32)
        d, dmin = (supers[..., at: at + 2].copy().view(np.float16).astype(np.float32) for at in (80, 82))  # [.., 1]
        sc, mn = (supers[..., :16] & 15).astype(np.float32), (supers[..., :16] >> 4).astype(np.float32)
        assert np.array_equal(weights, (d * sc)[..., None] * codes - (dmin * mn)[..., None])
    tile = packed[0, gguf_packing.super_tile(kind):]  # group 0, super-block 1
    at, d_at = gguf_packing.TWO_BIT_SCALES_AT[kind], {"Q3_K": 108, "Q2_K": 80}[kind]
    assert np.array_equal(tile[2 * 7: 2 * 8], supers[7, 1, d_at: d_at + 2])  # feature 7's d
    want_scales = scales.astype(np.int8).view(np.uint8) if kind == "Q3_K" else supers[..., :16]
    assert np.array_equal(tile[at + 16 * 9: at + 16 * 10], want_scales[:16, 1, 9])  # every feature's sub-block 9
    block = tile[gguf_packing.TWO_BIT_HEAD[kind] + gguf_packing.TWO_BIT_BLOCK[kind] * 3:]  # weights 96 .. 127
    all_codes = codes.reshape(37, 2, 256)
    # chunk 1's byte 2 of feature 4: weights 8s + 4 + 2 (s = 0 .. 3) of the block, 2 bits each
    byte = block[64 + 4 * 4 + 2]
    assert [(byte >> (2 * s)) & 3 for s in range(4)] == [int(all_codes[4, 1, 96 + 8 * s + 6]) & 3 for s in range(4)]
    if kind == "Q3_K":  # the plane's byte 2 of feature 4: bit t the third bit of weight 4t + 2
        plane = block[128 + 4 * 4 + 2]
        assert [(plane >> t) & 1 for t in range(8)] == [int(all_codes[4, 1, 96 + 4 * t + 2]) >> 2 for t in range(8)]


@pytest.mark.parametrize("kind", ["IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K"])
def test_the_tests_quantizers_keep_weights_close(kind):
    """The tests' quantizers for the formats the gguf package does not write (real weights for the model tests):
    the dequantized weights follow the originals."""
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    quantizer = {"IQ4_NL": quantize_iq4_nl, "IQ4_XS": quantize_iq4_xs, "Q3_K": quantize_q3_k, "Q2_K": quantize_q2_k}
    got = dequantize(quantizer[kind](w), GGMLQuantizationType[kind])
    assert got.shape == w.shape and np.abs(got - w).max() < 0.5 * np.abs(w).max()
    assert np.corrcoef(got.ravel(), w.ravel())[0, 1] > {"Q3_K": 0.95, "Q2_K": 0.85}.get(kind, 0.99)


def test_matmul_refuses_mismatched_blocks():
    packed = gguf_packing.pack(_blocks("Q4_1", 4, 64), "Q4_1")
    with pytest.raises(Exception, match="mismatched shapes"):
        cpu_kernels.matmul_gguf(np.ones((2, 96), np.float32), packed, "Q4_1", 4)
    with pytest.raises(ValueError, match="17 output features are 2 groups of 16, not 1"):
        cpu_kernels.matmul_gguf(np.ones((2, 64), np.float32), packed, "Q4_1", 17)
    with pytest.raises(ValueError, match="u8 blocks"):
        cpu_kernels.matmul_gguf(np.ones((2, 64), np.float32), packed.astype(np.int32), "Q4_1", 4)


def test_empty_rows():
    packed = gguf_packing.pack(_blocks("Q8_0", 3, 64), "Q8_0")
    assert cpu_kernels.matmul_gguf(np.ones((0, 64), np.float32), packed, "Q8_0", 3).shape == (0, 3)


def test_packing_into_a_given_output_writes_it_in_place_and_refuses_one_it_cannot():
    blocks = _blocks("Q4_K", 40, 512, seed=9)
    whole = gguf_packing.pack(blocks, "Q4_K")
    out = np.zeros_like(whole)
    assert gguf_packing.pack(blocks, "Q4_K", out=out) is not None and np.array_equal(out, whole)
    wide = np.zeros((whole.shape[0], 2 * whole.shape[1]), np.uint8)
    for wrong in (wide[:, ::2], np.zeros((whole.shape[0], whole.shape[1] + 1), np.uint8)):  # strided; wrong size
        with pytest.raises(ValueError, match="out must be a contiguous"):
            gguf_packing.pack(blocks, "Q4_K", out=wrong)
