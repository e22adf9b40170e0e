// The borrowing pool (borrow_pool.h) and its operators:
//
//   start_borrow_pool(int[] own, int[] borrowed) -> int
//       Pins the calling thread's process to `own`, and starts one helper thread per core in
//       `borrowed`, at SCHED_IDLE, allowed on own + borrowed (so a starved helper can move
//       to an own core that went idle). Returns the number of helpers. Once per process.
//   borrow_pool_stats() -> int[]
//       Counts since start: [jobs, chunks helpers committed, chunks the owner stole back,
//       helper chunks dropped (stolen from them), times the owner waited on a commit, helper
//       stalls the test hook below made].
//   borrow_pool_stall_next(int claims, int microseconds) -> ()
//       Test hook: the next `claims` chunks a helper claims, it sleeps that long before
//       computing (as a helper preempted by its core's owner would), so tests can show that the
//       owner does not wait for it and that its late work is dropped.
//
// A job is one heap object per call (Job below), kept by the owner until no helper holds it:
// a helper that wakes after the call returned still reads a live job (the kernel's inputs
// included) and finds every chunk taken or stolen. The owner frees it, at a later call.
// Each chunk has a state, which moves only forward:
//   kOpen -> kDone                      the owner claimed it and computed it into the output
//   kOpen -> kCommitting -> kDone       a helper claimed it, computed it privately, copied it in
//   kOpen -> kStolen                    a helper claimed it; the owner took it back (then it
//                                       computes it into the output itself)
// The CAS out of kOpen decides, once, who writes the chunk's part of the output. A helper's
// copy is released by its store of kDone, which the owner acquires before it returns.
#include "borrow_pool.h"

#include <ATen/ATen.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace pdserve {
namespace {

constexpr int kSpinWait = 20000;  // pause loops before sleeping: about the gap between two kernels
enum State : uint8_t { kOpen, kCommitting, kDone, kStolen };

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Job {
  Job(int64_t n, int64_t min_chunk, int64_t divisor, std::shared_ptr<const ChunkKernel> k, void* o)
      : kernel(std::move(k)), out(o) {
    // Guided sizes: a share of what is left, so the last chunks (the ones a late helper may
    // still hold when the owner runs out) are the smallest.
    bounds.push_back(0);
    for (int64_t b = 0; b < n;) bounds.push_back(b = std::min(n, b + std::max(min_chunk, (n - b + divisor - 1) / divisor)));
    const size_t chunks = bounds.size() - 1;
    state.reset(new std::atomic<uint8_t>[chunks]);
    claimed_ns.reset(new std::atomic<int64_t>[chunks]);
    for (size_t i = 0; i < chunks; ++i) {
      state[i].store(kOpen, std::memory_order_relaxed);
      claimed_ns[i].store(0, std::memory_order_relaxed);
    }
  }
  int64_t chunks() const { return static_cast<int64_t>(bounds.size()) - 1; }

  const std::shared_ptr<const ChunkKernel> kernel;
  void* const out;  // written by a helper only inside a commit, which the owner waits for
  std::vector<int64_t> bounds;  // chunk i is [bounds[i], bounds[i + 1])
  std::unique_ptr<std::atomic<uint8_t>[]> state;
  std::unique_ptr<std::atomic<int64_t>[]> claimed_ns;  // when a helper claimed it (0: not yet noted)
  std::atomic<int64_t> next{0};  // the next unclaimed chunk
  std::atomic<int64_t> helpers_in{0};
  std::atomic<int> reading{0};  // helpers holding it now (the owner frees it once none is)
};

// A helper's private output, grown to the largest job it took part in; never zeroed (a chunk
// writes all it copies).
class Shadow {
 public:
  ~Shadow() { std::free(p_); }
  void* get(int64_t bytes) {
    if (bytes > size_) {
      std::free(p_);
      size_ = (bytes + 4095) / 4096 * 4096;
      p_ = std::aligned_alloc(4096, static_cast<size_t>(size_));
      TORCH_CHECK(p_ != nullptr, "borrow pool: out of memory for a helper's ", size_, " byte output buffer");
    }
    return p_;
  }

 private:
  void* p_ = nullptr;
  int64_t size_ = 0;
};

struct Counters {
  std::atomic<int64_t> jobs{0}, committed{0}, stolen{0}, dropped{0}, waited{0}, stalled{0};
};

class BorrowPool {
 public:
  int64_t start(const std::vector<int64_t>& borrowed, const cpu_set_t& all) {
    for (size_t i = 0; i < borrowed.size(); ++i) threads_.emplace_back([this, all] { helper(all); });
    return static_cast<int64_t>(threads_.size());
  }

  bool active() const { return !threads_.empty(); }

