// Paged decode attention for CPUs, an XLA FFI custom call (jaxserve.ops.cpu_kernels builds and registers it).
//
// One query token per request (a decode step). Work unit u = (request r, KV head k): the G = N / K query
// heads of that group read each of r's K/V pages once, in page order, with an online softmax, so the
// traffic is each live K/V row once per step: what bounds decode attention, and what XLA:CPU's gathers of
// pages followed by small batched dots did not reach. Units are shared among XLA's intra-op threads and
// the calling thread through one atomic counter.
//
// Shapes (row-major):
//   q         [R, N, H]                 float32 or bfloat16 (the cache's dtype)
//   k_pages   [K, num_pages, page_size, H]
//   v_pages   [K, num_pages, page_size, H]
//   kv_lens   int32[R]                  0 marks a padding request: its output rows are zeros
//   page_table int32[R, P]              request r's pages; entries past its length are not read
//   out       [R, N, H]
// Scores and sums are float32 whatever the storage dtype.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 16;
constexpr int kKeyRun = 64;  // keys scored per online-softmax update (a page, or a slice of a large one)

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) {  // round to nearest even, as XLA converts
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *out = static_cast<uint16_t>(bits >> 16);
}

struct Problem {
  int num_reqs, num_q_heads, num_kv_heads, head_dim, num_pages, page_size, max_pages;
  float sm_scale;
  const void* q;
  const void* k_pages;
  const void* v_pages;
  const int32_t* kv_lens;
  const int32_t* page_table;
  void* out;
};

// Rows of `dim` values as float32: the rows themselves for a float32 cache, else converted into `buffer`.
template <typename T>
const float* as_float_rows(const T* rows, int num_rows, int dim, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return rows;
  } else {
    for (int i = 0; i < num_rows * dim; ++i) buffer[i] = to_float(rows[i]);
    return buffer;
  }
}

// Pages are scattered, and no hardware prefetcher follows into the next one: ask for it while this one runs.
inline void prefetch(const void* start, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(start) + b);
}

// One work unit: request r's G query heads of one KV head, over r's pages in order, online softmax.
// `kDim` is the head size when fixed at compile time (64, 128: loops the compiler unrolls), else 0.
template <typename T, int kDim>
void attend_unit(const Problem& p, int unit) {
  const int r = unit / p.num_kv_heads, kv_head = unit % p.num_kv_heads;
  const int group = p.num_q_heads / p.num_kv_heads, page_size = p.page_size;
  const int dim = kDim ? kDim : p.head_dim;
  const T* q = static_cast<const T*>(p.q) + (int64_t(r) * p.num_q_heads + kv_head * group) * dim;
  T* out = static_cast<T*>(p.out) + (int64_t(r) * p.num_q_heads + kv_head * group) * dim;
  const int kv_len = p.kv_lens[r];
  if (kv_len <= 0) {
    for (int i = 0; i < group * dim; ++i) from_float(0.0f, out + i);
    return;
  }
  alignas(64) float qs[kMaxGroup][kMaxHeadDim];      // [G, H], scaled
  alignas(64) float acc[kMaxGroup][kMaxHeadDim];     // [G, H], unnormalised output
  alignas(64) float scores[kMaxGroup][kKeyRun];      // [G, keys] of the current run
  alignas(64) float k_buffer[kKeyRun * kMaxHeadDim];  // a run's keys as float32 (16-bit caches only)
  alignas(64) float v_buffer[kMaxHeadDim];
  float row_max[kMaxGroup], row_sum[kMaxGroup];
  for (int g = 0; g < group; ++g) {
    for (int h = 0; h < dim; ++h) qs[g][h] = to_float(q[g * dim + h]) * p.sm_scale;
    for (int h = 0; h < dim; ++h) acc[g][h] = 0.0f;
    row_max[g] = -1e30f;  // finite: the build uses -ffast-math
    row_sum[g] = 0.0f;
  }
  const int64_t page_elems = int64_t(page_size) * dim;
  const T* k_head = static_cast<const T*>(p.k_pages) + kv_head * p.num_pages * page_elems;
  const T* v_head = static_cast<const T*>(p.v_pages) + kv_head * p.num_pages * page_elems;
  const int32_t* pages = p.page_table + int64_t(r) * p.max_pages;
  const int num_live_pages = (kv_len + page_size - 1) / page_size;
  for (int page = 0; page < num_live_pages; ++page) {
    if (page + 1 < num_live_pages) {
      prefetch(k_head + pages[page + 1] * page_elems, page_elems * sizeof(T));
      prefetch(v_head + pages[page + 1] * page_elems, page_elems * sizeof(T));
    }
    const int page_keys = std::min(page_size, kv_len - page * page_size);
    for (int first = 0; first < page_keys; first += kKeyRun) {
      const int keys = std::min(kKeyRun, page_keys - first);
      const int64_t offset = pages[page] * page_elems + int64_t(first) * dim;
      const float* k = as_float_rows(k_head + offset, keys, dim, k_buffer);
      const T* v = v_head + offset;
      for (int g = 0; g < group; ++g) {
        float run_max = row_max[g];
        for (int j = 0; j < keys; ++j) {
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int h = 0; h < dim; ++h) s += qs[g][h] * k[j * dim + h];
          scores[g][j] = s;
          run_max = std::max(run_max, s);
        }
        const float rescale = std::exp(row_max[g] - run_max);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < keys; ++j) {
          scores[g][j] = std::exp(scores[g][j] - run_max);
          sum += scores[g][j];
        }
        row_sum[g] = row_sum[g] * rescale + sum;
        row_max[g] = run_max;
#pragma omp simd
        for (int h = 0; h < dim; ++h) acc[g][h] *= rescale;
      }
      for (int j = 0; j < keys; ++j) {
        const float* v_row = as_float_rows(v + j * dim, 1, dim, v_buffer);
        for (int g = 0; g < group; ++g) {
          const float weight = scores[g][j];
#pragma omp simd
          for (int h = 0; h < dim; ++h) acc[g][h] += weight * v_row[h];
        }
      }
    }
  }
  for (int g = 0; g < group; ++g) {
    const float inv = 1.0f / row_sum[g];
    for (int h = 0; h < dim; ++h) from_float(acc[g][h] * inv, out + g * dim + h);
  }
}

