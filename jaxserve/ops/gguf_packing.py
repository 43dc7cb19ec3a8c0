"""The layout the native GGUF matmul reads (`cpu_kernels/matmul_gguf.cc`): a GGUF tensor's blocks interleaved
16 output features at a time, so that one 512-bit register holds four consecutive codes of 16 features.

A GGUF file stores a weight [N, K] as llama.cpp lays it out: row n holds K / 32 blocks, each its scale(s) and
its codes (`u8[N, K / 32 * block_bytes]`). Packed, the same bytes are regrouped per (group of 16 features,
block): the 16 features' d as f16[16], their m (Q4_1, Q5_1) as f16[16], then the code bytes in chunks of 64, chunk c
holding bytes 4c .. 4c + 3 of each feature's codes in turn: `u8[ceil(N / 16), group_bytes(kind, K)]`, with
features past N zero. No value changes: packing moves bytes (and the formats below, bits; Q3_K's and IQ4_XS's
6-bit scales become int8), and `unpack` inverts it.

Q5_0 and Q5_1 blocks (Q4_0's and Q4_1's with a 5th bit a code, u32 qh between the scales and the codes) keep
those bits as a plane between the scales and the code chunks: byte 4f + j of the plane holds in bit c the 5th
bit of the weight whose low bits are byte j of chunk c's low nibble (weight 4c + j), in bit 4 + c its high
nibble's (weight 16 + 4c + j). The plane holds the same bits as qh, so this is a permutation of bits.

Q4_K's super-blocks of 256 weights are packed per (group, super-block): the 16 features' d and dmin, their
8 scales and 8 mins unpacked from 6 bits to a byte each, then the super-block's 8 blocks of 32 codes, each as
a Q4_0 block's codes (byte j: weight j in the low nibble, j + 16 in the high). Q5_K's are Q4_K's with each
block's plane of 5th bits (as Q5_0's) before its codes.

Q6_K's super-blocks of 256 weights (16 sub-blocks of 16, each its own int8 scale, and 6-bit codes) are packed
per (group, super-block) too: the 16 features' d, their 16 scales, then each block of 32 as a Q4_0 block's
codes holding the codes' low 4 bits, followed by two planes of their high 2 bits (for the weights of the low
nibbles, then of the high nibbles): plane byte 4f + j holds in bits 2c .. 2c + 1 the high bits of the weight
whose low bits are in byte j of chunk c of feature f.

Q3_K's and Q2_K's super-blocks of 256 weights (16 sub-blocks of 16, each its own scale, Q2_K's a min too; codes
of 2 bits, Q3_K's with a mask of third bits) are packed per (group, super-block) as Q6_K's with 2-bit codes: the
16 features' d (Q2_K: and dmin), each sub-block's scales (Q3_K: int8, the 6 bits less 32; Q2_K: the file's byte
sc | mn << 4), then each block of 32 as two chunks of codes, byte 4f + j of chunk k holding in bits 2s .. 2s + 1
the code of weight 8s + 4k + j, and (Q3_K) a plane of the third bits, byte 4f + j holding in bit t that of
weight 4t + j.

IQ4_NL's blocks are Q4_0's, their nibbles indices into a table of 16 values, and pack as Q4_0's. IQ4_XS's
super-blocks of 256 weights (d, 8 6-bit scales, then each block's 16 code bytes as IQ4_NL's) are packed per
(group, super-block): the 16 features' d, their 8 scales as int8 (the 6 bits less 32), then the 8 blocks' codes
as Q4_0's.
"""

import functools
import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

