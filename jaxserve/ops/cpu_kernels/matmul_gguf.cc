// Matmuls with GGUF-quantized weights for CPUs, an XLA FFI custom call (jaxserve.ops.cpu_kernels builds and
// registers it). A GGUF file's 8- and 4-bit tensors stay in their blocks in memory and are multiplied in
// them: a decode step reads 4.5-8.5 bits per weight instead of 16 or 32.
//
//   JaxserveMatmulGguf  out f32[M, N] = x f32[M, K] @ W^T, W [N, K] as llama.cpp stores it: row n holds
//                       K / 32 blocks of 32 consecutive weights, u8[N, K / 32 * block_bytes]
//
// The blocks (ggml's layouts; `kind` is ggml's type number):
//   Q4_0 (2):  f16 d, u8 qs[16]           w[j] = d * ((qs[j] & 15) - 8),  w[j + 16] = d * ((qs[j] >> 4) - 8)
//   Q4_1 (3):  f16 d, f16 m, u8 qs[16]    w[j] = d * (qs[j] & 15) + m,    w[j + 16] = d * (qs[j] >> 4) + m
//   Q8_0 (8):  f16 d, i8 qs[32]           w[j] = d * qs[j]
//
// As llama.cpp does, each row of x is first rounded to 8 bits per block of 32 (a float scale dx = max|x| / 127
// and integers xq = rint(x / dx)), so a block's 32 products are one integer dot product of the weights'
// codes with xq: `vpdpbusd` (AVX512-VNNI) or `vpmaddubsw` + `vpmaddwd` (AVX2), 32 products in one or two
// instructions. With u the block's unsigned codes (Q8_0: |q|, x's signs flipped where q < 0):
//   x . w = sum over blocks of  d * dx * (u . xq)  +  c * dx * sum(xq),   c = m (Q4_1), -8 d (Q4_0), 0 (Q8_0)
// exactly, in integers and then float32: the result is x rounded to 8 bits times the dequantized weights
// (`tests/ops/test_matmul_gguf.py` holds the float64 oracle), up to float32 sums.
//
// Work is split into units of (a group of kGroup weight rows, a chunk of x rows), shared with XLA's intra-op
// threads (`work_sharing.h`). A unit takes each weight row once per tile of up to 4 x rows, unpacking each
// block once for the tile's rows; the per-block float32 sums stay in 8-lane vectors until the row's end.

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlock = 32;         // weights per block, every format here
constexpr int kGroup = 16;         // weight rows per unit
constexpr int kRowChunk = 64;      // x rows per unit
constexpr int kTileRows = 4;       // x rows per register tile

enum Kind : int32_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

int block_bytes(int32_t kind) {
  switch (kind) {
    case kQ4_0: return 2 + 16;
    case kQ4_1: return 2 + 2 + 16;
    case kQ8_0: return 2 + 32;
    default: return 0;
  }
}

// IEEE half to float, subnormals included: F16C's `vcvtph2ps` where there is one.
inline float half_to_float(const uint8_t* at) {
  uint16_t h;
  std::memcpy(&h, at, sizeof(h));
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
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
}

struct Problem {
  int64_t m, n, k, blocks;  // blocks = K / 32
  const uint8_t* w;         // [N, blocks * block_bytes]
  int64_t row_bytes;
  const int8_t* xq;         // [M, K]: x rounded to 8 bits per block
  const float* dx;          // [M, blocks]: each block's scale
  const float* sx;          // [M, blocks]: dx * sum(xq) over the block
  float* out;               // [M, N]
};

// x rows [m0, m1) rounded to 8 bits per block: dx = max|x| / 127, xq = rint(x * (1 / dx)) (0 for an all-zero
// block), in IEEE float32 arithmetic (not -ffast-math's approximate reciprocal), as the tests' oracle rounds.
__attribute__((optimize("no-fast-math"))) void quantize_rows(const float* x, int64_t k, int64_t m0, int64_t m1, int8_t* xq, float* dx, float* sx) {
  const int64_t blocks = k / kBlock;
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + m * k + b * kBlock;
      float amax = 0.0f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
      int sum = 0;
      int8_t* q = xq + m * k + b * kBlock;
      for (int j = 0; j < kBlock; ++j) {
        q[j] = int8_t(std::nearbyint(v[j] * inverse));
        sum += q[j];
      }
      dx[m * blocks + b] = d;
      sx[m * blocks + b] = d * float(sum);
    }
  }
}

#if defined(__AVX2__)

