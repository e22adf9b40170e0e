// Cores a worker may borrow while their owner (the other worker on the host) has nothing to
// run: helper threads at SCHED_IDLE that take chunks of the worker's kernels (parallel_chunks.h).
//
// The rule that keeps a borrowed core from slowing its borrower (the "owner" below is the
// worker's engine thread, the one that called the kernel):
//   - a helper runs only when its core is idle; the lender's threads preempt it at once
//     (SCHED_IDLE), so the lender never waits for a borrowed chunk;
//   - the owner never waits for a chunk no helper has taken (it takes them itself), and never
//     waits long for one a helper has taken: a helper computes its chunk into a private buffer
//     and marks it ready with a compare-and-swap; the owner, once nothing is left to take,
//     copies the ready chunks into the output, and steals every other one (after the time it
//     would need for it, and a quarter more, from the helper's claim) and computes it itself,
//     straight into the output. A helper whose CAS fails drops its result. Only the owner
//     writes the output, so it never waits on a helper's copy either;
//   - a stolen helper may still be computing after the kernel returned, so a kernel's chunks
//     own what they read (ChunkKernel below), and the owner frees them once no helper holds
//     them.
// Chunks shrink as the work runs out (large first, small last), so a chunk stolen at the end
// is a small one.
#pragma once

#include <cstdint>
#include <memory>

namespace pdserve {

// A kernel's work over [0, n), in chunks any thread may compute. Whoever computes a chunk
// runs the same arithmetic, so the bits never depend on who did. The object owns (or holds a
// reference on) everything compute() reads: a helper may run it after the caller returned.
class ChunkKernel {
 public:
  virtual ~ChunkKernel() = default;
  // Chunk [b, e) written into `out`: the output's own memory, or a helper's private buffer
  // of out_bytes() bytes laid out the same way.
  virtual void compute(int64_t b, int64_t e, void* out) const = 0;
  // What chunk [b, e) writes, copied from one buffer of the output's layout to another.
  virtual void copy(int64_t b, int64_t e, const void* from, void* to) const = 0;
  virtual int64_t out_bytes() const = 0;
};

// True once start_borrow_pool ran in this process with at least one helper.
bool borrow_pool_active();

// kernel over [0, n) into `out`, in chunks of about (n - done) / divisor items (at least
// min_chunk), taken by the caller and the helpers; returns when every chunk is in `out`.
// One job at a time: a second caller, or a kernel called from inside a chunk, runs its work
// alone.
void borrow_pool_run(int64_t n, int64_t min_chunk, int64_t divisor, std::shared_ptr<const ChunkKernel> kernel,
                     void* out);

// Helpers: how many ran at once in the last borrow_pool_run (0 with no helpers): for tests.
int64_t borrow_pool_helpers();

}  // namespace pdserve
