// Ragged paged attention for CPUs, an XLA FFI custom call (jaxserve.ops.cpu_kernels builds and registers it;
// its handler is `ffi_bindings.cc`'s JaxserveRaggedPagedAttention).
//
// The packed queries of a step (prefill chunks and decodes, any mix) attend causally over each request's
// paged K/V. Work unit = (request r, KV head k, a block of r's consecutive query tokens, a range of the
// G = N / K query heads sharing that KV head, all of them unless a call has fewer units than threads): its
// rows are the block's tokens times the range's heads, so every K/V row read serves all of them, and a
// decode's unit (one token) reads each live K/V row exactly once: what bounds decode attention, and what
// XLA:CPU's gathers of pages followed by small batched dots did not reach. Cost follows the live tokens, not
// the bucket's padded shape. Units are shared among XLA's intra-op threads and the calling thread through one
// atomic counter; each unit visits pages in order with an online softmax. Units of many rows (prefill chunks,
// and decodes of wide groups) run blocked loops (`block_scores`, `block_weighted_values`) whose sums stay in
// registers, where the head size is one compiled for; other units take plain dot products.
//
// Shapes (row-major):
//   q          [T, N, H]                  float32 or bfloat16
//   k_pages    [K, num_pages, page_size, H]
//   v_pages    [K, num_pages, page_size, H], or no elements: each key is also its value (DeepSeek's latent)
//   kv_lens    int32[R]                   r's cached tokens, its queries' included
//   page_table int32[R, P]                r's pages; entries past its length are not read
//   cu_q_lens  int32[R+1]                 r's queries are tokens cu_q_lens[r] : cu_q_lens[r+1]
//   out        [T, N, Hv]                 q's dtype; tokens past cu_q_lens[R] (padding) come back as zeros. Hv is
//                                         H, or fewer where the values are the keys: their first Hv dims
// The cache is float32, bfloat16 or float16, whatever q's dtype; scores and sums are float32.
// Attributes: sm_scale; sliding_window (0: none), a query at position p then sees keys p - window + 1 .. p,
// and a unit starts at the page holding its first query's earliest key; logit_softcap (0: none), scaled
// scores pass through cap * tanh(s / cap) (Gemma 2).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "work_sharing.h"

namespace {

constexpr int kMaxRows = 64;  // query rows per unit (tokens x heads of a GQA group)
constexpr int kKeyRun = 64;   // keys scored per online-softmax update (a page, or a slice of a large one)

struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(_Float16 x) { return static_cast<float>(x); }  // F16C's vcvtph2ps where the CPU has it
inline float to_float(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, bf16* out) {  // round to nearest even, as XLA converts
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  out->bits = static_cast<uint16_t>(bits >> 16);
}

struct Unit {
  int request, kv_head, first_query, num_queries;  // queries first_query : first_query + num_queries of r
  int first_head, num_heads;  // the group's heads first_head : first_head + num_heads of kv_head
};

struct Problem {
  int num_q_heads, num_kv_heads, head_dim, value_dim, num_pages, page_size, max_pages;
  bool values_are_keys;  // v_pages unused: the values are the keys' first value_dim dims
  float sm_scale;
  int sliding_window;   // 0: every earlier key
  float logit_softcap;  // 0: none
  const float* sinks;   // [num_q_heads]: each head's attention-sink logit (GPT-OSS), or null: none
  const void* q;
  const void* k_pages;
  const void* v_pages;
  const int32_t* kv_lens;
  const int32_t* page_table;
  const int32_t* cu_q_lens;
  void* out;
};

// Rows of `dim` values as float32: the rows themselves for a float32 cache, else converted into `buffer`.
template <typename T>
const float* as_float_rows(const T* rows, int num_rows, int dim, float* buffer) {
  const int count = num_rows * dim;
  if constexpr (std::is_same_v<T, float>) {
    return rows;
  } else if constexpr (std::is_same_v<T, _Float16>) {
    int i = 0;
#if defined(__F16C__)  // the compiler does not vectorise _Float16 conversions without AVX512-FP16
    for (; i + 8 <= count; i += 8) {
      _mm256_storeu_ps(buffer + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + i))));
    }
