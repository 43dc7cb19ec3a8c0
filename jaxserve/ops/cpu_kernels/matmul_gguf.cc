// Matmuls with GGUF-quantized weights for CPUs, XLA FFI custom calls (jaxserve.ops.cpu_kernels builds and
// registers them; their handlers are `ffi_bindings.cc`'s). A GGUF file's 2- to 8-bit tensors stay in their
// blocks in memory and are multiplied in them: a decode step reads 2.6-8.5 bits per weight instead of 16 or 32.
//
//   JaxserveMatmulGguf  out f32[M, N] = x f32[M, K] @ W^T, W [N, K] in GGUF blocks of 32 weights along K,
//                       interleaved 16 output features at a time (`jaxserve/ops/gguf_packing.py` lays them
//                       out): u8[ceil(N / 16), group_bytes]
//   JaxserveGroupedMatmulGguf  out f32[A, N]: the rows of x f32[A, K] in groups of group_sizes i32[G], each
//                       group's rows @ its own W^T, w u8[G, ceil(N / 16), group_bytes] (a mixture of
//                       experts' assignments sorted by expert); rows past the groups are zeros
//
// The blocks (ggml's formats; `kind` is ggml's type number), for one output feature:
//   Q4_0 (2):  f16 d, u8 qs[16]           w[j] = d * ((qs[j] & 15) - 8),  w[j + 16] = d * ((qs[j] >> 4) - 8)
//   Q4_1 (3):  f16 d, f16 m, u8 qs[16]    w[j] = d * (qs[j] & 15) + m,    w[j + 16] = d * (qs[j] >> 4) + m
//   Q5_0 (6):  f16 d, u32 qh, u8 qs[16]   Q4_0's with bit j of qh as the 5th bit of w[j], and bias 16
//   Q5_1 (7):  f16 d, f16 m, u32 qh, u8 qs[16]   Q4_1's with bit j of qh as the 5th bit of w[j]
//   Q8_0 (8):  f16 d, i8 qs[32]           w[j] = d * qs[j]
//   Q2_K (10): super-blocks of 16 sub-blocks of 16: f16 d, f16 dmin, 4-bit scales sc[16] and mins mn[16],
//              2-bit codes q;  sub-block i's  w[j] = d * sc[i] * q[j] - dmin * mn[i]
//   Q3_K (11): super-blocks of 16 sub-blocks of 16: f16 d, 6-bit scales sc[16] (less 32), 3-bit codes q (2
//              low bits and a mask of high bits);  sub-block i's  w[j] = d * sc[i] * (q[j] - 4)
//   Q4_K (12): super-blocks of 8 blocks: f16 d, f16 dmin, 6-bit scales sc[8] and mins mn[8], 4-bit codes q;
//              block i's  w[j] = d * sc[i] * q[j] - dmin * mn[i]
//   Q5_K (13): Q4_K's with 5-bit codes (u8 qh[32]: bit i of qh[j] the 5th bit of block i's weight j)
//   Q6_K (14): super-blocks of 16 sub-blocks of 16: f16 d, i8 scales sc[16], 6-bit codes q;
//              sub-block i's  w[j] = d * sc[i] * (q[j] - 32)
//   IQ4_NL (20): f16 d, u8 qs[16]         Q4_0's with the nibbles indices into a table of 16 int8 values:
//              w[j] = d * kIq4Values[qs[j] & 15],  w[j + 16] = d * kIq4Values[qs[j] >> 4]
//   IQ4_XS (23): super-blocks of 8 blocks: f16 d, 6-bit scales sc[8] (less 32), IQ4_NL's codes q;
//              block i's  w[j] = d * sc[i] * kIq4Values[q[j]]
// A tile holds one block of each of 16 features: their d (f16[16]), their m (Q4_1, Q5_1: f16[16]), then the
// code bytes in chunks of 64, chunk c holding bytes qs[4c .. 4c + 3] of feature 0, then of feature 1, ... (Q4:
// 4 chunks, whose low nibbles are weights 4c .. 4c + 3 and high nibbles 16 + 4c ..; Q8_0: 8 chunks). A Q5
// tile holds a plane of the codes' 5th bits between its scales and its Q4 chunks: byte 4f + j holds in bit c
// the 5th bit of the weight whose low bits chunk c holds in byte 4f + j's low nibble, in bit 4 + c the high
// nibble's. A Q4_K tile holds one super-block of each of 16 features: d and dmin (f16[16] each), sc and mn
// (u8[8][16] each, unpacked from 6 bits), then its 8 blocks' codes as Q4's (Q5_K: each block's plane, then
// its codes). A Q6_K tile holds one super-block of each of 16 features: d (f16[16]), sc (i8[16][16]), then
// each block of 32 as a Q4 block's codes (the codes' low 4 bits) followed by two 64-byte planes of their high
// 2 bits, for the low nibbles' weights and the high nibbles': byte 4f + j of a plane holds, in bits
// 2c .. 2c + 1, the high bits of the weight whose low bits chunk c holds in byte 4f + j. A block of 32 is two
// of Q6_K's sub-blocks, whose scales differ: the low nibbles' weights (0 .. 15) and the high nibbles'
// (16 .. 31), whose dot products are summed apart. Q3_K's and Q2_K's tiles are laid out as Q6_K's with 2-bit
// codes: a head (Q3_K: Q6_K's, the scales less 32; Q2_K: d and dmin (f16[16] each), then each sub-block's
// byte sc | mn << 4 (u8[16][16])), then per block of 32 two chunks of 2-bit codes, byte 4f + j of chunk k
// holding in bits 2s .. 2s + 1 the code of weight 8s + 4k + j, and (Q3_K) a 64-byte plane of the high bits,
// byte 4f + j holding in bit t that of weight 4t + j. So the codes of weights 16 sub + 4c + j (sub-block
// `sub`, c = 0 .. 3) are bits 2 (2 sub + c / 2) of chunk c % 2, and bit 4 sub + c of the plane. An IQ4_NL
// tile is Q4_0's; an IQ4_XS tile holds one super-block of each of 16 features: d (f16[16]), sc (i8[8][16], the
// scales less 32), then its 8 blocks' codes as Q4's.
// So one 512-bit register holds four consecutive codes of 16 features, and one `vpdpbusd` multiplies them
// with four activations broadcast from a row of x: 64 products, every lane a different output feature.
//
// As llama.cpp does, each row of x is first rounded to 8 bits per block of 32 (a float scale dx = max|x| / 127
// and integers xq = rint(x / dx)). With u a block's unsigned codes (Q4: the nibbles; Q5: the nibbles with
// their 5th bits; Q8_0: q + 128):
//   x . w = sum over blocks of  d * dx * (u . xq - bias * sum(xq))  +  m * dx * sum(xq)
// with bias 8 (Q4_0), 16 (Q5_0), 128 (Q8_0 and the IQ4 formats under AVX512-VNNI, whose table lookup gives
// the values plus 128; AVX2 and plain loops take their signed values as they are, bias 0) or 0, and the m
// term for Q4_1, Q5_1, Q4_K and Q5_K only (Q4_K, Q5_K: d * sc and -dmin * mn, both exact in float32; IQ4_XS's
// d is d * sc too). Q6_K's, Q3_K's and Q2_K's sums run per sub-block of 16, with bias 32 (Q6_K), 4 (Q3_K) or 0 and
// sum(xq) over the sub-block, times d * sc (exact in float32), plus Q2_K's -dmin * mn * dx * sum(xq) over the
// sub-block. The integer part is exact, so the result is x rounded to 8 bits times the dequantized weights
// (`tests/ops/test_matmul_gguf.py` holds the float64 oracle), up to float32 sums.
//
// Work is split into units of (a run of at least two groups of 16 features, at most 4 runs per thread; a chunk
// of x rows), shared with XLA's intra-op threads (`work_sharing.h`). A unit takes its groups two at a time and
// runs each pair's tiles once per register tile of up to 4 x rows: 8 integer and 8 float32 accumulators, each
// block's codes unpacked once for the tile's rows. Without
// AVX512-VNNI, AVX2 runs the same layout 8 features at a time (`vpmaddubsw` + `vpmaddwd`); without AVX2,
// plain loops. The rounding of x to 8 bits is vectorised too (AVX-512 or AVX2).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "work_sharing.h"

