// Cores a worker may borrow while their owner (the other worker on the host) has nothing to
// run: helper threads at SCHED_IDLE that take chunks of the worker's kernels (parallel_chunks.h).
//
// The rule that keeps a borrowed core from slowing its lender or its borrower:
//   - a helper runs only when its core is idle, and the owner's thread preempts it at once on
//     waking (SCHED_IDLE), so the lender gets its core back within its own step;
//   - work is handed out in chunks, and the caller never waits for a chunk no helper has
//     taken (it takes them itself): a helper that wakes late finds nothing left;
//   - the caller waits only for chunks a helper took and has not finished. It waits asleep,
//     which leaves its own core idle, and Linux then moves a preempted idle-policy helper
//     there (such a task is never held back as cache-hot): at most one chunk is late.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace pdserve {

// True once start_borrow_pool ran in this process with at least one helper.
bool borrow_pool_active();

// fn(begin, end) over [0, n) in chunks of `chunk`, taken by the caller and the helpers;
// returns when every chunk is done. Not reentrant (one engine thread per process calls it).
void borrow_pool_run(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn);

// Helpers: how many ran at once in the last borrow_pool_run (0 with no helpers): for tests.
int64_t borrow_pool_helpers();

}  // namespace pdserve