#endif
    for (; i < count; ++i) buffer[i] = to_float(rows[i]);
    return buffer;
  } else {
#pragma omp simd
    for (int i = 0; i < count; ++i) buffer[i] = to_float(rows[i]);
    return buffer;
  }
}

// Pages are scattered, and no hardware prefetcher follows into the next one: ask for it while this one runs.
inline void prefetch(const void* start, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(start) + b);
}

// One vector register of float32 lanes as GCC's vector extension, so blocks of rows keep their sums in
// registers across a loop, which plain arrays do not reliably get. The width is the build's registers': a
// wider vector (16 lanes on AVX2) compiles to element-wise traffic through the stack.
#if defined(__AVX512F__)
constexpr int kLanes = 16, kVectorRegisters = 32;
#elif defined(__AVX__)
constexpr int kLanes = 8, kVectorRegisters = 16;
#else
constexpr int kLanes = 4, kVectorRegisters = 16;
#endif
typedef float f32v __attribute__((vector_size(4 * kLanes)));
inline f32v load_lanes(const float* p) {
  f32v v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store_lanes(float* p, f32v v) { std::memcpy(p, &v, sizeof(v)); }

// Scores of 8 rows against up to kLanes keys at a time, K transposed so each step is one vector of keys times
// one broadcast query value: no horizontal sums. For units of many rows (prefill chunks), whose per-row dot
// products would otherwise spend more on reductions than on multiplies. Rows past the last block of 8 use
// the dot products.
template <int kDim>
void block_scores(const float* qs, int rows, const float* k, int keys, float* scores, float* kt) {
  for (int j0 = 0; j0 < keys; j0 += kLanes) {
    const int block_keys = std::min(kLanes, keys - j0);
    for (int h = 0; h < kDim; ++h) {  // kt: [H, kLanes], keys past the run's end zero
      for (int j = 0; j < kLanes; ++j) kt[h * kLanes + j] = j < block_keys ? k[(j0 + j) * kDim + h] : 0.0f;
    }
    int row = 0;
    for (; row + 8 <= rows; row += 8) {
      f32v sums[8] = {};
      for (int h = 0; h < kDim; ++h) {
        const f32v kv = load_lanes(kt + h * kLanes);
        for (int i = 0; i < 8; ++i) sums[i] += qs[(row + i) * kDim + h] * kv;
      }
      for (int i = 0; i < 8; ++i) {
        float lanes[kLanes];
        store_lanes(lanes, sums[i]);
        std::memcpy(scores + (row + i) * kKeyRun + j0, lanes, block_keys * sizeof(float));
      }
    }
    for (; row < rows; ++row) {
      for (int j = j0; j < j0 + block_keys; ++j) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int h = 0; h < kDim; ++h) dot += qs[row * kDim + h] * k[j * kDim + h];
        scores[row * kKeyRun + j] = dot;
      }
    }
  }
}

// The vectors of a value row held a row in `block_weighted_values`' register tile: half the register file
// spread over as many rows as fit a head of up to 128 values (AVX-512, 4 rows of 64 or 2 of 128; AVX, one
// row of 64); a wider head's tile is 4 rows by a quarter of the half, so each value vector loaded serves 4
// rows' sums.
constexpr int tile_slice(int chunks) {
  return chunks * kLanes <= 128 ? std::min(chunks, kVectorRegisters / 2) : kVectorRegisters / 8;
}