namespace {

constexpr int kBlock = 32;       // weights per block, every format here
constexpr int kFeatures = 16;    // output features per group (one tile row of 16 lanes)
constexpr int kUnitGroups = 2;   // groups per unit, at least
constexpr int kUnitsPerWorker = 4;  // units of groups per thread, at most
constexpr int kRowChunk = 64;    // x rows per unit
constexpr int kTileRows = 4;     // x rows per register tile
#ifndef JAXSERVE_GGUF_PREFETCH
#define JAXSERVE_GGUF_PREFETCH 2048
#endif
constexpr int kPrefetchBytes = JAXSERVE_GGUF_PREFETCH;  // how far ahead of its tiles a stream prefetches

enum Kind : int32_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13,
  kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23
};

// The IQ4 formats' 16 values (ggml's `kvalues_iq4nl`), which their 4-bit codes index.
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

constexpr int scale_bytes(int32_t kind) { return kind == kQ4_1 || kind == kQ5_1 ? 64 : 32; }  // f16 d (and m)
constexpr bool has_plane(int32_t kind) { return kind == kQ5_0 || kind == kQ5_1 || kind == kQ5_K; }  // 5th bits
constexpr int plane_bytes(int32_t kind) { return has_plane(kind) ? 64 : 0; }
constexpr int chunks(int32_t kind) { return kind == kQ8_0 ? 8 : 4; }          // 64-byte chunks of codes
constexpr bool scaled_blocks(int32_t kind) { return kind == kQ4_K || kind == kQ5_K; }  // d * sc, dmin * mn
constexpr bool signed_scales(int32_t kind) { return kind == kIQ4_XS; }  // d * sc, sc an int8 a block
constexpr bool table_codes(int32_t kind) { return kind == kIQ4_NL || kind == kIQ4_XS; }  // kIq4Values[q]
constexpr bool adds_m(int32_t kind) { return kind == kQ4_1 || kind == kQ5_1; }  // w = d * q + m
constexpr bool has_mins(int32_t kind) { return adds_m(kind) || scaled_blocks(kind); }
// The codes' zero point where it is folded into the integer sums as bias * sum(xq): Q4_0's and Q5_0's
// (AVX512-VNNI adds Q8_0's 128, its signed codes made unsigned).
constexpr int32_t code_bias(int32_t kind) { return kind == kQ4_0 ? 8 : kind == kQ5_0 ? 16 : 0; }
constexpr int kSuper = 8;                          // Q2_K .. Q6_K, IQ4_XS: blocks per super-block
constexpr int kSuperHead = 2 * 32 + 2 * 128;       // Q4_K, Q5_K: d, dmin (f16[16]), scales, mins (u8[8][16])
// Q4_K's and Q5_K's packed super-block of 16 features (Q5_K: each block's plane too).
constexpr int super_tile(int32_t kind) { return kSuperHead + kSuper * (plane_bytes(kind) + 256); }
// Q6_K, Q3_K, Q2_K: super-blocks of 16 sub-blocks of 16 weights, each its own scale (Q2_K: and min).
constexpr bool sub_blocks(int32_t kind) { return kind == kQ6_K || kind == kQ3_K || kind == kQ2_K; }
// The head of a packed super-block: Q6_K, Q3_K: d (f16[16]), scales (i8[16][16]); Q2_K: d, dmin (f16[16] each),
// each sub-block's scales and mins (u8[16][16], sc | mn << 4).
constexpr int sub_block_head(int32_t kind) { return kind == kQ2_K ? 64 + 256 : 32 + 256; }
// A block of 32 of 16 features: Q6_K: its low 4 bits, then two planes of 2 bits; Q3_K: two chunks of 2-bit
// codes, then a plane of high bits; Q2_K: two chunks of 2-bit codes.
constexpr int sub_block_block(int32_t kind) { return kind == kQ6_K ? 256 + 2 * 64 : kind == kQ3_K ? 128 + 64 : 128; }
constexpr int sub_block_tile(int32_t kind) { return sub_block_head(kind) + kSuper * sub_block_block(kind); }
// The codes' zero point: w = d * sc * (q - bias) (Q2_K: its mins instead).
constexpr int32_t sub_block_bias(int32_t kind) { return kind == kQ6_K ? 32 : kind == kQ3_K ? 4 : 0; }
constexpr int kXsHead = 32 + 8 * 16;               // IQ4_XS: d (f16[16]), scales (i8[8][16])
constexpr int kXsTile = kXsHead + kSuper * 256;

constexpr bool known_kind(int32_t kind) {
  return kind == kQ4_0 || kind == kQ4_1 || kind == kQ5_0 || kind == kQ5_1 || kind == kQ8_0 || kind == kQ2_K ||
         kind == kQ3_K || kind == kQ4_K || kind == kQ5_K || kind == kQ6_K || kind == kIQ4_NL || kind == kIQ4_XS;
}

// Bytes of one group's tiles for K / 32 blocks; 0 for a kind (or a block count) the kernel does not take.
int64_t group_bytes(int32_t kind, int64_t blocks) {
  switch (kind) {
    case kQ4_0:
    case kQ4_1:
    case kQ5_0:
    case kQ5_1:
    case kQ8_0:
    case kIQ4_NL: return blocks * (scale_bytes(kind) + plane_bytes(kind) + 64 * chunks(kind));
    case kQ4_K:
    case kQ5_K: return blocks % kSuper == 0 ? blocks / kSuper * super_tile(kind) : 0;
    case kQ2_K:
    case kQ3_K:
    case kQ6_K: return blocks % kSuper == 0 ? blocks / kSuper * sub_block_tile(kind) : 0;
    case kIQ4_XS: return blocks % kSuper == 0 ? blocks / kSuper * kXsTile : 0;
    default: return 0;
  }
}