// Per block: the integer dot product of 32 unsigned codes with 32 signed values, as 8 int32 partial sums.
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[m0 : m0 + MR, n] for weight row n.
template <int32_t K, int MR>
void row_tile(const Problem& p, int64_t n, int64_t m0) {
  const int bytes = block_bytes(K);
  const uint8_t* row = p.w + n * p.row_bytes;
  __m256 acc[MR];
  float corr[MR];
  const int8_t* xq[MR];
  const float* dx[MR];
  const float* sx[MR];
  for (int i = 0; i < MR; ++i) {
    acc[i] = _mm256_setzero_ps();
    corr[i] = 0.0f;
    xq[i] = p.xq + (m0 + i) * p.k;
    dx[i] = p.dx + (m0 + i) * p.blocks;
    sx[i] = p.sx + (m0 + i) * p.blocks;
  }
  const int64_t blocks = p.blocks;
  const __m128i low4 = _mm_set1_epi8(0x0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * bytes;
    const float d = half_to_float(block);
    __m256i u, w8;
    float c = 0.0f;
    if constexpr (K == kQ8_0) {
      w8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
      u = _mm256_abs_epi8(w8);
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (K == kQ4_1 ? 4 : 2)));
      u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low4), _mm_and_si128(q, low4));
      c = K == kQ4_1 ? half_to_float(block + 2) : -8.0f * d;
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + b * kBlock));
      if constexpr (K == kQ8_0) s = _mm256_sign_epi8(s, w8);  // |q| . sign(x, q) = q . x
      const __m256 sums = _mm256_cvtepi32_ps(dot_u8_s8(u, s));
      acc[i] = _mm256_fmadd_ps(sums, _mm256_set1_ps(d * dx[i][b]), acc[i]);
      if constexpr (K != kQ8_0) corr[i] += c * sx[i][b];
    }
  }
  for (int i = 0; i < MR; ++i) p.out[(m0 + i) * p.n + n] = horizontal_sum(acc[i]) + corr[i];
}

#else  // no AVX2: the same integer sums in plain loops

template <int32_t K, int MR>
void row_tile(const Problem& p, int64_t n, int64_t m0) {
  const int bytes = block_bytes(K);
  const uint8_t* row = p.w + n * p.row_bytes;
  for (int i = 0; i < MR; ++i) {
    float total = 0.0f;
    for (int64_t b = 0; b < p.blocks; ++b) {
      const uint8_t* block = row + b * bytes;
      const int8_t* s = p.xq + (m0 + i) * p.k + b * kBlock;
      const int64_t at = (m0 + i) * p.blocks + b;
      const float d = half_to_float(block);
      int dot = 0;
      if constexpr (K == kQ8_0) {
        for (int j = 0; j < kBlock; ++j) dot += int(int8_t(block[2 + j])) * s[j];
        total += d * p.dx[at] * float(dot);
      } else {
        const uint8_t* q = block + (K == kQ4_1 ? 4 : 2);
        for (int j = 0; j < 16; ++j) dot += int(q[j] & 15) * s[j] + int(q[j] >> 4) * s[j + 16];
        const float c = K == kQ4_1 ? half_to_float(block + 2) : -8.0f * d;
        total += d * p.dx[at] * float(dot) + c * p.sx[at];
      }
    }
    p.out[(m0 + i) * p.n + n] = total;
  }
}

#endif

template <int32_t K>
void unit(const Problem& p, int64_t m0, int64_t rows, int64_t n0, int cols) {
  for (int64_t m = m0; m < m0 + rows; m += kTileRows) {
    const int tile_rows = int(std::min<int64_t>(kTileRows, m0 + rows - m));
    for (int64_t n = n0; n < n0 + cols; ++n) {
      switch (tile_rows) {
        case 1: row_tile<K, 1>(p, n, m); break;
        case 2: row_tile<K, 2>(p, n, m); break;
        case 3: row_tile<K, 3>(p, n, m); break;
        default: row_tile<K, 4>(p, n, m); break;
      }
    }
  }
}

using UnitFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int);

ffi::Error MatmulGguf(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                      ffi::ResultBuffer<ffi::F32> out, int32_t kind) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const auto out_dims = out->dimensions();
  const int bytes = block_bytes(kind);
  if (bytes == 0) return ffi::Error::InvalidArgument("matmul_gguf: kind must be 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0)");
  if (x_dims.size() != 2 || w_dims.size() != 2 || out_dims.size() != 2) {
    return ffi::Error::InvalidArgument("matmul_gguf: x, w and out must be 2-D");
  }
  Problem p;
  p.m = x_dims[0];
  p.k = x_dims[1];
  p.n = w_dims[0];
  p.row_bytes = w_dims[1];
  if (p.k % kBlock != 0 || p.row_bytes != p.k / kBlock * bytes || out_dims[0] != p.m || out_dims[1] != p.n) {
    return ffi::Error::InvalidArgument("matmul_gguf: mismatched shapes");
  }
  p.w = w.typed_data();
  p.out = out->typed_data();
  p.blocks = p.k / kBlock;
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  std::vector<int8_t> xq(size_t(p.m * p.k));
  std::vector<float> dx(size_t(p.m * p.blocks)), sx(size_t(p.m * p.blocks));
  quantize_rows(x.typed_data(), p.k, 0, p.m, xq.data(), dx.data(), sx.data());
  p.xq = xq.data();
  p.dx = dx.data();
  p.sx = sx.data();
  const UnitFn run = kind == kQ4_0 ? unit<kQ4_0> : kind == kQ4_1 ? unit<kQ4_1> : unit<kQ8_0>;
  const int64_t groups = (p.n + kGroup - 1) / kGroup, chunks = (p.m + kRowChunk - 1) / kRowChunk;
  jaxserve::share_units(pool, int(groups * chunks), [&p, run, groups](int u) {
    const int64_t m0 = (u / groups) * kRowChunk, n0 = (u % groups) * kGroup;
    run(p, m0, std::min<int64_t>(kRowChunk, p.m - m0), n0, int(std::min<int64_t>(kGroup, p.n - n0)));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulGguf, MatmulGguf,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("kind"));