// acc[rows, Hv] += weights[rows, keys] @ v[keys, :Hv] (v's rows kStride apart), a tile of kRows rows by kSlice
// vectors of Hv held in registers across the keys (`tile_slice`). Weights past a row's visible keys are zero.
template <int kValueDim, int kStride>
void block_weighted_values(const float* weights, int rows, const int* visible, const float* v, float* acc) {
  constexpr int kChunks = kValueDim / kLanes, kSlice = tile_slice(kChunks);
  constexpr int kRows = std::max(1, kVectorRegisters / 2 / kSlice);
  static_assert(kValueDim % kLanes == 0 && kChunks % kSlice == 0, "a head size of whole slices of vectors");
  int row = 0;
  for (; row + kRows <= rows; row += kRows) {
    int keys = 0;
    for (int i = 0; i < kRows; ++i) keys = std::max(keys, visible[row + i]);
    for (int c0 = 0; c0 < kChunks; c0 += kSlice) {
      f32v sums[kRows][kSlice];
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kSlice; ++c) sums[i][c] = load_lanes(acc + (row + i) * kValueDim + (c0 + c) * kLanes);
      for (int j = 0; j < keys; ++j) {
        for (int c = 0; c < kSlice; ++c) {
          const f32v vj = load_lanes(v + j * kStride + (c0 + c) * kLanes);
          for (int i = 0; i < kRows; ++i) sums[i][c] += weights[(row + i) * kKeyRun + j] * vj;
        }
      }
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kSlice; ++c) store_lanes(acc + (row + i) * kValueDim + (c0 + c) * kLanes, sums[i][c]);
    }
  }
  for (; row < rows; ++row) {
    float* a = acc + row * kValueDim;
    for (int j = 0; j < visible[row]; ++j) {
      const float w = weights[row * kKeyRun + j];
#pragma omp simd
      for (int h = 0; h < kValueDim; ++h) a[h] += w * v[j * kStride + h];
    }
  }
}

constexpr int kBlockedRows = 8;  // units with at least this many rows take the blocked loops (kDim known)

// Per-thread scratch, sized once for the largest head size seen.
struct Scratch {
  std::vector<float> queries, acc, scores, keys, values, transposed;  // [rows|run, H]...; transposed [H, kLanes]
  void fit(int dim) {
    if (static_cast<int>(queries.size()) >= kMaxRows * dim) return;
    queries.assign(size_t(kMaxRows) * dim, 0.0f);
    acc.assign(size_t(kMaxRows) * dim, 0.0f);
    scores.assign(size_t(kMaxRows) * kKeyRun, 0.0f);
    keys.assign(size_t(kKeyRun) * dim, 0.0f);
    values.assign(size_t(kKeyRun) * dim, 0.0f);
    transposed.assign(size_t(kLanes) * dim, 0.0f);
  }
};