// IEEE half to float, subnormals included: F16C's `vcvtph2ps` where there is one.
inline float half_to_float(const uint8_t* at) {
  uint16_t h;
  std::memcpy(&h, at, sizeof(h));
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: mantissa * 2^-24, exact in float32
    const float value = float(mantissa) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &value, sizeof(bits));
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

inline int32_t load_i32(const int8_t* at) {
  int32_t v;
  std::memcpy(&v, at, sizeof(v));
  return v;
}

struct Problem {
  int64_t m, n, k, blocks, groups;  // blocks = K / 32, groups = ceil(N / 16)
  const uint8_t* w;                 // [groups, group_bytes]
  int64_t group_bytes;
  const int8_t* xq;                 // [M, K]: x rounded to 8 bits per block
  const float* dx;                  // [M, blocks]: each block's scale
  const float* sx;                  // [M, blocks]: dx * sum(xq) over the block
  const int32_t* isx;               // [M, blocks]: sum(xq) over the block
  const int32_t* hsx;               // [M, 2 * blocks]: sum(xq) over each half block (sub-blocks of 16)
  float* out;                       // [M, N]
};

// Where block b of group g lies: its codes and its 16 features' scale factors.
struct BlockAt {
  const uint8_t* codes;  // 64 * chunks bytes
  const uint8_t* d;      // f16[16]: d (Q4_K, Q6_K, IQ4_XS: the super-block's d)
  const uint8_t* m;      // f16[16]: Q4_1's and Q5_1's m, Q4_K's, Q5_K's and Q2_K's dmin
  const uint8_t* sc;     // Q4_K, Q5_K: u8[16], the block's scales (d * sc is its d); Q6_K, Q3_K: i8[2][16], its
                         // sub-blocks'; Q2_K: u8[2][16], its sub-blocks' sc | mn << 4; IQ4_XS: i8[16]
  const uint8_t* mn;     // Q4_K, Q5_K: u8[16], the block's mins (dmin * mn is its -m)
  const uint8_t* planes = nullptr;  // Q5: u8[64], the codes' 5th bits; Q6_K: u8[2][64], their high 2 bits;
                                    // Q3_K: u8[64], their high bits
};

template <int32_t K>
inline BlockAt block_at(const Problem& p, int64_t g, int64_t b) {
  const uint8_t* group = p.w + g * p.group_bytes;
  if constexpr (scaled_blocks(K)) {
    const uint8_t* super = group + (b / kSuper) * super_tile(K);
    const int64_t block = b % kSuper;  // within its super-block
    const uint8_t* at = super + kSuperHead + (plane_bytes(K) + 256) * block;  // Q5_K: its plane, then its codes
    return {at + plane_bytes(K), super, super + 32, super + 64 + 16 * block, super + 192 + 16 * block,
            has_plane(K) ? at : nullptr};
  } else if constexpr (sub_blocks(K)) {
    const uint8_t* super = group + (b / kSuper) * sub_block_tile(K);
    const uint8_t* codes = super + sub_block_head(K) + sub_block_block(K) * (b % kSuper);
    const int64_t scales_at = (K == kQ2_K ? 64 : 32) + 32 * (b % kSuper);
    const uint8_t* planes = K == kQ6_K ? codes + 256 : K == kQ3_K ? codes + 128 : nullptr;
    return {codes, super, K == kQ2_K ? super + 32 : nullptr, super + scales_at, nullptr, planes};
  } else if constexpr (K == kIQ4_XS) {
    const uint8_t* super = group + (b / kSuper) * kXsTile;
    return {super + kXsHead + 256 * (b % kSuper), super, nullptr, super + 32 + 16 * (b % kSuper), nullptr};
  } else {
    const uint8_t* tile = group + b * (scale_bytes(K) + plane_bytes(K) + 64 * chunks(K));
    const uint8_t* plane = has_plane(K) ? tile + scale_bytes(K) : nullptr;
    return {tile + scale_bytes(K) + plane_bytes(K), tile, tile + 32, nullptr, nullptr, plane};
  }
}

// Below this block scale (float32's smallest normal) 1 / dx could overflow: such a block's xq are 0.
constexpr float kMinScale = 0x1p-126f;

#if defined(__AVX2__) && !defined(__AVX512F__)
inline int32_t sum_lanes(__m256i v) {  // the sum of 8 int32 lanes
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(1, 0, 3, 2)));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(t4);
}
#endif

// x rows [m0, m1) rounded to 8 bits per block: dx = max|x| / 127, xq = rint(x * (1 / dx)) (0 for an all-zero
// block, or one whose scale is below kMinScale), in IEEE float32 arithmetic (not -ffast-math's approximate
// reciprocal), as the tests' oracle rounds. hsx (Q6_K's, Q3_K's, Q2_K's, or null): sum(xq) over each half block.
__attribute__((optimize("no-fast-math"))) void quantize_rows(const float* x, int64_t k, int64_t m0, int64_t m1,
                                                             int8_t* xq, float* dx, float* sx, int32_t* isx,
                                                             int32_t* hsx) {
  const int64_t blocks = k / kBlock;
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + m * k + b * kBlock;
      int8_t* q = xq + m * k + b * kBlock;
      int32_t halves[2] = {0, 0};  // sum(xq) over weights 0 .. 15 and 16 .. 31
      float d;
#if defined(__AVX512F__)
      const __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
      d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))) / 127.0f;
      const __m512 inverse = _mm512_set1_ps(d >= kMinScale ? 1.0f / d : 0.0f);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));  // rounds to nearest even, as rint
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qhi));
      halves[0] = _mm512_reduce_add_epi32(qlo);
      halves[1] = _mm512_reduce_add_epi32(qhi);
