// Matmuls with bfloat16 operands and float32 sums for CPUs, XLA FFI custom calls (jaxserve.ops.cpu_kernels
// builds and registers them; their handlers are `ffi_bindings.cc`'s). A bfloat16 model's projections and LM head run here on CPUs: XLA:CPU runs its
// bfloat16 dots several times slower than float32 ones, while AVX512-BF16's `vdpbf16ps` multiplies pairs of
// bfloat16 values into float32 sums, 32 products an instruction from half the bytes of float32 weights.
//
//   JaxserveMatmulBf16    out f32[M, N] = x bf16[M, K] @ w bf16[K, N]    (weights stored input-major)
//   JaxserveMatmulBf16Nt  out f32[M, N] = x bf16[M, K] @ w bf16[N, K]^T  (the LM head: the embedding table)
//   JaxserveGroupedMatmulBf16  out f32[A, N]: the rows of x bf16[A, K] in groups of group_sizes i32[G], each
//                              group's rows @ its own w bf16[G, K, N]; rows past the groups are zeros
//                              (a mixture of experts' assignments, sorted by expert)
//
// Products of bfloat16 values are exact in float32 and every sum is float32: the contract of a bfloat16
// dot with float32 accumulation (XLA's on GPUs), up to the order of the sums; `vdpbf16ps` also reads and
// writes subnormals as zero, which the portable loops do not.
//
// Input-major weights take one of three loops by the number of rows M (a step's padded token count):
//   M <= 4 (decodes of a few sequences): K is split between the threads, and each streams its weight rows
//     in order, two at a time, into float32 partial sums (in L1 for N up to a few thousand); the partials
//     are added at the end.
//     The weights are read once, in order, with prefetching: ~41 GB/s here, half float32's time.
//   M <= 8: the same split, with weight rows in blocks of 32 that register tiles sweep while in cache.
//   More rows: units of (a panel of 64 output columns, 32 below 512 columns, up to 48 rows) run tiles of
//     6 x 64 that keep 24 accumulators; from 12 rows on, the panel is first repacked into contiguous pairs.
// Every loop reads two weight rows (k, k + 1), interleaves them into (k, k + 1) pairs per column
// (`vpunpck{l,h}wd`, which permutes columns within 128-bit lanes; undone once when storing) and multiplies
// them with each row's (x[k], x[k + 1]) pair broadcast. Output-major weights (the LM head): units of 64
// columns (32 below 512), tiles of 1 row x 16 columns taking dot products 32 values at a time. Units are
// shared with XLA's intra-op threads (`work_sharing.h`). Machines without AVX512-BF16 run plain loops
// over float32 conversions with the same contract.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "work_sharing.h"

namespace {

constexpr int kPanel = 64;       // output columns per unit and per input-major tile
constexpr int kRowChunk = 48;    // rows per unit (a multiple of the tiles' row counts)
constexpr int kStreamRows = 8;   // up to this many rows, input-major weights stream in K-split units
constexpr int kStreamMinRows = 64;  // weight rows per K-split unit, at least
constexpr int kMaxSplits = 8;

struct Problem {
  int64_t m, n, k;
  const uint16_t* x;  // [M, K]
  const uint16_t* w;  // [K, N] or [N, K]
  float* out;         // [M, N]
};

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

#if defined(__AVX512BF16__)

inline __mmask32 low_mask32(int64_t count) {  // the first `count` of 32 lanes
  return count >= 32 ? ~__mmask32(0) : count <= 0 ? __mmask32(0) : (__mmask32(1) << count) - 1;
}
inline __mmask16 low_mask16(int64_t count) {
  return count >= 16 ? __mmask16(0xffff) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1);
}

// (k, k + 1) weight pairs of up to 64 columns, two registers per 32 columns: lane i of the first holds
// (w[k, c], w[k + 1, c]) for c = 0-3, 8-11, 16-19, 24-27 and the second for c = 4-7, 12-15, ... (the order
// `vpunpck{l,h}wd` leaves them in within 128-bit lanes; tiles undo it once, when storing). The last row
// of an odd K pairs with zeros.
template <int G>
inline void load_pairs(const uint16_t* row0, int64_t n, bool last, const __mmask32* mask, __m512bh* pairs) {
#pragma GCC unroll 32
  for (int g = 0; g < G; ++g) {
    const __m512i a = _mm512_maskz_loadu_epi16(mask[g], row0 + 32 * g);
    const __m512i b = last ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi16(mask[g], row0 + n + 32 * g);
    pairs[2 * g] = (__m512bh)_mm512_unpacklo_epi16(a, b);
    pairs[2 * g + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
  }
}

// Stores the first `cols` (up to 32) of a 32-column group's sums, given in `load_pairs`' lane order.
inline void store_in_column_order(float* out, int64_t cols, __m512 lo, __m512 hi) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_mask_storeu_ps(out, low_mask16(cols), _mm512_permutex2var_ps(lo, first, hi));
  _mm512_mask_storeu_ps(out + 16, low_mask16(cols - 16), _mm512_permutex2var_ps(lo, second, hi));
}