// Work shared by the caller and the pool's threads. Tasks the pool starts after the work is gone find
// the counter past the end and return, so they own a reference, never the caller's stack.
struct SharedWork {
  Problem problem;
  void (*run)(const Problem&, int);
  int num_units;
  std::atomic<int> next{0};
  std::atomic<int> done{0};

  void drain() {
    for (int u; (u = next.fetch_add(1, std::memory_order_relaxed)) < num_units;) {
      run(problem, u);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PagedDecodeAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                                ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> kv_lens,
                                ffi::Buffer<ffi::S32> page_table, float sm_scale,
                                ffi::Result<ffi::AnyBuffer> out) {
  const auto q_dims = q.dimensions();
  const auto k_dims = k_pages.dimensions();
  const auto table_dims = page_table.dimensions();
  if (q_dims.size() != 3 || k_dims.size() != 4 || table_dims.size() != 2) {
    return ffi::Error::InvalidArgument("paged_decode_attention: bad ranks");
  }
  Problem p;
  p.num_reqs = int(q_dims[0]);
  p.num_q_heads = int(q_dims[1]);
  p.head_dim = int(q_dims[2]);
  p.num_kv_heads = int(k_dims[0]);
  p.num_pages = int(k_dims[1]);
  p.page_size = int(k_dims[2]);
  p.max_pages = int(table_dims[1]);
  p.sm_scale = sm_scale;
  if (p.head_dim > kMaxHeadDim || p.num_q_heads % p.num_kv_heads != 0 ||
      p.num_q_heads / p.num_kv_heads > kMaxGroup || k_dims[3] != q_dims[2] ||
      int(table_dims[0]) != p.num_reqs || int(kv_lens.dimensions()[0]) != p.num_reqs) {
    return ffi::Error::InvalidArgument("paged_decode_attention: unsupported or mismatched shapes");
  }
  if (q.element_type() != k_pages.element_type() || q.element_type() != v_pages.element_type() ||
      q.element_type() != out->element_type()) {
    return ffi::Error::InvalidArgument("paged_decode_attention: q, K/V and out must share a dtype");
  }
  p.q = q.untyped_data();
  p.k_pages = k_pages.untyped_data();
  p.v_pages = v_pages.untyped_data();
  p.kv_lens = kv_lens.typed_data();
  p.page_table = page_table.typed_data();
  p.out = out->untyped_data();

  auto work = std::make_shared<SharedWork>();
  work->problem = p;
  work->num_units = p.num_reqs * p.num_kv_heads;
  const bool f32 = q.element_type() == ffi::DataType::F32;
  if (f32 || q.element_type() == ffi::DataType::BF16) {
    work->run = p.head_dim == 64    ? (f32 ? attend_unit<float, 64> : attend_unit<uint16_t, 64>)
                : p.head_dim == 128 ? (f32 ? attend_unit<float, 128> : attend_unit<uint16_t, 128>)
                                    : (f32 ? attend_unit<float, 0> : attend_unit<uint16_t, 0>);
  } else {
    return ffi::Error::InvalidArgument("paged_decode_attention: float32 or bfloat16 only");
  }
  const int helpers = int(std::min<int64_t>(pool.num_threads(), work->num_units - 1));
  for (int i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < work->num_units) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecodeAttention, PagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>());