#elif defined(__AVX2__)
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 v8[4], amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v8[i] = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v8[i]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      d = _mm_cvtss_f32(m4) / 127.0f;
      const __m256 inverse = _mm256_set1_ps(d >= kMinScale ? 1.0f / d : 0.0f);
      __m256i q32[4];  // rounds to nearest even, as rint
      for (int i = 0; i < 4; ++i) q32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v8[i], inverse));
      // Packing works within 128-bit lanes: [0 1 | 2 3] of q32[0..3] come out as 0, 2, 1, 3 in 32-bit groups.
      const __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(q32[0], q32[1]), _mm256_packs_epi32(q32[2], q32[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                          _mm256_permutevar8x32_epi32(q16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      halves[0] = sum_lanes(_mm256_add_epi32(q32[0], q32[1]));
      halves[1] = sum_lanes(_mm256_add_epi32(q32[2], q32[3]));
#else
      float amax = 0.0f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
      d = amax / 127.0f;
      const float inverse = d >= kMinScale ? 1.0f / d : 0.0f;
      for (int j = 0; j < kBlock; ++j) {
        q[j] = int8_t(std::nearbyint(v[j] * inverse));
        halves[j / 16] += q[j];
      }
#endif
      const int32_t sum = halves[0] + halves[1];
      dx[m * blocks + b] = d;
      sx[m * blocks + b] = d * float(sum);
      isx[m * blocks + b] = sum;
      if (hsx != nullptr) {
        hsx[2 * (m * blocks + b)] = halves[0];
        hsx[2 * (m * blocks + b) + 1] = halves[1];
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

constexpr int32_t bias(int32_t kind) { return kind == kQ8_0 || table_codes(kind) ? 128 : code_bias(kind); }

// kIq4Values + 128 (unsigned, as `vpdpbusd` takes its codes) in each 128-bit lane, for `vpshufb`.
inline __m512i iq4_table_u8() {
  alignas(16) uint8_t table[16];
  for (int i = 0; i < 16; ++i) table[i] = uint8_t(kIq4Values[i] + 128);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(table)));
}

// A tile's sums into out[m0 : m0 + R, 16 g0 : 16 (g0 + G)], features past N left out.
template <int R, int G>
void store_tile(const Problem& p, int64_t g0, int64_t m0, const __m512 (&sums)[R][G]) {
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) {
      const int64_t n0 = (g0 + g) * kFeatures;
      float* out = p.out + (m0 + r) * p.n + n0;
      if (p.n - n0 >= kFeatures) {
        _mm512_storeu_ps(out, sums[r][g]);
      } else {
        _mm512_mask_storeu_ps(out, __mmask16((1u << (p.n - n0)) - 1), sums[r][g]);
      }
    }
  }
}

// out[m0 : m0 + R, 16 g0 : 16 (g0 + G)]: G groups of 16 features, R rows of x.
template <int32_t K, int R, int G>
void tile(const Problem& p, int64_t g0, int64_t m0) {
  const __m512i low4 = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(char(0x80)), bit4 = _mm512_set1_epi8(0x10);
  const __m512i values = table_codes(K) ? iq4_table_u8() : _mm512_setzero_si512();
  __m512 sums[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) sums[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    const uint8_t* codes[G];
    __m512 d[G], mins[G];
    __m512i plane[G];
    for (int g = 0; g < G; ++g) {
      const BlockAt at = block_at<K>(p, g0 + g, b);
      codes[g] = at.codes;
      if constexpr (has_plane(K)) plane[g] = _mm512_loadu_si512(at.planes);
      for (int line = 0; kPrefetchBytes > 0 && line < 64 * chunks(K); line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(at.codes) + kPrefetchBytes + line, _MM_HINT_T0);
      }
      d[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at.d)));
      if constexpr (has_mins(K)) mins[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at.m)));
      if constexpr (scaled_blocks(K)) {  // d * sc and dmin * mn: exact in float32 (11 by 6 bits)
        const auto widen = [](const uint8_t* u8) {
          return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u8))));
        };
        d[g] = _mm512_mul_ps(d[g], widen(at.sc));
        mins[g] = _mm512_mul_ps(mins[g], widen(at.mn));
      }
      if constexpr (signed_scales(K)) {  // d * sc: exact in float32 (11 by 6 bits)
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at.sc));
        d[g] = _mm512_mul_ps(d[g], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
      }
    }
    __m512i dots[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) dots[r][g] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < chunks(K); ++c) {
      __m512i lo[G], hi[G];
      for (int g = 0; g < G; ++g) {
        const __m512i v = _mm512_loadu_si512(codes[g] + 64 * c);
        if constexpr (K == kQ8_0) {
          lo[g] = _mm512_xor_si512(v, flip);  // q + 128, unsigned
        } else {
          lo[g] = _mm512_and_si512(v, low4);
          hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        if constexpr (table_codes(K)) {  // the codes' values + 128
          lo[g] = _mm512_shuffle_epi8(values, lo[g]);
          hi[g] = _mm512_shuffle_epi8(values, hi[g]);
        }
        if constexpr (has_plane(K)) {  // bits c and 4 + c to bit 4 (16-bit shifts: what crosses bytes is masked)
          lo[g] = _mm512_or_si512(lo[g], _mm512_and_si512(_mm512_slli_epi16(plane[g], 4 - c), bit4));
          hi[g] = _mm512_or_si512(hi[g], _mm512_and_si512(_mm512_srli_epi16(plane[g], c), bit4));
        }
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* x = p.xq + (m0 + r) * p.k + b * kBlock;
        const __m512i xl = _mm512_set1_epi32(load_i32(x + 4 * c));
        for (int g = 0; g < G; ++g) dots[r][g] = _mm512_dpbusd_epi32(dots[r][g], lo[g], xl);
        if constexpr (K != kQ8_0) {
          const __m512i xh = _mm512_set1_epi32(load_i32(x + 16 + 4 * c));
          for (int g = 0; g < G; ++g) dots[r][g] = _mm512_dpbusd_epi32(dots[r][g], hi[g], xh);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t xb = (m0 + r) * p.blocks + b;  // x row m0 + r's block b
      const __m512 dx = _mm512_set1_ps(p.dx[xb]);
      const __m512i offset = _mm512_set1_epi32(bias(K) * p.isx[xb]);
      for (int g = 0; g < G; ++g) {
        __m512i dot = dots[r][g];
        if constexpr (bias(K) != 0) dot = _mm512_sub_epi32(dot, offset);
        sums[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d[g], dx), sums[r][g]);
        if constexpr (adds_m(K)) sums[r][g] = _mm512_fmadd_ps(mins[g], _mm512_set1_ps(p.sx[xb]), sums[r][g]);
        if constexpr (scaled_blocks(K)) sums[r][g] = _mm512_fnmadd_ps(mins[g], _mm512_set1_ps(p.sx[xb]), sums[r][g]);
      }
    }
  }
  store_tile<R, G>(p, g0, m0, sums);
}

// Chunk c's high bits of Q6_K codes, from bits 2c .. 2c + 1 of each byte of a plane to bits 4 .. 5 (16-bit
// shifts: what crosses bytes falls outside the mask). `c` is a constant once the chunk loop is unrolled.
inline __m512i high_bits(__m512i plane, int c) {
  const __m512i bits45 = _mm512_set1_epi8(0x30);
  switch (c) {
    case 0: return _mm512_and_si512(_mm512_slli_epi16(plane, 4), bits45);
    case 1: return _mm512_and_si512(_mm512_slli_epi16(plane, 2), bits45);
    case 2: return _mm512_and_si512(plane, bits45);
    default: return _mm512_and_si512(_mm512_srli_epi16(plane, 2), bits45);
  }
}