// Columns [n0, n0 + cols) of w as a panel of pairs, [ceil(K / 2)][2G][32] bf16: what a tile reads, in
// order, from contiguous memory. A row of w is 2N bytes apart from the next; read straight from w, each
// step of a tile touches a new page, and repacking once per unit beats that for tiles of many rows.
template <int G>
void pack_panel(const Problem& p, int64_t n0, const __mmask32* mask, uint16_t* packed) {
  for (int64_t k = 0; k < p.k; k += 2, packed += 64 * G) {
    __m512bh pairs[2 * G];
    load_pairs<G>(p.w + k * p.n + n0, p.n, k + 1 == p.k, mask, pairs);
#pragma GCC unroll 32
    for (int j = 0; j < 2 * G; ++j) _mm512_storeu_si512(packed + 32 * j, (__m512i)pairs[j]);
  }
}

// Rows [0, MR) x columns [n0, n0 + cols) of x @ w for input-major w; cols <= 32G. With `packed`, the
// weights come from `pack_panel`'s panel, else straight from w.
template <int MR, int G>
void kn_tile(const Problem& p, const uint16_t* x, float* out, int64_t n0, int64_t cols, const uint16_t* packed) {
  __m512 acc[MR][2 * G];
#pragma GCC unroll 32
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 32
    for (int j = 0; j < 2 * G; ++j) acc[m][j] = _mm512_setzero_ps();
  __mmask32 mask[G];
#pragma GCC unroll 32
  for (int g = 0; g < G; ++g) mask[g] = low_mask32(cols - 32 * g);
  const int64_t n = p.n, k_len = p.k;
  for (int64_t k = 0; k < k_len; k += 2) {
    const bool last = k + 1 == k_len;
    __m512bh pairs[2 * G];
    if (packed != nullptr) {
#pragma GCC unroll 32
      for (int j = 0; j < 2 * G; ++j) pairs[j] = (__m512bh)_mm512_loadu_si512(packed + (k / 2) * 64 * G + 32 * j);
    } else {
      const uint16_t* row0 = p.w + k * n + n0;
      if (MR <= 2) {  // streaming the weights: fetch a few row pairs ahead
        _mm_prefetch(reinterpret_cast<const char*>(row0 + 8 * n), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(row0 + 9 * n), _MM_HINT_T0);
      }
      load_pairs<G>(row0, n, last, mask, pairs);
    }
#pragma GCC unroll 32
    for (int m = 0; m < MR; ++m) {
      uint32_t xs = x[m * k_len + k];  // (x[k], x[k + 1]) as one 32-bit lane; (x[k], 0) for an odd K's last
      if (!last) std::memcpy(&xs, x + m * k_len + k, sizeof(xs));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(xs));
#pragma GCC unroll 32
      for (int j = 0; j < 2 * G; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, pairs[j]);
    }
  }
#pragma GCC unroll 32
  for (int m = 0; m < MR; ++m) {
    float* out_row = out + m * n + n0;
#pragma GCC unroll 32
    for (int g = 0; g < G; ++g) {
      const __m512 lo = acc[m][2 * g], hi = acc[m][2 * g + 1];
      store_in_column_order(out_row + 32 * g, cols - 32 * g, lo, hi);
    }
  }
}