// One unit. Row i * heads + g is query token i of the unit, head first_head + g of the group. Q is q's and
// out's type, T the cache's; `kDim` and `kValueDim` are the head size and the values' when fixed at compile
// time (64, 128, and DeepSeek's latent 576 whose first 512 are the values: loops the compiler unrolls), else 0.
template <typename Q, typename T, int kDim, int kValueDim>
void attend_unit(const Problem& p, const Unit& unit) {
  static_assert((kDim == 0) == (kValueDim == 0) && kValueDim <= kDim, "both sizes fixed, or neither");
  thread_local Scratch scratch;
  const int dim = kDim ? kDim : p.head_dim, value_dim = kValueDim ? kValueDim : p.value_dim;
  scratch.fit(dim);
  const int group = p.num_q_heads / p.num_kv_heads, heads = unit.num_heads, page_size = p.page_size;
  const int r = unit.request, rows = unit.num_queries * heads;
  const int kv_len = p.kv_lens[r], q_len = p.cu_q_lens[r + 1] - p.cu_q_lens[r];
  const int first_pos = kv_len - q_len + unit.first_query;  // position of the unit's first query token
  const int64_t first_token = p.cu_q_lens[r] + unit.first_query;
  const int first_head = unit.kv_head * group + unit.first_head;  // of the unit's heads, among all N
  auto head_index = [&](int row) {  // of row (i, g): its token's index times N plus its head's
    return (first_token + row / heads) * p.num_q_heads + first_head + row % heads;
  };
  const Q* q = static_cast<const Q*>(p.q);
  Q* out = static_cast<Q*>(p.out);
  float* __restrict__ qs = scratch.queries.data();
  float* __restrict__ acc = scratch.acc.data();
  float* __restrict__ scores = scratch.scores.data();
  float row_max[kMaxRows], row_sum[kMaxRows];
  for (int row = 0; row < rows; ++row) {
    const Q* q_row = q + head_index(row) * dim;
    for (int h = 0; h < dim; ++h) qs[row * dim + h] = to_float(q_row[h]) * p.sm_scale;
    for (int h = 0; h < value_dim; ++h) acc[row * value_dim + h] = 0.0f;
    // finite: the build uses -ffast-math. A sink is a key of its own logit that weighs no value: the running
    // maximum and sum start from it.
    row_max[row] = p.sinks != nullptr ? p.sinks[first_head + row % heads] : -1e30f;
    row_sum[row] = p.sinks != nullptr ? 1.0f : 0.0f;
  }
  const int64_t page_elems = int64_t(page_size) * dim;
  const T* k_head = static_cast<const T*>(p.k_pages) + unit.kv_head * p.num_pages * page_elems;
  const T* v_head =
      p.values_are_keys ? nullptr : static_cast<const T*>(p.v_pages) + unit.kv_head * p.num_pages * page_elems;
  const int32_t* pages = p.page_table + int64_t(r) * p.max_pages;
  const int num_keys = first_pos + unit.num_queries;  // the last query sees keys 0 .. its position
  const int num_live_pages = (num_keys + page_size - 1) / page_size;
  const int window = p.sliding_window;  // row i sees keys from its position - window + 1 (0: from key 0)
  const int first_page = window > 0 ? std::max(0, first_pos - window + 1) / page_size : 0;
  const float cap = p.logit_softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  for (int page = first_page; page < num_live_pages; ++page) {
    if (page + 1 < num_live_pages) {
      prefetch(k_head + pages[page + 1] * page_elems, page_elems * sizeof(T));
      if (v_head != nullptr) prefetch(v_head + pages[page + 1] * page_elems, page_elems * sizeof(T));
    }
    const int page_keys = std::min(page_size, num_keys - page * page_size);
    for (int run_start = 0; run_start < page_keys; run_start += kKeyRun) {
      const int keys = std::min(kKeyRun, page_keys - run_start);
      const int first_key = page * page_size + run_start;  // position of the run's first key
      const int64_t offset = pages[page] * page_elems + int64_t(run_start) * dim;
      const float* __restrict__ k = as_float_rows(k_head + offset, keys, dim, scratch.keys.data());
      // rows `dim` apart either way; the values' first value_dim of each are read
      const float* __restrict__ v = v_head == nullptr ? k : as_float_rows(v_head + offset, keys, dim,
                                                                           scratch.values.data());
      const bool blocked = kDim != 0 && rows >= kBlockedRows;
      if constexpr (kDim != 0) {
        if (blocked) block_scores<kDim>(qs, rows, k, keys, scores, scratch.transposed.data());
      }
      int visible[kMaxRows];  // a row sees the run's keys [from, visible[row])
      for (int row = 0; row < rows; ++row) {
        // keys at or before this row's position (and inside its window) are visible; a row that has seen
        // nothing yet keeps its maximum at -1e30, which the first run it sees replaces
        const int pos = first_pos + row / heads;
        visible[row] = std::clamp(pos - first_key + 1, 0, keys);
        const int from = window > 0 ? std::clamp(pos - window + 1 - first_key, 0, visible[row]) : 0;
        float* s = scores + row * kKeyRun;
        if (visible[row] == from) {
          std::fill(s, s + keys, 0.0f);  // the blocked sums read whole blocks of rows
          visible[row] = 0;
          continue;
        }
        const float* q_row = qs + row * dim;
        if (!blocked) {
          for (int j = from; j < visible[row]; ++j) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int h = 0; h < dim; ++h) dot += q_row[h] * k[j * dim + h];
            s[j] = dot;
          }
        }
        if (cap > 0.0f) {
          for (int j = from; j < visible[row]; ++j) s[j] = cap * std::tanh(s[j] * inv_cap);
        }
        float run_max = row_max[row];
        for (int j = from; j < visible[row]; ++j) run_max = std::max(run_max, s[j]);
        const float rescale = std::exp(row_max[row] - run_max);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int j = from; j < visible[row]; ++j) {
          s[j] = std::exp(s[j] - run_max);
          sum += s[j];
        }
        for (int j = 0; j < from; ++j) s[j] = 0.0f;  // before the window: weight 0
        for (int j = visible[row]; j < keys; ++j) s[j] = 0.0f;  // the blocked sums read whole blocks of rows
        row_sum[row] = row_sum[row] * rescale + sum;
        row_max[row] = run_max;
        float* a = acc + row * value_dim;
#pragma omp simd
        for (int h = 0; h < value_dim; ++h) a[h] *= rescale;
        if (!blocked) {
          for (int j = from; j < visible[row]; ++j) {
            const float weight = s[j];
#pragma omp simd
            for (int h = 0; h < value_dim; ++h) a[h] += weight * v[j * dim + h];
          }
        }
      }
      if constexpr (kDim != 0) {
        if (blocked) block_weighted_values<kValueDim, kDim>(scores, rows, visible, v, acc);
      }
    }
  }
  for (int row = 0; row < rows; ++row) {
    Q* out_row = out + head_index(row) * value_dim;
    const float inv = 1.0f / row_sum[row];
    for (int h = 0; h < value_dim; ++h) from_float(acc[row * value_dim + h] * inv, out_row + h);
  }
}