  void run(int64_t n, int64_t min_chunk, int64_t divisor, std::shared_ptr<const ChunkKernel> kernel, void* out) {
    // One job at a time. A kernel called from inside a chunk runs here (no nesting), and so
    // does one called by a second thread while a job is out.
    if (t_in_chunk || owner_.exchange(true, std::memory_order_acquire)) {
      kernel->compute(0, n, out);
      return;
    }
    struct Release {
      std::atomic<bool>& owner;
      ~Release() { owner.store(false, std::memory_order_release); }
    } release{owner_};
    free_finished();
    retained_.push_back(std::make_unique<Job>(n, min_chunk, divisor, std::move(kernel), out));
    Job* job = retained_.back().get();
    counters_.jobs.fetch_add(1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);
      current_ = job;
      gen_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
    std::exception_ptr error;
    const int64_t ns_per_item = own_chunks(*job, &error);
    {
      std::lock_guard<std::mutex> lock(mu_);  // helpers that come later find nothing to keep alive
      current_ = nullptr;
    }
    take_back(*job, ns_per_item, &error);
    last_helpers_ = job->helpers_in.load(std::memory_order_relaxed);
    if (error) std::rethrow_exception(error);  // every chunk is settled: no helper writes `out` now
  }

  int64_t last_helpers() const { return last_helpers_; }
  const Counters& counters() const { return counters_; }
  void stall_next(int64_t claims, int64_t us) {
    stall_us_.store(us, std::memory_order_relaxed);
    stall_claims_.store(claims, std::memory_order_release);
  }

 private:
  // Jobs no helper holds any more, freed here on the owner's thread: a helper at idle priority
  // never frees (a free takes the allocator's lock, and a helper preempted holding it would
  // stall the owner's next allocation).
  void free_finished() {
    retained_.erase(std::remove_if(retained_.begin(), retained_.end(),
                                   [](const std::unique_ptr<Job>& j) { return j->reading.load(std::memory_order_acquire) == 0; }),
                    retained_.end());
  }

  // The owner: claims and computes chunks until none is left unclaimed. Returns its time per
  // item (0: it computed none), the yardstick for how long a helper's chunk should take.
  int64_t own_chunks(Job& job, std::exception_ptr* error) {
    int64_t items = 0, ns = 0;
    for (int64_t i; (i = job.next.fetch_add(1, std::memory_order_acq_rel)) < job.chunks();) {
      const int64_t b = job.bounds[i], e = job.bounds[i + 1], t0 = now_ns();
      compute(job, b, e, job.out, error);
      job.state[i].store(kDone, std::memory_order_relaxed);  // only the owner reads its own chunks' state
      ns += now_ns() - t0;
      items += e - b;
    }
    return items ? std::max<int64_t>(1, ns / items) : 0;
  }

