// Work handed out in chunks to whichever thread asks next, instead of split in equal parts up
// front: a thread that is preempted (its core shared with another worker, the router or Ray's
// daemons) then holds back at most the one chunk it is on. With a borrowing pool
// (borrow_pool.h) a kernel's chunks go to the caller and the pool's idle-priority helpers
// instead of torch's threads, and the caller takes back any chunk a helper sits on.
//
// What a chunk is must never change a result: the linears' chunks are ranges of whole
// output panels, so a thread computes every element it writes from start to end.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

#include "borrow_pool.h"

namespace pdserve {

// True while the calling thread runs its kernels alone (SerialKernels): no parallel region, no
// borrowed helpers. Which thread computes a chunk never changes a result, so neither does this.
inline bool& serial_kernels() {
  static thread_local bool on = false;
  return on;
}

// Kernels called in this scope run on the calling thread alone when ``on``: a step's many
// small LoRA products, where a fork and join of torch's threads (a core shared with another
// worker) costs more than the split saves.
class SerialKernels {
 public:
  explicit SerialKernels(bool on) : was_(serial_kernels()) { serial_kernels() = was_ || on; }
  ~SerialKernels() { serial_kernels() = was_; }
  SerialKernels(const SerialKernels&) = delete;
  SerialKernels& operator=(const SerialKernels&) = delete;

 private:
  bool was_;
};

// fn(begin, end) over [0, n) on torch's threads, in chunks of about n / (chunks_per_thread x
// threads) items, at least min_chunk. One thread: one call over everything.
template <typename Fn>
void parallel_chunks(int64_t n, int64_t min_chunk, Fn&& fn, int64_t chunks_per_thread = 6) {
  const int threads = at::get_num_threads();
  if (threads <= 1 || n <= min_chunk || at::in_parallel_region() || serial_kernels()) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t chunk = std::max(min_chunk, (n + chunks_per_thread * threads - 1) / (chunks_per_thread * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(chunk); b < n; b = next.fetch_add(chunk)) fn(b, std::min(n, b + chunk));
  });
}

// kernel (a ChunkKernel, borrow_pool.h) over [0, n) into `out`: with a borrowing pool, on the
// caller and the pool's helpers (the kernel moves to the heap, where a helper that was stolen
// from can still read it after this returns); without one, on torch's threads as above.
// With the pool, chunks shrink as the work runs out: down to min_chunk when `fine_tail` (a
// prefill's kernels: a chunk the owner steals back at the end is then small), else down to
// half the first (a decode step's: smaller chunks would cost more to hand out than they
// save; a 576 x 3072 linear at one row, 52 us, took 56 with chunks down to 2 panels).
template <typename Kernel>
void parallel_kernel(int64_t n, int64_t min_chunk, Kernel&& kernel, void* out, int64_t chunks_per_thread = 6,
                     bool fine_tail = true) {
  if (borrow_pool_active() && n > min_chunk && !serial_kernels()) {
    using K = std::decay_t<Kernel>;
    const int64_t divisor = 2 * chunks_per_thread;
    const int64_t tail = fine_tail ? min_chunk : std::max(min_chunk, (n + 2 * divisor - 1) / (2 * divisor));
    borrow_pool_run(n, tail, divisor, std::make_shared<const K>(std::forward<Kernel>(kernel)), out);
    return;
  }
  parallel_chunks(n, min_chunk, [&](int64_t b, int64_t e) { kernel.compute(b, e, out); }, chunks_per_thread);
}

}  // namespace pdserve