// Bit t of each byte to bit `to`, the others 0 (16-bit shifts: what crosses bytes falls outside the mask).
// `t` is a constant once the chunk loop is unrolled.
inline __m512i bit_to(__m512i bytes, int t, int to) {
  const __m512i moved = t > to ? _mm512_srli_epi16(bytes, t - to) : t < to ? _mm512_slli_epi16(bytes, to - t) : bytes;
  return _mm512_and_si512(moved, _mm512_set1_epi8(char(1 << to)));
}

// The unsigned codes of weights 16 sub + 4c + j of a Q6_K, Q3_K or Q2_K block (`codes`: its first chunk;
// `plane`: Q6_K's plane for the sub-block, Q3_K's plane), 64 bytes: j in each feature's 4.
template <int32_t K>
inline __m512i sub_block_codes(const uint8_t* codes, __m512i plane, int sub, int c) {
  if constexpr (K == kQ6_K) {
    const __m512i v = _mm512_loadu_si512(codes + 64 * c);
    const __m512i nibbles = _mm512_and_si512(sub == 0 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
    return _mm512_or_si512(nibbles, high_bits(plane, c));
  } else {
    const int slot = 2 * sub + c / 2;  // bits 2 slot .. 2 slot + 1 of chunk c % 2
    const __m512i v = _mm512_loadu_si512(codes + 64 * (c % 2));
    const __m512i low = _mm512_and_si512(_mm512_srli_epi16(v, 2 * slot), _mm512_set1_epi8(0x03));
    if constexpr (K == kQ3_K) return _mm512_or_si512(low, bit_to(plane, 4 * sub + c, 2));
    return low;
  }
}

// Q6_K's, Q3_K's and Q2_K's tile: each block's two sub-blocks (weights 0 .. 15, then 16 .. 31) one after the
// other, each its own integer sums and scale (Q2_K: and min).
template <int32_t K, int R, int G>
void tile_sub_blocks(const Problem& p, int64_t g0, int64_t m0) {
  __m512 sums[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) sums[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    BlockAt at[G];
    __m512 d[G], dmin[G];
    for (int g = 0; g < G; ++g) {
      at[g] = block_at<K>(p, g0 + g, b);
      for (int line = 0; kPrefetchBytes > 0 && line < sub_block_block(K); line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(at[g].codes) + kPrefetchBytes + line, _MM_HINT_T0);
      }
      d[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at[g].d)));
      if constexpr (K == kQ2_K) {
        dmin[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at[g].m)));
      }
    }
    for (int sub = 0; sub < 2; ++sub) {  // weights 0 .. 15, then 16 .. 31
      __m512i planes[G];
      __m512 scale[G], mins[G];  // d * sc and dmin * mn: exact in float32 (11 by at most 8 bits)
      for (int g = 0; g < G; ++g) {
        planes[g] = _mm512_setzero_si512();  // Q2_K: none
        if constexpr (K == kQ6_K) planes[g] = _mm512_loadu_si512(at[g].planes + 64 * sub);
        if constexpr (K == kQ3_K) planes[g] = _mm512_loadu_si512(at[g].planes);
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at[g].sc + 16 * sub));
        if constexpr (K == kQ2_K) {  // sc | mn << 4
          const __m512i both = _mm512_cvtepu8_epi32(sc);
          scale[g] = _mm512_mul_ps(d[g], _mm512_cvtepi32_ps(_mm512_and_si512(both, _mm512_set1_epi32(15))));
          mins[g] = _mm512_mul_ps(dmin[g], _mm512_cvtepi32_ps(_mm512_srli_epi32(both, 4)));
        } else {
          scale[g] = _mm512_mul_ps(d[g], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        }
      }
      __m512i dots[R][G];
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) dots[r][g] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m512i q[G];
        for (int g = 0; g < G; ++g) q[g] = sub_block_codes<K>(at[g].codes, planes[g], sub, c);
        for (int r = 0; r < R; ++r) {
          const __m512i x = _mm512_set1_epi32(load_i32(p.xq + (m0 + r) * p.k + b * kBlock + 16 * sub + 4 * c));
          for (int g = 0; g < G; ++g) dots[r][g] = _mm512_dpbusd_epi32(dots[r][g], q[g], x);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t xb = (m0 + r) * p.blocks + b;  // x row m0 + r's block b
        const float dx = p.dx[xb];
        const int32_t sub_sum = p.hsx[2 * xb + sub];  // sum(xq) over the sub-block
        const __m512i offset = _mm512_set1_epi32(sub_block_bias(K) * sub_sum);
        for (int g = 0; g < G; ++g) {
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(dots[r][g], offset));
          sums[r][g] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale[g], _mm512_set1_ps(dx)), sums[r][g]);
          if constexpr (K == kQ2_K) {
            sums[r][g] = _mm512_fnmadd_ps(mins[g], _mm512_set1_ps(dx * float(sub_sum)), sums[r][g]);
          }
        }
      }
    }
  }
  store_tile<R, G>(p, g0, m0, sums);
}

template <int32_t K, int R>
void row_tile(const Problem& p, int64_t g0, int groups, int64_t m0) {
  if constexpr (sub_blocks(K)) {
    if (groups == 2) {
      tile_sub_blocks<K, R, 2>(p, g0, m0);
    } else {
      tile_sub_blocks<K, R, 1>(p, g0, m0);
    }
  } else if (groups == 2) {
    tile<K, R, 2>(p, g0, m0);
  } else {
    tile<K, R, 1>(p, g0, m0);
  }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr int32_t bias(int32_t kind) { return code_bias(kind); }  // Q8_0, IQ4: signs folded into x, no bias

// Half a group's sums into out[m0 : m0 + R, 16 g + 8 half : + 8], features past N left out.
template <int R>
void store_half(const Problem& p, int64_t g, int half, int64_t m0, const __m256 (&sums)[R]) {
  const int64_t n0 = g * kFeatures + 8 * half;
  for (int r = 0; r < R; ++r) {
    float* out = p.out + (m0 + r) * p.n + n0;
    if (p.n - n0 >= 8) {
      _mm256_storeu_ps(out, sums[r]);
    } else {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, sums[r]);
      std::copy(lanes, lanes + (p.n - n0), out);
    }
  }
}

// Chunk c's high bits of Q6_K codes, from bits 2c .. 2c + 1 of each byte of a plane to bits 4 .. 5
// (`high_bits` under AVX-512).
inline __m256i high_bits(__m256i plane, int c) {
  const __m256i bits45 = _mm256_set1_epi8(0x30);
  switch (c) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(plane, 4), bits45);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(plane, 2), bits45);
    case 2: return _mm256_and_si256(plane, bits45);
    default: return _mm256_and_si256(_mm256_srli_epi16(plane, 2), bits45);
  }
}

