"""MXFP4 weights (the OCP microscaling format GPT-OSS's experts are stored in), decoded on load.

A block of 32 weights is 16 bytes of 4-bit E2M1 codes, two to a byte (the low nibble first), and one E8M0
scale byte, the block's power of two plus 127. The serving dtype holds the decoded values exactly (the codes
are +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} times a power of two). No jax here: this runs on the host as the
checkpoint streams in.
"""

import numpy as np

# E2M1: the 16 codes' values (sign bit first, then 2 exponent bits and 1 mantissa bit).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)
SCALE_BIAS = 127


def decode_mxfp4(
    blocks: np.ndarray,  # u8[..., G, 16]: G blocks of 32 codes per row
    scales: np.ndarray,  # u8[..., G]
) -> np.ndarray:  # f32[..., G * 32]
    """The weights of MXFP4 blocks, block by block in the order they are stored."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match their scales {scales.shape}")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # u8[..., G, 16, 2]: low nibble first
    values = E2M1_VALUES[codes].reshape(*blocks.shape[:-1], 32)  # f32[..., G, 32]
    exponents = scales.astype(np.int32) - SCALE_BIAS
    values = np.ldexp(values, exponents[..., None])
    return values.reshape(*blocks.shape[:-2], -1)