using UnitFn = void (*)(const Problem&, const Unit&);

// The head (and values') sizes compiled for: the common heads, and DeepSeek's latent with its values.
template <typename Q, typename T>
UnitFn pick_unit(int head_dim, int value_dim) {
  if (head_dim == 64 && value_dim == 64) return attend_unit<Q, T, 64, 64>;
  if (head_dim == 128 && value_dim == 128) return attend_unit<Q, T, 128, 128>;
  if (head_dim == 576 && value_dim == 512) return attend_unit<Q, T, 576, 512>;
  return attend_unit<Q, T, 0, 0>;
}

template <typename Q>
UnitFn pick_unit(jaxserve::DType cache, int head_dim, int value_dim) {
  switch (cache) {
    case jaxserve::DType::kF32: return pick_unit<Q, float>(head_dim, value_dim);
    case jaxserve::DType::kBF16: return pick_unit<Q, bf16>(head_dim, value_dim);
    case jaxserve::DType::kF16: return pick_unit<Q, _Float16>(head_dim, value_dim);
    default: return nullptr;
  }
}

}  // namespace

namespace jaxserve {

Status ragged_paged_attention(ThreadPool& pool, const Array& q, const Array& k_pages, const Array& v_pages,
                              const Array& kv_lens, const Array& page_table, const Array& cu_q_lens,
                              const Array& sinks, float sm_scale, int32_t sliding_window, float logit_softcap,
                              const Array& out) {
  const auto q_dims = q.dimensions();
  const auto k_dims = k_pages.dimensions();
  const auto table_dims = page_table.dimensions();
  if (q_dims.size() != 3 || k_dims.size() != 4 || table_dims.size() != 2) {
    return "ragged_paged_attention: bad ranks";
  }
  const int num_tokens = int(q_dims[0]), num_reqs = int(table_dims[0]);
  Problem p;
  p.num_q_heads = int(q_dims[1]);
  p.head_dim = int(q_dims[2]);
  p.num_kv_heads = int(k_dims[0]);
  p.num_pages = int(k_dims[1]);
  p.page_size = int(k_dims[2]);
  p.max_pages = int(table_dims[1]);
  p.sm_scale = sm_scale;
  p.sliding_window = std::max(0, sliding_window);
  p.logit_softcap = std::max(0.0f, logit_softcap);
  const int64_t num_sinks = sinks.element_count();  // 0: none; else one per query head
  if (num_sinks != 0 && num_sinks != p.num_q_heads) {
    return "ragged_paged_attention: sinks must be none or one per query head";
  }
  p.sinks = num_sinks != 0 ? sinks.as<const float>() : nullptr;
  const int group = p.num_kv_heads > 0 ? p.num_q_heads / p.num_kv_heads : 0;
  p.values_are_keys = v_pages.element_count() == 0;
  const auto v_dims = v_pages.dimensions();
  if (!p.values_are_keys && (v_dims.size() != 4 || v_dims[0] != k_dims[0] || v_dims[1] != k_dims[1] ||
                             v_dims[2] != k_dims[2] || v_dims[3] != k_dims[3])) {
    return "ragged_paged_attention: K and V pages differ in shape";
  }
  const auto out_dims = out.dimensions();
  p.value_dim = out_dims.size() == 3 ? int(out_dims[2]) : 0;
  if (out_dims.size() != 3 || out_dims[0] != q_dims[0] || out_dims[1] != q_dims[1] || p.value_dim < 1 ||
      p.value_dim > p.head_dim || (p.value_dim != p.head_dim && !p.values_are_keys)) {
    return "ragged_paged_attention: out must be [T, N, H], or [T, N, Hv <= H] where the values are the keys";
  }
  if (group < 1 || group > kMaxRows || p.num_q_heads % p.num_kv_heads != 0 || k_dims[3] != q_dims[2] ||
      int(kv_lens.dimensions()[0]) != num_reqs || int(cu_q_lens.dimensions()[0]) != num_reqs + 1) {
    return "ragged_paged_attention: unsupported or mismatched shapes";
  }
  const bool f32 = q.dtype == DType::kF32;
  const UnitFn run = f32                        ? pick_unit<float>(k_pages.dtype, p.head_dim, p.value_dim)
                     : q.dtype == DType::kBF16 ? pick_unit<bf16>(k_pages.dtype, p.head_dim, p.value_dim)
                                               : nullptr;
  if (run == nullptr || (!p.values_are_keys && k_pages.dtype != v_pages.dtype) || q.dtype != out.dtype) {
    return "ragged_paged_attention: q and out float32 or bfloat16, K and V one of float32, bfloat16, float16";
  }
  p.q = q.data;
  p.k_pages = k_pages.data;
  p.v_pages = p.values_are_keys ? nullptr : v_pages.data;
  p.kv_lens = kv_lens.as<const int32_t>();
  p.page_table = page_table.as<const int32_t>();
  p.cu_q_lens = cu_q_lens.as<const int32_t>();
  p.out = out.data;

  std::vector<Unit> units;
  const int block = kMaxRows / group;  // query tokens per unit
  // What the units will read, checked once here: a bad batch is an error, never a read out of bounds.
  if (p.cu_q_lens[0] != 0) return "ragged_paged_attention: cu_q_lens[0] is not 0";
  for (int r = 0; r < num_reqs; ++r) {
    const int q_len = p.cu_q_lens[r + 1] - p.cu_q_lens[r];
    const int kv_len = p.kv_lens[r], num_live_pages = (kv_len + p.page_size - 1) / p.page_size;
    bool valid = q_len >= 0 && p.cu_q_lens[r + 1] <= num_tokens &&
                 (q_len == 0 || (kv_len >= q_len && num_live_pages <= p.max_pages));
    if (q_len == 0 && valid) continue;
    for (int page = 0; valid && page < num_live_pages; ++page) {
      const int32_t id = p.page_table[int64_t(r) * p.max_pages + page];
      valid = id >= 0 && id < p.num_pages;
    }
    if (!valid) return "ragged_paged_attention: request metadata out of range";
    for (int first = 0; first < q_len; first += block) {
      for (int k = 0; k < p.num_kv_heads; ++k) {
        units.push_back({r, k, first, std::min(block, q_len - first), 0, group});
      }
    }
  }
  // Fewer units than threads (a decode or two of a model with one KV head: DeepSeek's latent): each unit's
  // heads split into ranges of whole blocks of kBlockedRows heads (the last range takes the rest), so that every
  // thread works and a decode's rows take the same loops, blocked or not, as unsplit. Each range reads the same
  // K/V rows, the second time from the cache.
  const int workers = num_workers(pool), units_before = int(units.size());
  const int parts = units_before == 0 ? 1 : std::min((workers + units_before - 1) / units_before,
                                                     std::max(1, group / kBlockedRows));
  if (parts > 1) {
    const int heads = ((group + parts - 1) / parts + kBlockedRows - 1) / kBlockedRows * kBlockedRows;
    std::vector<Unit> split;
    for (const Unit& unit : units) {
      for (int h = 0; h < group; h += heads) split.push_back({unit.request, unit.kv_head, unit.first_query,
                                                              unit.num_queries, h, std::min(heads, group - h)});
    }
    units.swap(split);
  }
  // The units write every token up to cu_q_lens[R] (the requests' ranges tile it); padding tokens read zeros.
  const size_t row_bytes = size_t(p.num_q_heads) * p.value_dim * (f32 ? 4 : 2);
  const int num_real = p.cu_q_lens[num_reqs];
  std::memset(static_cast<char*>(p.out) + num_real * row_bytes, 0, (num_tokens - num_real) * row_bytes);

  share_units(pool, static_cast<int>(units.size()), [&p, &units, run](int u) { run(p, units[u]); });
  return nullptr;
}

}  // namespace jaxserve
