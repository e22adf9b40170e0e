// Bytes a kernel's caller will read next, fetched toward the core while a linear computes.
//
// Why: a mixed decode step's LoRA products read the adapters' packed weights (39 MB a step
// with four rank-16 adapters on SmolLM2-135M) in small kernels that do little arithmetic on
// each byte, while the base linear before each of them, at 16 rows, does much arithmetic on
// each. So while a projection's base linear runs, the calling thread prefetches that
// projection's adapter weights into L2, a slice after each register tile (panel_loop.h), and
// the products after it find them nearer. Measured (benchmarks/lora_parts.py, one thread, AMD
// EPYC, BENCHMARKS.md): the 16-row mixed step's LoRA time 4.27 and 4.42 ms with it against
// 4.95 and 4.62 without. A prefetch moves no value: no result changes.
#pragma once

#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>

namespace pdserve {

struct PrefetchPlan {
  static constexpr int kMaxRanges = 8;
  struct Range {
    const char* data;
    int64_t bytes;
  };
  Range ranges[kMaxRanges] = {};
  int count = 0;
  int64_t total = 0;   // bytes over every range
  int64_t panels = 0;  // the linear's output panels: a call over some of them takes its share
  int at = 0;          // the cursor: range and offset in it
  int64_t offset = 0;

  void add(const void* data, int64_t bytes) {
    if (count == kMaxRanges || bytes <= 0) return;
    ranges[count++] = {static_cast<const char*>(data), bytes};
    total += bytes;
  }

  // Prefetch the next ``bytes`` (whole 64-byte lines) into L2.
  void take(int64_t bytes) {
    while (bytes > 0 && at < count) {
      const Range& r = ranges[at];
      const int64_t n = std::min(bytes, r.bytes - offset);
      for (int64_t b = 0; b < n; b += 64) _mm_prefetch(r.data + offset + b, _MM_HINT_T1);
      offset += n;
      bytes -= n;
      if (offset >= r.bytes) ++at, offset = 0;
    }
  }
};

// The calling thread's plan while a PrefetchScope holds one (null otherwise). Only the thread
// that set it prefetches: a chunk another thread computes takes nothing from it.
inline PrefetchPlan*& prefetch_plan() {
  static thread_local PrefetchPlan* plan = nullptr;
  return plan;
}

class PrefetchScope {
 public:
  explicit PrefetchScope(PrefetchPlan& plan) : was_(prefetch_plan()) {
    if (plan.count > 0 && plan.panels > 0) prefetch_plan() = &plan;
  }
  ~PrefetchScope() { prefetch_plan() = was_; }
  PrefetchScope(const PrefetchScope&) = delete;
  PrefetchScope& operator=(const PrefetchScope&) = delete;

 private:
  PrefetchPlan* was_;
};

}  // namespace pdserve
