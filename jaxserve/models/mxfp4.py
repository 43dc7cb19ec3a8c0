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


# llama.cpp's GGUF blocks (`block_mxfp4` and `block_q5_0`): 32 weights each, codes j and j + 16 in the low and
# high nibbles of byte j.
GGML_MXFP4_BYTES = 17  # u8 e (E8M0), u8 qs[16]
GGML_Q5_0_BYTES = 22  # f16 d, u8 qh[4] (bit j: code j's fifth bit), u8 qs[16]
_DOUBLED_VALUES = (2 * E2M1_VALUES).astype(np.int8)  # the codes' values times 2: integers in -12 .. 12
_F16_EXPONENTS = range(-24, 16)  # the powers of two float16 holds (subnormal from 2^-24)


def ggml_mxfp4_as_q5_0(
    blocks: np.ndarray,  # u8[..., n * 17]: a GGUF tensor's rows of MXFP4 blocks
) -> np.ndarray | None:  # u8[..., n * 22]
    """The same weights as Q5_0 blocks, exactly, or None where a block's scale is beyond float16's powers
    of two (but for a block of zeros, whatever its scale). Q5_0 is d * (q - 16) with 5-bit codes q: twice
    an E2M1 value is an integer in -12 .. 12, so q = 2v + 16 and d = 2^(e - 128) hold each weight exactly,
    at 5.5 bits a weight (MXFP4's: 4.25), and a GGUF file's MXFP4 experts (gpt-oss's) run on the native
    kernel's Q5_0 path."""
    blocks = np.asarray(blocks, np.uint8)
    rows, row_bytes = blocks.shape[:-1], blocks.shape[-1]
    if row_bytes % GGML_MXFP4_BYTES:
        raise ValueError(f"MXFP4 rows of {row_bytes} bytes are not whole blocks of {GGML_MXFP4_BYTES}")
    mx = blocks.reshape(-1, GGML_MXFP4_BYTES)
    exponents = mx[:, 0].astype(np.int32) - SCALE_BIAS - 1  # d = 2^(e - 128): the doubled values' scale
    zero = ((mx[:, 1:] & 0x77) == 0).all(axis=1)  # every code +-0: any scale gives the block's zeros
    exponents = np.where(zero, 0, exponents)
    if exponents.size and (exponents.min() < _F16_EXPONENTS.start or exponents.max() >= _F16_EXPONENTS.stop):
        return None
    codes = np.concatenate([mx[:, 1:] & 0x0F, mx[:, 1:] >> 4], axis=1)  # u8[B, 32], weights 0 .. 31
    q = (_DOUBLED_VALUES[codes].astype(np.int16) + 16).astype(np.uint8)  # 4 .. 28
    out = np.empty((mx.shape[0], GGML_Q5_0_BYTES), np.uint8)
    out[:, :2] = np.ldexp(np.float16(1.0), exponents).astype(np.float16).view(np.uint8).reshape(-1, 2)
    fifth_bits = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    out[:, 2:6] = fifth_bits.sum(axis=1, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(-1, 4)
    out[:, 6:] = (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)
    return out.reshape(*rows, row_bytes // GGML_MXFP4_BYTES * GGML_Q5_0_BYTES)
