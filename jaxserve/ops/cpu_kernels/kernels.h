// The kernels' entry points, in plain C++: arrays as views, XLA's intra-op threads behind an interface, errors
// as messages. `ffi_bindings.cc` is the one source that includes XLA's FFI header; it binds each handler and
// hands its buffers here, so XLA's header and the handlers' binding templates, a large share of each source's
// compile when every source bound its own handlers, are compiled once (docs/benchmarks.md, stop 96).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace jaxserve {

// An element type, by XLA's number for it (`ffi_bindings.cc` checks these against XLA's); the kernels name
// the types they take, and any other type keeps its own number, so types compare exactly.
enum class DType : int32_t { kS32 = 4, kU8 = 6, kF16 = 10, kF32 = 11, kBF16 = 16 };

constexpr int kMaxRank = 4;

// A buffer of a call, dense and row-major: its data, element type and shape.
struct Array {
  // The shape, as XLA's FFI spells it (size(), [i], begin(), end()).
  struct Dims {
    const int64_t* data;
    size_t count;
    size_t size() const { return count; }
    int64_t operator[](size_t i) const { return data[i]; }
    const int64_t* begin() const { return data; }
    const int64_t* end() const { return data + count; }
  };

  void* data = nullptr;
  DType dtype{};
  size_t itemsize = 0;  // bytes an element
  int rank = 0;
  int64_t shape[kMaxRank] = {};

  Dims dimensions() const { return {shape, size_t(rank)}; }
  int64_t element_count() const {
    int64_t count = 1;
    for (int i = 0; i < rank; ++i) count *= shape[i];
    return count;
  }
  size_t size_bytes() const { return size_t(element_count()) * itemsize; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

// A kernel's answer: nullptr, or what is wrong with the call (a string literal; the binding returns it to
// XLA as an invalid-argument error).
using Status = const char*;

// The threads a call may share (XLA's intra-op pool): how many it has, and a task handed to one of them.
class ThreadPool {
 public:
  virtual int64_t num_threads() const = 0;
  virtual void schedule(std::function<void()> task) = 0;

 protected:
  ~ThreadPool() = default;
};

// ragged_paged_attention.cc
Status ragged_paged_attention(ThreadPool& pool, const Array& q, const Array& k_pages, const Array& v_pages,
                              const Array& kv_lens, const Array& page_table, const Array& cu_q_lens,
                              const Array& sinks, float sm_scale, int32_t sliding_window, float logit_softcap,
                              const Array& out);

// write_kv.cc
Status write_pages(const Array& pages, const Array& rows, const Array& slot_mapping, const Array& out);

// matmul_bf16.cc (`w_output_major`: w is [N, K], the LM head's embedding table)
Status matmul_bf16(ThreadPool& pool, const Array& x, const Array& w, const Array& out, bool w_output_major);
Status grouped_matmul_bf16(ThreadPool& pool, const Array& x, const Array& w, const Array& group_sizes,
                           const Array& out);

// matmul_gguf.cc
Status matmul_gguf(ThreadPool& pool, const Array& x, const Array& w, const Array& out, int32_t kind);
Status grouped_matmul_gguf(ThreadPool& pool, const Array& x, const Array& w, const Array& group_sizes,
                           const Array& out, int32_t kind);

}  // namespace jaxserve