template <int G>
void kn_rows(const Problem& p, int64_t m0, int64_t rows, int64_t n0, int64_t cols) {
  constexpr int kTileRows = 6;   // 6 x 4 accumulators + 4 weight pairs + 1 broadcast of 32 registers
  constexpr int kPackRows = 12;  // from two tiles on, a packed panel pays for itself
  thread_local std::vector<uint16_t> panel;
  const uint16_t* packed = nullptr;
  if (rows >= kPackRows) {
    __mmask32 mask[G];
    for (int g = 0; g < G; ++g) mask[g] = low_mask32(cols - 32 * g);
    panel.resize(size_t((p.k + 1) / 2) * 64 * G);
    pack_panel<G>(p, n0, mask, panel.data());
    packed = panel.data();
  }
  for (int64_t m = m0; m < m0 + rows; m += kTileRows) {
    const uint16_t* x = p.x + m * p.k;
    float* out = p.out + m * p.n;
    switch (std::min<int64_t>(kTileRows, m0 + rows - m)) {
      case 1: kn_tile<1, G>(p, x, out, n0, cols, packed); break;
      case 2: kn_tile<2, G>(p, x, out, n0, cols, packed); break;
      case 3: kn_tile<3, G>(p, x, out, n0, cols, packed); break;
      case 4: kn_tile<4, G>(p, x, out, n0, cols, packed); break;
      case 5: kn_tile<5, G>(p, x, out, n0, cols, packed); break;
      default: kn_tile<6, G>(p, x, out, n0, cols, packed); break;
    }
  }
}

void kn_unit(const Problem& p, int64_t m0, int64_t rows, int64_t n0, int64_t cols) {
  if (cols > 32) kn_rows<2>(p, m0, rows, n0, cols);
  else kn_rows<1>(p, m0, rows, n0, cols);
}

// A few rows (decodes): weight rows k0:k1 (k0 even) read in order, each pair of rows whole, their products
// added into `partial` [M, padded N] in the pairs' lane order. One weight stream per unit runs at the
// memory's speed; panels of columns, which read 128 bytes of each row and then jump, reach half of it.
template <int MR>
void kn_stream(const Problem& p, int64_t k0, int64_t k1, int64_t padded_n, float* partial) {
  const int64_t n = p.n;
  for (int64_t k = k0; k < k1; k += 2) {
    const bool last = k + 1 == p.k;
    __m512bh xv[MR];
#pragma GCC unroll 32
    for (int m = 0; m < MR; ++m) {
      uint32_t xs = p.x[m * p.k + k];
      if (!last) std::memcpy(&xs, p.x + m * p.k + k, sizeof(xs));
      xv[m] = (__m512bh)_mm512_set1_epi32(int(xs));
    }
    const uint16_t* row0 = p.w + k * n;
    for (int64_t c = 0; c < n; c += 32) {
      // Two row pairs ahead: measured 28 GB/s against 16-20 without, on one core.
      _mm_prefetch(reinterpret_cast<const char*>(row0 + 4 * n + c), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row0 + 5 * n + c), _MM_HINT_T0);
      const __mmask32 mask = low_mask32(n - c);
      __m512bh pairs[2];
      load_pairs<1>(row0 + c, n, last, &mask, pairs);
#pragma GCC unroll 32
      for (int m = 0; m < MR; ++m) {
        float* acc = partial + m * padded_n + c;
        _mm512_storeu_ps(acc, _mm512_dpbf16_ps(_mm512_loadu_ps(acc), xv[m], pairs[0]));
        _mm512_storeu_ps(acc + 16, _mm512_dpbf16_ps(_mm512_loadu_ps(acc + 16), xv[m], pairs[1]));
      }
    }
  }
}

// out = the sum of `splits` partials, back in column order.
void kn_stream_finish(const Problem& p, const float* partial, int splits, int64_t padded_n) {
  const int64_t stride = p.m * padded_n;
  for (int64_t m = 0; m < p.m; ++m) {
    for (int64_t c = 0; c < p.n; c += 32) {
      const float* at = partial + m * padded_n + c;
      __m512 lo = _mm512_loadu_ps(at), hi = _mm512_loadu_ps(at + 16);
      for (int s = 1; s < splits; ++s) {
        lo = _mm512_add_ps(lo, _mm512_loadu_ps(at + s * stride));
        hi = _mm512_add_ps(hi, _mm512_loadu_ps(at + s * stride + 16));
      }
      float* out = p.out + m * p.n + c;
      store_in_column_order(out, p.n - c, lo, hi);
    }
  }
}

// Rows m0 : m0 + MR times weight rows kb0 : kb1 in columns c : c + 64, added into `partial` (lane order).
template <int MR>
void kn_block_tile(const Problem& p, int64_t m0, int64_t kb0, int64_t kb1, int64_t c, int64_t padded_n,
                   float* partial) {
  __m512 acc[MR][4];
#pragma GCC unroll 32
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 32
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  const __mmask32 mask[2] = {low_mask32(p.n - c), low_mask32(p.n - c - 32)};
  const uint16_t* x = p.x + m0 * p.k;
  for (int64_t k = kb0; k < kb1; k += 2) {
    const bool last = k + 1 == p.k;
    __m512bh pairs[4];
    load_pairs<2>(p.w + k * p.n + c, p.n, last, mask, pairs);
#pragma GCC unroll 32
    for (int m = 0; m < MR; ++m) {
      uint32_t xs = x[m * p.k + k];
      if (!last) std::memcpy(&xs, x + m * p.k + k, sizeof(xs));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(xs));
#pragma GCC unroll 32
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, pairs[j]);
    }
  }
