// Writes a step's K/V rows into the paged cache in place, an XLA FFI custom call (jaxserve.ops.cpu_kernels;
// its handler is `ffi_bindings.cc`'s JaxserveWriteKv).
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

#include "kernels.h"

namespace jaxserve {

Status write_kv(const Array& k_pages, const Array& v_pages, const Array& k, const Array& v,
                const Array& slot_mapping, const Array& k_out, const Array& v_out) {
  const auto pages = k_pages.dimensions();
  const auto rows = k.dimensions();
  const auto same = [](auto a, auto b) { return std::equal(a.begin(), a.end(), b.begin(), b.end()); };
  if (pages.size() != 4 || rows.size() != 3 || slot_mapping.dimensions().size() != 1 ||
      !same(v_pages.dimensions(), pages) || !same(v.dimensions(), rows) || rows[1] != pages[0] ||
      rows[2] != pages[3] || slot_mapping.dimensions()[0] != rows[0] || k.dtype != k_pages.dtype ||
      v.dtype != v_pages.dtype || k_pages.dtype != v_pages.dtype || !same(k_out.dimensions(), pages) ||
      !same(v_out.dimensions(), pages)) {
    return "write_kv: mismatched shapes or dtypes";
  }
  const int64_t num_tokens = rows[0], num_kv_heads = pages[0], num_slots = pages[1] * pages[2];
  const size_t cache_rows = size_t(num_kv_heads * num_slots);
  const size_t row_bytes = cache_rows == 0 ? 0 : k_pages.size_bytes() / cache_rows;
  const int32_t* slots = slot_mapping.as<int32_t>();
  for (auto [cache, fresh, out] : {std::make_tuple(&k_pages, &k, &k_out), std::make_tuple(&v_pages, &v, &v_out)}) {
    char* dst = out->as<char>();
    if (dst != cache->data) std::memcpy(dst, cache->data, cache->size_bytes());  // not aliased
    const char* src = fresh->as<const char>();
    for (int64_t t = 0; row_bytes > 0 && t < num_tokens; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= num_slots) continue;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        std::memcpy(dst + (h * num_slots + slot) * row_bytes, src + (t * num_kv_heads + h) * row_bytes, row_bytes);
      }
    }
  }
  return nullptr;
}

}  // namespace jaxserve
