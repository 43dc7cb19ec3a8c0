// Writes a step's K/V rows into the paged cache in place, an XLA FFI custom call (jaxserve.ops.cpu_kernels).
//
// The jnp scatter does this everywhere else, but XLA:CPU runs a bfloat16 scatter by widening its operand,
// the whole cache, to float32 and back every step. Here each token's rows are copied as bytes, whatever
// the cache's dtype; the cache buffers are aliased to the outputs, so nothing else moves.
//
// Shapes (row-major):
//   k_pages, v_pages  [K, num_pages, page_size, H]   any dtype; aliased to the two outputs
//   k, v              [T, K, H]                      the cache's dtype
//   slot_mapping      int32[T]                       page * page_size + offset; out of range: dropped

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteKv(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> slot_mapping, ffi::Result<ffi::AnyBuffer> k_out,
                   ffi::Result<ffi::AnyBuffer> v_out) {
  const auto pages = k_pages.dimensions();
  const auto rows = k.dimensions();
  const auto same = [](auto a, auto b) { return std::equal(a.begin(), a.end(), b.begin(), b.end()); };
  if (pages.size() != 4 || rows.size() != 3 || slot_mapping.dimensions().size() != 1 ||
      !same(v_pages.dimensions(), pages) || !same(v.dimensions(), rows) || rows[1] != pages[0] ||
      rows[2] != pages[3] || slot_mapping.dimensions()[0] != rows[0] ||
      k.element_type() != k_pages.element_type() || v.element_type() != v_pages.element_type() ||
      k_pages.element_type() != v_pages.element_type()) {
    return ffi::Error::InvalidArgument("write_kv: mismatched shapes or dtypes");
  }
  const int64_t num_tokens = rows[0], num_kv_heads = pages[0], num_slots = pages[1] * pages[2];
  const size_t cache_rows = size_t(num_kv_heads * num_slots);
  const size_t row_bytes = cache_rows == 0 ? 0 : k_pages.size_bytes() / cache_rows;
  const int32_t* slots = slot_mapping.typed_data();
  for (auto [cache, fresh, out] : {std::make_tuple(&k_pages, &k, &k_out), std::make_tuple(&v_pages, &v, &v_out)}) {
    char* dst = static_cast<char*>((*out)->untyped_data());
    if (dst != cache->untyped_data()) std::memcpy(dst, cache->untyped_data(), cache->size_bytes());  // not aliased
    const char* src = static_cast<const char*>(fresh->untyped_data());
    for (int64_t t = 0; row_bytes > 0 && t < num_tokens; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= num_slots) continue;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        std::memcpy(dst + (h * num_slots + slot) * row_bytes, src + (t * num_kv_heads + h) * row_bytes, row_bytes);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKv, WriteKv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