FEATURES = 16  # output features per group
PIECE_BYTES = 2 << 20  # a tensor's blocks packed on one thread at least (more threads for a larger tensor)
SCALES = {"Q4_0": 1, "Q4_1": 2, "Q5_0": 1, "Q5_1": 2, "Q8_0": 1, "IQ4_NL": 1}  # f16 scales per block: d (and m)
PLANE_BYTES = {"Q5_0": 4, "Q5_1": 4, "Q5_K": 4}  # bytes of 5th bits per block of 32 weights (qh)
# A plane byte's bit for the 5th bit of weight 16 half + 4c + j (byte j of chunk c): 4 half + c, [half, chunk, 1].
FIFTH_BIT_SHIFTS = (4 * np.arange(2)[:, None, None] + np.arange(4)[None, :, None]).astype(np.uint8)
CODE_BYTES = {"Q4_0": 16, "Q4_1": 16, "Q5_0": 16, "Q5_1": 16, "Q8_0": 32, "IQ4_NL": 16}  # per block of 32 weights
SUPER = 256  # Q2_K .. Q6_K, IQ4_XS: weights per super-block (8 blocks of 32)
SUPER_KINDS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
Q4_K_BYTES = 2 + 2 + 12 + 128  # Q4_K: f16 d, f16 dmin, 6-bit scales and mins, 4-bit codes
Q4_K_HEAD = FEATURES * (2 + 2 + 8 + 8)  # Q4_K's packed tile: the features' d, dmin, 8 scales and 8 mins
Q4_K_DMIN_AT, Q4_K_SCALES_AT, Q4_K_MINS_AT = 2 * FEATURES, 4 * FEATURES, 12 * FEATURES  # where they start in it
Q4_K_TILE = Q4_K_HEAD + FEATURES * SUPER // 2  # Q4_K: one super-block of 16 features, packed
# Super-blocks of 8 blocks with 6-bit scales and mins (Q4_K, and Q5_K with qh[32], the codes' 5th bits): bytes.
SCALED_SUPER_BYTES = {"Q4_K": Q4_K_BYTES, "Q5_K": Q4_K_BYTES + SUPER // 8}
Q6_K_BYTES = SUPER // 2 + SUPER // 4 + 16 + 2  # Q6_K: ql (low 4 bits), qh (high 2), i8 scales[16], f16 d
Q6_K_HEAD = FEATURES * (2 + 16)  # Q6_K's packed tile: the features' d, then their 16 scales
Q6_K_SCALES_AT = 2 * FEATURES  # where the scales start in it (i8[16 sub-blocks][16 features])
Q6_K_BIAS = 32  # w = d * sc * (q - 32)
Q6_K_BLOCK = FEATURES * (32 // 2 + 32 // 4)  # then per block of 32: the codes' low 4 bits, their two planes
Q6_K_TILE = Q6_K_HEAD + 8 * Q6_K_BLOCK  # Q6_K: one super-block of 16 features, packed
Q3_K_BYTES = SUPER // 8 + SUPER // 4 + 12 + 2  # Q3_K: hmask (third bits), qs (low 2 bits), 6-bit scales, f16 d
Q3_K_BIAS = 4  # w = d * (ls - 32) * (q - 4), q = low bits | third bit << 2
Q2_K_BYTES = 16 + SUPER // 4 + 2 + 2  # Q2_K: scales (sc | mn << 4), qs (2 bits), f16 d, f16 dmin
TWO_BIT_SCALES_AT = {"Q3_K": 2 * FEATURES, "Q2_K": 4 * FEATURES}  # where the sub-blocks' scales start in a tile
TWO_BIT_HEAD = {kind: at + 16 * FEATURES for kind, at in TWO_BIT_SCALES_AT.items()}  # then the blocks
TWO_BIT_BLOCK = {"Q3_K": FEATURES * (8 + 4), "Q2_K": FEATURES * 8}  # a block of 32: codes (and third bits)
IQ4_XS_BYTES = 2 + 2 + 4 + SUPER // 2  # IQ4_XS: f16 d, u16 scales_h (2 high bits a block), u8 scales_l[4], codes
IQ4_XS_SCALES_AT = 2 * FEATURES  # IQ4_XS's packed tile: the features' d, then their 8 scales (i8[8][16])
IQ4_XS_HEAD = FEATURES * (2 + 8)
IQ4_XS_SCALE_BIAS = 32  # w = d * (ls - 32) * value(q), ls the file's 6-bit scale
IQ4_XS_TILE = IQ4_XS_HEAD + FEATURES * SUPER // 2  # IQ4_XS: one super-block of 16 features, packed
SUPER_BYTES = {**SCALED_SUPER_BYTES, "Q6_K": Q6_K_BYTES, "Q3_K": Q3_K_BYTES, "Q2_K": Q2_K_BYTES,
               "IQ4_XS": IQ4_XS_BYTES}  # a super-block's bytes in the file


def _by_group(blocks: np.ndarray, size: int) -> np.ndarray:
    """A file's rows u8[N, S * size] as u8[groups, 16, S, size] ([group, feature, block or super-block, bytes]),
    features past N zero (a view where N is a multiple of 16)."""
    n, row_bytes = blocks.shape
    units, groups = row_bytes // size, -(-n // FEATURES)
    if n % FEATURES == 0:
        return blocks.reshape(groups, FEATURES, units, size)
    padded = np.zeros((groups * FEATURES, units, size), np.uint8)
    padded[:n] = blocks.reshape(n, units, size)
    return padded.reshape(groups, FEATURES, units, size)


ALIGNMENT = 64  # bytes: jax's CPU client adopts a host buffer so aligned as the array's own, where it copies others


def _aligned_bytes(*shape: int) -> np.ndarray:
    """An uninitialized u8 array of `shape` starting on an ALIGNMENT boundary, so that `jax.device_put` on a CPU
    takes the packed blocks as they lie instead of copying them (numpy's own allocation is aligned to 16 bytes
    at least, and glibc's large ones sit 16 bytes past a page)."""
    size = math.prod(shape)
    raw = np.empty(size + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start: start + size].reshape(shape)


def _tiles(out: np.ndarray | None, groups: int, units: int, tile: int) -> np.ndarray:
    """A packer's output u8[groups, units, tile]: `out` (u8[groups, units * tile], C-contiguous: a piece of a
    larger output, written in place), or a fresh aligned array."""
    if out is None:
        return _aligned_bytes(groups, units, tile)
    if not out.flags.c_contiguous or out.shape != (groups, units * tile):
        raise ValueError(f"out must be a contiguous u8[{groups}, {units * tile}], not {out.shape}")
    return out.reshape(groups, units, tile)


def _words(fields: np.ndarray, width: int) -> np.ndarray:
    """u8[..., k * width] -> its k words of `width` bytes ([..., k]), a view where the layout allows: numpy moves a
    transposed array word by word, several times faster than byte by byte. The host's byte order, little-endian
    as the file's: byte j of a word is its bits 8j .. 8j + 7."""
    dtype = {2: np.uint16, 4: np.uint32}[width]
    try:
        return fields.view(dtype)
    except ValueError:  # the last axis not contiguous
        return np.ascontiguousarray(fields).view(dtype)


def _f16_fields(tiles: np.ndarray, at: int) -> np.ndarray:
    """Packed tiles [groups, S, tile]' 16 features' f16 at `at` -> u8[groups, 16, S, 2], the file's order."""
    groups, supers, _ = tiles.shape
    return tiles[..., at: at + 2 * FEATURES].reshape(groups, supers, FEATURES, 2).transpose(0, 2, 1, 3)


def block_bytes(kind: str) -> int:
    return 2 * SCALES[kind] + PLANE_BYTES.get(kind, 0) + CODE_BYTES[kind]


def tile_bytes(kind: str) -> int:  # one block of each of 16 features
    return FEATURES * block_bytes(kind)


def super_tile(kind: str) -> int:  # one packed super-block of 16 features: Q2_K .. Q6_K, IQ4_XS
    if kind == "Q6_K":
        return Q6_K_TILE
    if kind == "IQ4_XS":
        return IQ4_XS_TILE
    if kind in TWO_BIT_HEAD:
        return TWO_BIT_HEAD[kind] + 8 * TWO_BIT_BLOCK[kind]
    if kind not in SCALED_SUPER_BYTES:
        raise ValueError(f"{kind} has no super-blocks")
    return Q4_K_TILE + 8 * FEATURES * PLANE_BYTES.get(kind, 0)


def group_bytes(kind: str, k: int) -> int:  # one group's packed bytes for K inputs
    if kind in SUPER_KINDS:
        return k // SUPER * super_tile(kind)
    return k // 32 * tile_bytes(kind)


def pack(blocks: np.ndarray, kind: str, out: np.ndarray | None = None) -> np.ndarray:
    """u8[N, file's row bytes] -> u8[ceil(N / 16), group_bytes], into `out` where given (contiguous). A large
    tensor is packed in pieces of whole groups on as many threads as this process has cores (numpy lets go
    of the GIL as it moves and shifts), each piece in place in the output."""
    groups = -(-blocks.shape[0] // FEATURES)
    pieces = min(len(os.sched_getaffinity(0)), blocks.nbytes // PIECE_BYTES, groups)
    if pieces <= 1:
        return _pack_rows(blocks, kind, out)
    bounds = [groups * i // pieces for i in range(pieces + 1)]  # each piece's first group
    packed = _aligned_bytes(groups, _packed_row_bytes(kind, blocks.shape[1])) if out is None else out

    def pack_piece(i: int) -> None:
        rows = blocks[FEATURES * bounds[i]: FEATURES * bounds[i + 1]]
        _pack_rows(rows, kind, packed[bounds[i]: bounds[i + 1]])

    with ThreadPoolExecutor(pieces - 1, thread_name_prefix="jaxserve-gguf-pack") as pool:
        others = [pool.submit(pack_piece, i) for i in range(1, pieces)]
        pack_piece(0)
        for piece in others:
            piece.result()
    return packed


def pack_experts(blocks: np.ndarray, kind: str) -> np.ndarray:
    """A mixture's stacked experts u8[E, N, file's row bytes] -> u8[E, ceil(N / 16), group_bytes], each packed as
    `pack` packs it, into one aligned array."""
    experts, n, row_bytes = blocks.shape
    packed = _aligned_bytes(experts, -(-n // FEATURES), _packed_row_bytes(kind, row_bytes))
    for expert, expert_blocks in zip(packed, blocks, strict=True):
        pack(expert_blocks, kind, out=expert)
    return packed


def _packed_row_bytes(kind: str, row_bytes: int) -> int:  # a file's row of blocks -> its group's packed bytes
    if kind in SUPER_KINDS:
        return row_bytes // SUPER_BYTES[kind] * super_tile(kind)
    return row_bytes // block_bytes(kind) * tile_bytes(kind)


def _pack_rows(blocks: np.ndarray, kind: str, out: np.ndarray | None = None) -> np.ndarray:
    if kind in SCALED_SUPER_BYTES:
        return _pack_scaled_supers(blocks, kind, out)
    if kind == "Q6_K":
        return _pack_q6_k(blocks, out)
    if kind == "IQ4_XS":
        return _pack_iq4_xs(blocks, out)
    if kind in TWO_BIT_HEAD:
        return _pack_two_bit(blocks, kind, out)
    scales = SCALES[kind]
    grouped = _by_group(blocks, block_bytes(kind))  # [group, feature, block, bytes]
    groups, _, num_blocks, _ = grouped.shape
    tiles = _tiles(out, groups, num_blocks, tile_bytes(kind))  # each part written in place, word by word
    codes_at = 2 * scales + PLANE_BYTES.get(kind, 0)
    plane_at, tile_codes_at = 2 * scales * FEATURES, codes_at * FEATURES
    # [group, feature, block, scale] -> [group, block, scale, feature], f16 words
    tiles[..., :plane_at].view(np.uint16).reshape(groups, num_blocks, scales, FEATURES)[...] = (
        _words(grouped[..., : 2 * scales], 2).transpose(0, 2, 3, 1))
    # [group, feature, block, chunk] -> [group, block, chunk, feature], 4-byte words
    tiles[..., tile_codes_at:].view(np.uint32).reshape(groups, num_blocks, -1, FEATURES)[...] = (
        _words(grouped[..., codes_at:], 4).transpose(0, 2, 3, 1))
    if kind in PLANE_BYTES:  # [group, feature, block, 4 bytes] -> [group, block, feature, 4 bytes]
        tiles[..., plane_at:tile_codes_at].reshape(groups, num_blocks, FEATURES, 4)[...] = (
            _plane(grouped[..., 2 * scales: codes_at]).transpose(0, 2, 1, 3))
    return tiles.reshape(groups, num_blocks * tile_bytes(kind))


def unpack(packed: np.ndarray, kind: str, n: int) -> np.ndarray:
    """`pack`'s inverse: u8[ceil(N / 16), group_bytes] -> u8[N, file's row bytes]."""
    if kind in SCALED_SUPER_BYTES:
        return _unpack_scaled_supers(packed, kind, n)
    if kind == "Q6_K":
        return _unpack_q6_k(packed, n)
    if kind == "IQ4_XS":
        return _unpack_iq4_xs(packed, n)
    if kind in TWO_BIT_HEAD:
        return _unpack_two_bit(packed, kind, n)
    groups, row_bytes = packed.shape
    scales, num_blocks = SCALES[kind], row_bytes // tile_bytes(kind)
    tiles = packed.reshape(groups, num_blocks, tile_bytes(kind))
    codes_at = (2 * scales + PLANE_BYTES.get(kind, 0)) * FEATURES
    scale_part = tiles[..., : 2 * scales * FEATURES].reshape(groups, num_blocks, scales, FEATURES, 2)
    code_part = tiles[..., codes_at:].reshape(groups, num_blocks, -1, FEATURES, 4)
    parts = [scale_part.transpose(0, 3, 1, 2, 4).reshape(groups, FEATURES, num_blocks, -1),
             code_part.transpose(0, 3, 1, 2, 4).reshape(groups, FEATURES, num_blocks, -1)]
    if kind in PLANE_BYTES:
        plane = tiles[..., 2 * scales * FEATURES: codes_at].reshape(groups, num_blocks, FEATURES, 4)
        parts.insert(1, _qh(plane.transpose(0, 2, 1, 3)))
    per_feature = np.concatenate(parts, -1)
    return np.ascontiguousarray(per_feature.reshape(groups * FEATURES, num_blocks * block_bytes(kind))[:n])


LOW_NIBBLES = np.uint32(0x0F0F0F0F)  # in a word of 4 code bytes
FIELD_MASKS = {1: np.uint32(0x01010101), 2: np.uint32(0x03030303)}  # a word's bytes' lowest bit, lowest 2


def _gather_fields(words: np.ndarray, at: int, width: int) -> np.ndarray:
    """Words w_0, w_1, ... (u32[n, ...], n * width <= 8) -> one word (u32[...]) whose byte j holds in bits
    width * m .. width * (m + 1) - 1 the `width` bits at bit `at` of byte j of w_m: how the planes of high bits
    and the 2-bit chunks regroup a file's bit fields, a whole array at a time."""
    gathered = np.zeros(words.shape[1:], np.uint32)
    for m, word in enumerate(words):
        gathered |= ((word >> at) & FIELD_MASKS[width]) << (width * m)
    return gathered


@functools.cache
def _nibble_gather() -> np.ndarray:
    """u16[65536]: for 16 bits v, nibble j holds bits j, 4 + j, 8 + j, 12 + j of v in bits 0 .. 3 (Q5's plane, a
    half at a time)."""
    v = np.arange(1 << 16, dtype=np.uint32)
    table = np.zeros_like(v)
    for j in range(4):
        for c in range(4):
            table |= ((v >> (4 * c + j)) & 1) << (4 * j + c)
    table = table.astype(np.uint16)
    table.flags.writeable = False  # shared by every call and thread
    return table


def _spread_nibbles(x: np.ndarray) -> np.ndarray:  # u32 of 16 bits: nibble j -> bits 0 .. 3 of byte j
    return (x & 0xF) | ((x & 0xF0) << 4) | ((x & 0xF00) << 8) | ((x & 0xF000) << 12)


def _plane(qh: np.ndarray) -> np.ndarray:
    """Q5's qh (u8[..., 4], bit i the 5th bit of weight i) -> its plane u8[..., 4]: byte j's bit c that of weight
    4c + j, bit 4 + c that of weight 16 + 4c + j (each half of qh's 32 bits through a table)."""
    bits = _words(qh, 4)[..., 0].astype("<u4", copy=False)  # [...]: bit i, weight i (the file's byte order)
    table = _nibble_gather()
    low, high = (table[half].astype(np.uint32) for half in (bits & 0xFFFF, bits >> 16))
    plane = (_spread_nibbles(low) | (_spread_nibbles(high) << 4)).astype("<u4", copy=False)
    return plane.view(np.uint8).reshape(qh.shape)


def _qh(plane: np.ndarray) -> np.ndarray:
    """`_plane`'s inverse."""
    bits = (plane[..., None, None, :] >> FIFTH_BIT_SHIFTS) & 1  # [.., half, c, j]
    return np.packbits(bits.reshape(*plane.shape[:-1], 32), axis=-1, bitorder="little")


def _q4_0_words(first: np.ndarray, second: np.ndarray, low_block: np.ndarray, high_block: np.ndarray) -> None:
    """Two blocks of 32 codes held as ggml's K-quants hold them, words of 4 code bytes `first` (bytes 0 .. 15 of
    the 32) and `second` (16 .. 31) with the first block's weight l, 16 + l in byte l's low nibble and the second
    block's in its high nibble -> each block's codes as Q4_0's (byte j: weight j low, j + 16 high), as words, into
    `low_block` and `high_block` (all four of one shape, laid out as the tile wants them)."""
    np.bitwise_or(first & LOW_NIBBLES, (second & LOW_NIBBLES) << 4, out=low_block)
    np.bitwise_or((first >> 4) & LOW_NIBBLES, second & ~LOW_NIBBLES, out=high_block)


def _pack_scaled_supers(blocks: np.ndarray, kind: str, out: np.ndarray | None = None) -> np.ndarray:  # Q4_K, Q5_K
    qh_bytes = SCALED_SUPER_BYTES[kind] - Q4_K_BYTES  # Q5_K: qh[32] after the scales
    grouped = _by_group(blocks, SCALED_SUPER_BYTES[kind])  # [group, feature, super, bytes]
    groups, _, supers, _ = grouped.shape
    tiles = _tiles(out, groups, supers, super_tile(kind))  # each part written in place
    for at, field in ((0, 0), (Q4_K_DMIN_AT, 2)):  # d, dmin: f16 [group, feature, super] -> [group, super, feature]
        tiles[..., at: at + 2 * FEATURES].view(np.uint16)[...] = _words(grouped[..., field: field + 2], 2)[
            ..., 0].transpose(0, 2, 1)
    scales, mins = _q4_k_scales(grouped[..., 4:16])  # [group, feature, super, 8] each
    for at, values in ((Q4_K_SCALES_AT, scales), (Q4_K_MINS_AT, mins)):  # -> [group, super, 8, feature]
        tiles[..., at: at + 8 * FEATURES].reshape(groups, supers, 8, FEATURES)[...] = values.transpose(0, 2, 3, 1)
    # qs[32 i + l]: weight l of block 2i in the low nibble, of block 2i + 1 in the high; as words moved to the
    # tile's order first, [group, super, i, half of the 32 bytes, chunk, feature], so that the nibbles' arithmetic
    # runs over long rows
    qs = _words(grouped[..., 16 + qh_bytes:], 4).reshape(groups, FEATURES, supers, 4, 2, 4)
    qs = np.ascontiguousarray(qs.transpose(0, 2, 3, 4, 5, 1)).reshape(groups, supers, 4, 2, -1)
    plane_words = FEATURES * PLANE_BYTES.get(kind, 0) // 4
    per_block = tiles[..., Q4_K_HEAD:].view(np.uint32).reshape(groups, supers, 8, -1)  # [.., block, (plane,) codes]
    codes = per_block[..., plane_words:].reshape(groups, supers, 4, 2, -1)  # [.., i, block 2i + h, chunk x feature]
    _q4_0_words(qs[..., 0, :], qs[..., 1, :], codes[..., 0, :], codes[..., 1, :])
    if plane_words:  # bit b of qh[j] is block b's weight j's: block b's plane byte j' holds in bit m that of
        # qh[4m + j'] (weight 4c + j' for m = c, 16 + 4c + j' for m = 4 + c), so its words are those of qh's 8
        # words' bits b, each word's moved to bit m
        qh = np.ascontiguousarray(np.moveaxis(_words(grouped[..., 16:16 + qh_bytes], 4), -1, 0))  # [m, g, F, S]
        for block in range(8):
            per_block[..., block, :plane_words] = _gather_fields(qh, block, 1).transpose(0, 2, 1)
    return tiles.reshape(groups, supers * super_tile(kind))


def _unpack_scaled_supers(packed: np.ndarray, kind: str, n: int) -> np.ndarray:  # Q4_K or Q5_K
    groups, row_bytes = packed.shape
    tile, plane_bytes = super_tile(kind), FEATURES * PLANE_BYTES.get(kind, 0)
    supers = row_bytes // tile
    tiles = packed.reshape(groups, supers, tile)
    d, dmin = _f16_fields(tiles, 0), _f16_fields(tiles, Q4_K_DMIN_AT)
    scales, mins = (tiles[..., at: at + 8 * FEATURES].reshape(groups, supers, 8, FEATURES).transpose(0, 3, 1, 2)
                    for at in (Q4_K_SCALES_AT, Q4_K_MINS_AT))
    per_block = tiles[..., Q4_K_HEAD:].reshape(groups, supers, 8, -1)  # [.., block, (plane,) codes]
    q4 = per_block[..., plane_bytes:].reshape(groups, supers, 8, 4, FEATURES, 4).transpose(0, 4, 1, 2, 3, 5)
    q4 = q4.reshape(groups, FEATURES, supers, 8, 16)
    codes = np.concatenate([q4 & 15, q4 >> 4], -1).reshape(groups, FEATURES, supers, 4, 2, 32)
    qs = (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(groups, FEATURES, supers, 128)
    six_bit = np.concatenate([  # ggml's 12 bytes: low 6 bits of sc[0:4], mn[0:4]; the rest of sc, mn[4:8]
        scales[..., :4] | ((scales[..., 4:] >> 4) << 6),
        mins[..., :4] | ((mins[..., 4:] >> 4) << 6),
        (scales[..., 4:] & 15) | ((mins[..., 4:] & 15) << 4),
    ], -1)
    parts = [d, dmin, six_bit, qs]
    if plane_bytes:
        plane = per_block[..., :plane_bytes].reshape(groups, supers, 8, FEATURES, 4).transpose(0, 3, 1, 2, 4)
        bits = np.unpackbits(_qh(plane), axis=-1, bitorder="little")  # [group, feature, super, block, j]
        parts.insert(3, np.packbits(bits.transpose(0, 1, 2, 4, 3), axis=-1, bitorder="little")[..., 0])  # qh[32]
    blocks = np.concatenate(parts, -1).reshape(groups * FEATURES, supers * SCALED_SUPER_BYTES[kind])
    return np.ascontiguousarray(blocks[:n])


def _q4_k_scales(six_bit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> its 8 scales and 8 mins, u8[..., 8] each (ggml's `get_scale_min_k4`)."""
    low, high, rest = six_bit[..., 0:4], six_bit[..., 4:8], six_bit[..., 8:12]
    scales = np.concatenate([low & 63, (rest & 15) | ((low >> 6) << 4)], -1)
    mins = np.concatenate([high & 63, (rest >> 4) | ((high >> 6) << 4)], -1)
    return scales.astype(np.uint8), mins.astype(np.uint8)


def _pack_q6_k(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    grouped = _by_group(blocks, Q6_K_BYTES)  # [group, feature, super, bytes]
    groups, _, supers, _ = grouped.shape
    scales_at, d_at = SUPER // 2 + SUPER // 4, Q6_K_BYTES - 2
    tiles = _tiles(out, groups, supers, Q6_K_TILE)  # each part written in place
    tiles[..., :Q6_K_SCALES_AT].view(np.uint16)[...] = _words(grouped[..., d_at:], 2)[..., 0].transpose(0, 2, 1)
    tiles[..., Q6_K_SCALES_AT: Q6_K_HEAD].reshape(groups, supers, 16, FEATURES)[...] = (
        grouped[..., scales_at:d_at].transpose(0, 2, 3, 1))  # [group, super, sub-block, feature]
    # Half n of 128 weights: ql[64 n + l]'s low nibble is weight l, ql[64 n + 32 + l]'s weight 32 + l, their high
    # nibbles weights 64 + l and 96 + l; qh[32 n + l]'s bits 2k .. 2k + 1 the high bits of weight 32k + l.
    # ql as words in the tile's order, [group, super, n, m, 16 bytes of 32, chunk, feature]
    ql = _words(grouped[..., :SUPER // 2], 4).reshape(groups, FEATURES, supers, 2, 2, 2, 4)
    ql = np.ascontiguousarray(ql.transpose(0, 2, 3, 4, 5, 6, 1)).reshape(groups, supers, 2, 2, 2, -1)
    per_block = tiles[..., Q6_K_HEAD:].view(np.uint32).reshape(groups, supers, 8, -1)  # [.., block, codes, planes]
    codes = per_block[..., : 4 * FEATURES].reshape(groups, supers, 2, 2, 2, -1)  # [.., n, h, m, chunk x feature]
    for m in range(2):  # blocks 4n + m (low nibbles) and 4n + 2 + m (high)
        _q4_0_words(ql[..., m, 0, :], ql[..., m, 1, :], codes[..., 0, m, :], codes[..., 1, m, :])
    # qh[32 n + 16 p + 4 c + j] as words, [n, p, c, group, feature, super]: block 4n + k's plane p holds in bits
    # 2c .. 2c + 1 of byte j the bits 2k .. 2k + 1 of byte j of word (n, p, c)
    qh = _words(grouped[..., SUPER // 2: scales_at], 4).reshape(groups, FEATURES, supers, 2, 2, 4)
    qh = np.ascontiguousarray(qh.transpose(3, 4, 5, 0, 1, 2))
    planes = per_block[..., 4 * FEATURES:].reshape(groups, supers, 2, 4, 2, FEATURES)  # [.., n, k, p, feature]
    for n, k, half in itertools.product(range(2), range(4), range(2)):
        planes[:, :, n, k, half] = _gather_fields(qh[n, half], 2 * k, 2).transpose(0, 2, 1)
    return tiles.reshape(groups, supers * Q6_K_TILE)


def _unpack_q6_k(packed: np.ndarray, n: int) -> np.ndarray:
    groups, row_bytes = packed.shape
    supers = row_bytes // Q6_K_TILE
    tiles = packed.reshape(groups, supers, Q6_K_TILE)
    d = _f16_fields(tiles, 0)
    scales = tiles[..., Q6_K_SCALES_AT: Q6_K_HEAD].reshape(groups, supers, 16, FEATURES).transpose(0, 3, 1, 2)
    per_block = tiles[..., Q6_K_HEAD:].reshape(groups, supers, 8, Q6_K_BLOCK)
    code_bytes = FEATURES * 32 // 2
    q4 = per_block[..., :code_bytes].reshape(groups, supers, 8, 4, FEATURES, 4).transpose(0, 4, 1, 2, 3, 5)
    planes = per_block[..., code_bytes:].reshape(groups, supers, 8, 2, FEATURES, 4).transpose(0, 4, 1, 2, 3, 5)
    q4 = q4.reshape(groups, FEATURES, supers, 8, 16)
    low = np.stack([q4 & 15, q4 >> 4], -2)  # [.., block, half, 16]
    high = np.stack([(planes >> (2 * c)) & 3 for c in range(4)], -2).reshape(groups, FEATURES, supers, 8, 2, 16)
    codes = (low | (high << 4)).reshape(groups, FEATURES, supers, SUPER)
    blocks = np.concatenate([_q6_k_bytes(codes), scales, d], -1).reshape(groups * FEATURES, supers * Q6_K_BYTES)
    return np.ascontiguousarray(blocks[:n])


def _q6_k_codes(bits: np.ndarray) -> np.ndarray:
    """Q6_K's ql[128] and qh[64] -> its 256 codes in order, u8[..., 256] of 0 .. 63 (ggml's `dequantize_row_q6_K`:
    each half of 128 weights takes 64 bytes of ql, low then high nibbles, and 32 of qh, 2 bits per weight)."""
    ql = bits[..., :128].reshape(*bits.shape[:-1], 2, 64)
    qh = bits[..., 128:192].reshape(*bits.shape[:-1], 2, 1, 32)
    low = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], -2)  # [.., 2, 4, 32]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    return (low | (high << 4)).reshape(*bits.shape[:-1], 256)


def _q6_k_bytes(codes: np.ndarray) -> np.ndarray:
    """`_q6_k_codes`' inverse: u8[..., 256] codes -> ql[128] and qh[64], u8[..., 192]."""
    q = codes.reshape(*codes.shape[:-1], 2, 4, 32)
    ql = np.concatenate([(q[..., 0, :] & 15) | ((q[..., 2, :] & 15) << 4),
                         (q[..., 1, :] & 15) | ((q[..., 3, :] & 15) << 4)], -1)  # [.., 2, 64]
    qh = sum((q[..., c, :] >> 4) << (2 * c) for c in range(4)).astype(np.uint8)  # [.., 2, 32]
    return np.concatenate([ql.reshape(*codes.shape[:-1], 128), qh.reshape(*codes.shape[:-1], 64)], -1)


def _pack_iq4_xs(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    grouped = _by_group(blocks, IQ4_XS_BYTES)  # [group, feature, super, bytes]
    groups, _, supers, _ = grouped.shape
    scales_h = grouped[..., 2:4].copy().view("<u2")  # [.., 1]: bits 2i .. 2i + 1 block i's high 2 bits
    scales_l = grouped[..., 4:8, None] >> np.array([0, 4], np.uint8)  # [.., 4, 2]: blocks 2i, 2i + 1's low 4
    high = (scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [.., 8]
    scales = ((scales_l.reshape(*high.shape) & 15) | (high << 4).astype(np.uint8)) - np.uint8(IQ4_XS_SCALE_BIAS)
    tiles = _tiles(out, groups, supers, IQ4_XS_TILE)  # each part written in place
    tiles[..., :IQ4_XS_SCALES_AT].view(np.uint16)[...] = _words(grouped[..., 0:2], 2)[..., 0].transpose(0, 2, 1)
    tiles[..., IQ4_XS_SCALES_AT: IQ4_XS_HEAD].reshape(groups, supers, 8, FEATURES)[...] = (
        scales.transpose(0, 2, 3, 1))  # [group, super, block, feature]: int8 bytes
    # each block's 16 code bytes, as Q4_0's, as words: [group, feature, super, block, chunk] -> [.., block, chunk,
    # feature]
    tiles[..., IQ4_XS_HEAD:].view(np.uint32).reshape(groups, supers, 8, 4, FEATURES)[...] = _words(
        grouped[..., 8:], 4).reshape(groups, FEATURES, supers, 8, 4).transpose(0, 2, 3, 4, 1)
    return tiles.reshape(groups, supers * IQ4_XS_TILE)


def _unpack_iq4_xs(packed: np.ndarray, n: int) -> np.ndarray:
    groups, row_bytes = packed.shape
    supers = row_bytes // IQ4_XS_TILE
    tiles = packed.reshape(groups, supers, IQ4_XS_TILE)
    d = _f16_fields(tiles, 0)
    scales = tiles[..., IQ4_XS_SCALES_AT: IQ4_XS_HEAD].reshape(groups, supers, 8, FEATURES).transpose(0, 3, 1, 2)
    six_bit = (scales + np.uint8(IQ4_XS_SCALE_BIAS)) & 63  # [group, feature, super, block]
    scales_l = (six_bit[..., 0::2] & 15) | ((six_bit[..., 1::2] & 15) << 4)
    scales_h = ((six_bit >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)
    codes = tiles[..., IQ4_XS_HEAD:].reshape(groups, supers, 8, 4, FEATURES, 4).transpose(0, 4, 1, 2, 3, 5)
    parts = [d, scales_h[..., None].astype("<u2").view(np.uint8), scales_l, codes.reshape(groups, FEATURES, supers, -1)]
    blocks = np.concatenate(parts, -1).reshape(groups * FEATURES, supers * IQ4_XS_BYTES)
    return np.ascontiguousarray(blocks[:n])


def two_bit_codes(qs: np.ndarray) -> np.ndarray:
    """Q2_K's and Q3_K's qs[64] -> their 256 low 2 bits in order, u8[..., 256] (ggml's layout: byte l of each
    half of 32 bytes holds weights 128 half + 32i + l in bits 2i .. 2i + 1)."""
    q = qs.reshape(*qs.shape[:-1], 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
    return (q & 3).reshape(*qs.shape[:-1], SUPER)


def _two_bit_qs(codes: np.ndarray) -> np.ndarray:  # `two_bit_codes`' inverse
    q = codes.reshape(*codes.shape[:-1], 2, 4, 32)
    return sum(q[..., i, :] << (2 * i) for i in range(4)).astype(np.uint8).reshape(*codes.shape[:-1], 64)


def q3_k_third_bits(hmask: np.ndarray) -> np.ndarray:  # hmask u8[..., 32] -> u8[..., 256]: bit i of byte l, 32i + l
    return ((hmask[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(*hmask.shape[:-1], SUPER)


def q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> its 16 6-bit scales, u8[..., 16] (ggml's `dequantize_row_q3_K`): low 4 bits of scale
    8 half + i in byte i's half, high 2 bits of scale 4k + i in bits 2k of byte 8 + i."""
    low = (packed[..., None, 0:8] >> np.array([0, 4], np.uint8)[:, None]) & 15  # [.., 2, 8]
    high = (packed[..., None, 8:12] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [.., 4, 4]
    return (low.reshape(*packed.shape[:-1], 16) | (high.reshape(*packed.shape[:-1], 16) << 4)).astype(np.uint8)


def _q3_k_scale_bytes(scales: np.ndarray) -> np.ndarray:  # `q3_k_scales`' inverse: u8[..., 16] -> u8[..., 12]
    low, high = scales & 15, (scales >> 4).reshape(*scales.shape[:-1], 4, 4)
    return np.concatenate([low[..., :8] | (low[..., 8:] << 4),
                           sum(high[..., k, :] << (2 * k) for k in range(4)).astype(np.uint8)], -1)


def _pack_two_bit(blocks: np.ndarray, kind: str, out: np.ndarray | None = None) -> np.ndarray:  # Q3_K or Q2_K
    grouped = _by_group(blocks, Q3_K_BYTES if kind == "Q3_K" else Q2_K_BYTES)  # [group, feature, super, bytes]
    groups, _, supers, _ = grouped.shape
    if kind == "Q3_K":
        qs_at, factors_at = 32, (108,)  # d
        scales = q3_k_scales(grouped[..., 96:108]) - np.uint8(32)  # int8 bytes
    else:
        qs_at, factors_at, scales = 16, (80, 82), grouped[..., :16]  # d, dmin
    tiles = _tiles(out, groups, supers, super_tile(kind))  # each part written in place
    for i, at in enumerate(factors_at):  # f16 [group, feature, super] -> [group, super, feature]
        tiles[..., 2 * FEATURES * i: 2 * FEATURES * (i + 1)].view(np.uint16)[...] = _words(
            grouped[..., at: at + 2], 2)[..., 0].transpose(0, 2, 1)
    scales_at = TWO_BIT_SCALES_AT[kind]
    tiles[..., scales_at: TWO_BIT_HEAD[kind]].reshape(groups, supers, 16, FEATURES)[...] = (
        scales.transpose(0, 2, 3, 1))  # [group, super, sub-block, feature]
    per_block = tiles[..., TWO_BIT_HEAD[kind]:].view(np.uint32).reshape(groups, supers, 8, -1)
    # qs[32 h + 4 q + j] as words [h, q, group, feature, super]: block 4h + i's weight l in bits 2i of byte l of
    # half h, so chunk k of block 4h + i holds in bits 2s .. 2s + 1 of byte j bits 2i .. 2i + 1 of word (h, 2s + k)
    qs = _words(grouped[..., qs_at: qs_at + SUPER // 4], 4).reshape(groups, FEATURES, supers, 2, 8)
    qs = np.ascontiguousarray(qs.transpose(3, 4, 0, 1, 2))
    for h, i, k in itertools.product(range(2), range(4), range(2)):
        chunk = _gather_fields(qs[h, k::2], 2 * i, 2)  # words (h, 2s + k), s = 0 .. 3
        per_block[:, :, 4 * h + i, FEATURES * k: FEATURES * (k + 1)] = chunk.transpose(0, 2, 1)
    if kind == "Q3_K":  # hmask[4t + j]'s bit b is the third bit of block b's weight 4t + j: plane byte j's bit t
        hmask = np.ascontiguousarray(np.moveaxis(_words(grouped[..., :32], 4), -1, 0))  # [t, group, feature, super]
        for block in range(8):
            per_block[:, :, block, 2 * FEATURES:] = _gather_fields(hmask, block, 1).transpose(0, 2, 1)
    return tiles.reshape(groups, supers * super_tile(kind))


def _unpack_two_bit(packed: np.ndarray, kind: str, n: int) -> np.ndarray:  # Q3_K or Q2_K
    groups, row_bytes = packed.shape
    supers, head = row_bytes // super_tile(kind), TWO_BIT_HEAD[kind]
    tiles = packed.reshape(groups, supers, super_tile(kind))
    scales_at = TWO_BIT_SCALES_AT[kind]
    factors = [_f16_fields(tiles, at) for at in range(0, scales_at, 2 * FEATURES)]  # d (and dmin)
    scales = tiles[..., scales_at: head].reshape(groups, supers, 16, FEATURES).transpose(0, 3, 1, 2)
    per_block = tiles[..., head:].reshape(groups, supers, 8, TWO_BIT_BLOCK[kind])
    chunks = per_block[..., :128].reshape(groups, supers, 8, 2, FEATURES, 4).transpose(0, 4, 1, 2, 3, 5)
    codes = np.stack([(chunks >> (2 * s)) & 3 for s in range(4)], -3)  # [group, feature, super, block, s, k, j]
    qs = _two_bit_qs(codes.reshape(groups, FEATURES, supers, SUPER))
    if kind == "Q2_K":
        parts = [scales, qs, *factors]
    else:
        plane = per_block[..., 128:].reshape(groups, supers, 8, FEATURES, 4).transpose(0, 3, 1, 2, 4)
        third = np.stack([(plane >> t) & 1 for t in range(8)], -2)  # [.., block, t, j]: weight 32 block + 4t + j
        bits = third.reshape(groups, FEATURES, supers, 8, 32)  # [.., i, l]: weight 32i + l
        hmask = sum(bits[..., i, :] << i for i in range(8)).astype(np.uint8)
        parts = [hmask, qs, _q3_k_scale_bytes(scales + np.uint8(32)), *factors]
    size = Q3_K_BYTES if kind == "Q3_K" else Q2_K_BYTES
    blocks = np.concatenate(parts, -1).reshape(groups * FEATURES, supers * size)
    return np.ascontiguousarray(blocks[:n])