#pragma GCC unroll 32
  for (int m = 0; m < MR; ++m) {
    float* at = partial + (m0 + m) * padded_n + c;
#pragma GCC unroll 32
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(at + 16 * j, _mm512_add_ps(_mm512_loadu_ps(at + 16 * j), acc[m][j]));
  }
}

// Several rows (a few sequences' decodes): weight rows k0:k1 in blocks of kBlockRows that stay in cache
// while register tiles of 6 rows x 64 columns sweep them; the next block is fetched meanwhile. The weights
// are read once and in order, where the panels of `kn_rows` read 128 bytes of a row and then jump a page.
void kn_blocks(const Problem& p, int64_t k0, int64_t k1, int64_t padded_n, float* partial) {
  constexpr int64_t kBlockRows = 32;  // even: pairs never straddle two blocks
  for (int64_t kb = k0; kb < k1; kb += kBlockRows) {
    const int64_t kb1 = std::min(kb + kBlockRows, k1), next_end = std::min(kb1 + kBlockRows, k1);
    for (int64_t c = 0; c < p.n; c += 64) {
      for (int64_t r = kb1; r < next_end; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(p.w + r * p.n + c), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p.w + r * p.n + c + 32), _MM_HINT_T0);
      }
      for (int64_t m = 0; m < p.m; m += 6) {
        switch (std::min<int64_t>(6, p.m - m)) {
          case 1: kn_block_tile<1>(p, m, kb, kb1, c, padded_n, partial); break;
          case 2: kn_block_tile<2>(p, m, kb, kb1, c, padded_n, partial); break;
          case 3: kn_block_tile<3>(p, m, kb, kb1, c, padded_n, partial); break;
          case 4: kn_block_tile<4>(p, m, kb, kb1, c, padded_n, partial); break;
          case 5: kn_block_tile<5>(p, m, kb, kb1, c, padded_n, partial); break;
          default: kn_block_tile<6>(p, m, kb, kb1, c, padded_n, partial); break;
        }
      }
    }
  }
}

void kn_stream_unit(const Problem& p, int64_t k0, int64_t k1, int64_t padded_n, float* partial) {
  switch (p.m) {
    case 1: kn_stream<1>(p, k0, k1, padded_n, partial); break;
    case 2: kn_stream<2>(p, k0, k1, padded_n, partial); break;
    case 3: kn_stream<3>(p, k0, k1, padded_n, partial); break;
    case 4: kn_stream<4>(p, k0, k1, padded_n, partial); break;
    default: kn_blocks(p, k0, k1, padded_n, partial); break;
  }
}

// Rows [0, MR) x columns [n0, n0 + NR) of x @ w^T for output-major w; columns past `cols` are not stored.
template <int MR, int NR>
void nt_tile(const Problem& p, const uint16_t* x, float* out, int64_t n0, int64_t cols) {
  const int64_t k_len = p.k;
  const uint16_t* w[NR];
#pragma GCC unroll 32
  for (int j = 0; j < NR; ++j) w[j] = p.w + (n0 + std::min<int64_t>(j, cols - 1)) * k_len;  // in bounds
  __m512 acc[MR][NR];
#pragma GCC unroll 32
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 32
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_len; k += 32) {
    const __mmask32 mask = low_mask32(k_len - k);
    __m512bh xv[MR];
#pragma GCC unroll 32
    for (int m = 0; m < MR; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * k_len + k);
#pragma GCC unroll 32
    for (int j = 0; j < NR; ++j) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[j] + k);
#pragma GCC unroll 32
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv[m], wv);
    }
  }
  float sums[MR][NR];  // every accumulator read by a constant index, so none of them lives in memory
#pragma GCC unroll 32
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 32
    for (int j = 0; j < NR; ++j) sums[m][j] = _mm512_reduce_add_ps(acc[m][j]);
  for (int m = 0; m < MR; ++m) std::copy(sums[m], sums[m] + std::min<int64_t>(NR, cols), out + m * p.n + n0);
}