// out[m0 : m0 + R, 16 g + 8 half : + 8]: half a group, 8 features in 256-bit lanes.
template <int32_t K, int R>
void half_tile(const Problem& p, int64_t g, int half, int64_t m0) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
  const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values)));
  __m256 sums[R];
  for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    const BlockAt at = block_at<K>(p, g, b);
    __m256i plane = _mm256_setzero_si256();
    if constexpr (has_plane(K)) plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at.planes + 32 * half));
    const auto halves = [half](const uint8_t* f16) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f16 + 16 * half)));
    };
    const auto widen = [half](const uint8_t* u8) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u8 + 8 * half))));
    };
    __m256 d = halves(at.d), mins = _mm256_setzero_ps();
    if constexpr (has_mins(K)) mins = halves(at.m);
    if constexpr (scaled_blocks(K)) {
      d = _mm256_mul_ps(d, widen(at.sc));
      mins = _mm256_mul_ps(mins, widen(at.mn));
    }
    if constexpr (signed_scales(K)) {
      const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at.sc + 8 * half));
      d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    }
    __m256i dots[R];
    for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
    for (int c = 0; c < chunks(K); ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at.codes + 64 * c + 32 * half));
      __m256i lo = v, hi = v;  // the chunk's codes, unpacked once for the tile's rows (Q8_0: as they are)
      if constexpr (K != kQ8_0) {
        lo = _mm256_and_si256(v, low4);
        hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if constexpr (has_plane(K)) {  // codes <= 31: the two products' pair sums fit int16
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(plane, 4 - c), bit4));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(plane, c), bit4));
        }
        if constexpr (table_codes(K)) {  // the codes' signed values
          lo = _mm256_shuffle_epi8(values, lo);
          hi = _mm256_shuffle_epi8(values, hi);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* x = p.xq + (m0 + r) * p.k + b * kBlock;
        const __m256i xl = _mm256_set1_epi32(load_i32(x + 4 * c));
        if constexpr (K == kQ8_0) {  // |q| . sign(x, q) = q . x; |q| <= 128 and |x| <= 127 keep pairs in int16
          const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(xl, v));
          dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(prod, ones));
        } else if constexpr (table_codes(K)) {  // as Q8_0's; the two halves' pairs widened apart (|q| <= 127)
          const __m256i xh = _mm256_set1_epi32(load_i32(x + 16 + 4 * c));
          const __m256i low = _mm256_maddubs_epi16(_mm256_abs_epi8(lo), _mm256_sign_epi8(xl, lo));
          const __m256i high = _mm256_maddubs_epi16(_mm256_abs_epi8(hi), _mm256_sign_epi8(xh, hi));
          dots[r] = _mm256_add_epi32(dots[r], _mm256_add_epi32(_mm256_madd_epi16(low, ones),
                                                               _mm256_madd_epi16(high, ones)));
        } else {
          const __m256i xh = _mm256_set1_epi32(load_i32(x + 16 + 4 * c));
          const __m256i prod = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
          dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(prod, ones));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t xb = (m0 + r) * p.blocks + b;  // x row m0 + r's block b
      __m256i dot = dots[r];
      if constexpr (bias(K) != 0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(bias(K) * p.isx[xb]));
      sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(p.dx[xb])), sums[r]);
      if constexpr (adds_m(K)) sums[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(p.sx[xb]), sums[r]);
      if constexpr (scaled_blocks(K)) sums[r] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(p.sx[xb]), sums[r]);
    }
  }
  store_half<R>(p, g, half, m0, sums);
}

// Bit t of each byte to bit `to` (`bit_to` under AVX-512).
inline __m256i bit_to(__m256i bytes, int t, int to) {
  const __m256i moved = t > to ? _mm256_srli_epi16(bytes, t - to) : t < to ? _mm256_slli_epi16(bytes, to - t) : bytes;
  return _mm256_and_si256(moved, _mm256_set1_epi8(char(1 << to)));
}

// Half a group's codes of weights 16 sub + 4c + j of a Q6_K, Q3_K or Q2_K block (`sub_block_codes` under
// AVX-512; `codes` and `plane` at the half's features).
template <int32_t K>
inline __m256i sub_block_codes(const uint8_t* codes, __m256i plane, int sub, int c) {
  if constexpr (K == kQ6_K) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * c));
    const __m256i nibbles = _mm256_and_si256(sub == 0 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
    return _mm256_or_si256(nibbles, high_bits(plane, c));  // <= 63: pairs of products fit int16
  } else {
    const int slot = 2 * sub + c / 2;
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * (c % 2)));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(v, 2 * slot), _mm256_set1_epi8(0x03));
    if constexpr (K == kQ3_K) return _mm256_or_si256(low, bit_to(plane, 4 * sub + c, 2));
    return low;
  }
}

// Q6_K's, Q3_K's and Q2_K's half tile: each block's two sub-blocks one after the other (`tile_sub_blocks`
// under AVX-512).
template <int32_t K, int R>
void half_tile_sub_blocks(const Problem& p, int64_t g, int half, int64_t m0) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 sums[R];
  for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    const BlockAt at = block_at<K>(p, g, b);
    const auto halves = [half](const uint8_t* f16) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f16 + 16 * half)));
    };
    const __m256 d = halves(at.d), dmin = K == kQ2_K ? halves(at.m) : _mm256_setzero_ps();
    for (int sub = 0; sub < 2; ++sub) {
      __m256i plane = _mm256_setzero_si256();
      if constexpr (K == kQ6_K || K == kQ3_K) {
        const uint8_t* planes = at.planes + (K == kQ6_K ? 64 * sub : 0) + 32 * half;
        plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(planes));
      }
      const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at.sc + 16 * sub + 8 * half));
      __m256 scale, mins = _mm256_setzero_ps();
      if constexpr (K == kQ2_K) {  // sc | mn << 4
        const __m256i both = _mm256_cvtepu8_epi32(sc);
        scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(both, _mm256_set1_epi32(15))));
        mins = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(both, 4)));
      } else {
        scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
      }
      __m256i dots[R];
      for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i q = sub_block_codes<K>(at.codes + 32 * half, plane, sub, c);
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_set1_epi32(load_i32(p.xq + (m0 + r) * p.k + b * kBlock + 16 * sub + 4 * c));
          dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), ones));
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t xb = (m0 + r) * p.blocks + b;  // x row m0 + r's block b
        const float dx = p.dx[xb];
        const int32_t sub_sum = p.hsx[2 * xb + sub];
        const __m256i dot = _mm256_sub_epi32(dots[r], _mm256_set1_epi32(sub_block_bias(K) * sub_sum));
        sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(dx)), sums[r]);
        if constexpr (K == kQ2_K) sums[r] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(dx * float(sub_sum)), sums[r]);
      }
    }
  }
  store_half<R>(p, g, half, m0, sums);
}

