"""The layout the native GGUF matmul reads (`cpu_kernels/matmul_gguf.cc`): a GGUF tensor's blocks interleaved
16 output features at a time, so that one 512-bit register holds four consecutive codes of 16 features.

A GGUF file stores a weight [N, K] as llama.cpp lays it out: row n holds K / 32 blocks, each its scale(s) and
its codes (`u8[N, K / 32 * block_bytes]`). Packed, the same bytes are regrouped per (group of 16 features,
block): the 16 features' d as f16[16], their m (Q4_1) as f16[16], then the code bytes in chunks of 64, chunk c
holding bytes 4c .. 4c + 3 of each feature's codes in turn: `u8[ceil(N / 16), K / 32 * tile_bytes]`, with
features past N zero. No value changes: packing is a permutation of bytes, and `unpack` inverts it.
"""

import numpy as np

FEATURES = 16  # output features per group
SCALES = {"Q4_0": 1, "Q4_1": 2, "Q8_0": 1}  # f16 scales per block: d (and m)
CODE_BYTES = {"Q4_0": 16, "Q4_1": 16, "Q8_0": 32}  # code bytes per block of 32 weights


def block_bytes(kind: str) -> int:
    return 2 * SCALES[kind] + CODE_BYTES[kind]


def tile_bytes(kind: str) -> int:  # one block of each of 16 features
    return FEATURES * block_bytes(kind)


def pack(blocks: np.ndarray, kind: str) -> np.ndarray:
    """u8[N, K / 32 * block_bytes] (the file's rows) -> u8[ceil(N / 16), K / 32 * tile_bytes]."""
    n, row_bytes = blocks.shape
    per_block, scales = block_bytes(kind), SCALES[kind]
    num_blocks, groups = row_bytes // per_block, -(-n // FEATURES)
    padded = np.zeros((groups * FEATURES, num_blocks, per_block), np.uint8)
    padded[:n] = blocks.reshape(n, num_blocks, per_block)
    grouped = padded.reshape(groups, FEATURES, num_blocks, per_block)
    # [group, feature, block, scale, 2 bytes] -> [group, block, scale, feature, 2 bytes]
    scale_part = grouped[..., : 2 * scales].reshape(groups, FEATURES, num_blocks, scales, 2).transpose(0, 2, 3, 1, 4)
    # [group, feature, block, chunk, 4 bytes] -> [group, block, chunk, feature, 4 bytes]
    code_part = grouped[..., 2 * scales:].reshape(groups, FEATURES, num_blocks, -1, 4).transpose(0, 2, 3, 1, 4)
    tiles = np.concatenate([scale_part.reshape(groups, num_blocks, -1), code_part.reshape(groups, num_blocks, -1)], -1)
    return np.ascontiguousarray(tiles.reshape(groups, num_blocks * tile_bytes(kind)))


def unpack(packed: np.ndarray, kind: str, n: int) -> np.ndarray:
    """`pack`'s inverse: u8[ceil(N / 16), K / 32 * tile_bytes] -> u8[N, K / 32 * block_bytes]."""
    groups, group_bytes = packed.shape
    scales, num_blocks = SCALES[kind], group_bytes // tile_bytes(kind)
    tiles = packed.reshape(groups, num_blocks, tile_bytes(kind))
    scale_part = tiles[..., : 2 * scales * FEATURES].reshape(groups, num_blocks, scales, FEATURES, 2)
    code_part = tiles[..., 2 * scales * FEATURES:].reshape(groups, num_blocks, -1, FEATURES, 4)
    per_feature = np.concatenate([
        scale_part.transpose(0, 3, 1, 2, 4).reshape(groups, FEATURES, num_blocks, -1),
        code_part.transpose(0, 3, 1, 2, 4).reshape(groups, FEATURES, num_blocks, -1),
    ], -1)
    return np.ascontiguousarray(per_feature.reshape(groups * FEATURES, num_blocks * block_bytes(kind))[:n])