void nt_unit(const Problem& p, int64_t m0, int64_t rows, int64_t n0, int64_t cols) {
  // Tiles of 1 row x 16 columns: 4 x 4 tiles (half the loads per product) measured 1.3-1.7x slower at 4-8
  // rows, and XLA's bfloat16 dot beats both from 4 rows on, so the models send only 1-3 rows here.
  for (int64_t m = m0; m < m0 + rows; ++m) {
    for (int64_t c = 0; c < cols; c += 16)
      nt_tile<1, 16>(p, p.x + m * p.k, p.out + m * p.n, n0 + c, std::min<int64_t>(16, cols - c));
  }
}

#else  // no AVX512-BF16: float32 conversions, the compiler's vector loops

void kn_unit(const Problem& p, int64_t m0, int64_t rows, int64_t n0, int64_t cols) {
  float acc[kPanel];
  for (int64_t m = m0; m < m0 + rows; ++m) {
    std::fill(acc, acc + cols, 0.0f);
    const uint16_t* x = p.x + m * p.k;
    for (int64_t k = 0; k < p.k; ++k) {
      const float xk = bf16_to_float(x[k]);
      const uint16_t* w = p.w + k * p.n + n0;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) acc[c] += xk * bf16_to_float(w[c]);
    }
    std::copy(acc, acc + cols, p.out + m * p.n + n0);
  }
}

void kn_stream_unit(const Problem& p, int64_t k0, int64_t k1, int64_t padded_n, float* partial) {
  for (int64_t m = 0; m < p.m; ++m) {
    float* acc = partial + m * padded_n;
    for (int64_t k = k0; k < k1; ++k) {
      const float xk = bf16_to_float(p.x[m * p.k + k]);
      const uint16_t* w = p.w + k * p.n;
#pragma omp simd
      for (int64_t c = 0; c < p.n; ++c) acc[c] += xk * bf16_to_float(w[c]);
    }
  }
}

void kn_stream_finish(const Problem& p, const float* partial, int splits, int64_t padded_n) {
  for (int64_t m = 0; m < p.m; ++m) {
    for (int64_t c = 0; c < p.n; ++c) {
      float sum = 0.0f;
      for (int s = 0; s < splits; ++s) sum += partial[(s * p.m + m) * padded_n + c];
      p.out[m * p.n + c] = sum;
    }
  }
}

void nt_unit(const Problem& p, int64_t m0, int64_t rows, int64_t n0, int64_t cols) {
  for (int64_t m = m0; m < m0 + rows; ++m) {
    const uint16_t* x = p.x + m * p.k;
    for (int64_t c = 0; c < cols; ++c) {
      const uint16_t* w = p.w + (n0 + c) * p.k;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < p.k; ++k) sum += bf16_to_float(x[k]) * bf16_to_float(w[k]);
      p.out[m * p.n + n0 + c] = sum;
    }
  }
}

#endif

using UnitFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t);

// One product's share of a call: its units of work, and where its K-split partials go.
struct Work {
  Problem p;
  int splits = 0;         // K-split units streaming input-major weights (a few rows), or 0 for tiles
  int64_t padded_n = 0;   // the partials' row length: whole 64-column tiles
  size_t partial = 0;     // the first of its partials in the call's buffer
  int64_t panel = 0, panels = 0;  // tiles: the columns of a unit, and units across the columns
  int units = 0;
};

// The units of p: one in-order weight stream per K-split unit for up to kStreamRows rows of input-major
// weights (at most `max_splits` of them), else (a panel of columns, up to kRowChunk rows) a unit.
Work plan(const Problem& p, bool w_output_major, int max_splits, size_t& partial_floats) {
  Work work;
  work.p = p;
  if (!w_output_major && p.m <= kStreamRows) {
    work.padded_n = (p.n + 63) / 64 * 64;
    work.splits = int(std::clamp<int64_t>(p.k / kStreamMinRows, 1, std::min(max_splits, kMaxSplits)));
    work.units = work.splits;
    work.partial = partial_floats;
    partial_floats += size_t(work.splits) * p.m * work.padded_n;
    return work;
  }
  // Narrow panels when there are few columns, so both threads have work at one row.
  work.panel = p.n >= 8 * kPanel ? kPanel : 32;
  work.panels = (p.n + work.panel - 1) / work.panel;
  work.units = int(work.panels * ((p.m + kRowChunk - 1) / kRowChunk));
  return work;
}