template <int32_t K, int R>
void row_tile(const Problem& p, int64_t g0, int groups, int64_t m0) {
  for (int64_t g = g0; g < g0 + groups; ++g) {
    for (int half = 0; half < 2 && g * kFeatures + 8 * half < p.n; ++half) {
      if constexpr (sub_blocks(K)) {
        half_tile_sub_blocks<K, R>(p, g, half, m0);
      } else {
        half_tile<K, R>(p, g, half, m0);
      }
    }
  }
}

#else  // the same integer sums in plain loops

constexpr int32_t bias(int32_t kind) { return code_bias(kind); }  // Q8_0: signed codes, no bias

// Feature f's share of block b for x row r: x rounded to 8 bits (xq, the row's block at `x`) times the weights.
template <int32_t K>
float block_product(const Problem& p, const BlockAt& at, int f, const int8_t* x, int64_t xb) {
  const uint8_t* codes = at.codes + 4 * f;
  if constexpr (sub_blocks(K)) {
    float total = 0.0f;
    for (int sub = 0; sub < 2; ++sub) {  // weights 0 .. 15, then 16 .. 31
      int32_t dot = 0;
      for (int c = 0; c < 4; ++c) {
        for (int j = 0; j < 4; ++j) {  // weight 16 sub + 4c + j
          int32_t q;
          if constexpr (K == kQ6_K) {
            const uint8_t byte = codes[64 * c + j], high = at.planes[64 * sub + 4 * f + j];
            q = (sub == 0 ? byte & 15 : byte >> 4) | (((high >> (2 * c)) & 3) << 4);
          } else {
            q = (codes[64 * (c % 2) + j] >> (2 * (2 * sub + c / 2))) & 3;
            if constexpr (K == kQ3_K) q |= ((at.planes[4 * f + j] >> (4 * sub + c)) & 1) << 2;
          }
          dot += q * x[16 * sub + 4 * c + j];
        }
      }
      const int32_t sub_sum = p.hsx[2 * xb + sub];
      dot -= sub_block_bias(K) * sub_sum;
      const uint8_t sc = at.sc[16 * sub + f];
      const float d = half_to_float(at.d + 2 * f), dx = p.dx[xb];
      if constexpr (K == kQ2_K) {  // sc | mn << 4
        const float dmin = half_to_float(at.m + 2 * f);
        total += d * float(sc & 15) * dx * float(dot) - dmin * float(sc >> 4) * (dx * float(sub_sum));
      } else {
        total += d * float(int8_t(sc)) * dx * float(dot);
      }
    }
    return total;
  } else {
    int32_t dot = 0;
    for (int c = 0; c < chunks(K); ++c) {
      for (int j = 0; j < 4; ++j) {
        const uint8_t byte = codes[64 * c + j];
        if constexpr (K == kQ8_0) {
          dot += int32_t(int8_t(byte)) * x[4 * c + j];
        } else {
          const int32_t fifth = has_plane(K) ? at.planes[4 * f + j] : 0;  // bits c and 4 + c
          int32_t lo = (byte & 15) | (((fifth >> c) & 1) << 4), hi = (byte >> 4) | (((fifth >> (4 + c)) & 1) << 4);
          if constexpr (table_codes(K)) {
            lo = kIq4Values[lo];
            hi = kIq4Values[hi];
          }
          dot += lo * x[4 * c + j] + hi * x[16 + 4 * c + j];
        }
      }
    }
    dot -= bias(K) * p.isx[xb];
    float d = half_to_float(at.d + 2 * f), m = has_mins(K) ? half_to_float(at.m + 2 * f) : 0.0f;
    if constexpr (scaled_blocks(K)) {
      d *= float(at.sc[f]);
      m *= -float(at.mn[f]);
    }
    if constexpr (signed_scales(K)) d *= float(int8_t(at.sc[f]));
    return d * p.dx[xb] * float(dot) + m * p.sx[xb];
  }
}

template <int32_t K, int R>
void row_tile(const Problem& p, int64_t g0, int groups, int64_t m0) {
  for (int64_t g = g0; g < g0 + groups; ++g) {
    for (int f = 0; f < kFeatures && g * kFeatures + f < p.n; ++f) {
      for (int r = 0; r < R; ++r) {
        float total = 0.0f;
        for (int64_t b = 0; b < p.blocks; ++b) {
          const int64_t xb = (m0 + r) * p.blocks + b;  // x row m0 + r's block b
          total += block_product<K>(p, block_at<K>(p, g, b), f, p.xq + (m0 + r) * p.k + b * kBlock, xb);
        }
        p.out[(m0 + r) * p.n + g * kFeatures + f] = total;
      }
    }
  }
}

#endif

template <int32_t K>
void unit(const Problem& p, int64_t m0, int64_t rows, int64_t g0, int64_t groups) {
  for (int64_t g = g0; g < g0 + groups; g += 2) {  // a pair's tiles stay in cache for the chunk's rows
    const int pair = int(std::min<int64_t>(2, g0 + groups - g));
    for (int64_t m = m0; m < m0 + rows; m += kTileRows) {
      switch (std::min<int64_t>(kTileRows, m0 + rows - m)) {
        case 1: row_tile<K, 1>(p, g, pair, m); break;
        case 2: row_tile<K, 2>(p, g, pair, m); break;
        case 3: row_tile<K, 3>(p, g, pair, m); break;
        default: row_tile<K, 4>(p, g, pair, m); break;
      }
    }
  }
}

using UnitFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t);

UnitFn unit_for(int32_t kind) {
  switch (kind) {
    case kQ4_0: return unit<kQ4_0>;
    case kQ4_1: return unit<kQ4_1>;
    case kQ5_0: return unit<kQ5_0>;
    case kQ5_1: return unit<kQ5_1>;
    case kQ2_K: return unit<kQ2_K>;
    case kQ3_K: return unit<kQ3_K>;
    case kQ4_K: return unit<kQ4_K>;
    case kQ5_K: return unit<kQ5_K>;
    case kQ6_K: return unit<kQ6_K>;
    case kIQ4_NL: return unit<kIQ4_NL>;
    case kIQ4_XS: return unit<kIQ4_XS>;
    default: return unit<kQ8_0>;
  }
}

// One product's units: runs of groups (long, contiguous tiles, which the hardware prefetcher follows; a few
// runs a thread of `workers`, at least one pair of groups a run) times chunks of x rows.
struct Work {
  Problem p;
  int64_t unit_groups = 0, units_n = 0;
  int units = 0;
};

