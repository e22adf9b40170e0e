// Per-thread float32 scratch for the CPU kernels (paged_attention.cpp).
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace pdserve {

// A float32 buffer whose start sits at a fixed offset from a 4 KiB boundary. The hot loops
// load from one buffer while storing to another, and heap-placed std::vectors left their
// relative placement to the allocations before them: one unrelated change to this struct cost
// the AVX2 loops a quarter of their speed, decode included. Placed this way, each buffer has
// its own offset within a page, and the speed no longer depends on the heap.
class Buffer {
 public:
  explicit Buffer(int64_t lines) : offset_(lines * 16) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { std::free(base_); }
  float* data() { return p_; }
  float& operator[](int64_t i) { return p_[i]; }
  // At least n floats, zero where new (contents are not kept across a growth).
  void grow(int64_t n) {
    if (n <= n_) return;
    std::free(base_);
    const size_t bytes = (static_cast<size_t>(n + offset_) * sizeof(float) + 4095) / 4096 * 4096;
    base_ = static_cast<float*>(std::aligned_alloc(4096, bytes));
    TORCH_CHECK(base_ != nullptr, "paged_attention: out of memory for ", bytes, " bytes of scratch");
    std::memset(base_, 0, bytes);
    p_ = base_ + offset_;
    n_ = n;
  }

 private:
  const int64_t offset_;  // floats
  float* base_ = nullptr;
  float* p_ = nullptr;
  int64_t n_ = 0;
};

}  // namespace pdserve