// Runs every unit of every product on this thread and the pool's, then adds each product's K-split
// partials (few, whatever the core count) on this thread.
void run(jaxserve::ThreadPool& pool, const std::vector<Work>& works, size_t partial_floats, UnitFn unit) {
  std::vector<int> units;
  for (const Work& work : works) units.push_back(work.units);
  std::vector<float> partial(partial_floats, 0.0f);
  jaxserve::share_product_units(pool, units, [&works, &partial, unit](int w, int i) {
    const Work& work = works[w];
    const Problem& p = work.p;
    if (work.splits > 0) {
      const int64_t k0 = p.k * i / work.splits / 2 * 2;
      const int64_t k1 = i + 1 == work.splits ? p.k : p.k * (i + 1) / work.splits / 2 * 2;
      kn_stream_unit(p, k0, k1, work.padded_n, partial.data() + work.partial + size_t(i) * p.m * work.padded_n);
      return;
    }
    const int64_t m0 = (i / work.panels) * kRowChunk, n0 = (i % work.panels) * work.panel;
    unit(p, m0, std::min<int64_t>(kRowChunk, p.m - m0), n0, std::min<int64_t>(work.panel, p.n - n0));
  });
  for (const Work& work : works) {
    if (work.splits > 0) kn_stream_finish(work.p, partial.data() + work.partial, work.splits, work.padded_n);
  }
}

}  // namespace

namespace jaxserve {

Status matmul_bf16(ThreadPool& pool, const Array& x, const Array& w, const Array& out, bool w_output_major) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const auto out_dims = out.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || out_dims.size() != 2) {
    return "matmul_bf16: x, w and out must be 2-D";
  }
  Problem p;
  p.m = x_dims[0];
  p.k = x_dims[1];
  p.n = w_output_major ? w_dims[0] : w_dims[1];
  if ((w_output_major ? w_dims[1] : w_dims[0]) != p.k || out_dims[0] != p.m || out_dims[1] != p.n) {
    return "matmul_bf16: mismatched shapes";
  }
  p.x = x.as<const uint16_t>();
  p.w = w.as<const uint16_t>();
  p.out = out.as<float>();
  if (p.m == 0 || p.n == 0) return nullptr;
  size_t partial_floats = 0;
  std::vector<Work> works{plan(p, w_output_major, num_workers(pool), partial_floats)};
  run(pool, works, partial_floats, w_output_major ? nt_unit : kn_unit);
  return nullptr;
}

// Rows of x in groups, each times its own input-major weights: a mixture of experts' assignments sorted by
// expert. Each non-empty group is a product of its own, planned as above; groups share the threads, so a
// group's K-split narrows as more groups stream (one unit a group once there are as many as threads).
Status grouped_matmul_bf16(ThreadPool& pool, const Array& x, const Array& w, const Array& group_sizes,
                           const Array& out) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const auto out_dims = out.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 3 || group_sizes.dimensions().size() != 1 || out_dims.size() != 2) {
    return "grouped_matmul_bf16: x [A, K], w [G, K, N], group_sizes [G], out [A, N]";
  }
  const int64_t rows = x_dims[0], k = x_dims[1], n = w_dims[2], groups = w_dims[0];
  if (w_dims[1] != k || group_sizes.dimensions()[0] != groups || out_dims[0] != rows || out_dims[1] != n) {
    return "grouped_matmul_bf16: mismatched shapes";
  }
  const uint16_t* xs = x.as<const uint16_t>();
  const uint16_t* ws = w.as<const uint16_t>();
  const int32_t* sizes = group_sizes.as<const int32_t>();
  float* outs = out.as<float>();
  if (rows == 0 || n == 0) return nullptr;
  std::vector<Problem> problems;
  int64_t covered = 0, streamed = 0;
  for (int64_t g = 0; g < groups && covered < rows; ++g) {
    const int64_t m = std::min<int64_t>(std::max(sizes[g], 0), rows - covered);
    if (m == 0) continue;
    problems.push_back(Problem{m, n, k, xs + covered * k, ws + g * k * n, outs + covered * n});
    covered += m;
    streamed += m <= kStreamRows;
  }
  std::fill(outs + covered * n, outs + rows * n, 0.0f);  // rows past the groups
  const int max_splits = int(std::max<int64_t>(num_workers(pool) / std::max<int64_t>(streamed, 1), 1));
  size_t partial_floats = 0;
  std::vector<Work> works;
  for (const Problem& p : problems) works.push_back(plan(p, false, max_splits, partial_floats));
  run(pool, works, partial_floats, kn_unit);
  return nullptr;
}

}  // namespace jaxserve
