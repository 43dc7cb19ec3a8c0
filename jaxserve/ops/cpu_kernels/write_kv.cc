// Writes a step's K (or V) rows into one array of the paged cache in place, an XLA FFI custom call
// (jaxserve.ops.cpu_kernels; its handler is `ffi_bindings.cc`'s JaxserveWritePages), once for K and once for V,
// or once for a cache that keeps K alone (its values are its keys: DeepSeek's latent cache).
//
// The jnp scatter does this everywhere else, but XLA:CPU runs a bfloat16 scatter by widening its operand,
// the whole cache, to float32 and back every step. Here each token's rows are copied as bytes, whatever
// the cache's dtype; the cache buffer is aliased to the output, so nothing else moves.
//
// Shapes (row-major):
//   pages         [K, num_pages, page_size, H]   any dtype; aliased to the output
//   rows          [T, K, H]                      the cache's dtype
//   slot_mapping  int32[T]                       page * page_size + offset; out of range: dropped

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace jaxserve {

Status write_pages(const Array& pages, const Array& rows, const Array& slot_mapping, const Array& out) {
  const auto shape = pages.dimensions();
  const auto fresh = rows.dimensions();
  const auto same = [](auto a, auto b) { return std::equal(a.begin(), a.end(), b.begin(), b.end()); };
  if (shape.size() != 4 || fresh.size() != 3 || slot_mapping.dimensions().size() != 1 || fresh[1] != shape[0] ||
      fresh[2] != shape[3] || slot_mapping.dimensions()[0] != fresh[0] || rows.dtype != pages.dtype ||
      !same(out.dimensions(), shape)) {
    return "write_pages: mismatched shapes or dtypes";
  }
  const int64_t num_tokens = fresh[0], num_kv_heads = shape[0], num_slots = shape[1] * shape[2];
  const size_t cache_rows = size_t(num_kv_heads * num_slots);
  const size_t row_bytes = cache_rows == 0 ? 0 : pages.size_bytes() / cache_rows;
  const int32_t* slots = slot_mapping.as<int32_t>();
  char* dst = out.as<char>();
  if (dst != pages.data) std::memcpy(dst, pages.data, pages.size_bytes());  // not aliased
  const char* src = rows.as<const char>();
  for (int64_t t = 0; row_bytes > 0 && t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) continue;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      std::memcpy(dst + (h * num_slots + slot) * row_bytes, src + (t * num_kv_heads + h) * row_bytes, row_bytes);
    }
  }
  return nullptr;
}

}  // namespace jaxserve
