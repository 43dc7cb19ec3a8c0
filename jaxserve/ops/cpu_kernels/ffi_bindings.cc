// The native CPU kernels' XLA FFI handlers (jaxserve.ops.cpu_kernels registers them by these symbols): each
// binds its call's buffers, attributes and XLA's intra-op thread pool and hands them to a kernel as plain
// views (`kernels.h`). This is the one source that includes XLA's FFI header. XLA checks each buffer's
// element type against the binding before a handler runs; the kernel checks the shapes.

#include <cstdint>
#include <functional>
#include <utility>

#include "kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::Array;

// The kernels' element types are XLA's numbers (`kernels.h`).
static_assert(int32_t(jaxserve::DType::kS32) == int32_t(ffi::DataType::S32));
static_assert(int32_t(jaxserve::DType::kU8) == int32_t(ffi::DataType::U8));
static_assert(int32_t(jaxserve::DType::kF16) == int32_t(ffi::DataType::F16));
static_assert(int32_t(jaxserve::DType::kF32) == int32_t(ffi::DataType::F32));
static_assert(int32_t(jaxserve::DType::kBF16) == int32_t(ffi::DataType::BF16));

// A buffer (any of the FFI's buffer types) as a view. One of a rank past kMaxRank comes as an empty view of
// rank 0, which every kernel's shape checks refuse.
template <typename Buffer>
Array view(const Buffer& buffer) {
  Array array;
  const auto dims = buffer.dimensions();
  if (dims.size() > size_t(jaxserve::kMaxRank)) return array;
  array.data = buffer.untyped_data();
  array.dtype = jaxserve::DType(int32_t(buffer.element_type()));
  array.itemsize = ffi::ByteWidth(buffer.element_type());
  array.rank = int(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) array.shape[i] = dims[i];
  return array;
}

template <typename Buffer>
Array view(ffi::Result<Buffer>& result) {
  return view(*result);
}

class Pool final : public jaxserve::ThreadPool {
 public:
  explicit Pool(ffi::ThreadPool& pool) : pool_(pool) {}
  int64_t num_threads() const override { return pool_.num_threads(); }
  void schedule(std::function<void()> task) override { pool_.Schedule(std::move(task)); }

 private:
  ffi::ThreadPool& pool_;
};

ffi::Error to_error(jaxserve::Status status) {
  return status == nullptr ? ffi::Error::Success() : ffi::Error::InvalidArgument(status);
}

ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                                ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> kv_lens,
                                ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> cu_q_lens,
                                ffi::Buffer<ffi::F32> sinks, float sm_scale, int32_t sliding_window,
                                float logit_softcap, ffi::Result<ffi::AnyBuffer> out) {
  Pool workers(pool);
  return to_error(jaxserve::ragged_paged_attention(workers, view(q), view(k_pages), view(v_pages), view(kv_lens),
                                                   view(page_table), view(cu_q_lens), view(sinks), sm_scale,
                                                   sliding_window, logit_softcap, view(out)));
}

ffi::Error WritePages(ffi::AnyBuffer pages, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> slot_mapping,
                      ffi::Result<ffi::AnyBuffer> out) {
  return to_error(jaxserve::write_pages(view(pages), view(rows), view(slot_mapping), view(out)));
}

ffi::Error MatmulBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                      ffi::ResultBuffer<ffi::F32> out) {
  Pool workers(pool);
  return to_error(jaxserve::matmul_bf16(workers, view(x), view(w), view(out), false));
}

ffi::Error MatmulBf16Nt(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                        ffi::ResultBuffer<ffi::F32> out) {
  Pool workers(pool);
  return to_error(jaxserve::matmul_bf16(workers, view(x), view(w), view(out), true));
}

ffi::Error GroupedMatmulBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  Pool workers(pool);
  return to_error(jaxserve::grouped_matmul_bf16(workers, view(x), view(w), view(group_sizes), view(out)));
}

ffi::Error MatmulGguf(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                      ffi::ResultBuffer<ffi::F32> out, int32_t kind) {
  Pool workers(pool);
  return to_error(jaxserve::matmul_gguf(workers, view(x), view(w), view(out), kind));
}

ffi::Error GroupedMatmulGguf(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out, int32_t kind) {
  Pool workers(pool);
  return to_error(jaxserve::grouped_matmul_gguf(workers, view(x), view(w), view(group_sizes), view(out), kind));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttention, RaggedPagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks: f32[N] or f32[0]
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("logit_softcap")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWritePages, WritePages,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

// Both bfloat16 matmuls' calls: x, w -> out (w input- or output-major, by the handler).
static auto MatmulBf16Binding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>().Ret<
      ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulBf16, MatmulBf16, MatmulBf16Binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulBf16Nt, MatmulBf16Nt, MatmulBf16Binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGroupedMatmulBf16, GroupedMatmulBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulGguf, MatmulGguf,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGroupedMatmulGguf, GroupedMatmulGguf,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("kind"));