Work plan(const Problem& p, int64_t workers) {
  Work work;
  work.p = p;
  const int64_t runs = 2 * kUnitsPerWorker * workers;
  work.unit_groups = std::max<int64_t>(kUnitGroups, 2 * ((p.groups + runs - 1) / runs));
  work.units_n = (p.groups + work.unit_groups - 1) / work.unit_groups;
  work.units = int(work.units_n * ((p.m + kRowChunk - 1) / kRowChunk));
  return work;
}

// Every unit of every product, on this thread and the pool's.
void run(jaxserve::ThreadPool& pool, const std::vector<Work>& works, UnitFn unit_fn) {
  std::vector<int> units;
  for (const Work& work : works) units.push_back(work.units);
  jaxserve::share_product_units(pool, units, [&works, unit_fn](int w, int64_t i) {
    const Work& work = works[w];
    const Problem& p = work.p;
    const int64_t m0 = (i / work.units_n) * kRowChunk, g0 = (i % work.units_n) * work.unit_groups;
    unit_fn(p, m0, std::min<int64_t>(kRowChunk, p.m - m0), g0, std::min<int64_t>(work.unit_groups, p.groups - g0));
  });
}

// x rounded to 8 bits per block: the rows' codes, scales and sums, which every product of a call shares.
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> dx, sx;
  std::vector<int32_t> isx, hsx;  // hsx: sums over half blocks (sub-blocks of 16), empty for the other kinds

  QuantizedRows(const float* x, int64_t m, int64_t k, int32_t kind)
      : xq(size_t(m * k)), dx(size_t(m * (k / kBlock))), sx(dx.size()), isx(dx.size()),
        hsx(sub_blocks(kind) ? 2 * dx.size() : 0) {
    quantize_rows(x, k, 0, m, xq.data(), dx.data(), sx.data(), isx.data(), hsx.empty() ? nullptr : hsx.data());
  }

  // Rows m0 onward of x times `w`'s groups into rows m0 onward of out.
  Problem rows(int64_t m0, int64_t m, int64_t n, int64_t k, const uint8_t* w, int64_t w_group_bytes, float* out) const {
    Problem p;
    p.m = m;
    p.n = n;
    p.k = k;
    p.blocks = k / kBlock;
    p.groups = (n + kFeatures - 1) / kFeatures;
    p.w = w;
    p.group_bytes = w_group_bytes;
    p.xq = xq.data() + m0 * k;
    p.dx = dx.data() + m0 * p.blocks;
    p.sx = sx.data() + m0 * p.blocks;
    p.isx = isx.data() + m0 * p.blocks;
    p.hsx = hsx.empty() ? nullptr : hsx.data() + 2 * m0 * p.blocks;
    p.out = out + m0 * n;
    return p;
  }
};

}  // namespace

namespace jaxserve {

Status matmul_gguf(ThreadPool& pool, const Array& x, const Array& w, const Array& out, int32_t kind) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const auto out_dims = out.dimensions();
  if (!known_kind(kind)) {
    return "matmul_gguf: kind must be 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1), 8 (Q8_0), 10 (Q2_K), 11 (Q3_K), 12 "
        "(Q4_K), 13 (Q5_K), 14 (Q6_K), 20 (IQ4_NL) or 23 (IQ4_XS)";
  }
  if (x_dims.size() != 2 || w_dims.size() != 2 || out_dims.size() != 2) {
    return "matmul_gguf: x, w and out must be 2-D";
  }
  const int64_t m = x_dims[0], k = x_dims[1], n = out_dims[1];
  if (k % kBlock != 0 || group_bytes(kind, k / kBlock) == 0 || w_dims[1] != group_bytes(kind, k / kBlock) ||
      out_dims[0] != m || w_dims[0] != (n + kFeatures - 1) / kFeatures) {
    return "matmul_gguf: mismatched shapes";
  }
  if (m == 0 || n == 0) return nullptr;
  const QuantizedRows rows(x.as<const float>(), m, k, kind);
  std::vector<Work> works{plan(rows.rows(0, m, n, k, w.as<const uint8_t>(), w_dims[1], out.as<float>()),
                               num_workers(pool))};
  run(pool, works, unit_for(kind));
  return nullptr;
}

// Rows of x in groups, each times its own weights' blocks (a mixture of experts' assignments sorted by
// expert): x rounded to 8 bits once, then each non-empty group a product planned as above, all sharing
// the threads. Rows past the groups are zeros.
Status grouped_matmul_gguf(ThreadPool& pool, const Array& x, const Array& w, const Array& group_sizes,
                           const Array& out, int32_t kind) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const auto out_dims = out.dimensions();
  if (!known_kind(kind)) {
    return "grouped_matmul_gguf: kind must be 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1), 8 (Q8_0), 10 (Q2_K), 11 (Q3_K), "
        "12 (Q4_K), 13 (Q5_K), 14 (Q6_K), 20 (IQ4_NL) or 23 (IQ4_XS)";
  }
  if (x_dims.size() != 2 || w_dims.size() != 3 || group_sizes.dimensions().size() != 1 || out_dims.size() != 2) {
    return "grouped_matmul_gguf: x [A, K], w [G, ceil(N / 16), group_bytes], group_sizes [G], out [A, N]";
  }
  const int64_t a = x_dims[0], k = x_dims[1], n = out_dims[1], experts = w_dims[0];
  if (k % kBlock != 0 || group_bytes(kind, k / kBlock) == 0 || w_dims[2] != group_bytes(kind, k / kBlock) ||
      out_dims[0] != a || w_dims[1] != (n + kFeatures - 1) / kFeatures || group_sizes.dimensions()[0] != experts) {
    return "grouped_matmul_gguf: mismatched shapes";
  }
  float* outs = out.as<float>();
  if (a == 0 || n == 0) return nullptr;
  const int32_t* sizes = group_sizes.as<const int32_t>();
  std::vector<std::pair<int64_t, int64_t>> spans;  // (group, rows), in order
  int64_t covered = 0;
  for (int64_t g = 0; g < experts && covered < a; ++g) {
    const int64_t m = std::min<int64_t>(std::max(sizes[g], 0), a - covered);
    if (m > 0) spans.emplace_back(g, m);
    covered += m;
  }
  std::fill(outs + covered * n, outs + a * n, 0.0f);  // rows past the groups
  if (covered == 0) return nullptr;
  const QuantizedRows rows(x.as<const float>(), covered, k, kind);
  const int64_t expert_bytes = w_dims[1] * w_dims[2];
  const int64_t workers = std::max<int64_t>(num_workers(pool) / int64_t(spans.size()), 1);
  std::vector<Work> works;
  int64_t m0 = 0;
  for (const auto& [g, m] : spans) {
    works.push_back(plan(rows.rows(m0, m, n, k, w.as<const uint8_t>() + g * expert_bytes, w_dims[2], outs), workers));
    m0 += m;
  }
  run(pool, works, unit_for(kind));
  return nullptr;
}

}  // namespace jaxserve
