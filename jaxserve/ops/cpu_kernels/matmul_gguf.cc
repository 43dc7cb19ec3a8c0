// Matmuls with GGUF-quantized weights for CPUs, an XLA FFI custom call (jaxserve.ops.cpu_kernels builds and
// registers it). A GGUF file's 8- and 4-bit tensors stay in their blocks in memory and are decoded here,
// block by block, as they are multiplied: a decode step reads 4.5-8.5 bits per weight instead of 16 or 32.
//
//   JaxserveMatmulGguf  out f32[M, N] = x f32[M, K] @ W^T, W [N, K] as llama.cpp stores it: row n holds
//                       K / 32 blocks of 32 consecutive weights, u8[N, K / 32 * block_bytes]
//
// The blocks (ggml's layouts; `kind` is ggml's type number):
//   Q4_0 (2):  f16 d, u8 qs[16]           w[j] = d * ((qs[j] & 15) - 8),  w[j + 16] = d * ((qs[j] >> 4) - 8)
//   Q4_1 (3):  f16 d, f16 m, u8 qs[16]    w[j] = d * (qs[j] & 15) + m,    w[j + 16] = d * (qs[j] >> 4) + m
//   Q8_0 (8):  f16 d, i8 qs[32]           w[j] = d * qs[j]
// Each weight is decoded to float32 exactly as ggml's dequantization computes it, and every product and sum
// is float32: the result is x times the dequantized matrix up to the order of the sums (llama.cpp instead
// rounds the activations to 8 bits for integer dot products).
//
// Work is split into units of (a group of kGroup weight rows, a chunk of x rows), shared with XLA's intra-op
// threads (`work_sharing.h`). A unit decodes its weight rows once, into a float32 panel that stays in
// cache, and register tiles of up to 4 x rows by 4 weight rows sweep it; the weights are read once per
// chunk of x rows. The loops use GCC's vector extensions, so -march=native makes them AVX-512 or AVX2.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlock = 32;         // weights per block, every format here
constexpr int kGroup = 16;         // weight rows per unit
constexpr int kRowChunk = 64;      // x rows per unit
constexpr int kTileRows = 4;       // x rows per register tile
constexpr int kTileCols = 4;       // weight rows per register tile

enum Kind : int32_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

int block_bytes(int32_t kind) {
  switch (kind) {
    case kQ4_0: return 2 + 16;
    case kQ4_1: return 2 + 2 + 16;
    case kQ8_0: return 2 + 32;
    default: return 0;
  }
}

// IEEE half to float, subnormals included.
inline float half_to_float(const uint8_t* at) {
  uint16_t h;
  std::memcpy(&h, at, sizeof(h));
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

// One block's 32 weights as two vectors of 16: weights 0-15 and 16-31.
template <int32_t K>
inline void decode_block(const uint8_t* block, f32x16& lo, f32x16& hi) {
  const float d = half_to_float(block);
  if constexpr (K == kQ8_0) {
    i8x16 a, b;
    std::memcpy(&a, block + 2, 16);
    std::memcpy(&b, block + 18, 16);
    lo = __builtin_convertvector(__builtin_convertvector(a, i32x16), f32x16) * d;
    hi = __builtin_convertvector(__builtin_convertvector(b, i32x16), f32x16) * d;
  } else {
    const int offset = K == kQ4_1 ? 4 : 2;
    u8x16 q;
    std::memcpy(&q, block + offset, 16);
    f32x16 low = __builtin_convertvector(__builtin_convertvector(q & 15, i32x16), f32x16);
    f32x16 high = __builtin_convertvector(__builtin_convertvector(q >> 4, i32x16), f32x16);
    if constexpr (K == kQ4_0) {
      lo = (low - 8.0f) * d;
      hi = (high - 8.0f) * d;
    } else {
      const float m = half_to_float(block + 2);
      lo = low * d + m;
      hi = high * d + m;
    }
  }
}

struct Problem {
  int64_t m, n, k;
  const float* x;     // [M, K]
  const uint8_t* w;   // [N, K / 32 * block_bytes]
  int64_t row_bytes;  // K / 32 * block_bytes
  float* out;         // [M, N]
};

// Weight rows n0 : n0 + rows decoded into panel [rows][K].
template <int32_t K>
void decode_rows(const Problem& p, int64_t n0, int rows, float* panel) {
  const int bytes = block_bytes(K);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* row = p.w + (n0 + r) * p.row_bytes;
    float* dst = panel + r * p.k;
    for (int64_t b = 0; b < p.k / kBlock; ++b) {
      f32x16 lo, hi;
      decode_block<K>(row + b * bytes, lo, hi);
      std::memcpy(dst + b * kBlock, &lo, sizeof(lo));
      std::memcpy(dst + b * kBlock + 16, &hi, sizeof(hi));
    }
  }
}

// out[m0 : m0 + MR, n0 : n0 + NR] from x rows m0.. and the panel's rows j0..: dot products 16 values at a time.
template <int MR, int NR>
void tile(const Problem& p, int64_t m0, const float* panel, int j0, int64_t n0) {
  f32x16 acc[MR][NR] = {};
  const float* xs[MR];
  const float* ws[NR];
  for (int i = 0; i < MR; ++i) xs[i] = p.x + (m0 + i) * p.k;
  for (int j = 0; j < NR; ++j) ws[j] = panel + (j0 + j) * p.k;
  for (int64_t k = 0; k < p.k; k += 16) {
    f32x16 xv[MR], wv[NR];
    for (int i = 0; i < MR; ++i) std::memcpy(&xv[i], xs[i] + k, sizeof(f32x16));
    for (int j = 0; j < NR; ++j) std::memcpy(&wv[j], ws[j] + k, sizeof(f32x16));
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] += xv[i] * wv[j];
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float sum = 0.0f;
      for (int l = 0; l < 16; ++l) sum += acc[i][j][l];
      p.out[(m0 + i) * p.n + n0 + j0 + j] = sum;
    }
  }
}

template <int MR>
void tile_cols(const Problem& p, int64_t m0, const float* panel, int j0, int cols, int64_t n0) {
  switch (cols) {
    case 1: tile<MR, 1>(p, m0, panel, j0, n0); break;
    case 2: tile<MR, 2>(p, m0, panel, j0, n0); break;
    case 3: tile<MR, 3>(p, m0, panel, j0, n0); break;
    default: tile<MR, 4>(p, m0, panel, j0, n0); break;
  }
}

template <int32_t K>
void unit(const Problem& p, int64_t m0, int64_t rows, int64_t n0, int cols) {
  thread_local std::vector<float> panel;
  panel.resize(size_t(kGroup) * p.k);
  decode_rows<K>(p, n0, cols, panel.data());
  for (int64_t m = m0; m < m0 + rows; m += kTileRows) {
    const int tile_rows = int(std::min<int64_t>(kTileRows, m0 + rows - m));
    for (int j = 0; j < cols; j += kTileCols) {
      const int width = std::min(kTileCols, cols - j);
      switch (tile_rows) {
        case 1: tile_cols<1>(p, m, panel.data(), j, width, n0); break;
        case 2: tile_cols<2>(p, m, panel.data(), j, width, n0); break;
        case 3: tile_cols<3>(p, m, panel.data(), j, width, n0); break;
        default: tile_cols<4>(p, m, panel.data(), j, width, n0); break;
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
  p.x = x.typed_data();
  p.w = w.typed_data();
  p.out = out->typed_data();
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
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