  // The owner, once nothing is unclaimed: every helper chunk is committed, or stolen and
  // computed here. A helper still on its chunk gets the time the owner would need for it
  // (and half again) from its claim, then loses it; a commit already begun is waited for.
  void take_back(Job& job, int64_t ns_per_item, std::exception_ptr* error) {
    for (int64_t i = 0; i < job.chunks(); ++i) {
      const int64_t b = job.bounds[i], e = job.bounds[i + 1];
      uint8_t s = job.state[i].load(std::memory_order_acquire);
      if (s == kOpen) {
        int64_t claimed = job.claimed_ns[i].load(std::memory_order_relaxed);
        const int64_t deadline = (claimed ? claimed : now_ns()) + (e - b) * ns_per_item * 3 / 2 + 10000;
        while (s == kOpen && now_ns() < deadline) {
          _mm_pause();
          s = job.state[i].load(std::memory_order_acquire);
        }
        if (s == kOpen && job.state[i].compare_exchange_strong(s, kStolen, std::memory_order_acq_rel)) {
          counters_.stolen.fetch_add(1, std::memory_order_relaxed);
          compute(job, b, e, job.out, error);
          continue;
        }
      }
      if (s == kCommitting) counters_.waited.fetch_add(1, std::memory_order_relaxed);
      // A commit is a copy: wait, spinning, then asleep so a preempted helper can move here.
      for (int spin = 0; s != kDone; ++spin, s = job.state[i].load(std::memory_order_acquire)) {
        if (spin < kSpinWait) _mm_pause();
        else std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }

  void compute(const Job& job, int64_t b, int64_t e, void* out, std::exception_ptr* error) {
    t_in_chunk = true;
    try {
      job.kernel->compute(b, e, out);
    } catch (...) {  // kept for the caller, who rethrows it once every chunk is settled
      if (!*error) *error = std::current_exception();
    }
    t_in_chunk = false;
  }

  // A helper on one job: claims chunks, computes each into its shadow, commits what the owner
  // has not stolen meanwhile.
  void help(Job& job, Shadow& shadow) {
    bool joined = false;
    for (int64_t i; (i = job.next.fetch_add(1, std::memory_order_acq_rel)) < job.chunks();) {
      job.claimed_ns[i].store(now_ns(), std::memory_order_relaxed);
      if (!joined) job.helpers_in.fetch_add(1, std::memory_order_relaxed), joined = true;
      if (job.state[i].load(std::memory_order_acquire) != kOpen) {  // stolen before it began
        counters_.dropped.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      maybe_stall();
      const int64_t b = job.bounds[i], e = job.bounds[i + 1];
      void* mine = nullptr;
      std::exception_ptr failed;
      try {
        mine = shadow.get(job.kernel->out_bytes());
      } catch (...) {
        failed = std::current_exception();
      }
      if (mine) compute(job, b, e, mine, &failed);
      uint8_t open = kOpen;
      // A failed chunk stays open: the owner steals it and meets the error itself.
      if (failed || !job.state[i].compare_exchange_strong(open, kCommitting, std::memory_order_acq_rel)) {
        counters_.dropped.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      job.kernel->copy(b, e, mine, job.out);
      job.state[i].store(kDone, std::memory_order_release);
      counters_.committed.fetch_add(1, std::memory_order_relaxed);
    }
  }

  void maybe_stall() {
    int64_t left = stall_claims_.load(std::memory_order_acquire);
    while (left > 0 && !stall_claims_.compare_exchange_weak(left, left - 1, std::memory_order_acq_rel)) {
    }
    if (left <= 0) return;
    counters_.stalled.fetch_add(1, std::memory_order_relaxed);
    std::this_thread::sleep_for(std::chrono::microseconds(stall_us_.load(std::memory_order_relaxed)));
  }

  void helper(cpu_set_t all) {
    sched_param none{};
    pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_t), &all);
    sched_setscheduler(0, SCHED_IDLE, &none);
    Shadow shadow;
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = gen_.load(std::memory_order_acquire);
      for (int spin = 0; g == seen && spin < kSpinWait; ++spin) {
        _mm_pause();
        g = gen_.load(std::memory_order_acquire);
      }
      Job* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (gen_.load(std::memory_order_relaxed) == seen) {
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          cv_.wait(lock, [&] { return gen_.load(std::memory_order_relaxed) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        }
        seen = gen_.load(std::memory_order_relaxed);
        job = current_;  // null when its owner already took back what was left
        if (job) job->reading.fetch_add(1, std::memory_order_relaxed);  // under the lock: before the owner may free it
      }
      if (job) {
        help(*job, shadow);
        job->reading.fetch_sub(1, std::memory_order_release);  // the last touch: the owner may free it now
      }
    }
  }

  static thread_local bool t_in_chunk;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  Job* current_ = nullptr;  // guarded by mu_; gen_ counts its changes to a job
  std::vector<std::unique_ptr<Job>> retained_;  // the owner's: jobs a helper may still hold
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> owner_{false};  // a thread is in run() with a job out
  std::atomic<int64_t> stall_claims_{0}, stall_us_{0};
  Counters counters_;
  int64_t last_helpers_ = 0;
};

thread_local bool BorrowPool::t_in_chunk = false;

BorrowPool& pool() {
  static BorrowPool* p = new BorrowPool();  // never destroyed: its helpers live as long as the process
  return *p;
}

std::once_flag g_started;

int64_t start_borrow_pool(std::vector<int64_t> own, std::vector<int64_t> borrowed) {
  TORCH_CHECK(!own.empty(), "start_borrow_pool: a worker needs at least one core of its own");
  int64_t helpers = -1;
  std::call_once(g_started, [&] {
    cpu_set_t own_set, all;
    CPU_ZERO(&own_set);
    for (int64_t c : own) CPU_SET(static_cast<int>(c), &own_set);
    all = own_set;
    for (int64_t c : borrowed) CPU_SET(static_cast<int>(c), &all);
    helpers = pool().start(borrowed, all);
  });
  TORCH_CHECK(helpers >= 0, "start_borrow_pool: the pool of this process is already started");
  return helpers;
}

std::vector<int64_t> borrow_pool_stats() {
  const Counters& c = pool().counters();
  return {c.jobs.load(), c.committed.load(), c.stolen.load(), c.dropped.load(), c.waited.load(), c.stalled.load()};
}

void borrow_pool_stall_next(int64_t claims, int64_t microseconds) {
  TORCH_CHECK(claims >= 0 && microseconds >= 0 && microseconds <= 10000000, "borrow_pool_stall_next: claims must "
              "be >= 0 and microseconds in [0, 10000000], got claims=", claims, ", microseconds=", microseconds);
  pool().stall_next(claims, microseconds);
}

}  // namespace

bool borrow_pool_active() { return pool().active(); }

void borrow_pool_run(int64_t n, int64_t min_chunk, int64_t divisor, std::shared_ptr<const ChunkKernel> kernel,
                     void* out) {
  pool().run(n, min_chunk, divisor, std::move(kernel), out);
}

int64_t borrow_pool_helpers() { return pool().last_helpers(); }

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("start_borrow_pool(int[] own, int[] borrowed) -> int", &pdserve::start_borrow_pool);
  m.def("borrow_pool_helpers() -> int", &pdserve::borrow_pool_helpers);
  m.def("borrow_pool_stats() -> int[]", &pdserve::borrow_pool_stats);
  m.def("borrow_pool_stall_next(int claims, int microseconds) -> ()", &pdserve::borrow_pool_stall_next);
}
