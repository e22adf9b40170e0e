// Work handed out in chunks to whichever thread asks next, instead of split in equal parts up
// front: a thread that is preempted (its core shared with another worker, the router or Ray's
// daemons) then holds back at most the one chunk it is on. With a borrowing pool
// (borrow_pool.h) the chunks go to the caller and the pool's idle-priority helpers instead
// of torch's threads.
//
// What a chunk is must never change a result: the linears' chunks are ranges of whole
// output panels, so a thread computes every element it writes from start to end.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "borrow_pool.h"

namespace pdserve {

// fn(begin, end) over [0, n) in chunks of about n / (chunks_per_thread x threads) items, at
// least min_chunk. One thread: one call over everything.
template <typename Fn>
void parallel_chunks(int64_t n, int64_t min_chunk, Fn&& fn, int64_t chunks_per_thread = 6) {
  if (borrow_pool_active() && n > min_chunk) {
    borrow_pool_run(n, std::max(min_chunk, (n + 2 * chunks_per_thread - 1) / (2 * chunks_per_thread)),
                    [&](int64_t b, int64_t e) { fn(b, e); });
    return;
  }
  const int threads = at::get_num_threads();
  if (threads <= 1 || n <= min_chunk || at::in_parallel_region()) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t chunk = std::max(min_chunk, (n + chunks_per_thread * threads - 1) / (chunks_per_thread * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(chunk); b < n; b = next.fetch_add(chunk)) fn(b, std::min(n, b + chunk));
  });
}

}  // namespace pdserve
